"""The attention variants of :func:`attnlab.attention`: their checks and the one score
pipeline the eager and tiled backends share.

Part of ``functional.py`` in all but file. One definition of each variant (the
docstring of :func:`attnlab.attention` states them; ``reference.py`` writes them again in
NumPy), applied to the scaled scores ``s = q k^T * scale`` of any tile, in this order:

1. ``softcap``: ``s = softcap * tanh(s / softcap)`` (Gemma 2);
2. ``score_mod(s, b, h, q_idx, kv_idx)`` (FlexAttention's signature, vectorised);
3. ALiBi: ``s -= slope[b, h] * |p - j|`` with ``p`` the query's end-aligned (or
   document-aligned) position (FlashAttention's convention);
4. the additive float mask;
5. ``-inf`` where a key is forbidden: the causal/window/document rule (``masks.KeyRule``),
   a bool mask, the ``mask_mod``'s block mask;
6. the softmax, with each head's sink logit (gpt-oss) in its denominator.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import masks as _masks
from ._tracing import reads_values
from .blockmask import EMPTY, PARTIAL, BlockMask, block_mask, evaluate_mod, mod_name
from .checks import finite_float

__all__ = ["Variants", "check", "rule", "score_tile", "softmax", "grouped_sinks"]

_NEG_INF = float("-inf")


@dataclass(frozen=True, eq=False)
class Variants:
    """The variants of one call, after their checks (None where not asked for):
    ``alibi_slopes`` ``(1 or batch, q_heads)``, ``sinks`` ``(q_heads,)``, ``documents`` the
    rule's :class:`masks.Documents`, ``block_mask`` the evaluated ``mask_mod``."""

    softcap: float | None = None
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    documents: _masks.Documents | None = None
    block_mask: BlockMask | None = None
    score_mod: Callable | None = None

    # capability name (a field of backends.Backend) -> this class's field
    CAPABILITIES = {"softcap": "softcap", "alibi": "alibi_slopes", "sinks": "sinks",
                    "documents": "documents", "mask_mod": "block_mask",
                    "score_mod": "score_mod"}

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The tensors of the call's variants that a backend reads besides q, k, v."""
        docs = self.documents
        return (self.alibi_slopes, self.sinks, *((docs.q_ids, docs.k_ids) if docs else ()))

    def present(self) -> tuple[str, ...]:
        """The capabilities this call needs (names of ``backends.Backend`` fields)."""
        return tuple(cap for cap, name in self.CAPABILITIES.items()
                     if getattr(self, name) is not None)


def rule(variants: Variants | None, q_len: int, k_len: int, causal: bool,
         window: int | None, offset: int | None = None) -> _masks.KeyRule:
    """The key rule of a call, documents included."""
    documents = None if variants is None else variants.documents
    return _masks.KeyRule(q_len, k_len, causal=causal, window=window, offset=offset,
                          documents=documents)


# --------------------------------------------------------------------------- checks


def _tensor(name: str, t, q: torch.Tensor, *, floating: bool) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if floating and not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if not floating and (t.dtype.is_floating_point or t.dtype.is_complex
                         or t.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor (document ids), got dtype {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}; expected one device")
    if floating and reads_values() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} must hold finite values, got {t.flatten().tolist()[:8]}")
    return t


def _per_head(name: str, t, q: torch.Tensor, *, batched: bool) -> torch.Tensor:
    """``t`` of shape ``(q_heads,)`` (or ``(*batch, q_heads)`` when ``batched``) as
    ``(1 or batch, q_heads)``."""
    t = _tensor(name, t, q, floating=True)
    heads, lead = q.shape[-3], tuple(q.shape[:-3])
    shapes = [(heads,)] + ([(*lead, heads)] if batched and lead else [])
    if tuple(t.shape) not in shapes:
        want = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name} must have shape {want} (one per query head"
                         f"{', per batch element' if batched else ''}), got {tuple(t.shape)}")
    return t.reshape(-1, heads)


def _ids(name: str, ids, length: int, q: torch.Tensor) -> torch.Tensor:
    ids = _tensor(name, ids, q, floating=False)
    lead = tuple(q.shape[:-3])
    if tuple(ids.shape) not in {(length,), (*lead, length)}:
        want = f"({length},)" + (f" or {(*lead, length)}" if lead else "")
        raise ValueError(f"{name} must have shape {want} (one id per position), got "
                         f"{tuple(ids.shape)}")
    ids = (ids.unsqueeze(0) if ids.ndim == 1 else ids.reshape(math.prod(lead), length)).long()
    down = ids[:, 1:] < ids[:, :-1]
    if reads_values() and bool(down.any()):
        row, at = (int(i) for i in down.nonzero()[0])
        raise ValueError(f"{name} must be non-decreasing along each sequence (packed "
                         f"documents, in order), got {int(ids[row, at])} then "
                         f"{int(ids[row, at + 1])} at positions {at}, {at + 1} of sequence {row}")
    return ids


