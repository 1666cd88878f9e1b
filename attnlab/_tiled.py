"""The ``tiled`` backend of :func:`attnlab.attention`: flash-style attention in PyTorch.

Part of ``functional.py`` in all but file: only ``functional.attention`` calls it.

The forward walks over query blocks and, inside each, over key blocks with an
online softmax (running max ``m``, running sum ``l``), so memory is
O(seq x block) instead of O(seq^2). Key blocks that the causal or window rule
rules out for a whole query block are never visited, so a sliding window costs
O(seq x window). The backward recomputes each tile's probabilities from the
saved log-sum-exp instead of storing the weights (FlashAttention-2, Dao 2023).

Layout: queries are viewed as ``(B, Hkv, G, Lq, D)`` with the G query heads
that share a kv head folded next to the rows, so K/V are never repeated.

The variants (``_variants``): softcap, ALiBi, sinks, documents and ``mask_mod`` run in
the same loops, forward and backward (the softcap's derivative ``1 - tanh^2`` and the
sinks' gradient ``-sum_i P_sink,i D_i`` by hand); key tiles that the documents' rule or
the block mask rule out are never visited. A ``score_mod`` is the user's Python, so it
runs in ``_tiled_mod`` under autograd, recomputed per query block in the backward.
"""

from __future__ import annotations

import torch

from . import _tiled_mod, _variants
from . import masks as _masks
from ._tracing import each_mapped_call, first_derivatives_only
from .blockmask import EMPTY

BLOCK_Q = 256
BLOCK_K = 512
_NEG_INF = float("-inf")


def _slice_mask(mask, q_start, q_end, k_start, k_end):
    """Slice a broadcastable 4-D mask to one tile, leaving size-1 dims alone."""
    while mask.ndim < 4:
        mask = mask.unsqueeze(0)
    qs = slice(q_start, q_end) if mask.shape[2] > 1 else slice(None)
    ks = slice(k_start, k_end) if mask.shape[3] > 1 else slice(None)
    return mask[:, :, qs, ks]


def _slice_rows(mask, idx, kv_heads):
    """Rows ``idx`` of a broadcastable 4-D mask, grouped for GQA."""
    while mask.ndim < 4:
        mask = mask.unsqueeze(0)
    if mask.shape[2] > 1:
        mask = mask.index_select(2, idx)
    return _masks.group_view(mask, kv_heads)


def _tile_scores(q_blk, k_blk, mask, ctx, q_start, q_end, k_start, k_end, want_tanh=False):
    """Masked scores of one tile ``(B, Hkv, G, bq, bk)``, and the softcap's
    ``tanh(raw / softcap)`` (None without one) for its derivative.

    ``q_blk`` is ``(B, Hkv, G, bq, D)`` and pre-scaled; ``k_blk`` is ``(B, Hkv, bk, D)``.
    """
    b, hkv, g, bq, d = q_blk.shape
    s = torch.matmul(q_blk.reshape(b, hkv, g * bq, d), k_blk.transpose(-1, -2))
    s = s.view(b, hkv, g, bq, k_end - k_start)
    if ctx.variants is not None:
        m = None if mask is None else _masks.group_view(
            _slice_mask(mask, q_start, q_end, k_start, k_end), hkv)
        rows = torch.arange(q_start, q_end, device=s.device)
        return _variants.score_tile(s, ctx.variants, ctx.rule, m, rows, k_start, k_end,
                                    q_range=(q_start, q_end), want_tanh=want_tanh)
    if not ctx.rule.full(q_start, q_end, k_start, k_end):
        allowed = ctx.rule.allowed(q_start, q_end - q_start, k_start, k_end - k_start,
                                   device=s.device)
        s.masked_fill_(~allowed, _NEG_INF)
    if mask is not None:
        m = _masks.group_view(_slice_mask(mask, q_start, q_end, k_start, k_end), hkv)
        if m.dtype == torch.bool:
            s.masked_fill_(~m, _NEG_INF)
        else:
            s.add_(m.to(s.dtype))
    return s, None


