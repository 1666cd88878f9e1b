"""The oracle of ``attnlab check`` and its "buggy oracles", in NumPy float64.

A learner's output is compared with the oracle and with the oracle carrying each
mistake the tutorials make (one, two or three at once); the variant that
matches names the mistake. With no mistake applied, :func:`attend` is the same
computation as :func:`attnlab.reference.attention` (a test holds them equal);
it is written out again here only because each step must be breakable one at a
time, which the reference, on purpose, does not allow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Every known mistake, grouped by family: a variant applies at most one per family.
# The order is the order of preference when two variants explain the same outputs.
FAMILIES: dict[str, tuple[str, ...]] = {
    "scale": ("scale_d_model", "scale_d_in", "no_scale", "scale_by_d", "scale_times"),
    "softmax": ("softmax_axis",),
    "transpose": ("k_not_transposed",),
    "mask": ("mask_inverted", "mask_after_softmax"),
    "causal": ("causal_missing", "causal_excludes_self", "causal_sees_next", "causal_top_left"),
    "heads": ("heads_split_merge", "heads_split", "heads_merge"),
    "gqa": ("gqa_tile",),
    # Not a mistake: the book's weight-free attention has no scale, 1/sqrt(d) is fine too.
    "benign": ("scaled",),
}
FAMILY_OF = {bug: family for family, bugs in FAMILIES.items() for bug in bugs}
BENIGN = frozenset(FAMILIES["benign"])

# What a query row with no key to attend gives: zeros (attnlab's rule), NaN (the
# softmax of a row of -inf) or the mean of the values (a finite fill such as -1e9).
EMPTY_MODES = ("zero", "nan", "mean")


def allowed(q_len: int, k_len: int, *, causal: bool, window: int | None,
            mask: np.ndarray | None, bugs: frozenset[str]) -> np.ndarray:
    """``(q_len, k_len)`` bool (or the mask's broadcast shape): which keys a query sees.

    Causal and window rules are aligned to the end (query i sits at ``i + k_len - q_len``),
    as in :mod:`attnlab.masks`; the causal bugs shift or drop that rule.
    """
    i = np.arange(q_len)[:, None]
    j = np.arange(k_len)[None, :]
    p = i + (0 if "causal_top_left" in bugs else k_len - q_len)
    ok = np.ones((q_len, k_len), dtype=bool)
    if causal and "causal_missing" not in bugs:
        if "causal_excludes_self" in bugs:
            ok &= j < p
        elif "causal_sees_next" in bugs:
            ok &= j <= p + 1
        else:
            ok &= j <= p
    if window is not None:
        ok &= j > p - window
        if not causal:
            ok &= j < p + window
    if mask is not None:
        ok = ok & (~mask if "mask_inverted" in bugs else mask)
    return ok


def scale_of(bugs: frozenset[str], head_dim: int, d_model: int, d_in: int,
             base: float | None) -> float:
    """The multiplier of the scores: ``base`` (or ``1/sqrt(head_dim)``), or a wrong one."""
    if "no_scale" in bugs:
        return 1.0
    if "scale_by_d" in bugs:
        return 1.0 / head_dim
    if "scale_times" in bugs:
        return float(np.sqrt(head_dim))
    if "scale_d_model" in bugs:
        return 1.0 / float(np.sqrt(d_model))
    if "scale_d_in" in bugs:
        return 1.0 / float(np.sqrt(d_in))
    if "scaled" in bugs:
        return 1.0 / float(np.sqrt(head_dim))
    return 1.0 / float(np.sqrt(head_dim)) if base is None else base


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, ok: np.ndarray, scale: float,
           bugs: frozenset[str], empty: str = "zero") -> np.ndarray | None:
    """``(B, Hq, Tq, D)`` queries, ``(B, Hkv, Tk, D)`` keys/values -> ``(B, Hq, Tq, D)``,
    or None where the mistake cannot run at these shapes (``q @ k`` with Tk != D)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:  # query head h reads kv head h // group; tile() pairs h with h % Hkv
        k, v = ((np.tile(t, (1, group, 1, 1)) if "gqa_tile" in bugs
                 else np.repeat(t, group, axis=1)) for t in (k, v))
    if "k_not_transposed" in bugs:
        if k.shape[-2] != k.shape[-1]:
            return None
        scores = q @ k
    else:
        scores = q @ np.swapaxes(k, -1, -2)
    scores = scores * scale
    ok = np.broadcast_to(ok, scores.shape)
    axis = -2 if "softmax_axis" in bugs else -1
    if "mask_after_softmax" in bugs:  # every key's softmax, the masked weights then zeroed
        e = np.exp(scores - np.max(scores, axis=axis, keepdims=True))
        return np.where(ok, e / np.sum(e, axis=axis, keepdims=True), 0.0) @ v
    scores = np.where(ok, scores, -np.inf)
    top = np.max(scores, axis=axis, keepdims=True)
    e = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    total = np.sum(e, axis=axis, keepdims=True)
    weights = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    none = np.broadcast_to(total <= 0, weights.shape)
    if empty == "nan":
        weights = np.where(none, np.nan, weights)
    elif empty == "mean":
        weights = np.where(none, 1.0 / weights.shape[axis], weights)
    return weights @ v


@dataclass
class Block:
    """Projections of a group of heads, as ``(out, in)`` matrices (``nn.Linear``'s layout)."""

    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    bq: np.ndarray | None
    bk: np.ndarray | None
    bv: np.ndarray | None
    heads: int
    kv_heads: int
    head_dim: int


@dataclass
class Weights:
    """What a module computes with: blocks of heads side by side, then ``out`` (or none)."""

    blocks: list[Block]
    out_w: np.ndarray | None = None
    out_b: np.ndarray | None = None


def _linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    return x @ w.T + (0.0 if b is None else b)


def module_forward(x: np.ndarray, weights: Weights, ok: np.ndarray, base: float | None,
                   bugs: frozenset[str], d_in: int, empty: str = "zero") -> np.ndarray | None:
    """``(B, T, d_in)`` -> ``(B, T, d_out)``: project, split heads, attend, merge, project."""
    b, t, _ = x.shape
    d_model = sum(blk.heads * blk.head_dim for blk in weights.blocks)
    wrong_split = bool(bugs & {"heads_split", "heads_split_merge"})
    wrong_merge = bool(bugs & {"heads_merge", "heads_split_merge"})
    outs = []
    for blk in weights.blocks:
        def split(y: np.ndarray, heads: int, blk: Block = blk) -> np.ndarray:
            if wrong_split:  # view(b, heads, T, D): rows of different tokens end up in a head
                return y.reshape(b, heads, t, blk.head_dim)
            return y.reshape(b, t, heads, blk.head_dim).transpose(0, 2, 1, 3)

        q = split(_linear(x, blk.wq, blk.bq), blk.heads)
        k = split(_linear(x, blk.wk, blk.bk), blk.kv_heads)
        v = split(_linear(x, blk.wv, blk.bv), blk.kv_heads)
        scale = scale_of(bugs, blk.head_dim, d_model, d_in, base)
        out = attend(q, k, v, ok, scale, bugs, empty)
        if out is None:
            return None
        merged = out.reshape(b, t, -1) if wrong_merge else out.transpose(0, 2, 1, 3).reshape(
            b, t, -1)
        outs.append(merged)
    out = np.concatenate(outs, axis=-1)
    return out if weights.out_w is None else _linear(out, weights.out_w, weights.out_b)
