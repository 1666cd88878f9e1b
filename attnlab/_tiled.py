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
"""

from __future__ import annotations

import torch

from . import masks as _masks

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


def _tile_scores(q_blk, k_blk, mask, ctx, q_start, q_end, k_start, k_end):
    """Masked scores of one tile ``(B, Hkv, G, bq, bk)``.

    ``q_blk`` is ``(B, Hkv, G, bq, D)`` and pre-scaled; ``k_blk`` is ``(B, Hkv, bk, D)``.
    """
    b, hkv, g, bq, d = q_blk.shape
    s = torch.matmul(q_blk.reshape(b, hkv, g * bq, d), k_blk.transpose(-1, -2))
    s = s.view(b, hkv, g, bq, k_end - k_start)
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
    return s


def _keep_mask(ctx, qi, ki, shape, device):
    """Dropout keep-mask of one tile, already scaled by 1/(1-p), regenerated identically
    in the backward. With p == 1 nothing is kept (a factor of 0, not a division by 0)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(ctx.seed + qi * 1_000_003 + ki)
    keep = torch.rand(shape, generator=gen, device=device) >= ctx.dropout_p
    return keep * (0.0 if ctx.dropout_p >= 1.0 else 1.0 / (1.0 - ctx.dropout_p))


class _Ctx:
    """Plain settings shared by the forward and backward loops."""

    def __init__(self, q, k, causal, window, scale, dropout_p, seed, offset=None):
        self.batch, self.q_heads, self.q_len, self.head_dim = q.shape
        self.kv_heads, self.k_len = k.shape[1], k.shape[2]
        self.group = self.q_heads // self.kv_heads
        self.rule = _masks.KeyRule(self.q_len, self.k_len, causal=causal, window=window,
                                   offset=offset)
        self.scale = scale
        self.dropout_p, self.seed = dropout_p, seed
        low = q.dtype in (torch.float16, torch.bfloat16)
        self.compute = torch.float32 if low else q.dtype

    def grouped(self, t):  # (B, Hq, L, D) -> (B, Hkv, G, L, D)
        return t.reshape(self.batch, self.kv_heads, self.group, t.shape[2], t.shape[3])

    def blocks(self, n, size):
        return [(s, min(s + size, n)) for s in range(0, n, size)]


def _forward(ctx, q, k, v, mask):
    c = ctx.compute
    qg = ctx.grouped(q)
    out = torch.zeros(ctx.batch, ctx.kv_heads, ctx.group, ctx.q_len, v.shape[-1],
                      dtype=c, device=q.device)
    lse = torch.full((ctx.batch, ctx.kv_heads, ctx.group, ctx.q_len), float("inf"),
                     dtype=c, device=q.device)
    for qi, (qs, qe) in enumerate(ctx.blocks(ctx.q_len, BLOCK_Q)):
        lo, hi = ctx.rule.block(qs, qe)
        if hi <= lo:
            continue  # every query here has nothing to attend: zeros
        q_blk = qg[:, :, :, qs:qe].to(c) * ctx.scale
        m = torch.full((*q_blk.shape[:-1], 1), _NEG_INF, dtype=c, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(*q_blk.shape[:-1], v.shape[-1], dtype=c, device=q.device)
        for ki, ks in enumerate(range(lo, hi, BLOCK_K)):
            ke = min(ks + BLOCK_K, hi)
            s = _tile_scores(q_blk, k[:, :, ks:ke].to(c), mask, ctx, qs, qe, ks, ke)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            m_safe = m_new
            if mask is not None or not ctx.rule.full(qs, qe, lo, ke):
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
        empty = l == 0
        out[:, :, :, qs:qe] = acc / l.masked_fill(empty, 1.0)
        lse[:, :, :, qs:qe] = (m + l.log()).masked_fill(empty, float("inf")).squeeze(-1)
    return out, lse


def _backward(ctx, q, k, v, mask, out, lse, grad_out):
    c = ctx.compute
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
        for ki, ks in enumerate(range(lo, hi, BLOCK_K)):
            ke = min(ks + BLOCK_K, hi)
            k_blk = k[:, :, ks:ke].to(c)  # (B, Hkv, bk, D)
            v_blk = v[:, :, ks:ke].to(c)  # (B, Hkv, bk, Dv)
            p = _tile_scores(q_blk, k_blk, mask, ctx, qs, qe, ks, ke).sub_(lse_blk).exp_()
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
            dq_blk += (_fold(ds) @ k_blk).view_as(dq_blk)
            dk[:, :, ks:ke] += _fold(ds).transpose(-1, -2) @ _fold(q_blk)
        dq[:, :, :, qs:qe] = dq_blk * ctx.scale
    return dq.view(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _fold(t):  # (B, Hkv, G, L, X) -> (B, Hkv, G*L, X)
    return t.reshape(t.shape[0], t.shape[1], t.shape[2] * t.shape[3], t.shape[4])


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, window, scale, dropout_p, seed, offset):
        settings = _Ctx(q, k, causal, window, scale, dropout_p, seed, offset)
        out, lse = _forward(settings, q, k, v, mask)
        out = out.view(settings.batch, settings.q_heads, settings.q_len, -1).to(q.dtype)
        ctx.settings = settings
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, mask, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.settings, q, k, v, mask, out, lse, grad_out)
        return dq, dk, dv, None, None, None, None, None, None, None