def _keep_mask(ctx, qi, ki, shape, device):
    """Dropout keep-mask of one tile, already scaled by 1/(1-p), regenerated identically
    in the backward. With p == 1 nothing is kept (a factor of 0, not a division by 0)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(ctx.seed + qi * 1_000_003 + ki)
    keep = torch.rand(shape, generator=gen, device=device) >= ctx.dropout_p
    return keep * (0.0 if ctx.dropout_p >= 1.0 else 1.0 / (1.0 - ctx.dropout_p))


class _Ctx:
    """Plain settings shared by the forward and backward loops."""

    def __init__(self, q, k, causal, window, scale, dropout_p, seed, offset=None,
                 variants=None):
        self.batch, self.q_heads, self.q_len, self.head_dim = q.shape
        self.kv_heads, self.k_len = k.shape[1], k.shape[2]
        self.group = self.q_heads // self.kv_heads
        self.rule = _variants.rule(variants, self.q_len, self.k_len, causal, window, offset)
        self.scale = scale
        self.dropout_p, self.seed = dropout_p, seed
        low = q.dtype in (torch.float16, torch.bfloat16)
        self.compute = torch.float32 if low else q.dtype
        self.variants = variants
        self.blocks_mask = None if variants is None else variants.block_mask

    def skip(self, q_start, q_end, k_start, k_end) -> bool:
        """Whether the mask_mod's block mask rules the whole tile out."""
        return self.blocks_mask is not None and self.blocks_mask.kind(
            q_start, q_end, k_start, k_end) == EMPTY

    def sinks(self, sinks):
        """The sink logits ``(1, Hkv, G, 1, 1)`` in the compute dtype, or None."""
        if sinks is None:
            return None
        return sinks.to(self.compute).reshape(1, self.kv_heads, self.group, 1, 1)

    def grouped(self, t):  # (B, Hq, L, D) -> (B, Hkv, G, L, D)
        return t.reshape(self.batch, self.kv_heads, self.group, t.shape[2], t.shape[3])

    def blocks(self, n, size):
        return [(s, min(s + size, n)) for s in range(0, n, size)]


