"""The arguments of :func:`attnlab.attention` and :func:`attnlab.functional.decode_step`,
checked: each error names the argument, what came and what was expected (DESIGN.md).
Part of ``functional.py`` in all but file."""

from __future__ import annotations

import torch

from . import _variants
from ._tracing import reads_values
from .backends import TABLE
from .checks import (
    boolean,
    finite_float,
    one_of,
    optional_positive_int,
    positive_int,
    probability,
)

# The names attention() takes: "auto" (backends.choose), then the table's.
BACKENDS = ("auto", *TABLE)


def shape_of(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check(q, k, v, mask, causal, window, scale, dropout_p, return_weights, backend):
    """Validate the arguments; return the requested weight rows (LongTensor) or None."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim < 3:
            raise ValueError(
                f"{name} must have at least 3 dimensions (..., heads, seq, head_dim), "
                f"got shape {shape_of(t)}"
            )
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    lead = q.shape[:-3]
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; expected one dtype")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; expected one device")
        if t.ndim != q.ndim:
            raise ValueError(
                f"{name} has shape {shape_of(t)} but q has {shape_of(q)}; expected the same "
                "number of dimensions"
            )
        if t.shape[:-3] != lead:
            raise ValueError(
                f"{name} has batch dimensions {shape_of(t)[:-3]} but q has {shape_of(q)[:-3]}; "
                "expected them equal"
            )
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"k has head_dim {k.shape[-1]} but q has head_dim {q.shape[-1]} "
            f"(q {shape_of(q)}, k {shape_of(k)}); expected them equal"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k has length {k.shape[-2]} but v has length {v.shape[-2]} "
            f"(k {shape_of(k)}, v {shape_of(v)}); expected them equal"
        )
    if k.shape[-3] != v.shape[-3]:
        raise ValueError(
            f"k has {k.shape[-3]} heads but v has {v.shape[-3]}; expected them equal"
        )
    q_heads, kv_heads = q.shape[-3], k.shape[-3]
    if q.shape[-1] == 0:
        raise ValueError(f"q has head_dim 0 (shape {shape_of(q)}); expected head_dim >= 1")
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(
            f"q has {q_heads} heads and k/v have {kv_heads}; expected q heads to be a "
            "multiple of kv heads (grouped-query attention)"
        )
    one_of("backend", backend, BACKENDS)
    probability("dropout_p", dropout_p)
    optional_positive_int("window", window)
    boolean("causal", causal)
    if scale is not None:
        finite_float("scale", scale)
    if mask is not None:
        _check_mask(mask, q, k)
    return _check_rows(return_weights, q)


def _check_mask(mask, q, k):
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(
            f"mask must be bool (True = may attend) or an additive float mask, got dtype "
            f"{mask.dtype}; convert 1/0 padding masks with attnlab.masks.from_attention_mask"
        )
    if mask.device != q.device:
        raise ValueError(f"mask is on {mask.device} but q is on {q.device}; expected one device")
    if mask.dtype != torch.bool and reads_values():
        # NaN poisons every row it touches and +inf turns a softmax into NaN; only
        # -inf ("may not attend") and finite values are additive masks.
        bad = torch.isnan(mask) | (mask == float("inf"))
        if bool(bad.any()):
            at = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(f"mask holds {float(mask[at])} at {at}; expected finite values "
                             "or -inf (a float mask is added to the scores)")
    target = (*q.shape[:-1], k.shape[-2])
    try:
        ok = mask.ndim <= len(target) and torch.broadcast_shapes(mask.shape, target) == target
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"mask of shape {shape_of(mask)} does not broadcast to (..., heads, q_len, k_len) "
            f"= {target}"
        )


def _check_rows(return_weights, q):
    if return_weights is False or return_weights is None:
        return None
    q_len = q.shape[-2]
    if return_weights is True:
        rows = torch.arange(q_len, device=q.device)
    else:
        try:
            rows = torch.as_tensor(return_weights, device=q.device)
        except (TypeError, ValueError, RuntimeError):
            rows = None
        if rows is not None and rows.ndim == 1 and rows.numel() == 0:
            rows = rows.long()  # ([] and () come as float32: no rows, no weights)
        if rows is None or rows.ndim != 1 or rows.dtype.is_floating_point or rows.dtype == (
            torch.bool
        ):
            raise TypeError(
                "return_weights must be a bool or a sequence of query indices, got "
                f"{return_weights!r}"
            )
        if len(rows) and (int(rows.min()) < -q_len or int(rows.max()) >= q_len):
            raise ValueError(
                f"return_weights rows must lie in [-q_len, q_len) with q_len={q_len} "
                f"(negative ones count from the end, as Python indexing), got {rows.tolist()}"
            )
        rows = rows.remainder(q_len).long()
    return rows


def check_decode(qkv, cache, window, num_heads, num_kv_heads, scale, softcap, alibi_slopes,
                  sinks):
    """:func:`decode_step`'s arguments checked as :func:`attention` checks its own; the
    variants as checked (``softcap``, ``alibi_slopes``, ``sinks``)."""
    if not isinstance(qkv, torch.Tensor) or not qkv.dtype.is_floating_point:
        raise TypeError(f"qkv must be a floating-point torch.Tensor, got "
                        f"{getattr(qkv, 'dtype', type(qkv).__name__)}")
    positive_int("num_heads", num_heads)
    positive_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads or num_kv_heads != cache.num_kv_heads:
        raise ValueError(f"num_heads={num_heads} and num_kv_heads={num_kv_heads}: expected "
                         f"num_kv_heads to divide num_heads and equal the cache's "
                         f"{cache.num_kv_heads}")
    width = (num_heads + 2 * num_kv_heads) * cache.head_dim
    if qkv.ndim != 3 or tuple(qkv.shape) != (cache.batch_size, 1, width):
        raise ValueError(f"qkv must have shape ({cache.batch_size}, 1, {width}) (the cache's "
                         f"batch, one token, q|k|v of head_dim {cache.head_dim}), got "
                         f"{shape_of(qkv)}")
    optional_positive_int("window", window)
    if scale is not None:
        finite_float("scale", scale)
    q = qkv[..., :num_heads * cache.head_dim].unflatten(-1, (num_heads, -1)).transpose(1, 2)
    variants = _variants.check(q, q, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    if variants is None:
        return None, None, None
    slopes = variants.alibi_slopes
    if slopes is not None and slopes.shape[0] != 1:
        raise ValueError(f"alibi_slopes must have shape ({num_heads},) for decode_step (one "
                         f"per head), got {shape_of(alibi_slopes)}")
    return variants.softcap, None if slopes is None else slopes.reshape(-1), variants.sinks
