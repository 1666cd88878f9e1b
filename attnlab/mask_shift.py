"""Additive masks as every backend takes them: each query row shifted so that its
largest entry over the keys the rule allows is 0, in at least float32.

Softmax ignores a constant added to a row, so the shift changes no weight; it keeps large
finite values (HF's ``finfo.min``, ``-1e9``, ALiBi's ``slope * j``) from swallowing the
scores. The key rule itself is :mod:`attnlab.masks`'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._tracing import reads_values
from .masks import Documents, KeyRule

if TYPE_CHECKING:
    from .blockmask import BlockMask


def additive_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an additive mask is shifted and added in for inputs of ``dtype``:
    float64 for float64, else float32 (never bf16/fp16, which would round the bias)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# Scratch of the allowed-key maximum: about this many mask entries per step.
_SHIFT_SCRATCH = 1 << 22


def for_kernels(mask: torch.Tensor | None, q_len: int, k_len: int, dtype: torch.dtype, *,
                causal: bool, window: int | None, documents: Documents | None,
                sinks: bool, blocks: BlockMask | None = None,
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A 4-D mask as every backend takes it and its rows' shift ``(B|1, H|1, Lq|1)``
    (which a row's log-sum-exp adds back) or None: a bool mask as it is; an additive one
    in at least float32, shifted by :func:`shift_rows` but beside ``sinks`` (whose share
    depends on the level of the scores)."""
    if mask is None or mask.dtype == torch.bool:
        return mask, None
    if sinks:
        return mask.to(torch.promote_types(mask.dtype, additive_dtype(dtype))), None
    mask, top = shift_rows(mask, q_len, k_len, causal=causal, window=window, with_shift=True,
                           dtype=additive_dtype(dtype), documents=documents, blocks=blocks)
    return mask, top.squeeze(-1)


def shift_rows(mask: torch.Tensor, q_len: int, k_len: int, *, causal: bool = False,
               window: int | None = None, dtype: torch.dtype = torch.float32,
               documents: Documents | None = None, with_shift: bool = False,
               blocks: BlockMask | None = None):
    """An additive mask with each row's largest *allowed* entry moved to 0.

    Softmax ignores a constant added to a row, so this changes no weight, but it
    keeps large finite values (HF's ``finfo.min``, ``-1e9``, a BLOOM-style
    ``slope * j``) from swallowing the scores when added in float32. The maximum is
    taken over the keys the causal/window/document rule and ``blocks`` (a ``mask_mod``'s
    block mask) allow (as ``reference.py`` does): a
    big value on a key the rule forbids would otherwise push the allowed entries so
    far down that their differences are lost. The arithmetic runs in at least
    ``dtype`` (float32; the kernels add the mask in their compute dtype), never in
    bf16/fp16, whose 8/11-bit mantissas cannot hold ``slope * j`` exactly.

    ``mask`` broadcasts to ``(..., q_len, k_len)``. Its shape is kept when one shift
    fits every query row (no rule, or a rule that leaves each row's maximum alone);
    otherwise the result is ``(..., q_len, k_len)``. Entries the rule forbids may
    come out positive; they are clamped to 0 so that no finite pair of values can
    overflow to ``+inf`` (they are masked to ``-inf`` anyway). Rows with no allowed
    key are left unshifted. The shift carries no gradient (softmax has none there).
    ``with_shift``: ``(mask, shift)``, the shift ``(..., q_len or 1, 1)`` subtracted.
    """
    while mask.ndim < 2:
        mask = mask.unsqueeze(0)
    mask = mask.to(torch.promote_types(mask.dtype, dtype))
    if k_len == 0 or mask.shape[-1] == 0:  # no keys: nothing to shift
        return (mask, mask.new_zeros(*mask.shape[:-1], 1)) if with_shift else mask
    top = mask.detach().amax(dim=-1, keepdim=True)  # (..., q_len or 1, 1)
    rule = KeyRule(q_len, k_len, causal=causal, window=window, documents=documents)
    # One shift for all rows keeps the mask's shape. Whether it fits every row is a
    # data-dependent branch, which a torch.compile trace or vmap cannot take: there a mask
    # of one row for every query (key padding) keeps the one shift, exact up to rounding
    # unless a forbidden key holds a value ~80 above every allowed one, and only a mask of
    # a row per query (q_len x k_len already) is shifted row by row.
    per_row = reads_values() or (mask.shape[-2] == q_len and q_len > 1)
    if per_row and (blocks is not None or not rule.full(0, q_len, 0, k_len)):
        row_top = _allowed_max(mask.detach(), rule, blocks)
        row_top = torch.where(torch.isfinite(row_top), row_top, top)  # empty rows: any shift
        if not reads_values() or not torch.equal(row_top, top.expand_as(row_top)):
            top = row_top
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return ((mask - top).clamp(max=0.0), top) if with_shift else (mask - top).clamp(max=0.0)


def _allowed_max(mask: torch.Tensor, rule: KeyRule, blocks: BlockMask | None = None,
                 ) -> torch.Tensor:
    """Each query row's largest mask entry over the keys ``rule`` and ``blocks`` allow,
    ``(..., q_len, 1)`` (``-inf`` for a row with none), a block of rows at a time."""
    lead = mask.shape[:-2] if blocks is None else torch.broadcast_shapes(
        mask.shape[:-2], (blocks.batch, blocks.heads))
    batch = lead.numel()
    step = max(1, _SHIFT_SCRATCH // max(1, batch * rule.k_len))
    tops = []
    for start in range(0, rule.q_len, step):
        n = min(step, rule.q_len - start)
        allowed = rule.allowed(start, n, device=mask.device)
        if blocks is not None:  # (batch or 1, heads or 1, n, k_len)
            allowed = allowed & blocks.tile(start, start + n, 0, rule.k_len)
        part = mask[..., start:start + n, :] if mask.shape[-2] > 1 else mask
        tops.append(part.masked_fill(~allowed, float("-inf")).amax(dim=-1, keepdim=True))
    if not tops:  # no query rows
        return mask.new_empty((*mask.shape[:-2], 0, 1))
    return torch.cat(tops, dim=-2)
