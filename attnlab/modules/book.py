"""The book's positional call of ``MultiHeadAttention``:
``(d_in, d_out, context_length, dropout, num_heads[, qkv_bias])`` (chapter 3)."""

from __future__ import annotations

from typing import Any

import torch


def shape_of(t: object) -> object:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


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
