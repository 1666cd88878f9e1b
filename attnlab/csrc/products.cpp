// The int8 products (int8_product.h) as an op, and the tests' switch between the dot-
// product instructions (vdpbf16ps, vpdpbusd) and the portable loops.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "decode.h"
#include "int8_product.h"

namespace attnlab {

std::string int8_problem(const at::Tensor& data, const at::Tensor& scales, int64_t out,
                         int64_t in) {
  const int64_t bands = (out + Q8_BAND - 1) / Q8_BAND, blocks = (in + Q8_BLOCK - 1) / Q8_BLOCK;
  auto shape = [](int64_t a, int64_t b) {
    return "(" + std::to_string(a) + ", " + std::to_string(b) + ")";
  };
  if (out <= 0 || in <= 0) return "int8 weight of no outputs or no inputs";
  if (!data.device().is_cpu() || data.scalar_type() != at::kByte || !data.is_contiguous() ||
      data.dim() != 2 || data.size(0) != bands || data.size(1) != blocks * Q8_BLOCK_BYTES)
    return "int8 data is not a contiguous " + shape(bands, blocks * Q8_BLOCK_BYTES) +
           " uint8 CPU tensor";
  if (!scales.device().is_cpu() || scales.scalar_type() != at::kShort || !scales.is_contiguous() ||
      scales.dim() != 2 || scales.size(0) != bands || scales.size(1) != blocks * Q8_BAND)
    return "int8 scales are not a contiguous " + shape(bands, blocks * Q8_BAND) +
           " int16 CPU tensor (float16 bits)";
  return "";
}

namespace {

// t as a contiguous float32 tensor (itself where it is one).
at::Tensor as_float(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

}  // namespace

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                       int64_t out, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() >= 1 && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "attnlab int8_linear: x must be (..., in) float32 or bf16 on the CPU");
  const int64_t in = x.size(-1);
  const std::string why = int8_problem(data, scales, out, in);
  TORCH_CHECK(why.empty(), "attnlab int8_linear: ", why);
  const at::Tensor xf = as_float(x);
  const int64_t rows = in == 0 ? 0 : xf.numel() / in;
  at::Tensor b, r;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == out, "attnlab int8_linear: bias must hold out values");
    b = as_float(*bias);
  }
  if (residual.has_value()) {
    TORCH_CHECK(residual->numel() == rows * out, "attnlab int8_linear: residual (..., out)");
    r = as_float(*residual);
  }
  const at::Tensor y = int8_linear_checked(
      xf, data.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>()),
      out, b.defined() ? b.data_ptr<float>() : nullptr, r);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

at::Tensor int8_linear_checked(const at::Tensor& x, const uint8_t* data, const uint16_t* scales,
                               int64_t out, const float* bias, const at::Tensor& residual) {
  const int64_t in = x.size(-1), rows = in == 0 ? 0 : x.numel() / in;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  at::Tensor y = at::empty(shape, x.options());
  if (rows > 0)
    int8_product(x.data_ptr<float>(), rows, in, data, scales, out, bias,
                 residual.defined() ? residual.data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y;
}

namespace {

// Rows [row0, row0 + rows) of a weight (out, in), float32 or bf16, quantised (Q8_0, as
// layouts/int8.py's q8_0 and the gguf package compute it: float32 maths, d = max|w| / 127
// rounded to float16 after q = round(w / d), halves away from zero) into their bands of
// `data` and `scales`; row0 a multiple of 16, rows past `out` in the last band zeroed.
template <typename S>
void quantize_band_rows(const S* w, int64_t rows, int64_t in, int64_t row0, int64_t out,
                        uint8_t* data, uint16_t* scales) {
  const int64_t blocks = (in + Q8_BLOCK - 1) / Q8_BLOCK;
  const int64_t end = row0 + rows;  // the last chunk pads its band with zero rows
  const int64_t last = end == out ? (out + Q8_BAND - 1) / Q8_BAND * Q8_BAND : end;
  at::parallel_for(row0, last, 64, [&](int64_t r0, int64_t r1) {
    float q[Q8_BLOCK];
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t band = r / Q8_BAND, o = r % Q8_BAND;
      uint8_t* band_data = data + band * blocks * Q8_BLOCK_BYTES;
      for (int64_t j = 0; j < blocks; ++j) {
        float amax = 0.0f;
        const bool real = r < row0 + rows;
        for (int64_t t = 0; t < Q8_BLOCK; ++t) {
          const int64_t i = j * Q8_BLOCK + t;
          q[t] = real && i < in ? float(w[(r - row0) * in + i]) : 0.0f;
          amax = std::max(amax, std::fabs(q[t]));
        }
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int64_t t = 0; t < Q8_BLOCK; ++t) {
          const float v = std::round(q[t] * id);  // NaN (a NaN or infinite weight): 0
          band_data[q8_at(j * Q8_BLOCK + t, o)] = uint8_t((v == v ? int(v) : 0) + 128);
        }
        scales[band * blocks * Q8_BAND + j * Q8_BAND + o] = c10::Half(d).x;
      }
    }
  });
}

