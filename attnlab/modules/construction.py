"""The other ways to make a :class:`~attnlab.modules.MultiHeadAttention`: the book's
positional call, and a copy of ``torch.nn.MultiheadAttention``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import fused

__all__ = ["book_call", "from_torch"]


def book_call(third: Any, rest: tuple, context_length: Any, dropout: Any, qkv_bias: Any,
               causal: Any) -> tuple:
    """``(num_heads, context_length, dropout, qkv_bias, causal)`` of the book's positional
    call ``(d_in, d_out, context_length, dropout, num_heads[, qkv_bias])``: its third
    argument is ``context_length``, and the module is causal, as the book's always is."""
    if len(rest) not in (2, 3):
        raise TypeError(
            f"MultiHeadAttention takes (d_in, d_out, num_heads, *, context_length=..., "
            f"dropout=..., ...) or the book's (d_in, d_out, context_length, dropout, "
            f"num_heads, qkv_bias=False); got {3 + len(rest)} positional arguments")
    if context_length is not None or dropout != 0.0:
        raise TypeError("MultiHeadAttention: the book's positional call already gives "
                        "context_length and dropout (3rd and 4th arguments); got them as "
                        "keywords too")
    if len(rest) == 3:
        if qkv_bias is not False:
            raise TypeError("MultiHeadAttention: qkv_bias given both as the 6th positional "
                            "argument and as a keyword")
        qkv_bias = rest[2]
    return rest[1], third, rest[0], qkv_bias, True if causal is None else causal


def from_torch(cls: type, m: nn.MultiheadAttention):
    """``cls.from_torch(m)`` (see :meth:`MultiHeadAttention.from_torch`)."""
    if not isinstance(m, nn.MultiheadAttention):
        raise TypeError(f"m must be a torch.nn.MultiheadAttention, got {type(m).__name__}")
    e = m.embed_dim
    if not m._qkv_same_embed_dim or m.kdim != e or m.vdim != e:
        raise ValueError(
            f"kdim={m.kdim}/vdim={m.vdim} different from embed_dim={e} is not supported"
        )
    if m.bias_k is not None or m.bias_v is not None:
        raise ValueError("add_bias_kv=True is not supported")
    if m.add_zero_attn:
        raise ValueError("add_zero_attn=True is not supported")
    w = m.in_proj_weight
    out = cls(e, e, m.num_heads, qkv_bias=m.in_proj_bias is not None,
              out_bias=m.out_proj.bias is not None, dropout=m.dropout)
    out = out.to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        for i, lin in enumerate((out.W_query, out.W_key, out.W_value)):
            lin.weight.copy_(w[i * e:(i + 1) * e])
            if m.in_proj_bias is not None:
                lin.bias.copy_(m.in_proj_bias[i * e:(i + 1) * e])
        out.out_proj.weight.copy_(m.out_proj.weight)
        if m.out_proj.bias is not None:
            out.out_proj.bias.copy_(m.out_proj.bias)
    fused.pack((out.W_query, out.W_key, out.W_value))  # .to() may have unpacked them
    fused.pack((out.out_proj,))
    out.train(m.training)
    return out
