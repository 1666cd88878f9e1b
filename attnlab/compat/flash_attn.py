"""FlashAttention's ``flash_attn_func`` and ``flash_attn_varlen_func`` (flash-attn 2.x
signatures, layouts and return values) on :func:`attnlab.attention`.

The semantics are FlashAttention's README's, mapped exactly:

- layout ``(batch, seqlen, nheads, headdim)`` (varlen: ``(total_tokens, nheads,
  headdim)`` with ``cu_seqlens``); ``k``/``v`` may have fewer heads (MQA/GQA);
- ``causal``: aligned to the bottom-right corner when the lengths differ (attnlab's rule);
- ``window_size=(left, right)``: query ``i`` attends keys ``j`` with
  ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right`` (the README's
  formula), the sides set as FlashAttention's kernel sets them (``mha_fwd``, then
  ``set_params_fprop``; varlen: ``max_seqlen_k`` for ``seqlen_k``): ``causal`` makes
  ``right`` 0, a side of ``seqlen_k`` or more is -1, and a -1 beside a non-negative side
  becomes ``seqlen_k``; two -1 are no window. The README reads a -1 as unbounded; the two
  differ only for ``(left >= 0, -1)`` with more queries than keys, in the first
  ``seqlen_q - seqlen_k - 1`` rows, which the kernel stops at key
  ``i + 2 seqlen_k - seqlen_q``. ``(-1, 0)`` is attnlab's
  causal rule, ``(w, 0)`` causal with ``window=w + 1``, ``(w, w)`` ``window=w + 1``; every
  other pair becomes a band ``mask_mod`` (exact, evaluated once into a block mask);
- ``softcap``: ``softcap * tanh(qk^T * softmax_scale / softcap)``, 0 = off (attnlab's);
- ``alibi_slopes`` ``(nheads,)`` or ``(batch, nheads)``: a bias ``-slope * |i + seqlen_k -
  seqlen_q - j|`` (attnlab's ALiBi);
- varlen: each sequence attends on its own, its causal/window/ALiBi positions aligned to
  its own end (attnlab's ``document_ids``);
- ``return_attn_probs=True``: ``(out, softmax_lse, probs)``, the lse ``(batch, nheads,
  seqlen_q)`` float32 (varlen: ``(nheads, total_q)``), ``+inf`` for a row with no key,
  differentiable as ``attention_with_lse``'s (FlashAttention's is not), and the
  probabilities before dropout (FlashAttention's testing output; its dropout sign
  encoding is not reproduced).

Refused, each with one ValueError: a negative ``softcap``; ``block_table`` (a paged KV
cache); in varlen, per-sequence ALiBi slopes that differ between sequences. Varlen tokens
past ``cu_seqlens[-1]`` (padding to a fixed total) are left out: their rows are zeros.
``deterministic`` is accepted and changes nothing (attnlab's backward is deterministic).
"""

from __future__ import annotations

import functools

import torch

from .._tracing import reads_values
from ..blockmask import block_mask
from ..checks import boolean, is_int, probability
from ..functional import attention, attention_with_lse

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]


