// The small operations of decoding one sequence, each one call instead of several:
// rms_norm and SwiGLU's silu_mul in one pass per row, and the products of one row
// (streamed, row_product.h) or more (the tile kernel, tile_gemm.h). The attention
// step is decode_step.cpp; a whole run of layers in one call, decode_layers.cpp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "decode.h"
#include "row_product.h"
#include "tile_gemm.h"
#include "rows.h"
#include "tile_bf16.h"

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
  for (; i + 8 <= n; i += 8) store8(out + i, silu8(load8(gate + i)) * load8(up + i));
  if (i < n) {
    const f8 g = silu8(load_tail(gate + i, n - i, 0.0f)) * load_tail(up + i, n - i, 0.0f);
    for (int64_t j = i; j < n; ++j) out[j] = g[j - i];
  }
}

// gelu_mul: GeGLU's gelu_tanh(gate) * up (vec.h's gelu_tanh8).
ATTNLAB_PER_ISA static void gelu_mul_row(float* out, const float* gate, const float* up,
                                         int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(out + i, gelu_tanh8(load8(gate + i)) * load8(up + i));
  if (i < n) {
    const f8 g = gelu_tanh8(load_tail(gate + i, n - i, 0.0f)) * load_tail(up + i, n - i, 0.0f);
    for (int64_t j = i; j < n; ++j) out[j] = g[j - i];
  }
}

}  // namespace

// x's sizes with the last one replaced by n: the shape of a row-wise op's result.
std::vector<int64_t> with_last(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return shape;
}

// act(gate) * up from the joint (..., 2F) product [gate | up] to (..., F), a row at a time.
template <typename Row>
at::Tensor gated(const at::Tensor& gate_up, const char* name, Row row) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == at::kFloat &&
                  gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "attnlab ", name, ": CPU float32 (..., 2F)");
  const at::Tensor gu = gate_up.contiguous();
  const int64_t n = gu.size(-1) / 2, rows = n == 0 ? 0 : gu.numel() / (2 * n);
  at::Tensor out = at::empty(with_last(gu, n), gu.options());
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

