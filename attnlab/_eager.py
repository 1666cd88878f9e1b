"""The ``eager`` backend of :func:`attnlab.attention`: the textbook path.

Part of ``functional.py`` in all but file: only its backend table calls it.
It materialises the scores, masks them, takes the softmax and the weighted sum;
every other backend is checked against it (and it against the NumPy oracle).
The variants (softcap, ALiBi, sinks, documents, mask_mod, score_mod) go through
``_variants``' pipeline on the whole score matrix, and autograd differentiates it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _variants
from . import masks as _masks

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def nothing_to_compute(q, k, v) -> bool:
    """Whether a call has nothing to compute (an empty batch, head or sequence): the
    textbook path takes it, where the tiled and fused kernels would divide by a length."""
    return min(q.numel(), k.numel(), v.numel()) == 0


def eager_attention(q, k, v, mask, causal, window, scale, dropout_p, rows, variants=None):
    """The textbook path: materialise the scores, mask, softmax, weighted sum.
    Returns ``(out, weights)`` (``weights`` None unless ``rows``)."""
    out, weights, _ = _eager(q, k, v, mask, causal, window, scale, dropout_p, rows, variants)
    return out, weights


def eager_lse(q, k, v, mask, causal, window, scale, dropout_p, variants=None, offset=None):
    """``(out, lse)``: the output and each row's log-sum-exp ``(B, Hq, Lq)`` (natural log
    of the softmax's denominator, the sink included; ``+inf`` for a row with nothing to
    attend), which carries no gradient. ``offset``: query row 0's position among the
    keys (``masks.KeyRule``; None: end-aligned)."""
    out, _, lse = _eager(q, k, v, mask, causal, window, scale, dropout_p, None, variants,
                         want_lse=True, offset=offset)
    return out, lse


def _scores(q, k, mask, causal, window, scale, variants, offset=None):
    """The masked scores ``(B, Hkv, G, Lq, Lk)`` (forbidden pairs ``-inf``), whether a row
    may be empty, and the grouped sink logits (or None)."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    # (B, Hkv, G*Lq, D) @ (B, Hkv, D, Lk): the group rides along the query rows.
    scores = torch.matmul(q.reshape(batch, kv_heads, group * q_len, head_dim), k.transpose(-1, -2))
    # In-place from here: the product is a fresh tensor that autograd does not keep.
    scores = scores.view(batch, kv_heads, group, q_len, k_len).mul_(scale)
    if variants is None:
        rule = _masks.KeyRule(q_len, k_len, causal=causal, window=window, offset=offset)
        struct = rule.allowed(device=q.device) if rule.structural else None
        allowed = _masks.combine(struct, mask if mask is None or mask.dtype == torch.bool
                                 else None)
        if allowed is not None:
            scores.masked_fill_(~_masks.group_view(allowed, kv_heads), float("-inf"))
        if mask is not None and mask.dtype != torch.bool:
            scores.add_(_masks.group_view(mask.to(scores.dtype), kv_heads))
        may_be_empty = mask is not None or not rule.every_row_sees_a_key
        return scores, may_be_empty, None
    rule = _variants.rule(variants, q_len, k_len, causal, window, offset)
    grouped = None if mask is None else _masks.group_view(mask, kv_heads)
    scores, _ = _variants.score_tile(scores, variants, rule, grouped,
                                     torch.arange(q_len, device=q.device), 0, k_len,
                                     q_range=(0, q_len))
    return scores, True, _variants.grouped_sinks(variants, kv_heads, scores.dtype)


def _eager(q, k, v, mask, causal, window, scale, dropout_p, rows, variants, want_lse=False,
           offset=None):
    batch, q_heads, q_len, _ = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    dtype = q.dtype
    if dtype in _LOW_PRECISION:
        q, k, v = q.float(), k.float(), v.float()
    scores, may_be_empty, sinks = _scores(q, k, mask, causal, window, scale, variants, offset)
    lse = None
    if want_lse:
        with torch.no_grad():
            parts = scores if sinks is None else torch.cat(
                [scores, sinks.expand(*scores.shape[:-1], 1)], dim=-1)
            lse = (torch.logsumexp(parts, dim=-1) if parts.shape[-1]
                   else parts.new_full(parts.shape[:-1], float("-inf")))
            lse = lse.masked_fill(lse == float("-inf"), float("inf")).reshape(
                batch, q_heads, q_len)
    # A row with nothing to attend is all -inf, where softmax (and its backward) gives
    # NaN: softmax() softens it to zeros.
    weights = _variants.softmax(scores, sinks, may_be_empty=may_be_empty)
    used = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    out = torch.matmul(used.view(batch, kv_heads, group * q_len, k_len), v)
    out = out.view(batch, q_heads, q_len, v.shape[-1]).to(dtype)
    if rows is None:
        return out, None, lse
    picked = weights.view(batch, q_heads, q_len, k_len).index_select(2, rows)
    return out, picked.to(dtype), lse


def eager_lse_backward(q, k, v, mask, out, lse, grad_out, causal, window, scale, variants,
                       offset=None):
    """``backends.LseStep.backward`` on the textbook path: one block of keys' share of
    ``(dq, dk, dv)`` given each row's ``out`` and ``lse`` merged over every block it
    attends (FlashAttention-2's backward: ``dS = P * (dP - rowsum(dO * O))`` with
    ``P = exp(S - lse)``), in float32 (float64 kept). Autograd differentiates the scalar
    ``sum(P * (dO V^T - delta))``, whose gradient in ``S`` and ``V`` is exactly that, so
    every variant of the score pipeline (softcap's tanh, ALiBi, documents) is followed.
    A sink in ``variants`` is already in ``lse``; its own gradient is the caller's."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.enable_grad():
        q, k, v = (t.detach().to(work).requires_grad_() for t in (q, k, v))
        s, _, _ = _scores(q, k, mask, causal, window, scale, variants, offset)
        batch, kv_heads, group, q_len, k_len = s.shape
        p = torch.exp(s - lse.to(work).view(batch, kv_heads, group, q_len, 1))
        do = grad_out.to(work).reshape(batch, kv_heads, group * q_len, -1)
        dp = (do @ v.transpose(-1, -2)).view_as(p)
        delta = (grad_out.to(work) * out.to(work)).sum(-1).view(batch, kv_heads, group,
                                                                  q_len, 1)
        surrogate = (p * (dp - delta)).sum()
        return torch.autograd.grad(surrogate, (q, k, v))