def _sides(window_size, causal: bool, seqlen_q: int, seqlen_k: int,
           ) -> tuple[int | None, int | None]:
    """``window_size`` as FlashAttention's kernel sets it (module docstring), as
    ``(left, right)`` with None for a side that rules no key out from any query's position
    (``p`` from ``seqlen_k - seqlen_q`` to ``seqlen_k - 1``), so that a plain rule takes it."""
    if (not isinstance(window_size, tuple | list) or len(window_size) != 2
            or not all(is_int(x) for x in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 = unbounded, "
                        f"got {window_size!r}")
    left, right = (int(x) for x in window_size)
    right = 0 if causal else right
    left, right = (-1 if side >= seqlen_k else side for side in (left, right))
    if left < 0 and right < 0:
        return None, None
    left, right = (seqlen_k if side < 0 else side for side in (left, right))
    return (None if left >= seqlen_k - 1 else left, None if right >= seqlen_q - 1 else right)


def _rule(left, right) -> tuple[bool, int | None] | None:
    """attnlab's ``(causal, window)`` for a window, or None where it is no such rule."""
    if left is None and right is None:
        return False, None
    if right == 0:
        return True, None if left is None else left + 1
    if left is not None and left == right:
        return False, left + 1
    return None


def _band(left, right, offset):
    """The mask_mod of FlashAttention's window: key ``j`` of query ``i`` (at position
    ``i + offset``, ``offset`` an int or a per-query long tensor) when
    ``p - left <= j <= p + right``."""
    def band(b, h, q_idx, kv_idx):
        p = q_idx + (offset if isinstance(offset, int) else offset[q_idx])
        ok = kv_idx >= (p - left if left is not None else 0)
        return ok & (kv_idx <= p + right) if right is not None else ok
    return band


_cached_band = functools.lru_cache(maxsize=64)(_band)  # one function per window: cached masks


def _softcap(softcap) -> float | None:
    if isinstance(softcap, bool) or not isinstance(softcap, int | float) or softcap < 0:
        raise ValueError(f"softcap must be a number >= 0 (0 = off), got {softcap!r}")
    return float(softcap) or None


def _layout(q, k, v, layout: str) -> None:
    """q, k, v in FlashAttention's ``layout`` (its last three sizes ``seqlen, nheads,
    headdim``), checked and named as the caller passed them."""
    ndim = len(layout.split(","))
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != ndim:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    shapes = f"(q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; {layout})"
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must have the same sizes but headdim {shapes}")
    if q.shape[:-3] != k.shape[:-3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same batch and headdim {shapes}")
    if q.shape[-2] % max(k.shape[-2], 1) or k.shape[-2] == 0:
        raise ValueError(f"k's nheads must divide q's (MQA/GQA) {shapes}")


def _common(dropout_p, softcap, deterministic, return_attn_probs, causal):
    probability("dropout_p", dropout_p)
    boolean("deterministic", deterministic)
    boolean("return_attn_probs", return_attn_probs)
    boolean("causal", causal)
    return _softcap(softcap)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    deterministic=False, return_attn_probs=False):
    """FlashAttention's ``flash_attn_func``: ``q`` ``(batch, seqlen_q, nheads, headdim)``,
    ``k``/``v`` ``(batch, seqlen_k, nheads_k, headdim)``; returns ``out`` ``(batch,
    seqlen_q, nheads, headdim)``, or ``(out, softmax_lse, probs)`` (module docstring)."""
    _layout(q, k, v, "(batch, seqlen, nheads, headdim)")
    cap = _common(dropout_p, softcap, deterministic, return_attn_probs, causal)
    left, right = _sides(window_size, causal, q.shape[1], k.shape[1])
    rule = _rule(left, right)
    q4, k4, v4 = (t.transpose(1, 2) for t in (q, k, v))
    kw = dict(scale=softmax_scale, dropout_p=dropout_p, softcap=cap, alibi_slopes=alibi_slopes)
    if rule is not None:
        kw.update(causal=rule[0], window=rule[1])
    elif not reads_values():  # a trace: the band as a bool mask (a block mask reads values)
        band = _band(left, right, k.shape[1] - q.shape[1])
        kw["mask"] = band(None, None, torch.arange(q.shape[1], device=q.device)[:, None],
                          torch.arange(k.shape[1], device=q.device))
    else:
        kw["mask_mod"] = _cached_band(left, right, k.shape[1] - q.shape[1])
    return _finish(q4, k4, v4, kw, return_attn_probs, lambda t: t.transpose(1, 2).contiguous())


def _finish(q4, k4, v4, kw, probs, back):
    if not probs:
        return back(attention(q4, k4, v4, **kw))
    out, weights = attention(q4, k4, v4, return_weights=True, **kw)
    _, lse = attention_with_lse(q4, k4, v4, **{**kw, "dropout_p": 0.0})
    return back(out), lse.float(), weights


def _cu_seqlens(name: str, cu, total: int, device) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor) or cu.ndim != 1 or cu.dtype.is_floating_point or (
            cu.dtype == torch.bool) or len(cu) < 1:
        raise TypeError(f"{name} must be a 1-D integer tensor (batch + 1,) of cumulative "
                        f"sequence lengths, got {cu!r}")
    cu = cu.to(device=device, dtype=torch.long)
    if int(cu[0]) != 0 or int(cu[-1]) > total or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name} must start at 0, never decrease and end at or before the "
                         f"number of tokens ({total}), got {cu.tolist()}")
    return cu


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """FlashAttention's ``flash_attn_varlen_func``: ``q`` ``(total_q, nheads, headdim)``,
    ``k``/``v`` ``(total_k, nheads_k, headdim)``, sequence ``b`` the tokens
    ``cu_seqlens[b]:cu_seqlens[b + 1]``; returns ``out`` ``(total_q, nheads, headdim)``, or
    ``(out, softmax_lse (nheads, total_q), probs (batch, nheads, max_seqlen_q,
    max_seqlen_k))``."""
    _layout(q, k, v, "(total_tokens, nheads, headdim)")
    if block_table is not None:
        raise ValueError("block_table (a paged KV cache) is not supported; pass the keys and "
                         "values of each sequence packed, with cu_seqlens_k")
    cap = _common(dropout_p, softcap, deterministic, return_attn_probs, causal)
    cu_q = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    cu_k = _cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe as many sequences, got "
                         f"{len(cu_q) - 1} and {len(cu_k) - 1}")
    for name, cu, most in (("max_seqlen_q", cu_q, max_seqlen_q),
                           ("max_seqlen_k", cu_k, max_seqlen_k)):
        longest = int((cu[1:] - cu[:-1]).max()) if len(cu) > 1 else 0
        if not is_int(most) or int(most) < longest:
            raise ValueError(f"{name} must be an int >= the longest sequence ({longest}), "
                             f"got {most!r}")
    batch = len(cu_q) - 1
    # Tokens past cu_seqlens[-1] (padding to a fixed total, which FlashAttention leaves
    # alone) are sequences of their own, the queries' with no keys: their rows are zeros.
    ids = torch.arange(batch + 2, device=q.device)
    q_ids = torch.repeat_interleave(ids, torch.cat([cu_q[1:] - cu_q[:-1], (
        q.shape[0] - cu_q[-1]).view(1), cu_q.new_zeros(1)]))
    k_ids = torch.repeat_interleave(ids, torch.cat([cu_k[1:] - cu_k[:-1], cu_k.new_zeros(1), (
        k.shape[0] - cu_k[-1]).view(1)]))
    if isinstance(alibi_slopes, torch.Tensor):
        heads = q.shape[1]
        if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
            raise ValueError(f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}) "
                             f"(nheads, or batch x nheads), got {tuple(alibi_slopes.shape)}")
        if alibi_slopes.ndim == 2:
            if not bool((alibi_slopes == alibi_slopes[:1]).all()):
                raise ValueError("alibi_slopes of shape (batch, nheads) that differ between "
                                 "sequences are not supported with cu_seqlens (packed "
                                 "sequences take one slope per head); pass (nheads,)")
            alibi_slopes = alibi_slopes[0]
    left, right = _sides(window_size, causal, int(max_seqlen_q), int(max_seqlen_k))
    rule = _rule(left, right)
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    kw = dict(scale=softmax_scale, dropout_p=dropout_p, softcap=cap, alibi_slopes=alibi_slopes,
              document_ids=(q_ids, k_ids))
    if rule is not None:
        kw.update(causal=rule[0], window=rule[1])
    else:  # a band around each query's position in its own sequence
        offset = torch.cat([cu_k[1:] - cu_q[1:], cu_q.new_zeros(2)])[q_ids]
        kw["mask_mod"] = block_mask(_band(left, right, offset), 1, 1, q.shape[0], k.shape[0],
                                    device=q.device, cache=False)
    result = _finish(q4, k4, v4, kw, return_attn_probs,
                     lambda t: t.squeeze(0).transpose(0, 1).contiguous())
    if not return_attn_probs:
        return result
    out, lse, weights = result
    probs = weights.new_zeros(batch, q.shape[1], int(max_seqlen_q), int(max_seqlen_k))
    for b in range(batch):
        (qa, qb), (ka, kb) = cu_q[b:b + 2].tolist(), cu_k[b:b + 2].tolist()
        probs[b, :, :qb - qa, :kb - ka] = weights[0, :, qa:qb, ka:kb]
    return out, lse[0], probs
