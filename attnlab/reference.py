"""NumPy float64 reference: the independent oracle the tests hold every backend to.

Written without torch and without the helpers of ``masks.py``: the masking
rules are spelled out here a second time, on purpose, so that a mistake in
one place cannot hide in both.
"""

from __future__ import annotations

import numpy as np

__all__ = ["softmax", "attention", "causal_attention"]


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax in float64; a row that is all ``-inf`` gives zeros."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    s = np.sum(e, axis=axis, keepdims=True)
    return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None = None,
    *,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    return_weights: bool = False,
):
    """Scaled dot-product attention on ``(..., heads, seq, head_dim)`` arrays.

    ``k``/``v`` may have fewer heads than ``q`` (grouped-query attention:
    query head h reads kv head ``h // (q_heads // kv_heads)``). ``mask`` is
    bool (True = may attend) or additive float, broadcast to
    ``(..., heads, q_len, k_len)``. Causal and window rules are aligned to the
    end when ``q_len != k_len``. Rows with nothing to attend give zeros. Float
    masks are added exactly (``-inf`` forbids a key; any finite row constant,
    however large, changes nothing).
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    _check_shapes(q, k, v)
    q_heads, q_len, head_dim = q.shape[-3:]
    kv_heads, k_len = k.shape[-3], k.shape[-2]
    group = q_heads // kv_heads
    k = np.repeat(k, group, axis=-3)
    v = np.repeat(v, group, axis=-3)
    scale = 1.0 / np.sqrt(head_dim) if scale is None else float(scale)

    scores = np.einsum("...qd,...kd->...qk", q, k) * scale
    allowed = np.ones(scores.shape, dtype=bool)
    bias = np.zeros(scores.shape)
    for i in range(q_len):
        p = i + (k_len - q_len)
        for j in range(k_len):
            ok = True
            if causal and j > p:
                ok = False
            if window is not None:
                if j <= p - window:
                    ok = False
                if not causal and j >= p + window:
                    ok = False
            if not ok:
                allowed[..., i, j] = False
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == bool:
            allowed = allowed & np.broadcast_to(mask, scores.shape)
        else:
            bias = bias + np.broadcast_to(mask.astype(np.float64), scores.shape)
    # Add the bias exactly: softmax ignores a per-row constant, so take each row's
    # largest allowed bias out first, or a bias of -1e9 would swallow the scores.
    bias = np.where(allowed, bias, -np.inf)
    top = np.max(bias, axis=-1, keepdims=True)
    scores = scores + (bias - np.where(np.isfinite(top), top, 0.0))  # -inf: not allowed
    weights = softmax(scores, axis=-1)
    out = np.einsum("...qk,...kd->...qd", weights, v)
    return (out, weights) if return_weights else out


def _check_shapes(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """The shape rules of :func:`attnlab.attention`, worded the same way, so that a 2-D
    ``(seq, dim)`` input is one clear error here too, not a failed unpacking."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim < 3:
            raise ValueError(f"{name} must have at least 3 dimensions (..., heads, seq, "
                             f"head_dim), got shape {a.shape}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k has head_dim {k.shape[-1]} but q has head_dim {q.shape[-1]} "
                         f"(q {q.shape}, k {k.shape}); expected them equal")
    if k.shape[-3:-1] != v.shape[-3:-1]:
        raise ValueError(f"v has shape {v.shape} but k has {k.shape}; expected the same "
                         "heads and length")
    if k.shape[-3] == 0 or q.shape[-3] % k.shape[-3]:
        raise ValueError(f"q has {q.shape[-3]} heads and k has {k.shape[-3]}; expected a "
                         "multiple (grouped-query attention)")


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, **kwargs):
    """:func:`attention` with ``causal=True``."""
    return attention(q, k, v, causal=True, **kwargs)