bool floating(const at::Tensor& t) {
  return (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
         t.device().is_cpu();
}

// Whether a weight (out, in) is stored by rows: unit stride along in, its rows apart.
bool stored_by_rows(const at::Tensor& w) {
  return w.dim() == 2 && w.stride(1) == 1 && (w.size(0) <= 1 || w.stride(0) >= w.size(1));
}

// Whether a weight (out, in) is stored by columns (the packed (in, out) blocks): unit
// stride along out, its columns apart.
bool stored_by_columns(const at::Tensor& w) {
  return w.dim() == 2 && w.stride(0) == 1 && (w.size(1) <= 1 || w.stride(1) >= w.size(0));
}

// One row x (..., in) times an nn.Linear weight (out, in), float32 or bf16, stored by
// rows (unit stride along in) or by columns (unit stride along out, the packed blocks),
// plus bias (out,) and residual (numel = out), each optional: row_product.h's streamed
// product. x, bias and residual float32 or bf16 (read as float32). Returns (..., out)
// shaped like x, in x's dtype, or None for a layout it does not read.
std::optional<at::Tensor> one_row(const at::Tensor& x, const at::Tensor& w,
                                  const std::optional<at::Tensor>& bias,
                                  const std::optional<at::Tensor>& residual) {
  if (!floating(x) || !floating(w) || w.dim() != 2 || x.dim() < 1 || x.size(-1) != w.size(1) ||
      leading_rows(x) != 1 || !x.is_contiguous())
    return std::nullopt;
  const int64_t n_out = w.size(0), n_in = w.size(1);
  const bool by_rows = stored_by_rows(w);
  if (!by_rows && !stored_by_columns(w)) return std::nullopt;
  for (const auto* t : {&bias, &residual}) {
    if (t->has_value() && (!floating(**t) || (*t)->numel() != n_out || !(*t)->is_contiguous()))
      return std::nullopt;
  }
  auto as_float = [](const at::Tensor& t) { return t.to(at::kFloat); };
  const at::Tensor xf = as_float(x);
  const at::Tensor b = bias.has_value() ? as_float(*bias) : at::Tensor();
  const at::Tensor r = residual.has_value() ? as_float(*residual) : at::Tensor();
  at::Tensor y = at::empty(with_last(x, n_out), xf.options());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* rp = r.defined() ? r.data_ptr<float>() : nullptr;
  const int64_t ld = by_rows ? w.stride(0) : w.stride(1);
  if (n_out > 0 && w.scalar_type() == at::kFloat)
    row_product(xf.data_ptr<float>(), w.data_ptr<float>(), ld, by_rows, n_in, n_out, bp, rp,
                y.data_ptr<float>());
  else if (n_out > 0)
    row_product(xf.data_ptr<float>(), w.data_ptr<c10::BFloat16>(), ld, by_rows, n_in, n_out,
                bp, rp, y.data_ptr<float>());
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

namespace {

// Up to this many rows, threads take bands of 64 outputs over all rows at once, the
// next band's weight prefetched (a prompt, a batch being decoded: bound by reading W).
constexpr int64_t FEW_ROWS = 64;
// Up to this many rows a bf16 weight's rows are multiplied by the one-row loop, four rows
// of x at a time (few_rows_bf16): reading the weight bounds them, and 2-4 rows take the
// time of one. More go to the bf16 tile kernel: at 17-64 rows (a short prompt, SmolLM-135M's
// shapes) it ran 1.03-1.35x the speed of torch's bf16 product on one Zen 4 core and
// 1.03-1.52x on two (torch's had been taking them: 1.05-1.14x the loop's speed at 32 rows).
constexpr int64_t BF16_DOT_ROWS = 16;
// Up to this many rows a float32 weight stored by rows is multiplied by row_product.h's
// dots_rows, four rows of x a pass over each band (1.1-1.3x the tile kernel's speed over
// the same weight by columns at 8-16 rows, SmolLM-135M's output layer); more go to the
// tile kernel from transposed panels (at 64 rows dots_rows took 1.2x its time).
constexpr int64_t F32_DOT_ROWS = 16;
// More rows (prefill, an encoder's batch) are bound by the products: each band of 64
// outputs is multiplied ROW_CHUNK rows at a time (the chunk of x stays in L2 across the
// band's k loop), and with more than PACK_IN inputs the band's weight columns, whose
// rows lie a packed block's width apart, are first copied into one contiguous panel (at
// 1536 inputs read in place they ran at 71 GFLOP/s, copied at 106, one Zen 4 core).
constexpr int64_t ROW_CHUNK = 96;
constexpr int64_t PACK_IN = 512;

// c[r, j] += bias[j] for the rows of c (rows, n_out) and the columns [j0, j1); none
// for no bias.
void add_bias(float* c, int64_t rows, int64_t n_out, const float* bias, int64_t j0, int64_t j1) {
  if (bias == nullptr) return;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = j0; j < j1; ++j) c[r * n_out + j] += bias[j];
}

// rows x (n_in) times the band [j0, j1) of W^T (n_in, ld) into c (rows, n_out), + bias;
// W stored by rows (W (n_out, ld)): the band's rows copied transposed into the panel.
void many_rows_band(int64_t rows, int64_t n_in, int64_t n_out, const float* a, const float* b,
                    int64_t ld, bool by_rows, const float* bias, float* c, int64_t j0,
                    int64_t j1, std::vector<float>& panel) {
  const int64_t width = j1 - j0;
  const float* bj = b + j0;
  int64_t ldb = ld;
  if (by_rows || n_in > PACK_IN) {
    panel.resize(n_in * PANEL);
    if (by_rows)
      pack_transposed(b + j0 * ld, ld, width, n_in, panel.data());
    else
      for (int64_t p = 0; p < n_in; ++p)
        std::copy(b + p * ld + j0, b + p * ld + j1, panel.data() + p * PANEL);
    bj = panel.data();
    ldb = PANEL;
  }
  // The first chunk fetches the next band's weight columns (read in place, ld apart)
  // while it multiplies: they come from memory, too far apart for the hardware's
  // prefetchers.
  const bool fetch = !by_rows && n_in <= PACK_IN && j1 < n_out;
  for (int64_t r0 = 0; r0 < rows; r0 += ROW_CHUNK) {
    const int64_t m = std::min(ROW_CHUNK, rows - r0);
    float* cr = c + r0 * n_out;
    tile_gemm(m, width, n_in, 1.0f, a + r0 * n_in, n_in, 1, bj, ldb, false, cr + j0, n_out,
              false, b + j1, fetch && r0 == 0 ? std::min(PANEL, n_out - j1) : 0);
    add_bias(cr, m, n_out, bias, j0, j1);
  }
}

// Whether more than one row times w goes to attnlab's bf16 products: up to BF16_DOT_ROWS
// rows (few_rows_bf16), more on the tile kernel (tile_bf16.h); a bf16 weight packed by
// rows with an even number of inputs, a CPU with the bf16 dot product.
bool bf16_rows(int64_t rows, const at::Tensor& w) {
  return rows > 1 &&
         w.scalar_type() == at::kBFloat16 && w.device().is_cpu() && w.dim() == 2 &&
         w.size(1) > 0 && w.size(1) % 2 == 0 && stored_by_rows(w) && bf16_dot_active();
}

// The operands of rows of x (bf16) times a bf16 weight packed by rows, + bias, into y
// (C: float32 or bf16), which threads take by bands of PANEL outputs.
template <typename C>
struct Bf16Product {
  int64_t n_in, n_out, ldw, rows, bands;
  const uint16_t* a;  // x
  const uint16_t* b;  // W
  const float* bias;
  C* c;  // y
  Bf16Product(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias_, at::Tensor& y)
      : n_in(w.size(1)), n_out(w.size(0)), ldw(w.stride(0)), rows(leading_rows(x)),
        bands((n_out + PANEL - 1) / PANEL),
        a(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>())),
        b(reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>())),
        bias(bias_.defined() ? bias_.data_ptr<float>() : nullptr), c(y.data_ptr<C>()) {}
};

