"""The fake (meta) kernels of the native ops: what each returns (shapes, dtypes, strides,
or None where the real op declines its inputs), computed from the inputs' metadata alone,
so that torch.compile can trace through them. ``_native.load`` registers them, once per
process, with the answers of two probes of the real op (which tile kernels this CPU has).
"""

from __future__ import annotations

import math

import torch

# The dtypes the products and the decoding run read (weights, rows, caches).
PRODUCT_DTYPES = (torch.float32, torch.bfloat16)


# Rows up to which linear multiplies a float32 weight stored by rows by its rows loop, more
# on the tile kernel (csrc/decode.cpp's constant; a test holds them equal).
F32_DOT_ROWS = 16


def fakes(tiles: bool, bf16_dot: bool = False) -> dict:
    """The fake kernels, by op name (the C++ signatures in csrc/*.cpp)."""

    def flash_forward(q, k, v, mask, causal, window, offset, scale, dropout_p, seed, block_q,
                      block_k, softcap, alibi, sinks, documents, block_kinds, block_index,
                      block_partial):
        batch, heads, q_len, _ = q.shape
        out = q.new_empty(batch, heads, q_len, v.shape[-1])
        # The log-sum-exp, one per row, in the accumulation dtype (float32 for bf16/fp16).
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        return out, q.new_empty(batch, heads, q_len, dtype=acc)

    def flash_backward(q, k, v, mask, out, lse, grad_out, causal, window, offset, scale,
                       dropout_p, seed, block_q, block_k, softcap, alibi, sinks, documents,
                       block_kinds, block_index, block_partial):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def rms_norm(x, weight, eps):
        # The kernel's empty_like of x.contiguous() keeps that tensor's strides, even the
        # free ones of size-1 dimensions, which torch.empty_like under fake tensors resets.
        dense = x.contiguous()
        return dense.new_empty_strided(dense.shape, dense.stride())

    def silu_mul(gate_up):
        return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    gelu_mul = silu_mul  # the same shapes

    def usable(t) -> bool:
        return t.dtype == torch.float32 and t.device.type == "cpu"

    def floating(t) -> bool:
        return t.dtype in PRODUCT_DTYPES and t.device.type == "cpu"

    def by_rows(w) -> bool:
        return w.dim() == 2 and w.stride(1) == 1 and (w.shape[0] <= 1
                                                      or w.stride(0) >= w.shape[1])

    def by_columns(w) -> bool:
        return w.dim() == 2 and w.stride(0) == 1 and (w.shape[1] <= 1
                                                      or w.stride(1) >= w.shape[0])

    def one_row(x, w, bias, residual):
        if (not floating(x) or not floating(w) or w.dim() != 2 or x.dim() < 1
                or x.shape[-1] != w.shape[1] or math.prod(x.shape[:-1]) != 1
                or not x.is_contiguous()):
            return None
        n_out = w.shape[0]
        if not by_rows(w) and not by_columns(w):
            return None
        for t in (bias, residual):
            if t is not None and (not floating(t) or t.numel() != n_out
                                  or not t.is_contiguous()):
                return None
        return x.new_empty(*x.shape[:-1], n_out)

    def bf16_by_rows(x, weight, bias, residual, rows) -> bool:
        n_out, n_in = weight.shape if weight.dim() == 2 else (0, 0)
        return (bf16_dot and residual is None and floating(x) and x.dim() >= 1
                and x.is_contiguous() and x.shape[-1] == n_in
                and rows > 1
                and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
                and n_in > 0 and n_in % 2 == 0 and by_rows(weight)
                and (bias is None or (floating(bias) and bias.numel() == n_out
                                      and bias.is_contiguous())))

    def linear(x, weight, bias, residual):
        rows = math.prod(x.shape[:-1]) if x.dim() >= 1 else 0
        if x.dim() >= 1 and rows == 1:
            return one_row(x, weight, bias, residual)
        if bf16_by_rows(x, weight, bias, residual, rows):
            return x.new_empty(*x.shape[:-1], weight.shape[0])
        # A float32 weight by columns, or by rows (up to F32_DOT_ROWS rows without the
        # tiles).
        rows_layout = by_rows(weight)
        if ((not tiles and not (rows_layout and rows <= F32_DOT_ROWS)) or residual is not None
                or not usable(x) or not usable(weight) or weight.dim() != 2 or x.dim() < 1
                or x.shape[-1] != weight.shape[1] or not x.is_contiguous()
                or not (rows_layout or by_columns(weight)) or weight.shape[1] == 0):
            return None
        if bias is not None and (not usable(bias) or bias.numel() != weight.shape[0]
                                 or not bias.is_contiguous()):
            return None
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    def decode_step(qkv, cos, sin, k_cache, v_cache, pos, window, num_heads, num_kv_heads,
                    scale, softcap=0.0, alibi=None, sinks=None):
        return qkv.new_empty(k_cache.shape[0], 1, num_heads * k_cache.shape[3])

    def int8_linear(x, data, scales, out_features, bias, residual):
        return x.new_empty(*x.shape[:-1], out_features)

    def int8_rows(data, scales, ids, out_features, in_features):
        return data.new_empty(ids.numel(), in_features, dtype=torch.float32)

    return {"flash_forward": flash_forward, "flash_backward": flash_backward,
            "rms_norm": rms_norm, "silu_mul": silu_mul, "gelu_mul": gelu_mul, "linear": linear,
            "decode_step": decode_step, "int8_linear": int8_linear, "int8_rows": int8_rows}
