"""A learner's attention code with one planted bug per function or class, written the
way the tutorials write it; ``attnlab check`` must name each bug (test_learner_check.py).

Only the bugs differ from the clean versions (``good_attention``, ``BookCausalAttention``,
``BookMultiHeadAttention``, ``GroupedQueryAttention``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _masked(scores, mask, *, inverted=False):
    if mask is None:
        return scores
    return scores.masked_fill(mask if inverted else ~mask, float("-inf"))


def _finish(scores, v, dim=-1):
    weights = torch.nan_to_num(torch.softmax(scores, dim=dim))  # no key: zeros, not NaN
    return weights @ v


def good_attention(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return _finish(_masked(scores, mask), v)


def softmax_wrong_axis(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return _finish(_masked(scores, mask), v, dim=-2)


def k_not_transposed(q, k, v, mask=None):
    scores = q @ k / math.sqrt(q.shape[-1])
    return _finish(_masked(scores, mask), v)


def mask_inverted(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return _finish(_masked(scores, mask, inverted=True), v)


def nan_on_masked_row(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(_masked(scores, mask), dim=-1) @ v


def finite_fill(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, -1e9)
    return torch.softmax(scores, dim=-1) @ v


def mask_after_softmax(q, k, v, mask=None):
    weights = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
    return (weights if mask is None else weights * mask) @ v  # not renormalised


def no_scale_and_mask_inverted(q, k, v, mask=None):
    return _finish(_masked(q @ k.transpose(-2, -1), mask, inverted=True), v)


def off_by_a_little(q, k, v, mask=None):
    return good_attention(q, k, v, mask) + 0.01 * torch.arange(q.shape[-1])


def simplified(x):
    return torch.softmax(x @ x.transpose(-2, -1), dim=-1) @ x


class BookCausalAttention(nn.Module):
    """The book's CausalAttention (chapter 3.5), as printed."""

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False, diagonal=1,
                 eval_dropout=False):
        super().__init__()
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.p, self.eval_dropout = dropout, eval_dropout
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length),
                                                diagonal=diagonal))

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys, queries, values = self.W_key(x), self.W_query(x), self.W_value(x)
        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        if self.eval_dropout:
            attn_weights = F.dropout(attn_weights, self.p)  # training=True by default
        else:
            attn_weights = self.dropout(attn_weights)
        return attn_weights @ values


class CausalMaskAfterSoftmax(BookCausalAttention):
    """The book's first causal attempt (3.5.1) without its renormalising step."""

    def forward(self, x):
        n = x.shape[1]
        keys, queries, values = self.W_key(x), self.W_query(x), self.W_value(x)
        w = torch.softmax(queries @ keys.transpose(1, 2) / keys.shape[-1] ** 0.5, dim=-1)
        return (w * torch.tril(torch.ones(n, n))) @ values


class CausalOffByOne(BookCausalAttention):
    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, qkv_bias, diagonal=0)


class CausalSeesNext(BookCausalAttention):
    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, qkv_bias, diagonal=2)


class DropoutInEval(BookCausalAttention):
    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, qkv_bias, eval_dropout=True)


class BookMultiHeadAttention(nn.Module):
    """The book's MultiHeadAttention (chapter 3.6.2); ``split``/``merge``/``scale`` plant
    the tutorials' bugs."""

    split = merge = "right"
    scale = "head_dim"

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length),
                                                diagonal=1))

    def _heads(self, t, b, n):
        if self.split == "wrong":
            return t.view(b, self.num_heads, n, self.head_dim)
        return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys = self._heads(self.W_key(x), b, num_tokens)
        queries = self._heads(self.W_query(x), b, num_tokens)
        values = self._heads(self.W_value(x), b, num_tokens)
        attn_scores = queries @ keys.transpose(2, 3)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        size = self.d_out if self.scale == "embed_dim" else keys.shape[-1]
        attn_weights = self.dropout(torch.softmax(attn_scores / size ** 0.5, dim=-1))
        context = attn_weights @ values
        if self.merge == "right":
            context = context.transpose(1, 2)
        return self.out_proj(context.contiguous().view(b, num_tokens, self.d_out))


class MultiHeadSqrtEmbedDim(BookMultiHeadAttention):
    scale = "embed_dim"  # the seed-004 tutorial: scores / math.sqrt(embed_dim)


class MultiHeadWrongSplit(BookMultiHeadAttention):
    split = merge = "wrong"


class MultiHeadForgotTranspose(BookMultiHeadAttention):
    merge = "wrong"