// Few rows times a weight stored by rows: threads take bands of PANEL outputs, and each
// band's weight, read from memory once, serves the rows four at a time from cache;
// dot(r, n, o0, o1) multiplies rows [r, r + n) (n <= 4) by outputs [o0, o1).
template <typename Dot>
void few_rows_by_bands(int64_t rows, int64_t n_in, int64_t n_out, const Dot& dot) {
  const int64_t bands = (n_out + PANEL - 1) / PANEL;
  split_region(bands, 2.0 * rows * n_in * n_out, [&](int64_t begin, int64_t end) {
    for (int64_t band = begin; band < end; ++band) {
      const int64_t o0 = band * PANEL, o1 = std::min(n_out, o0 + PANEL);
      for (int64_t r = 0; r < rows; r += 4) dot(r, std::min<int64_t>(4, rows - r), o0, o1);
    }
  });
}

// Up to BF16_DOT_ROWS rows, into y float32 (dot_bf16.h's one-row loop): 0.55-0.61x
// torch's time for 2-4 rows, 0.89-0.96x for 16 (SmolLM-135M's matrices, one Zen 5 core).
void few_rows_bf16(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                   at::Tensor& y) {
  const Bf16Product<float> p(x, w, bias, y);
  few_rows_by_bands(p.rows, p.n_in, p.n_out, [&](int64_t r, int64_t n, int64_t o0, int64_t o1) {
    const uint16_t* xr = p.a + r * p.n_in;
    float* yr = p.c + r * p.n_out;
    const int64_t k = p.n_in, ld = p.n_out;
    switch (n) {
      case 1: return dots_bf16_dot<1>(p.b, p.ldw, xr, k, k, o0, o1, p.bias, nullptr, yr, ld);
      case 2: return dots_bf16_dot<2>(p.b, p.ldw, xr, k, k, o0, o1, p.bias, nullptr, yr, ld);
      case 3: return dots_bf16_dot<3>(p.b, p.ldw, xr, k, k, o0, o1, p.bias, nullptr, yr, ld);
      default: return dots_bf16_dot<4>(p.b, p.ldw, xr, k, k, o0, o1, p.bias, nullptr, yr, ld);
    }
  });
}