def tiled_attention(q, k, v, mask, causal, window, scale, dropout_p, offset=None):
    """Flash-style attention on 4-D inputs; returns ``(out, lse)`` with lse ``(B, Hkv, G, Lq)``.
    ``offset``: query row 0's position among the keys (``masks.KeyRule``; default
    ``k_len - q_len``, end-aligned)."""
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if dropout_p > 0 else 0
    return _TiledAttention.apply(q, k, v, mask, causal, window, scale, dropout_p, seed, offset)


def tiled_weights(q, k, mask, causal, window, scale, rows):
    """Weights of the chosen query ``rows`` ``(B, Hq, R, Lk)``, BLOCK_Q rows at a time.

    A plain masked softmax of each block of full score rows, so memory stays
    O(BLOCK_Q x k_len) and gradients flow back into ``q`` and ``k`` (the saved
    log-sum-exp is not differentiable, so the weights are not rebuilt from it).
    """
    settings = _Ctx(q, k, causal, window, scale, 0.0, 0)
    c = settings.compute
    batch, q_heads, _, head_dim = q.shape
    qg = settings.grouped(q)
    parts = []
    for r in range(0, len(rows), BLOCK_Q):
        idx = rows[r:r + BLOCK_Q]
        q_blk = qg.index_select(3, idx).to(c) * scale
        s = torch.matmul(_fold(q_blk), k.to(c).transpose(-1, -2))
        s = s.view(batch, settings.kv_heads, settings.group, len(idx), settings.k_len)
        s.masked_fill_(~settings.rule.allowed(rows=idx), _NEG_INF)
        if mask is not None:
            m = _slice_rows(mask, idx, settings.kv_heads)
            s = s.masked_fill(~m, _NEG_INF) if m.dtype == torch.bool else s + m.to(c)
        empty = s.amax(dim=-1, keepdim=True) == _NEG_INF
        p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
        parts.append(p.reshape(batch, q_heads, len(idx), settings.k_len))
    if not parts:
        return torch.zeros(batch, q_heads, 0, settings.k_len, dtype=q.dtype, device=q.device)
    return torch.cat(parts, dim=2).to(q.dtype)


def _work(t):  # the block steps' dtype: float64 stays, everything else is float32
    return t if t.dtype == torch.float64 else t.float()


def tiled_block_forward(q, k, v, mask, causal, window, offset, scale):
    """``backends.BlockStep.forward`` in PyTorch: ``(out (B, Hq, Lq, Dv), lse (B, Hq, Lq))``
    of one block of queries (row ``i`` at position ``i + offset`` among the keys),
    in float32 (float64 kept)."""
    q, k, v = (_work(t) for t in (q, k, v))
    ctx = _Ctx(q, k, causal, window, scale, 0.0, 0, offset)
    out, lse = _forward(ctx, q, k, v, mask)
    return (out.view(ctx.batch, ctx.q_heads, ctx.q_len, -1),
            lse.view(ctx.batch, ctx.q_heads, ctx.q_len))


def tiled_block_backward(q, k, v, mask, out, lse, grad_out, causal, window, offset, scale):
    """``backends.BlockStep.backward``: the block's share of ``(dq, dk, dv)`` given the
    merged ``out`` and ``lse (B, Hq, Lq)`` of every block its rows attend."""
    q, k, v, out, lse, grad_out = (_work(t) for t in (q, k, v, out, lse, grad_out))
    ctx = _Ctx(q, k, causal, window, scale, 0.0, 0, offset)
    lse = lse.reshape(ctx.batch, ctx.kv_heads, ctx.group, ctx.q_len)
    return _backward(ctx, q, k, v, mask, out, lse, grad_out)
