"""NumPy float64 reference: the independent oracle the tests hold every backend to.

Written without torch and without the helpers of ``masks.py``: the masking
rules are spelled out here a second time, on purpose, so that a mistake in
one place cannot hide in both.
"""

from __future__ import annotations

import numpy as np

__all__ = ["softmax", "attention", "causal_attention"]


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax in float64; a row that is all ``-inf`` (or has no
    entries) gives zeros."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=axis, keepdims=True, initial=-np.inf)
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
    softcap: float | None = None,
    alibi_slopes: np.ndarray | None = None,
    sinks: np.ndarray | None = None,
    document_ids=None,
    mask_mod=None,
    score_mod=None,
):
    """Scaled dot-product attention on ``(..., heads, seq, head_dim)`` arrays.

    ``k``/``v`` may have fewer heads than ``q`` (grouped-query attention:
    query head h reads kv head ``h // (q_heads // kv_heads)``). ``mask`` is
    bool (True = may attend) or additive float, broadcast to
    ``(..., heads, q_len, k_len)``. Causal and window rules are aligned to the
    end when ``q_len != k_len``. Rows with nothing to attend give zeros. Float
    masks are added exactly (``-inf`` forbids a key; any finite row constant,
    however large, changes nothing).

    The variants, as ``attnlab.attention`` defines them, one (query, key) pair at a
    time where they are about positions:

    - ``softcap``: the scaled score becomes ``softcap * tanh(score / softcap)``;
    - ``score_mod(score, b, h, i, j)``: called once per pair with Python numbers
      (FlexAttention's semantics; ``b`` indexes the flattened leading dimensions);
    - ``alibi_slopes`` ``(heads,)`` or ``(..., heads)``: ``- slope * |p - j|``;
    - ``document_ids``: ``(..., seq)``/``(seq,)`` ids, or a pair for queries and keys:
      a query sees only keys with its id; the ``r``-th of a document's ``nq`` queries
      sits at local position ``r + nk - nq`` among its ``nk`` keys, and the
      causal/window rule and ALiBi's ``p - j`` are taken in those local positions;
    - ``mask_mod(b, h, i, j) -> bool``: called once per pair, False forbids;
    - ``sinks`` ``(heads,)``: ``exp(sink)`` joins each row's softmax denominator.
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    _check_shapes(q, k, v)
    lead = q.shape[:-3]
    q_heads, q_len, head_dim = q.shape[-3:]
    kv_heads, k_len = k.shape[-3], k.shape[-2]
    group = q_heads // kv_heads
    k = np.repeat(k, group, axis=-3)
    v = np.repeat(v, group, axis=-3)
    scale = 1.0 / np.sqrt(head_dim) if scale is None else float(scale)

    scores = np.einsum("...qd,...kd->...qk", q, k) * scale
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    batch = int(np.prod(lead)) if lead else 1
    flat = scores.reshape(batch, q_heads, q_len, k_len)  # a view of scores
    if score_mod is not None:
        for b, h, i, j in np.ndindex(flat.shape):
            flat[b, h, i, j] = float(score_mod(flat[b, h, i, j], b, h, i, j))
    docs = _documents(document_ids, batch, q_len, k_len)
    allowed = np.ones((batch, q_heads, q_len, k_len), dtype=bool)
    distance = np.zeros((batch, q_len, k_len))
    for b in range(batch):
        for i in range(q_len):
            for j in range(k_len):
                if docs is None:
                    p, c, same = i + (k_len - q_len), j, True
                else:
                    p, c, same = _local(docs, b, i, j)
                ok = same
                if causal and c > p:
                    ok = False
                if window is not None:
                    if c <= p - window:
                        ok = False
                    if not causal and c >= p + window:
                        ok = False
                allowed[b, :, i, j] = ok
                distance[b, i, j] = abs(p - c)
                if mask_mod is not None:
                    for h in range(q_heads):
                        allowed[b, h, i, j] &= bool(mask_mod(b, h, i, j))
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=np.float64).reshape(-1, q_heads)
        flat -= slopes[:, :, None, None] * distance[:, None]
    allowed = allowed.reshape(scores.shape)
    bias = np.zeros(scores.shape)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == bool:
            allowed = allowed & np.broadcast_to(mask, scores.shape)
        else:
            bias = bias + np.broadcast_to(mask.astype(np.float64), scores.shape)
    # Add the bias exactly: softmax ignores a per-row constant, so take each row's
    # largest allowed bias out first, or a bias of -1e9 would swallow the scores. Not
    # with sinks: a sink's share depends on the scores' level, so the bias stays as is.
    bias = np.where(allowed, bias, -np.inf)
    top = (np.max(bias, axis=-1, keepdims=True) if k_len and sinks is None
           else np.zeros((*bias.shape[:-1], 1)))
    scores = scores + (bias - np.where(np.isfinite(top), top, 0.0))  # -inf: not allowed
    if sinks is None:
        weights = softmax(scores, axis=-1)
    else:
        weights = _softmax_with_sinks(scores, np.asarray(sinks, dtype=np.float64))
    out = np.einsum("...qk,...kd->...qd", weights, v)
    return (out, weights) if return_weights else out


def _softmax_with_sinks(scores: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """Softmax over the keys with ``exp(sink[h])`` added to each row's denominator."""
    sink = sinks.reshape(-1, 1, 1)  # (heads, 1, 1) against (..., heads, q_len, k_len)
    top = np.maximum(np.max(scores, axis=-1, keepdims=True, initial=-np.inf), sink)
    e = np.exp(scores - top)
    return e / (np.sum(e, axis=-1, keepdims=True) + np.exp(sink - top))


def _documents(document_ids, batch: int, q_len: int, k_len: int):
    """``(q_ids, k_ids)`` as ``(batch, len)`` integer arrays, or None."""
    if document_ids is None:
        return None
    if isinstance(document_ids, tuple | list):
        q_ids, k_ids = (np.asarray(x) for x in document_ids)
    else:
        q_ids = k_ids = np.asarray(document_ids)
    return (np.broadcast_to(q_ids.reshape(-1, q_len), (batch, q_len)),
            np.broadcast_to(k_ids.reshape(-1, k_len), (batch, k_len)))


def _local(docs, b: int, i: int, j: int) -> tuple[int, int, bool]:
    """Query ``i``'s and key ``j``'s positions inside query ``i``'s document (the query
    end-aligned with the document's keys) and whether key ``j`` is in it."""
    q_ids, k_ids = docs[0][b], docs[1][b]
    doc = q_ids[i]
    queries = [x for x in range(len(q_ids)) if q_ids[x] == doc]
    keys = [x for x in range(len(k_ids)) if k_ids[x] == doc]
    p = queries.index(i) + len(keys) - len(queries)
    if j in keys:
        return p, keys.index(j), True
    return p, 0, False


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
