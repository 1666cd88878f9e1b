// The small operations of decoding one sequence, each one call instead of several:
// rms_norm and SwiGLU's silu_mul in one pass per row, and the products of one row
// (streamed, row_product.h) or a few (the tile kernel, tile_gemm.h). The attention
// step is decode_step.cpp; a whole run of layers in one call, decode_layers.cpp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "decode.h"
#include "row_product.h"
#include "tile_gemm.h"
#include "rows.h"

namespace attnlab {
namespace {

// rms_norm: x * rsqrt(mean(x^2) + eps) * weight over the last dimension, one pass per
// row. torch's CPU rms_norm is six dispatched operations (square, mean, add,
// rsqrt, two products); at one row per call that is most of its cost.
ATTNLAB_PER_ISA static void rms_norm_row(float* out, const float* x, const float* w, int64_t n,
                                        float eps) {
  f8 acc{};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const f8 v = load8(x + j);
    acc += v * v;
  }
  float sq = sum8(acc);
  for (; j < n; ++j) sq += x[j] * x[j];
  const float r = 1.0f / std::sqrt(sq / float(n) + eps);
  if (w == nullptr) {
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r;
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
  }
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1,
              "attnlab rms_norm: CPU float32 only");
  const at::Tensor xc = x.contiguous();
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : xc.numel() / n;
  const float* w = nullptr;
  if (weight.has_value() && weight->defined()) {
    TORCH_CHECK(weight->is_contiguous() && weight->scalar_type() == at::kFloat &&
                    weight->numel() == n,
                "attnlab rms_norm: weight (n,) float32");
    w = weight->data_ptr<float>();
  }
  at::Tensor out = at::empty_like(xc);
  const float* src = xc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, n));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(dst + r * n, src + r * n, w, n, float(eps));
  });
  return out;
}

namespace {

// silu_mul: SwiGLU's silu(gate) * up from the joint (..., 2F) product [gate | up] to
// (..., F): one pass instead of a split, a silu and a product.
ATTNLAB_PER_ISA static void silu_mul_row(float* out, const float* gate, const float* up,
                                        int64_t n) {
  int64_t i = 0;  // the vectorised exp of vec.h: a scalar std::exp per value cost 13 us
  for (; i + 8 <= n; i += 8) {
    const f8 g = load8(gate + i);
    store8(out + i, g / (1.0f + exp8(-g)) * load8(up + i));
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// gelu_mul: GeGLU's gelu_tanh(gate) * up, the tanh approximation
// 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) as torch's gelu(approximate="tanh").
ATTNLAB_PER_ISA static void gelu_mul_row(float* out, const float* gate, const float* up,
                                         int64_t n) {
  constexpr float k = 0.7978845608028654f;  // sqrt(2 / pi)
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const f8 g = load8(gate + i);
    const f8 t = tanh8(k * (g + 0.044715f * g * g * g));
    store8(out + i, 0.5f * g * (1.0f + t) * load8(up + i));
  }
  for (; i < n; ++i) {
    const float g = gate[i];
    out[i] = 0.5f * g * (1.0f + std::tanh(k * (g + 0.044715f * g * g * g))) * up[i];
  }
}

}  // namespace

// act(gate) * up from the joint (..., 2F) product [gate | up] to (..., F), a row at a time.
template <typename Row>
at::Tensor gated(const at::Tensor& gate_up, const char* name, Row row) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == at::kFloat &&
                  gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "attnlab ", name, ": CPU float32 (..., 2F)");
  const at::Tensor gu = gate_up.contiguous();
  const int64_t n = gu.size(-1) / 2, rows = n == 0 ? 0 : gu.numel() / (2 * n);
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, gu.options());
  const float* src = gu.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, n));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row(dst + r * n, src + r * 2 * n, src + r * 2 * n + n, n);
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) { return gated(gate_up, "silu_mul", silu_mul_row); }
at::Tensor gelu_mul(const at::Tensor& gate_up) { return gated(gate_up, "gelu_mul", gelu_mul_row); }

// Rows of x (..., in): the product of its leading sizes (x.numel() / in fails for in = 0).
int64_t leading_rows(const at::Tensor& x) {
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < x.dim(); ++i) rows *= x.size(i);
  return rows;
}

// A tensor the products read: float32 on the CPU.
bool usable(const at::Tensor& t) { return t.scalar_type() == at::kFloat && t.device().is_cpu(); }

