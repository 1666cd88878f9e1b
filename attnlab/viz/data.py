"""The checks every picture makes on its input: tokens, one matrix, or all layers.

:func:`heatmap`, :func:`heatmap_grid` and the HTML explorer take the same
kinds of input (torch tensors, NumPy arrays or nested lists of weights, and a
list of token strings); these functions turn them into NumPy arrays and refuse
anything malformed with an error naming the argument, so every picture checks
its input one way. torch is never imported: tensors are recognised by duck typing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["to_numpy", "as_tokens", "as_matrix", "as_layers", "as_mask", "as_labels"]

# Attention weights may overshoot [0, 1] a little in low precision; more is a caller error.
_WEIGHT_TOLERANCE = 1e-2


def to_numpy(x: Any, name: str) -> np.ndarray:
    """A float64 NumPy copy of ``x`` (torch tensor, NumPy array or nested lists)."""
    if hasattr(x, "detach") and type(x).__module__.startswith("torch"):
        x = x.detach().cpu().float().numpy()
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"{name}: expected a torch tensor or numpy array of numbers, "
            f"got {type(x).__name__} ({exc})"
        ) from None
    return arr


def as_tokens(tokens: Any) -> list[str]:
    """``tokens`` as a list of strings; a bare ``str`` is refused as ambiguous."""
    if isinstance(tokens, str | bytes):
        raise TypeError(
            f"tokens: expected a sequence of token strings, got a {type(tokens).__name__} "
            f"of length {len(tokens)}; pass list(text) for one token per character"
        )
    try:
        return [str(t) for t in tokens]
    except TypeError:
        raise TypeError(
            f"tokens: expected a sequence of token strings, got {type(tokens).__name__}"
        ) from None


def as_matrix(weights: Any, tokens: Any) -> tuple[np.ndarray, list[str]]:
    """Check one ``(q_len, k_len)`` matrix and its ``k_len`` tokens.

    Returns ``(weights as float64, tokens as a list of str)``. ``1 <= q_len <=
    k_len`` (the queries are the last tokens) and the values must be finite;
    unlike :func:`as_layers` they need not be weights in [0, 1].
    """
    w = to_numpy(weights, "weights")
    if w.ndim != 2:
        raise ValueError(
            f"weights: expected a 2-D (q_len, k_len) matrix, got shape {tuple(w.shape)}"
        )
    q_len, k_len = w.shape
    tokens = as_tokens(tokens)
    if len(tokens) != k_len:
        raise ValueError(
            f"tokens: expected {k_len} tokens (k_len of weights {tuple(w.shape)}), "
            f"got {len(tokens)}"
        )
    if q_len > k_len or q_len == 0:
        raise ValueError(
            f"weights: expected 1 <= q_len <= k_len (queries are the last tokens), "
            f"got shape {tuple(w.shape)}"
        )
    if not np.isfinite(w).all():
        raise ValueError("weights: expected finite values, got NaN or infinity")
    return w, tokens


def as_layers(attentions: Any, tokens: Any) -> tuple[np.ndarray, list[str]]:
    """Check ``attentions`` and its ``k_len`` tokens.

    Returns ``(one (layers, heads, q_len, k_len) float64 array, tokens as a
    list of str)``. Each layer may be ``(heads, q_len, k_len)`` or
    ``(1, heads, q_len, k_len)``; all layers must have the same shape,
    ``k_len == len(tokens)``, ``q_len <= k_len``, and the values must be finite
    weights in ``[0, 1]`` (clipped to exactly [0, 1] after a small
    low-precision overshoot).
    """
    tokens = as_tokens(tokens)
    if isinstance(attentions, np.ndarray) or hasattr(attentions, "detach"):
        arr = to_numpy(attentions, "attentions")
        if arr.ndim not in (4, 5):
            raise ValueError(
                "attentions: expected a sequence (one per layer) of (heads, q_len, k_len) "
                f"arrays, got a single array of shape {tuple(arr.shape)}"
            )
        attentions = list(arr)
    try:
        layers = list(attentions)
    except TypeError:
        raise TypeError(
            "attentions: expected a sequence (one per layer) of (heads, q_len, k_len) "
            f"tensors or arrays, got {type(attentions).__name__}"
        ) from None
    if not layers:
        raise ValueError("attentions: expected at least one layer, got an empty sequence")
    arrays = []
    for i, layer in enumerate(layers):
        a = to_numpy(layer, f"attentions[{i}]")
        if a.ndim == 4:
            if a.shape[0] != 1:
                raise ValueError(
                    f"attentions[{i}]: expected batch size 1 for a 4-D "
                    f"(batch, heads, q_len, k_len) array, got shape {tuple(a.shape)}; "
                    "select one sequence first, e.g. attn[0]"
                )
            a = a[0]
        if a.ndim != 3:
            raise ValueError(
                f"attentions[{i}]: expected shape (heads, q_len, k_len), "
                f"got shape {tuple(a.shape)}"
            )
        if 0 in a.shape:
            raise ValueError(f"attentions[{i}]: expected a non-empty array, got shape {a.shape}")
        if arrays and a.shape != arrays[0].shape:
            raise ValueError(
                f"attentions[{i}]: expected the same shape as layer 0 "
                f"{tuple(arrays[0].shape)}, got {tuple(a.shape)}"
            )
        arrays.append(a)
    stacked = np.stack(arrays)
    _, _, q_len, k_len = stacked.shape
    if len(tokens) != k_len:
        raise ValueError(
            f"tokens: expected {k_len} tokens (the key length of attentions), got {len(tokens)}"
        )
    if q_len > k_len:
        raise ValueError(
            f"attentions: expected q_len <= k_len (queries are the last tokens), "
            f"got q_len={q_len}, k_len={k_len}"
        )
    if not np.isfinite(stacked).all():
        raise ValueError("attentions: expected finite weights, got NaN or infinity")
    lo, hi = float(stacked.min()), float(stacked.max())
    if lo < -_WEIGHT_TOLERANCE or hi > 1 + _WEIGHT_TOLERANCE:
        raise ValueError(
            f"attentions: expected attention weights in [0, 1], got values in [{lo:.4g}, {hi:.4g}]"
        )
    return np.clip(stacked, 0.0, 1.0), tokens


def as_rollout(rollout: Any, tokens: Sequence[str], q_len: int, k_len: int) -> np.ndarray | None:
    """``rollout`` (a ``(q_len, k_len)`` matrix, :func:`attnlab.viz.rollout`) as a float
    array checked against the attention's shape; None stays None."""
    if rollout is None:
        return None
    flow = as_layers([to_numpy(rollout, "rollout")[None]], tokens)[0][0, 0]
    if flow.shape != (q_len, k_len):
        raise ValueError(f"rollout: expected shape ({q_len}, {k_len}), got {flow.shape}")
    return flow