// Up to F32_DOT_ROWS rows times a float32 weight stored by rows (modules/fused.py's
// output layer past COLUMNS_MAX_OUT outputs), into y.
void few_rows_f32(int64_t rows, int64_t n_in, int64_t n_out, const float* a, const float* b,
                  int64_t ld, const float* bias, float* c) {
  few_rows_by_bands(rows, n_in, n_out, [&](int64_t r, int64_t n, int64_t o0, int64_t o1) {
    const float* xr = a + r * n_in;
    float* yr = c + r * n_out;
    switch (n) {
      case 1: return dots_rows<1>(b, ld, xr, n_in, n_in, o0, o1, bias, yr, n_out);
      case 2: return dots_rows<2>(b, ld, xr, n_in, n_in, o0, o1, bias, yr, n_out);
      case 3: return dots_rows<3>(b, ld, xr, n_in, n_in, o0, o1, bias, yr, n_out);
      default: return dots_rows<4>(b, ld, xr, n_in, n_in, o0, o1, bias, yr, n_out);
    }
  });
}

// More than BF16_DOT_ROWS rows (float32 or bf16, rounded to bf16 as vdpbf16ps reads them), in
// x's dtype: each band packed into pairs once (tile_bf16.h) and every row multiplied by it.
template <typename C>
void many_rows_bf16(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                    at::Tensor& y) {
  const Bf16Product<C> p(x, w, bias, y);
  split_region(p.bands, 2.0 * p.rows * p.n_in * p.n_out, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> panel(p.n_in / 2 * PANEL);
    for (int64_t band = begin; band < end; ++band) {
      const int64_t j0 = band * PANEL, width = std::min(PANEL, p.n_out - j0);
      tile_bf16::pack_pairs(p.b + j0 * p.ldw, p.ldw, width, p.n_in, panel.data());
      // The thread's next band (its rows, ldw apart) fetched into L2 while this one is
      // multiplied: packing it then reads from cache.
      const int64_t next = band + 1 < end ? std::min(PANEL, p.n_out - j0 - PANEL) : 0;
      tile_bf16_panel(p.rows, p.n_in, p.a, p.n_in, panel.data(), width,
                      p.bias ? p.bias + j0 : nullptr, p.c + j0, p.n_out,
                      next > 0 ? p.b + (j0 + PANEL) * p.ldw : nullptr,
                      next * p.ldw * int64_t(sizeof(uint16_t)));
    }
  });
}