// One row x (..., in) times an nn.Linear weight (out, in) stored by rows (unit
// stride along in) or by columns (unit stride along out, the packed blocks), plus
// bias (out,) and residual (numel = out), each optional: row_product.h's streamed
// product. Returns (..., out) shaped like x, or None for a layout it does not read.
std::optional<at::Tensor> one_row(const at::Tensor& x, const at::Tensor& w,
                                  const std::optional<at::Tensor>& bias,
                                  const std::optional<at::Tensor>& residual) {
  if (!usable(x) || !usable(w) || w.dim() != 2 || x.dim() < 1 || x.size(-1) != w.size(1) ||
      leading_rows(x) != 1 || !x.is_contiguous())
    return std::nullopt;
  const int64_t n_out = w.size(0), n_in = w.size(1);
  const bool by_rows = w.stride(1) == 1 && (n_out <= 1 || w.stride(0) >= n_in);
  const bool by_columns = !by_rows && w.stride(0) == 1 && (n_in <= 1 || w.stride(1) >= n_out);
  if (!by_rows && !by_columns) return std::nullopt;
  for (const auto* t : {&bias, &residual}) {
    if (t->has_value() && (!usable(**t) || (*t)->numel() != n_out || !(*t)->is_contiguous()))
      return std::nullopt;
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n_out;
  at::Tensor y = at::empty(shape, x.options());
  if (n_out > 0)
    row_product(x.data_ptr<float>(), w.data_ptr<float>(), by_rows ? w.stride(0) : w.stride(1),
                by_rows, n_in, n_out, bias.has_value() ? bias->data_ptr<float>() : nullptr,
                residual.has_value() ? residual->data_ptr<float>() : nullptr,
                y.data_ptr<float>());
  return y;
}

namespace {

// Up to this many rows go through the tile kernel; more, and BLAS's blocking of the
// rows pays (the tile kernel streams all of x once per 64 outputs).
constexpr int64_t FEW_ROWS = 64;

// linear (inference): x W^T + bias (+ residual) for x (..., in) and an nn.Linear weight
// (out, in): one row by one_row; a few rows (<= FEW_ROWS), W stored by columns (the
// packed blocks), by the AVX-512 tile kernel where the CPU has it, threads taking
// bands of 64 outputs; None otherwise (the caller runs F.linear).
std::optional<at::Tensor> linear(const at::Tensor& x, const at::Tensor& w,
                                 const std::optional<at::Tensor>& bias,
                                 const std::optional<at::Tensor>& residual) {
  if (x.dim() >= 1 && leading_rows(x) == 1) return one_row(x, w, bias, residual);
  if (!tile_gemm_supported() || residual.has_value() || !usable(x) || !usable(w) ||
      w.dim() != 2 || x.dim() < 1 || x.size(-1) != w.size(1) || !x.is_contiguous() ||
      w.stride(0) != 1 || w.stride(1) < w.size(0))
    return std::nullopt;
  const int64_t n_in = w.size(1), n_out = w.size(0), ld = w.stride(1);
  const int64_t rows = leading_rows(x);
  if (rows > FEW_ROWS || n_in == 0) return std::nullopt;
  if (bias.has_value() && (!usable(*bias) || bias->numel() != n_out || !bias->is_contiguous()))
    return std::nullopt;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n_out;
  at::Tensor y = at::empty(shape, x.options());
  const float* a = x.data_ptr<float>();
  const float* b = w.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* c = y.data_ptr<float>();
  const int64_t bands = (n_out + PANEL - 1) / PANEL;
  at::parallel_for(0, bands, 1, [&](int64_t begin, int64_t end) {
    const int64_t j0 = begin * PANEL, j1 = std::min(end * PANEL, n_out);
    tile_gemm(rows, j1 - j0, n_in, 1.0f, a, n_in, 1, b + j0, ld, false, c + j0, n_out, true);
    if (bp != nullptr)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = j0; j < j1; ++j) c[r * n_out + j] += bp[j];
  });
  return y;
}

}  // namespace

// one_row, or ATen's product where one_row does not read the layout.
at::Tensor linear_row(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                      const at::Tensor& residual) {
  auto opt = [](const at::Tensor& t) {
    return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
  };
  if (auto y = one_row(x, w, opt(bias), opt(residual))) return *y;
  at::Tensor y = at::linear(x, w, opt(bias));
  return residual.defined() ? y.add_(residual.view_as(y)) : y;
}

}  // namespace attnlab

TORCH_LIBRARY_FRAGMENT(attnlab_native, m) {
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_mul(Tensor gate_up) -> Tensor");
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, Tensor? residual) -> Tensor?");
}

TORCH_LIBRARY_IMPL(attnlab_native, CPU, m) {
  m.impl("rms_norm", &attnlab::rms_norm);
  m.impl("silu_mul", &attnlab::silu_mul);
  m.impl("gelu_mul", &attnlab::gelu_mul);
  m.impl("linear", &attnlab::linear);
}
