"""The tutorial family of chapter 3 of *Build a Large Language Model (From Scratch)*.

Each class has the same constructor, the same parameters (created in the same
order, with the same initialisation) and the same output as its counterpart in
``llms_from_scratch.ch03``, but its ``forward`` hands the attention itself to
:func:`attnlab.attention`, with the sequence viewed as ``(batch, 1 head, seq, dim)``.

For teaching, ``steps(x)`` spells the computation out one tensor at a time
(queries, keys, values, scores, weights, context); the tests hold it equal to
``forward``.

Inputs are ``(seq, d_in)`` as in the book, or ``(batch, seq, d_in)``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..checks import positive_int, probability
from ..functional import attention

__all__ = [
    "SimplifiedSelfAttention",
    "SelfAttentionV1",
    "SelfAttentionV2",
    "CausalAttention",
    "MultiHeadAttentionWrapper",
]


def _as_batch(x: object, d_in: int | None, who: str) -> tuple[torch.Tensor, bool]:
    """``(seq, d)`` or ``(batch, seq, d)`` -> ``(batch, seq, d)`` and whether it was 2-D."""
    if not isinstance(x, torch.Tensor) or x.ndim not in (2, 3):
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        feats = "d" if d_in is None else f"d_in={d_in}"
        raise ValueError(f"{who}: x must be (seq, {feats}) or (batch, seq, {feats}), got {shape}")
    if d_in is not None and x.shape[-1] != d_in:
        raise ValueError(
            f"{who}: x has {x.shape[-1]} features (shape {tuple(x.shape)}) but d_in={d_in}"
        )
    return (x.unsqueeze(0), True) if x.ndim == 2 else (x, False)


def _attend(q, k, v, *, squeeze: bool, causal: bool = False, scale=None, dropout_p=0.0,
            return_weights: bool = False):
    """``(B, T, d)`` q/k/v -> one-head :func:`attention` -> ``(B, T, d_out)`` or ``(T, d_out)``."""
    out = attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), causal=causal, scale=scale,
                    dropout_p=dropout_p, return_weights=return_weights)
    weights = None
    if return_weights:
        out, weights = out
        weights = weights.squeeze(1)  # (B, T, T)
    out = out.squeeze(1)  # (B, T, d_out)
    if squeeze:
        out = out.squeeze(0)
        weights = None if weights is None else weights.squeeze(0)
    return out if weights is None else (out, weights)


def _spell_out(q, k, v, *, squeeze: bool, causal: bool = False, scale=None) -> dict:
    """The textbook steps, one named tensor each (for reading, not for speed)."""
    scale = 1.0 / math.sqrt(k.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1)  # (B, T, T): omega_ij = q_i . k_j
    masked = scores
    if causal:
        t = scores.shape[-1]
        future = torch.triu(torch.ones(t, t, dtype=torch.bool, device=q.device), diagonal=1)
        masked = scores.masked_fill(future, float("-inf"))
    weights = torch.softmax(masked * scale, dim=-1)  # each row sums to 1
    context = weights @ v  # (B, T, d_out): z_i = sum_j alpha_ij v_j
    out = {"queries": q, "keys": k, "values": v, "scores": scores, "weights": weights,
           "context": context}
    return {name: t.squeeze(0) for name, t in out.items()} if squeeze else out


class SimplifiedSelfAttention(nn.Module):
    """Self-attention without trainable weights (section 3.3.1).

    Scores are plain dot products ``x_i . x_j`` (no scaling), the weights their
    softmax over j, and the output the weighted sum of the inputs themselves.

    Input ``x``: ``(seq, d)`` or ``(batch, seq, d)``; output has the same shape.
    """

    def forward(self, x: torch.Tensor, *, return_weights: bool = False):
        """``x`` ``(seq, d)`` / ``(batch, seq, d)`` -> context of the same shape
        (and weights ``(seq, seq)`` / ``(batch, seq, seq)`` with ``return_weights``)."""
        xb, squeeze = _as_batch(x, None, type(self).__name__)
        return _attend(xb, xb, xb, squeeze=squeeze, scale=1.0, return_weights=return_weights)

    def steps(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The computation spelled out: ``scores``, ``weights``, ``context`` (and q=k=v=x)."""
        xb, squeeze = _as_batch(x, None, type(self).__name__)
        return _spell_out(xb, xb, xb, squeeze=squeeze, scale=1.0)