def as_mask(mask: Any, n_layers: int, q_len: int, k_len: int) -> np.ndarray | None:
    """``mask`` (True = may attend: a ``(q_len, k_len)`` mask shared by every layer, or one
    per layer, ``(layers, q_len, k_len)``) as a bool ``(layers, q_len, k_len)`` array;
    None stays None. The pictures draw the cells it forbids grey, not as a weight of 0."""
    if mask is None:
        return None
    if hasattr(mask, "detach") and type(mask).__module__.startswith("torch"):
        mask = mask.detach().cpu().numpy()
    m = np.asarray(mask)
    if m.dtype != np.bool_:
        raise TypeError(f"mask: expected a boolean array (True = may attend), got dtype {m.dtype}")
    if m.ndim == 2:
        m = m[None]
    if m.ndim != 3 or m.shape[1:] != (q_len, k_len) or m.shape[0] not in (1, n_layers):
        raise ValueError(f"mask: expected shape ({q_len}, {k_len}) or ({n_layers}, {q_len}, "
                         f"{k_len}) (True = may attend), got {tuple(np.shape(mask))}")
    return np.broadcast_to(m, (n_layers, q_len, k_len))


def as_labels(labels: Any, n_layers: int, n_heads: int) -> list[list[str]] | None:
    """``labels`` (one string per head, ``layers x heads`` nested sequences: what
    :func:`attnlab.heads.head_labels` returns) checked against the weights' shape; None
    stays None."""
    if labels is None:
        return None
    try:
        rows = [[str(x) for x in row] for row in labels if not isinstance(row, str)]
    except TypeError:
        rows = []
    if len(rows) != n_layers or any(len(r) != n_heads for r in rows):
        raise ValueError(f"labels: expected {n_layers} rows (layers) of {n_heads} strings "
                         f"(heads), got {labels!r:.120}")
    return rows
