"""The tiled backend with a ``score_mod``: the user's Python inside the loops, under autograd.

Part of ``_tiled.py`` in all but file. A ``score_mod`` may be any differentiable
function of the score (and of tensors it closes over, which get their gradients too),
so its derivative is autograd's, not written by hand. Each block of query rows is one
differentiable computation: its scores over the key tiles the rule and the block mask
leave (tiles ruled out are never formed), ``_variants``' pipeline, the softmax (sinks
included) and the weighted sum. Under grad mode each block runs inside
``torch.utils.checkpoint``: the forward keeps only the block's output, and the backward
recomputes the block's scores, so memory stays O(block x seq) at any time, O(seq)
over the whole call, never ``q_len x k_len``. Dropout draws the same keep-mask in the
recomputation (checkpoint restores the generator's state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import _variants
from . import masks as _masks
from .blockmask import mod_name, reads

_NEG_INF = float("-inf")


def _slice(mask, q_start, q_end, k_start, k_end, kv_heads):
    if mask is None:
        return None
    qs = slice(q_start, q_end) if mask.shape[2] > 1 else slice(None)
    ks = slice(k_start, k_end) if mask.shape[3] > 1 else slice(None)
    return _masks.group_view(mask[:, :, qs, ks], kv_heads)


def _reads(score_mod) -> tuple:
    """What ``score_mod`` reads (:func:`~attnlab.blockmask.reads`), with the tensors inside
    the objects it reads by identity (a module's parameters and buffers, a dict's or a
    list's tensors: ``self.rel[k]``), each as (identity, version); and the list that keeps
    them alive."""
    held: list = []
    key = reads(score_mod, held)
    inside = []
    for obj in list(held):
        if isinstance(obj, torch.nn.Module):
            found = [*obj.parameters(), *obj.buffers()]
        elif isinstance(obj, dict):
            found = list(obj.values())
        elif isinstance(obj, list | tuple):
            found = list(obj)
        else:
            continue
        for t in found:
            if isinstance(t, torch.Tensor):
                held.append(t)
                inside.append((id(t), None if t.is_inference() else t._version))
    return (key, tuple(inside)), held


def _block(ctx, q_start, q_end, lo, hi, mask, block_k, q, k, v, sinks, seen=None):
    """Output ``(B, Hkv, G, n, Dv)`` and lse ``(B, Hkv, G, n)`` of query rows
    ``[q_start, q_end)``, from the keys ``[lo, hi)``, differentiably. ``seen``: what the
    score_mod read at the forward (:func:`~attnlab.blockmask.reads`, and the list that
    keeps those tensors alive), which its recomputation in the backward must read again."""
    if seen is not None and _reads(ctx.variants.score_mod)[0] != seen[0]:
        # checkpoint's recomputation would read the new values: a silently wrong gradient
        raise RuntimeError(
            f"score_mod {mod_name(ctx.variants.score_mod)!r} reads a tensor that was "
            "modified in place (or a name now bound to another value) after the forward and "
            "before the backward, which recomputes the scores from it; change a clone of it "
            "instead")
    c = ctx.compute
    q_blk = ctx.grouped(q)[:, :, :, q_start:q_end].to(c) * ctx.scale
    b, hkv, g, n, d = q_blk.shape
    rows = torch.arange(q_start, q_end, device=q.device)
    scores, values = [], []
    for ks in range(lo, hi, block_k):
        ke = min(ks + block_k, hi)
        if ctx.skip(q_start, q_end, ks, ke):
            continue
        s = torch.matmul(q_blk.reshape(b, hkv, g * n, d), k[:, :, ks:ke].to(c).transpose(-1, -2))
        s, _ = _variants.score_tile(s.view(b, hkv, g, n, ke - ks), ctx.variants, ctx.rule,
                                    _slice(mask, q_start, q_end, ks, ke, hkv), rows, ks, ke,
                                    q_range=(q_start, q_end))
        scores.append(s)
        values.append(v[:, :, ks:ke])
    if not scores:  # no key: empty products, so that q, k, v still get (zero) gradients
        s = torch.matmul(q_blk, k[:, :, :0].to(c).unsqueeze(2).transpose(-1, -2))
        vv = v[:, :, :0]
    else:
        s, vv = torch.cat(scores, dim=-1), torch.cat(values, dim=-2)
    sink = ctx.sinks(sinks)
    weights = _variants.softmax(s, sink)
    with torch.no_grad():
        parts = s if sink is None else torch.cat([s, sink.expand(b, hkv, g, n, 1)], dim=-1)
        lse = torch.logsumexp(parts, dim=-1) if parts.shape[-1] else parts.new_full(
            (b, hkv, g, n), _NEG_INF)
        lse = lse.masked_fill(lse == _NEG_INF, float("inf"))  # nothing to attend
    if ctx.dropout_p > 0:
        weights = F.dropout(weights, p=ctx.dropout_p)
    out = weights.reshape(b, hkv, g * n, -1) @ vv.to(c)
    return out.view(b, hkv, g, n, -1), lse


def attention(ctx, q, k, v, mask, sinks, block_q: int, block_k: int):
    """``(out (B, Hq, Lq, Dv), lse (B, Hkv, G, Lq))`` as ``_tiled.tiled_attention``;
    ``ctx`` is its ``_Ctx`` (``ctx.variants`` holds the score_mod); tiles of ``block_q``
    query rows by ``block_k`` keys."""
    tensors = (q, k, v) + (() if sinks is None else (sinks,))
    recompute = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if mask is not None:
        while mask.ndim < 4:
            mask = mask.unsqueeze(0)
    seen = None
    if (recompute and ctx.variants is not None and ctx.variants.score_mod is not None
            and not torch.compiler.is_compiling()):  # (a trace cannot read versions)
        seen = _reads(ctx.variants.score_mod)
    outs, lses = [], []
    for q_start in range(0, ctx.q_len, block_q):
        q_end = min(q_start + block_q, ctx.q_len)
        lo, hi = ctx.rule.block(q_start, q_end)
        args = (ctx, q_start, q_end, lo, max(lo, hi), mask, block_k, q, k, v, sinks)
        if recompute:
            out, lse = checkpoint(_block, *args, seen, use_reentrant=False)
        else:
            out, lse = _block(*args)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs, dim=3) if outs else q.new_zeros(
        ctx.batch, ctx.kv_heads, ctx.group, 0, v.shape[-1])
    lse = torch.cat(lses, dim=3) if lses else q.new_zeros(
        ctx.batch, ctx.kv_heads, ctx.group, 0)
    out = out.reshape(ctx.batch, ctx.q_heads, ctx.q_len, -1).to(q.dtype)
    return out, lse