def _forward(ctx, q, k, v, mask, sinks=None):
    c = ctx.compute
    sink = ctx.sinks(sinks)
    qg = ctx.grouped(q)
    out = torch.zeros(ctx.batch, ctx.kv_heads, ctx.group, ctx.q_len, v.shape[-1],
                      dtype=c, device=q.device)
    lse = torch.full((ctx.batch, ctx.kv_heads, ctx.group, ctx.q_len), float("inf"),
                     dtype=c, device=q.device)
    for qi, (qs, qe) in enumerate(ctx.blocks(ctx.q_len, BLOCK_Q)):
        lo, hi = ctx.rule.block(qs, qe)
        if hi <= lo:  # every query here has nothing to attend: zeros
            if sink is not None:  # and the sink takes the whole row: lse = sink
                lse[:, :, :, qs:qe] = sink.squeeze(-1)
            continue
        q_blk = qg[:, :, :, qs:qe].to(c) * ctx.scale
        m = torch.full((*q_blk.shape[:-1], 1), _NEG_INF, dtype=c, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(*q_blk.shape[:-1], v.shape[-1], dtype=c, device=q.device)
        for ki, ks in enumerate(range(lo, hi, BLOCK_K)):
            ke = min(ks + BLOCK_K, hi)
            if ctx.skip(qs, qe, ks, ke):
                continue
            s, _ = _tile_scores(q_blk, k[:, :, ks:ke].to(c), mask, ctx, qs, qe, ks, ke)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            m_safe = m_new
            if (mask is not None or ctx.variants is not None
                    or not ctx.rule.full(qs, qe, lo, ke)):
                m_safe = m_new.masked_fill(m_new == _NEG_INF, 0.0)  # rows masked so far
            p = s.sub_(m_safe).exp_()
            alpha = (m - m_safe).exp_()
            l.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
            if ctx.dropout_p > 0:
                p = p * _keep_mask(ctx, qi, ki, p.shape, p.device)
            # (B, Hkv, G*bq, bk) @ (B, Hkv, bk, Dv): the group rides along the rows, as
            # in the scores; broadcasting V over G would copy it G times per tile.
            acc.mul_(alpha).add_((_fold(p) @ v[:, :, ks:ke].to(c)).view_as(acc))
            m = m_new
        if sink is not None:  # the sink joins the denominator and weighs no value
            m_new = torch.maximum(m, sink)
            alpha = (m - m_new).exp_()
            l.mul_(alpha).add_((sink - m_new).exp_())
            acc.mul_(alpha)
            m = m_new
        empty = l == 0
        out[:, :, :, qs:qe] = acc / l.masked_fill(empty, 1.0)
        lse[:, :, :, qs:qe] = (m + l.log()).masked_fill(empty, float("inf")).squeeze(-1)
    return out, lse


def _backward(ctx, q, k, v, mask, out, lse, grad_out, sinks=None):
    c = ctx.compute
    sink = ctx.sinks(sinks)
    dsink = None if sink is None else torch.zeros_like(sink)
    qg, og, gg = ctx.grouped(q), ctx.grouped(out), ctx.grouped(grad_out)
    dq = torch.zeros(qg.shape, dtype=c, device=q.device)
    dk = torch.zeros(k.shape, dtype=c, device=q.device)
    dv = torch.zeros(v.shape, dtype=c, device=q.device)
    # D_i = sum_d dO_i * O_i (uses the dropped-out output, as FlashAttention does)
    delta = (gg.to(c) * og.to(c)).sum(dim=-1, keepdim=True)
    for qi, (qs, qe) in enumerate(ctx.blocks(ctx.q_len, BLOCK_Q)):
        lo, hi = ctx.rule.block(qs, qe)
        if hi <= lo:
            continue
        q_blk = qg[:, :, :, qs:qe].to(c) * ctx.scale
        do_blk = _fold(gg[:, :, :, qs:qe].to(c))  # (B, Hkv, G*bq, Dv), once per query block
        lse_blk = lse[:, :, :, qs:qe].unsqueeze(-1)
        d_blk = delta[:, :, :, qs:qe]
        dq_blk = torch.zeros_like(q_blk)
        if sink is not None:  # d lse / d sink = P_sink; d out / d sink = -P_sink * out
            dsink -= ((sink - lse_blk).exp() * d_blk).sum(dim=(0, 3), keepdim=True)
        for ki, ks in enumerate(range(lo, hi, BLOCK_K)):
            ke = min(ks + BLOCK_K, hi)
            if ctx.skip(qs, qe, ks, ke):
                continue
            k_blk = k[:, :, ks:ke].to(c)  # (B, Hkv, bk, D)
            v_blk = v[:, :, ks:ke].to(c)  # (B, Hkv, bk, Dv)
            s, tanh = _tile_scores(q_blk, k_blk, mask, ctx, qs, qe, ks, ke, want_tanh=True)
            p = s.sub_(lse_blk).exp_()
            # Folded (B, Hkv, G*bq, .) products, as in the forward: no copies of K/V per head.
            dp = (do_blk @ v_blk.transpose(-1, -2)).view_as(p)  # (B, Hkv, G, bq, bk)
            p_used = p
            if ctx.dropout_p > 0:
                keep = _keep_mask(ctx, qi, ki, p.shape, p.device)
                p_used = p * keep
                dp = dp * keep
            # Sum over the group and the rows at once: (B, Hkv, bk, G*bq) @ (B, Hkv, G*bq, Dv)
            dv[:, :, ks:ke] += _fold(p_used).transpose(-1, -2) @ do_blk
            ds = p.mul_(dp.sub_(d_blk))
            if tanh is not None:  # through softcap * tanh(s / softcap)
                ds.mul_(1 - tanh * tanh)
            dq_blk += (_fold(ds) @ k_blk).view_as(dq_blk)
            dk[:, :, ks:ke] += _fold(ds).transpose(-1, -2) @ _fold(q_blk)
        dq[:, :, :, qs:qe] = dq_blk * ctx.scale
    if dsink is not None:
        dsink = dsink.reshape(-1).to(sinks.dtype)
    return dq.view(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink


def _fold(t):  # (B, Hkv, G, L, X) -> (B, Hkv, G*L, X)
    return t.reshape(t.shape[0], t.shape[1], t.shape[2] * t.shape[3], t.shape[4])


class _TiledAttention(torch.autograd.Function):
    """Forward and backward in O(seq) memory; ``setup_context`` apart, so that
    ``torch.func.grad`` (and ``jacrev``) take it."""

    @staticmethod
    def forward(q, k, v, mask, sinks, causal, window, scale, dropout_p, seed, offset,
                variants):
        settings = _Ctx(q, k, causal, window, scale, dropout_p, seed, offset, variants)
        out, lse = _forward(settings, q, k, v, mask, sinks)
        return out.view(settings.batch, settings.q_heads, settings.q_len, -1).to(q.dtype), lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, sinks, causal, window, scale, dropout_p, seed, offset, variants = inputs
        out, lse = output
        ctx.settings = _Ctx(q, k, causal, window, scale, dropout_p, seed, offset, variants)
        ctx.save_for_backward(q, k, v, mask, sinks, out, lse)
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def vmap(info, in_dims, *args):
        """Under ``torch.func.vmap``: each mapped call in turn, stacked (the tiles loop over
        rows already). q, k, v and the mask may be mapped; mapped variants' tensors are
        refused before (the backend table's ``mapped_variants``)."""
        return each_mapped_call(_TiledAttention, info, in_dims, args)

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, mask, sinks, out, lse = ctx.saved_tensors
        with torch.no_grad():
            grads = _backward(ctx.settings, q, k, v, mask, out, lse, grad_out, sinks)
        dq, dk, dv, dsink = first_derivatives_only("the tiled backend", grads, q, k, v, sinks,
                                                   grad_out, out)
        return dq, dk, dv, None, dsink, None, None, None, None, None, None, None


def tiled_attention(q, k, v, mask, causal, window, scale, dropout_p, offset=None,
                    variants=None):
    """Flash-style attention on 4-D inputs; returns ``(out, lse)`` with lse ``(B, Hkv, G, Lq)``
    (natural log of each row's softmax denominator, sink included; ``+inf`` for a row
    with nothing to attend, which carries no gradient).
    ``offset``: query row 0's position among the keys (``masks.KeyRule``; default
    ``k_len - q_len``, end-aligned). ``variants``: a ``_variants.Variants`` or None."""
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if dropout_p > 0 else 0
    if variants is not None and variants.score_mod is not None:
        settings = _Ctx(q, k, causal, window, scale, dropout_p, seed, offset, variants)
        return _tiled_mod.attention(settings, q, k, v, mask, variants.sinks, BLOCK_Q, BLOCK_K)
    sinks = None if variants is None else variants.sinks
    return _TiledAttention.apply(q, k, v, mask, sinks, causal, window, scale, dropout_p, seed,
                                 offset, variants)


def tiled_weights(q, k, mask, causal, window, scale, rows, variants=None):
    """Weights of the chosen query ``rows`` ``(B, Hq, R, Lk)``, BLOCK_Q rows at a time.

    A plain masked softmax of each block of full score rows, so memory stays
    O(BLOCK_Q x k_len) and gradients flow back into ``q`` and ``k`` (the saved
    log-sum-exp is not differentiable, so the weights are not rebuilt from it).
    """
    settings = _Ctx(q, k, causal, window, scale, 0.0, 0, variants=variants)
    c = settings.compute
    sink = settings.sinks(None if variants is None else variants.sinks)
    batch, q_heads, _, head_dim = q.shape
    qg = settings.grouped(q)
    parts = []
    for r in range(0, len(rows), BLOCK_Q):
        idx = rows[r:r + BLOCK_Q]
        q_blk = qg.index_select(3, idx).to(c) * scale
        s = torch.matmul(_fold(q_blk), k.to(c).transpose(-1, -2))
        s = s.view(batch, settings.kv_heads, settings.group, len(idx), settings.k_len)
        m = None if mask is None else _slice_rows(mask, idx, settings.kv_heads)
        s, _ = _variants.score_tile(s, variants, settings.rule, m, idx, 0, settings.k_len,
                                    fresh=False)
        p = _variants.softmax(s, sink)
        parts.append(p.reshape(batch, q_heads, len(idx), settings.k_len))
    if not parts:
        return torch.zeros(batch, q_heads, 0, settings.k_len, dtype=q.dtype, device=q.device)
    return torch.cat(parts, dim=2).to(q.dtype)


def tiled_lse_backward(q, k, v, mask, out, lse, grad_out, causal, window, scale, variants,
                       offset=None):
    """``backends.LseStep.backward`` in PyTorch: one block of keys' share of ``(dq, dk, dv)``
    given each row's ``out`` and ``lse (B, Hq, Lq)`` merged over every block it attends
    (query row ``i`` at position ``i + offset`` among the keys), in float32 (float64 kept).
    A sink in ``variants`` is already in ``lse``; its own gradient is the caller's."""
    q, k, v, out, lse, grad_out = (t if t.dtype == torch.float64 else t.float()
                                   for t in (q, k, v, out, lse, grad_out))
    ctx = _Ctx(q, k, causal, window, scale, 0.0, 0, offset, variants)
    lse = lse.reshape(ctx.batch, ctx.kv_heads, ctx.group, ctx.q_len)
    return _backward(ctx, q, k, v, mask, out, lse, grad_out)[:3]
