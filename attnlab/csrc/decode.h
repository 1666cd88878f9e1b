// The decoding kernels of decode.cpp and decode_step.cpp that decode_layers.cpp builds a
// layer from.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace attnlab {

// A tensor the decoding kernels read: float32 on the CPU.
bool usable(const at::Tensor& t);
// A weight (or activation) the products read: float32 or bf16 on the CPU.
bool floating(const at::Tensor& t);

// One new token's attention: RoPE, cache append at `pos`, attention over the cache
// (float32 or bf16; decode_step.cpp's comment has the shapes). Returns (B, 1, Hq * D).
at::Tensor decode_step(const at::Tensor& qkv, const std::optional<at::Tensor>& cos_table,
                       const std::optional<at::Tensor>& sin_table, at::Tensor& k_cache,
                       at::Tensor& v_cache, int64_t pos, int64_t window, int64_t num_heads,
                       int64_t num_kv_heads, double scale, double softcap,
                       const std::optional<at::Tensor>& alibi,
                       const std::optional<at::Tensor>& sinks);
// x * rsqrt(mean(x^2) + eps) * weight over the last dimension.
at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps);
// silu(gate) * up from (..., 2F) [gate | up] to (..., F).
at::Tensor silu_mul(const at::Tensor& gate_up);
// gelu_tanh(gate) * up (GeGLU) from (..., 2F) [gate | up] to (..., F).
at::Tensor gelu_mul(const at::Tensor& gate_up);
// x W^T + bias + residual for one row x, the weight (float32 or bf16) stored by rows or
// by columns; ATen's product where the streamed one does not read the layout (undefined
// bias/residual: none).
at::Tensor linear_row(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                      const at::Tensor& residual);
// x W^T + bias + residual, W int8 in int8_product.h's layout (data, scales) with `out`
// outputs; the result in x's dtype (float32 or bf16).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                       int64_t out, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual);
// int8_linear for inputs already checked and converted (x, residual float32 contiguous or
// residual undefined; bias a float32 copy or null; the weight's data and scales int8_problem-
// free): the decoding run's products, which read the weight's pointers when a layer is added.
at::Tensor int8_linear_checked(const at::Tensor& x, const uint8_t* data, const uint16_t* scales,
                               int64_t out, const float* bias, const at::Tensor& residual);
// Rows `ids` (int64) of an int8 weight of (out, in), float32 (n, in): an embedding table
// tied to its output layer.
at::Tensor int8_rows(const at::Tensor& data, const at::Tensor& scales, const at::Tensor& ids,
                     int64_t out, int64_t in);
// Why (data, scales) is not an int8 weight of (out, in) in that layout, or "".
std::string int8_problem(const at::Tensor& data, const at::Tensor& scales, int64_t out,
                         int64_t in);

}  // namespace attnlab