def _documents(document_ids, q: torch.Tensor, k: torch.Tensor) -> _masks.Documents:
    q_len, k_len = q.shape[-2], k.shape[-2]
    if isinstance(document_ids, tuple | list):
        if len(document_ids) != 2:
            raise TypeError(f"document_ids must be a tensor or a pair (q_ids, k_ids), got a "
                            f"{type(document_ids).__name__} of {len(document_ids)}")
        q_ids = _ids("document_ids[0] (queries)", document_ids[0], q_len, q)
        k_ids = _ids("document_ids[1] (keys)", document_ids[1], k_len, q)
    else:
        if q_len != k_len:
            raise ValueError(f"document_ids as one tensor needs q_len == k_len, got q_len "
                             f"{q_len} and k_len {k_len}; pass a pair (q_ids, k_ids)")
        q_ids = k_ids = _ids("document_ids", document_ids, q_len, q)
    return _masks.Documents(q_ids, k_ids)


def _block_mask(mask_mod, q: torch.Tensor, k: torch.Tensor) -> BlockMask:
    batch, heads = math.prod(q.shape[:-3]), q.shape[-3]
    q_len, k_len = q.shape[-2], k.shape[-2]
    if isinstance(mask_mod, BlockMask):
        mask_mod = mask_mod.for_call(batch, heads)
        if not mask_mod.fits(batch, heads, q_len, k_len):
            raise ValueError(f"mask_mod is a BlockMask of shape {mask_mod.shape}; expected "
                             f"(1 or {batch}, 1 or {heads}, {q_len}, {k_len})")
        if mask_mod.device != q.device:
            raise ValueError(f"mask_mod is a BlockMask on {mask_mod.device} but q is on "
                             f"{q.device}; expected one device")
        return mask_mod
    if not callable(mask_mod):
        raise TypeError("mask_mod must be a function (b, h, q_idx, kv_idx) -> bool tensor "
                        f"or a BlockMask, got {type(mask_mod).__name__}")
    return block_mask(mask_mod, batch, heads, q_len, k_len, device=q.device)


def check(q, k, *, softcap=None, alibi_slopes=None, sinks=None, document_ids=None,
          mask_mod=None, score_mod=None) -> Variants | None:
    """The variants of a call, checked (``q``/``k`` as given, already checked), or None
    when it asks for none."""
    if all(x is None for x in (softcap, alibi_slopes, sinks, document_ids, mask_mod,
                               score_mod)):
        return None
    if softcap is not None:
        softcap = finite_float("softcap", softcap, positive=True)
    if alibi_slopes is not None:
        alibi_slopes = _per_head("alibi_slopes", alibi_slopes, q, batched=True)
        if alibi_slopes.requires_grad:
            raise ValueError("alibi_slopes must not require grad: ALiBi's slopes are fixed "
                             "and get no gradient; pass alibi_slopes.detach()")
        # A copy (a few numbers): the backward rebuilds the bias from the slopes, and the
        # caller may change theirs in place before it runs.
        alibi_slopes = alibi_slopes.clone()
    if sinks is not None:
        sinks = _per_head("sinks", sinks, q, batched=False).reshape(-1)
    if score_mod is not None and not callable(score_mod):
        raise TypeError("score_mod must be a function (score, b, h, q_idx, kv_idx) -> score, "
                        f"got {type(score_mod).__name__}")
    documents = None if document_ids is None else _documents(document_ids, q, k)
    blocks = None if mask_mod is None else _block_mask(mask_mod, q, k)
    return Variants(softcap, alibi_slopes, sinks, documents, blocks, score_mod)


# --------------------------------------------------------------------------- the pipeline


def _grids(shape, rows: torch.Tensor, k_start: int, k_end: int, device):
    """FlexAttention's indices for a ``(B, Hkv, G, n, kn)`` tile, broadcast: ``b``, ``h``
    (the query head), ``q_idx`` (the rows), ``kv_idx``."""
    batch, kv_heads, group = shape[:3]
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1, 1)
    h = torch.arange(kv_heads * group, device=device).view(1, kv_heads, group, 1, 1)
    q_idx = rows.view(1, 1, 1, -1, 1)
    kv_idx = torch.arange(k_start, k_end, device=device).view(1, 1, 1, 1, -1)
    return b, h, q_idx, kv_idx


def _score_mod(fn, s, rows, k_start, k_end):
    out = evaluate_mod("score_mod", fn, s, *_grids(s.shape, rows, k_start, k_end, s.device))
    if not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point:
        what = f"dtype {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"score_mod {mod_name(fn)!r} must return a "
                        f"floating-point tensor of the score's shape, got {what}")
    if out.shape != s.shape:  # one computed from the indices alone broadcasts, as in torch
        try:
            fits = torch.broadcast_shapes(out.shape, s.shape) == s.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"score_mod {mod_name(fn)!r} returned shape "
                             f"{tuple(out.shape)} for scores of shape {tuple(s.shape)}; it "
                             "must keep the score's shape or broadcast to it")
        out = out.expand(s.shape)
    return out.to(s.dtype)