// linear (inference): x W^T + bias (+ residual) for x (..., in) and an nn.Linear weight
// (out, in): one row by one_row; more, W float32 stored by columns (the packed blocks),
// by the AVX-512 tile kernel where the CPU has it (few rows and many as above), threads
// taking bands of 64 outputs; W float32 stored by rows (an output layer past
// modules/fused.py's COLUMNS_MAX_OUT), up to F32_DOT_ROWS rows by few_rows_f32 (a batch
// being decoded: 1.06x tokens/s at 4 and 8 sequences against the layer by columns,
// SmolLM-135M, Zen 4), more by the tile kernel from each band transposed into a panel;
// more than one row times a bf16 weight packed by rows by attnlab's bf16 products
// (bf16_rows); None otherwise (the caller runs F.linear).
std::optional<at::Tensor> linear(const at::Tensor& x, const at::Tensor& w,
                                 const std::optional<at::Tensor>& bias,
                                 const std::optional<at::Tensor>& residual) {
  if (x.dim() >= 1 && leading_rows(x) == 1) return one_row(x, w, bias, residual);
  if (x.dim() >= 1 && bf16_rows(leading_rows(x), w) && !residual.has_value() &&
      floating(x) && x.is_contiguous() && x.size(-1) == w.size(1) &&
      (!bias.has_value() ||
       (floating(*bias) && bias->numel() == w.size(0) && bias->is_contiguous()))) {
    const at::Tensor xb = x.to(at::kBFloat16).contiguous();
    const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
    if (leading_rows(x) <= BF16_DOT_ROWS) {
      at::Tensor y = at::empty(with_last(x, w.size(0)), x.options().dtype(at::kFloat));
      few_rows_bf16(xb, w, b, y);
      return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
    }
    at::Tensor y = at::empty(with_last(x, w.size(0)), x.options());
    if (x.scalar_type() == at::kFloat)
      many_rows_bf16<float>(xb, w, b, y);
    else
      many_rows_bf16<c10::BFloat16>(xb, w, b, y);
    return y;
  }
  // A float32 weight by columns (the packed blocks) or by rows (an output layer past
  // COLUMNS_MAX_OUT outputs: up to F32_DOT_ROWS rows by few_rows_f32).
  const bool by_rows = stored_by_rows(w);
  const bool by_columns = stored_by_columns(w);
  const int64_t rows = x.dim() >= 1 ? leading_rows(x) : 0;
  const bool few_by_rows = by_rows && rows <= F32_DOT_ROWS;
  if ((!tile_gemm_supported() && !few_by_rows) || residual.has_value() || !usable(x) ||
      !usable(w) || w.dim() != 2 || x.dim() < 1 || x.size(-1) != w.size(1) ||
      !x.is_contiguous() || !(by_rows || by_columns))
    return std::nullopt;
  const int64_t n_in = w.size(1), n_out = w.size(0), ld = by_rows ? w.stride(0) : w.stride(1);
  if (n_in == 0) return std::nullopt;
  if (bias.has_value() && (!usable(*bias) || bias->numel() != n_out || !bias->is_contiguous()))
    return std::nullopt;
  at::Tensor y = at::empty(with_last(x, n_out), x.options());
  const float* a = x.data_ptr<float>();
  const float* b = w.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* c = y.data_ptr<float>();
  if (few_by_rows) {
    few_rows_f32(rows, n_in, n_out, a, b, ld, bp, c);
    return y;
  }
  const int64_t bands = (n_out + PANEL - 1) / PANEL;
  split_region(bands, 2.0 * rows * n_in * n_out, [&](int64_t begin, int64_t end) {
    const int64_t j0 = begin * PANEL, j1 = std::min(end * PANEL, n_out);
    if (rows > FEW_ROWS || by_rows) {
      std::vector<float> panel;
      for (int64_t band = begin; band < end; ++band)
        many_rows_band(rows, n_in, n_out, a, b, ld, by_rows, bp, c, band * PANEL,
                       std::min((band + 1) * PANEL, n_out), panel);
      return;
    }
    tile_gemm(rows, j1 - j0, n_in, 1.0f, a, n_in, 1, b + j0, ld, false, c + j0, n_out, true);
    add_bias(c, rows, n_out, bp, j0, j1);
  });
  return y;
}

}  // namespace

// one_row, or ATen's product (in the weight's dtype) where one_row does not read the
// layout; the result in x's dtype.
at::Tensor linear_row(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                      const at::Tensor& residual) {
  auto opt = [&](const at::Tensor& t) {
    return t.defined() ? std::optional<at::Tensor>(t.to(w.scalar_type())) : std::nullopt;
  };
  if (auto y = one_row(x, w, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                       residual.defined() ? std::optional<at::Tensor>(residual) : std::nullopt))
    return *y;
  at::Tensor y = at::linear(x.to(w.scalar_type()), w, opt(bias)).to(x.scalar_type());
  return residual.defined() ? y.add_(residual.view_as(y)) : y;
}

// The threads a one-row product of `weights` weights takes now (row_product.h); for tests.
int64_t product_threads_now(int64_t weights) { return product_threads(weights); }

}  // namespace attnlab

TORCH_LIBRARY_FRAGMENT(attnlab_native, m) {
  m.def("product_threads(int weights) -> int", &attnlab::product_threads_now);
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