void quantize_rows(const at::Tensor& w, at::Tensor& data, at::Tensor& scales, int64_t row0,
                   int64_t out) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "attnlab quantize_rows: w must be contiguous (rows, in) float32 or bf16");
  TORCH_CHECK(row0 >= 0 && row0 % Q8_BAND == 0 && row0 + w.size(0) <= out &&
                  ((row0 + w.size(0)) % Q8_BAND == 0 || row0 + w.size(0) == out),
              "attnlab quantize_rows: rows must fill whole bands of 16 (but the last) "
              "inside out");
  const std::string why = int8_problem(data, scales, out, w.size(1));
  TORCH_CHECK(why.empty(), "attnlab quantize_rows: ", why);
  uint8_t* d = data.data_ptr<uint8_t>();
  uint16_t* s = reinterpret_cast<uint16_t*>(scales.data_ptr<int16_t>());
  if (w.scalar_type() == at::kFloat)
    quantize_band_rows(w.data_ptr<float>(), w.size(0), w.size(1), row0, out, d, s);
  else
    quantize_band_rows(w.data_ptr<c10::BFloat16>(), w.size(0), w.size(1), row0, out, d, s);
}

}  // namespace

// Rows `ids` of an int8 weight (an embedding table tied to its output layer), float32
// (n, in): w = d * q, as layouts/int8.py's dequantize computes it.
at::Tensor int8_rows(const at::Tensor& data, const at::Tensor& scales, const at::Tensor& ids,
                     int64_t out, int64_t in) {
  const std::string why = int8_problem(data, scales, out, in);
  TORCH_CHECK(why.empty(), "attnlab int8_rows: ", why);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.device().is_cpu(),
              "attnlab int8_rows: ids must be int64 on the CPU");
  const at::Tensor flat = ids.reshape(-1).contiguous();
  const int64_t n = flat.numel(), blocks = (in + Q8_BLOCK - 1) / Q8_BLOCK;
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(id[r] >= 0 && id[r] < out, "attnlab int8_rows: id ", id[r], " is not a row of ",
                out);
  at::Tensor rows = at::empty({n, in}, data.options().dtype(at::kFloat));
  const uint8_t* q = data.data_ptr<uint8_t>();
  const uint16_t* d = reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>());
  float* y = rows.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    const int64_t band = id[r] / Q8_BAND, o = id[r] % Q8_BAND;
    const uint8_t* qb = q + band * blocks * Q8_BLOCK_BYTES;
    for (int64_t i = 0; i < in; ++i) {
      const float scale = float(c10::Half(d[(band * blocks + i / Q8_BLOCK) * Q8_BAND + o],
                                          c10::Half::from_bits()));
      y[r * in + i] = float(int(qb[q8_at(i, o)]) - 128) * scale;
    }
  }
  return rows;
}

namespace {

// Whether the products may use the dot-product instructions where the CPU has them
// (the tests run both paths); returns the setting before.
bool set_dot_products(bool allowed) { return dot_products_allowed().exchange(allowed); }

bool dot_products_ready() { return dot_products_active(); }

}  // namespace
}  // namespace attnlab

TORCH_LIBRARY_FRAGMENT(attnlab_native, m) {
  m.def(
      "int8_linear(Tensor x, Tensor data, Tensor scales, int out_features, Tensor? bias, "
      "Tensor? residual) -> Tensor");
  m.def("quantize_rows(Tensor w, Tensor(a!) data, Tensor(b!) scales, int row0, int out) -> ()");
  m.def("int8_rows(Tensor data, Tensor scales, Tensor ids, int out_features, int in_features) "
        "-> Tensor");
  m.def("set_dot_products(bool allowed) -> bool", &attnlab::set_dot_products);
  m.def("dot_products_active() -> bool", &attnlab::dot_products_ready);
}

TORCH_LIBRARY_IMPL(attnlab_native, CPU, m) {
  m.impl("int8_linear", &attnlab::int8_linear);
  m.impl("quantize_rows", &attnlab::quantize_rows);
  m.impl("int8_rows", &attnlab::int8_rows);
}