def alibi(slopes, rule, rows, k_start, k_end, kv_heads, dtype):
    """``-slope * |p - j|``, ``(1 or B, Hkv, G, n, kn)``."""
    p = rule.positions(rows)  # (n,) or (B, n)
    p = p.reshape(p.shape[0] if p.ndim == 2 else 1, 1, 1, p.shape[-1], 1)
    j = torch.arange(k_start, k_end, device=p.device)
    slopes = slopes.to(dtype).reshape(slopes.shape[0], kv_heads, -1, 1, 1)
    return (p - j).abs().to(dtype) * -slopes


def score_tile(s, variants: Variants | None, rule: _masks.KeyRule, mask, rows, k_start: int,
               k_end: int, *, q_range: tuple[int, int] | None = None, fresh: bool = True,
               want_tanh: bool = False):
    """Steps 1-5 of the pipeline on the scaled scores ``s`` ``(B, Hkv, G, n, kn)`` of query
    ``rows`` (LongTensor ``(n,)``; ``q_range`` when they are ``[start, end)``) and keys
    ``[k_start, k_end)``. ``mask`` is the user's mask for this tile, grouped
    (``masks.group_view``), or None. ``fresh``: ``s`` may be written in place.

    Returns ``(s, t)``: with ``want_tanh``, ``t = tanh(raw / softcap)`` for the softcap's
    derivative (None without a softcap; maybe None without ``want_tanh``)."""
    kv_heads = s.shape[1]
    t = None
    if variants is not None and variants.softcap is not None:
        cap = variants.softcap
        if fresh and not s.requires_grad:  # no autograd to keep tanh's output for
            t = s.div_(cap).tanh_()
            s = t * cap if want_tanh else t.mul_(cap)
        else:
            t = torch.tanh(s / cap)
            s, fresh = t * cap, True
        t = t if want_tanh else None
    if variants is not None and variants.score_mod is not None:
        s, fresh = _score_mod(variants.score_mod, s, rows, k_start, k_end), False
    if variants is not None and variants.alibi_slopes is not None:
        bias = alibi(variants.alibi_slopes, rule, rows, k_start, k_end, kv_heads, s.dtype)
        s, fresh = (s.add_(bias) if fresh else s + bias), True
    if mask is not None and mask.dtype != torch.bool:
        m = mask.to(s.dtype)
        s, fresh = (s.add_(m) if fresh else s + m), True
    forbid = None
    if q_range is None or not rule.full(*q_range, k_start, k_end):
        allowed = rule.allowed(rows=rows, k_start=k_start, k_len=k_end - k_start)
        forbid = ~_masks.group_view(allowed, kv_heads)
    if mask is not None and mask.dtype == torch.bool:
        forbid = ~mask if forbid is None else forbid | ~mask
    blocks = None if variants is None else variants.block_mask
    if blocks is not None:
        kind = blocks.kind(*q_range, k_start, k_end) if q_range is not None else PARTIAL
        if kind == EMPTY:
            forbid = torch.ones((), dtype=torch.bool, device=s.device)
        elif kind == PARTIAL:
            tile = (blocks.tile(*q_range, k_start, k_end) if q_range is not None
                    else blocks.rows(rows)[..., k_start:k_end])
            tile = ~_masks.group_view(tile, kv_heads)
            forbid = tile if forbid is None else forbid | tile
    if forbid is not None:
        s = s.masked_fill_(forbid, _NEG_INF) if fresh else s.masked_fill(forbid, _NEG_INF)
    return s, t


def grouped_sinks(variants: Variants | None, kv_heads: int, dtype) -> torch.Tensor | None:
    """The sink logits as ``(1, Hkv, G, 1, 1)`` in ``dtype``, or None."""
    if variants is None or variants.sinks is None:
        return None
    return variants.sinks.to(dtype).reshape(1, kv_heads, -1, 1, 1)


def softmax(s: torch.Tensor, sinks: torch.Tensor | None, *, may_be_empty: bool = True):
    """Step 6: the weights of the keys of ``s`` ``(..., n, kn)``, differentiable. With
    ``sinks`` (broadcastable to ``(..., n, 1)``) each row's denominator also holds
    ``exp(sink)``, so its weights sum to less than 1. A row with no allowed key gives
    zeros (``may_be_empty``: it may happen), never NaN."""
    if sinks is not None:
        if s.shape[-1] == 0:  # no keys: no weights (still tied to the sinks: zero gradients)
            return s + sinks * 0
        top = torch.maximum(s.amax(dim=-1, keepdim=True), sinks).detach()
        e = torch.exp(s - top)
        return e / (e.sum(dim=-1, keepdim=True) + torch.exp(sinks - top))
    if not may_be_empty:
        return torch.softmax(s, dim=-1)
    if s.shape[-1]:
        empty = s.amax(dim=-1, keepdim=True) == _NEG_INF
    else:  # no keys at all: every row is empty
        empty = s.new_ones((*s.shape[:-1], 1), dtype=torch.bool)
    return torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