class _Projected(nn.Module):
    """Shared forward of the classes with W_query/W_key/W_value projections."""

    d_in: int
    causal = False

    def _qkv(self, x):  # pragma: no cover - defined by subclasses
        raise NotImplementedError

    def _dropout_p(self) -> float:
        return 0.0

    def forward(self, x: torch.Tensor, *, return_weights: bool = False):
        """``x`` ``(seq, d_in)`` / ``(batch, seq, d_in)`` -> ``(seq, d_out)`` /
        ``(batch, seq, d_out)`` (and weights ``(..., seq, seq)`` with ``return_weights``)."""
        xb, squeeze = _as_batch(x, self.d_in, type(self).__name__)
        self._check_len(xb)
        q, k, v = self._qkv(xb)
        return _attend(q, k, v, squeeze=squeeze, causal=self.causal,
                       dropout_p=self._dropout_p(), return_weights=return_weights)

    def steps(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The computation spelled out: ``queries``, ``keys``, ``values``, ``scores``
        (before scaling and masking), ``weights``, ``context`` (no dropout)."""
        xb, squeeze = _as_batch(x, self.d_in, type(self).__name__)
        self._check_len(xb)
        q, k, v = self._qkv(xb)
        return _spell_out(q, k, v, squeeze=squeeze, causal=self.causal)

    def _check_len(self, x: torch.Tensor) -> None:
        pass


class SelfAttentionV1(_Projected):
    """Scaled dot-product self-attention with ``nn.Parameter`` weights (section 3.4.1).

    Args:
        d_in (int): input features.
        d_out (int): output features (the size of queries, keys and values).

    ``W_query``, ``W_key``, ``W_value`` are ``(d_in, d_out)`` ``torch.rand`` matrices,
    applied as ``x @ W``. Input ``(seq, d_in)`` or ``(batch, seq, d_in)``.
    """

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def _qkv(self, x):
        return x @ self.W_query, x @ self.W_key, x @ self.W_value  # (B, T, d_out) each


class SelfAttentionV2(_Projected):
    """Scaled dot-product self-attention with ``nn.Linear`` projections (section 3.4.2).

    Args:
        d_in (int): input features.
        d_out (int): output features.
        qkv_bias (bool): biases in the three projections.

    Input ``(seq, d_in)`` or ``(batch, seq, d_in)``.
    """

    def __init__(self, d_in: int, d_out: int, qkv_bias: bool = False) -> None:
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def _qkv(self, x):
        return self.W_query(x), self.W_key(x), self.W_value(x)  # (B, T, d_out) each


class CausalAttention(SelfAttentionV2):
    """Causal (masked) self-attention with dropout on the weights (section 3.5).

    Args:
        d_in (int): input features.
        d_out (int): output features.
        context_length (int): longest sequence accepted.
        dropout (float): dropout on the attention weights, in training mode only.
        qkv_bias (bool): biases in the three projections.

    Token i attends to tokens ``j <= i``. Unlike the book no ``(context_length,
    context_length)`` mask buffer is stored: :func:`attnlab.attention` applies the
    rule itself. Input ``(seq, d_in)`` or ``(batch, seq, d_in)``.
    """

    causal = True

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float = 0.0,
                 qkv_bias: bool = False) -> None:
        super().__init__(d_in, d_out, qkv_bias)
        self.context_length = positive_int("context_length", context_length)
        self.dropout = probability("dropout", dropout)

    def _dropout_p(self) -> float:
        return self.dropout if self.training else 0.0

    def _check_len(self, x: torch.Tensor) -> None:
        if x.shape[1] > self.context_length:
            raise ValueError(
                f"sequence of {x.shape[1]} tokens is longer than "
                f"context_length={self.context_length}"
            )


class MultiHeadAttentionWrapper(nn.Module):
    """Several :class:`CausalAttention` heads side by side, outputs concatenated (3.6.1).

    Args:
        d_in (int): input features.
        d_out (int): output features *per head*; the output has ``num_heads * d_out``.
        context_length (int): longest sequence accepted.
        dropout (float): dropout on each head's attention weights (training only).
        num_heads (int): number of heads.
        qkv_bias (bool): biases in the projections.

    The teaching version of multi-head attention: one module per head, run one
    after the other. :class:`MultiHeadAttention` computes the same thing in one go.
    Input ``(seq, d_in)`` or ``(batch, seq, d_in)``; output ``(..., seq, num_heads * d_out)``.
    """

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float,
                 num_heads: int, qkv_bias: bool = False) -> None:
        super().__init__()
        positive_int("num_heads", num_heads)
        self.heads = nn.ModuleList(
            [CausalAttention(d_in, d_out, context_length, dropout, qkv_bias)
             for _ in range(num_heads)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, d_in)`` -> ``(batch, seq, num_heads * d_out)`` (or without batch)."""
        return torch.cat([head(x) for head in self.heads], dim=-1)
