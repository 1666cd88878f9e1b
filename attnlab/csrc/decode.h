// The decoding kernels of decode.cpp and decode_step.cpp that decode_layers.cpp builds a
// layer from.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace attnlab {

// A tensor the decoding kernels read: float32 on the CPU.
bool usable(const at::Tensor& t);

// One new token's attention: RoPE, cache append at `pos`, attention over the cache
// (decode_step.cpp's comment has the shapes). Returns (B, 1, Hq * D).
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
// x W^T + bias + residual for one row x, the weight stored by rows or by columns;
// ATen's product where the streamed one does not read the layout (undefined
// bias/residual: none).
at::Tensor linear_row(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                      const at::Tensor& residual);

}  // namespace attnlab