class GroupedQueryAttention(nn.Module):
    """GQA as the tutorials write it; ``repeat`` plants the head-mapping bug."""

    repeat = "interleave"

    def __init__(self, d_in, d_out, num_heads, num_kv_heads):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, num_kv_heads * self.head_dim, bias=False)
        self.W_value = nn.Linear(d_in, num_kv_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(d_out, d_out, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.W_query(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.W_key(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.W_value(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        group = self.num_heads // self.num_kv_heads
        if self.repeat == "interleave":
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        else:
            k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        w = torch.softmax(q @ k.transpose(-2, -1) / self.head_dim ** 0.5, dim=-1)
        return self.out_proj((w @ v).transpose(1, 2).reshape(b, n, -1))


class GroupedQueryWrongRepeat(GroupedQueryAttention):
    repeat = "tile"


def attn_mask_after_causal(q, k, v, causal=False, mask=None):
    """Correct: the mask in the fifth place, by its name."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:  # end-aligned, as attnlab's rule (and transformers') is
        n, m = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(n, m).triu(m - n + 1).bool(), -torch.inf)
    return _finish(scores if mask is None else _masked(scores, mask), v)


def attn_causal_flag(q, k, v, causal=False):
    """Correct: a causal option in the fourth place, where a mask often is."""
    return attn_mask_after_causal(q, k, v, causal)


def attn_scale_like_sdpa(q, k, v, scale=None):
    """Correct: SDPA's own keyword in the fourth place."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _finish(q @ k.transpose(-2, -1) * scale, v)


def causal_inside(q, k, v):
    """Correct and causal, with no flag to say so: the mask is made inside."""
    return attn_causal_flag(q, k, v, causal=True)


class MaskedSelfAttention(BookCausalAttention):
    """The book's CausalAttention with its buffer called ``future_mask``."""

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, qkv_bias)
        self.register_buffer("future_mask", self.mask)
        del self.mask

    def forward(self, x):
        self.mask = self.future_mask
        try:
            return super().forward(x)
        finally:
            del self.mask


class MaskMadeInForward(nn.Module):
    """A one-width multi-head module, ``(d_in, num_heads)``, whose causal mask is made in
    ``forward``; ``scaled`` False plants the missing scale."""

    scaled = True

    def __init__(self, d_in, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_in // num_heads
        self.W_query = nn.Linear(d_in, d_in, bias=False)
        self.W_key = nn.Linear(d_in, d_in, bias=False)
        self.W_value = nn.Linear(d_in, d_in, bias=False)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (w(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                   for w in (self.W_query, self.W_key, self.W_value))
        scores = q @ k.transpose(-2, -1)
        scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), -torch.inf)
        if self.scaled:
            scores = scores / self.head_dim ** 0.5
        return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, n, d)


class MaskMadeInForwardNoScale(MaskMadeInForward):
    scaled = False


def simplified_causal(x):
    """Correct: the weight-free attention with its causal mask made inside."""
    n = x.shape[-2]
    scores = (x @ x.transpose(-2, -1)).masked_fill(torch.ones(n, n).triu(1).bool(), -torch.inf)
    return torch.softmax(scores, dim=-1) @ x


def drops_last_key(q, k, v):
    """Wrong, and not causal: the last key and value are left out of every row."""
    return good_attention(q, k[..., :-1, :], v[..., :-1, :])


class WithContext(BookMultiHeadAttention):
    """Correct: a second forward parameter that is not a mask."""

    def forward(self, x, context=None):
        return super().forward(x if context is None else context)


def broken_import_free():
    """Nothing: a name that is neither attention nor a module (for the CLI's exit 2)."""


# Projections named as in Aladdin Persson's tutorial (queries/keys/values), with no width
# attribute: checked at the width its layers read (helper-found: fed 8 wide, "raises").
class PerssonSelfAttention(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.queries = nn.Linear(d_model, d_model, bias=False)
        self.keys = nn.Linear(d_model, d_model, bias=False)
        self.values = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x):
        q, k, v = self.queries(x), self.keys(x), self.values(x)
        return torch.softmax(q @ k.transpose(-2, -1) / k.shape[-1] ** 0.5, -1) @ v


class PerssonNoScale(PerssonSelfAttention):
    def forward(self, x):
        q, k, v = self.queries(x), self.keys(x), self.values(x)
        return torch.softmax(q @ k.transpose(-2, -1), -1) @ v


KARPATHY_BLOCK_SIZE = 8  # a global, as in Karpathy's notebook: no context attribute


class KarpathyHead(nn.Module):
    """One head of Karpathy's "Let's build GPT": the only length it takes is its tril's."""

    def __init__(self, n_embd):
        super().__init__()
        self.key = nn.Linear(n_embd, n_embd, bias=False)
        self.query = nn.Linear(n_embd, n_embd, bias=False)
        self.value = nn.Linear(n_embd, n_embd, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(KARPATHY_BLOCK_SIZE,
                                                           KARPATHY_BLOCK_SIZE)))

    def forward(self, x):
        _, t, _ = x.shape
        k, q = self.key(x), self.query(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        wei = wei.masked_fill(self.tril[:t, :t] == 0, float("-inf"))
        return torch.softmax(wei, dim=-1) @ self.value(x)


class WrapsTorchMultihead(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.mha = nn.MultiheadAttention(d_model, 4, batch_first=True, bias=False)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]
