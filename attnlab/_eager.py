"""The ``eager`` backend of :func:`attnlab.attention`: the textbook path.

Part of ``functional.py`` in all but file: only its backend table calls it.
It materialises the scores, masks them, takes the softmax and the weighted sum;
every other backend is checked against it (and it against the NumPy oracle).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import masks as _masks

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def eager_attention(q, k, v, mask, causal, window, scale, dropout_p, rows):
    """The textbook path: materialise the scores, mask, softmax, weighted sum."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    dtype = q.dtype
    if dtype in _LOW_PRECISION:
        q, k, v = q.float(), k.float(), v.float()

    # (B, Hkv, G*Lq, D) @ (B, Hkv, D, Lk): the group rides along the query rows.
    scores = torch.matmul(q.reshape(batch, kv_heads, group * q_len, head_dim), k.transpose(-1, -2))
    # In-place from here: the product is a fresh tensor that autograd does not keep.
    scores = scores.view(batch, kv_heads, group, q_len, k_len).mul_(scale)
    struct = _masks.structural(q_len, k_len, causal=causal, window=window, device=q.device)
    allowed = _masks.combine(struct, mask if mask is None or mask.dtype == torch.bool else None)
    if allowed is not None:
        scores.masked_fill_(~_masks.group_view(allowed, kv_heads), float("-inf"))
    if mask is not None and mask.dtype != torch.bool:
        scores.add_(_masks.group_view(mask.to(scores.dtype), kv_heads))

    # Causal and window rules alone leave every row a key unless q_len > k_len.
    if mask is not None or (struct is not None and q_len > k_len):
        # A row with nothing to attend is all -inf, where softmax (and its backward)
        # gives NaN: soften it to zeros first, then zero its weights.
        if k_len:
            empty = scores.amax(dim=-1, keepdim=True) == float("-inf")
        else:  # no keys at all: every row is empty
            empty = scores.new_ones((*scores.shape[:-1], 1), dtype=torch.bool)
        weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    else:
        weights = torch.softmax(scores, dim=-1)
    used = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    out = torch.matmul(used.view(batch, kv_heads, group * q_len, k_len), v)
    out = out.view(batch, q_heads, q_len, v.shape[-1]).to(dtype)
    if rows is None:
        return out, None
    picked = weights.view(batch, q_heads, q_len, k_len).index_select(2, rows)
    return out, picked.to(dtype)


# --------------------------------------------------------------------------- block step


def _work(t):  # the block steps' dtype: float64 stays, everything else is float32
    return t if t.dtype == torch.float64 else t.float()


def _block_scores(q, k, mask, causal, window, offset, scale):
    """Masked scores ``(B, Hkv, G, Lq, Lk)`` of one block, query row ``i`` at position
    ``i + offset`` among the keys (``masks.KeyRule``); forbidden pairs are ``-inf``."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    s = torch.matmul(q.reshape(batch, kv_heads, group * q_len, head_dim), k.transpose(-1, -2))
    s = s.view(batch, kv_heads, group, q_len, k_len).mul_(scale)
    rule = _masks.KeyRule(q_len, k_len, causal=causal, window=window, offset=offset)
    if rule.structural:
        s.masked_fill_(~rule.allowed(device=q.device), float("-inf"))
    if mask is not None:
        s.masked_fill_(~_masks.group_view(mask, kv_heads), float("-inf"))
    return s


def eager_block_forward(q, k, v, mask, causal, window, offset, scale):
    """``backends.BlockStep.forward`` on the textbook path: ``(out, lse)``, ``lse`` ``+inf``
    (and ``out`` zeros) for a row with no allowed key; float32 (float64 kept)."""
    q, k, v = (_work(t) for t in (q, k, v))
    s = _block_scores(q, k, mask, causal, window, offset, scale)
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, Lq); -inf where nothing is allowed
    empty = lse == float("-inf")
    p = torch.exp(s - lse.masked_fill(empty, 0.0).unsqueeze(-1))
    batch, kv_heads, group, q_len, k_len = p.shape
    out = torch.matmul(p.view(batch, kv_heads, group * q_len, k_len), v)
    return (out.view(batch, kv_heads * group, q_len, v.shape[-1]),
            lse.masked_fill(empty, float("inf")).view(batch, kv_heads * group, q_len))


def eager_block_backward(q, k, v, mask, out, lse, grad_out, causal, window, offset, scale):
    """``backends.BlockStep.backward``: FlashAttention-2's backward of one block, the
    weights rebuilt from the merged ``lse`` (``+inf``: a row with nothing, weights 0)."""
    q, k, v, out, lse, grad_out = (_work(t) for t in (q, k, v, out, lse, grad_out))
    s = _block_scores(q, k, mask, causal, window, offset, scale)
    batch, kv_heads, group, q_len, k_len = s.shape
    p = torch.exp(s - lse.view(batch, kv_heads, group, q_len, 1))
    rows = (batch, kv_heads, group * q_len)
    p2 = p.view(*rows, k_len)
    do = grad_out.reshape(*rows, grad_out.shape[-1])
    dv = p2.transpose(-1, -2) @ do
    delta = (grad_out * out).sum(-1).view(batch, kv_heads, group, q_len, 1)
    ds = p.mul_((do @ v.transpose(-1, -2)).view_as(p).sub_(delta)).view(*rows, k_len)
    dq = (ds @ k).mul_(scale).view(q.shape)
    dk = (ds.transpose(-1, -2) @ q.reshape(*rows, q.shape[-1])).mul_(scale)
    return dq, dk, dv
