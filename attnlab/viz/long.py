"""Long inputs: what a page and a picture hold when the full weights would not fit.

Every layer x head's whole ``(T, T)`` weights fit an explorer page up to
:data:`DENSE_MAX_WEIGHTS` bytes (one byte each, 8 MB as base64). Beyond that (about 600
tokens for 2 layers of 4 heads, 150 for SmolLM2's 30 x 9) the page holds, for every query
row of every head, its ``k`` strongest keys (:class:`TopKeys`): the key's position (two
bytes) and its weight (one byte, 1/255 steps). ``k`` is as large as
:data:`TOPK_BUDGET` bytes allow, up to :data:`MAX_TOPK`; when even :data:`MIN_TOPK` keys
per row would not fit, only the first layers that do are kept (``--layer`` picks another).
What was left out, and how much weight the kept keys hold, is written in the page.

No ``(T, T)`` matrix is held in Python either: the rows come from each attention module's
``attention_rows`` (:func:`attnlab.attention` with ``return_weights=rows``), a block of
:data:`ROW_BLOCK` rows at a time, from the queries and keys recorded during one forward
pass, and only each row's top ``k`` are kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["TopKeys", "DENSE_MAX_WEIGHTS", "TOPK_BUDGET", "MAX_TOPK", "MIN_TOPK",
           "MAX_TOKENS", "is_long", "top_keys", "pooled"]

DENSE_MAX_WEIGHTS = 6_000_000  # layers * heads * q_len * k_len bytes a page holds whole
TOPK_BUDGET = 6_000_000  # bytes of kept keys a long page holds (3 per key)
MAX_TOPK, MIN_TOPK = 16, 2
MAX_TOKENS = 4096  # the browser paints T x T pixels of the selected head (64 MB at 4096)
ROW_BLOCK = 256


@dataclass(frozen=True)
class TopKeys:
    """The ``k`` strongest keys of every query row of each kept ``(layer, head)``.

    Attributes:
        index: ``(layers, heads, q_len, k)`` key positions, strongest first.
        weight: ``(layers, heads, q_len, k)`` their weights in [0, 1].
        k_len: the number of keys (tokens).
        layer_ids: the model's numbers of the kept layers.
        n_layers: how many layers the model has.
        rules: per kept layer ``(causal, window)``: which keys a query could see.
        kept: ``(layers, heads)`` the mean over the rows of the weight their keys hold.
    """

    index: np.ndarray
    weight: np.ndarray
    k_len: int
    layer_ids: tuple[int, ...]
    n_layers: int
    rules: tuple[tuple[bool, int | None], ...]
    kept: np.ndarray

    @property
    def k(self) -> int:
        return int(self.index.shape[-1])

    def note(self) -> str:
        """What the page leaves out, in one sentence or two."""
        n_l, n_h, q_len, _ = self.index.shape
        low = np.unravel_index(int(np.argmin(self.kept)), self.kept.shape)
        text = (f"each of the {q_len:,} query rows keeps its {self.k} strongest keys (of up to "
                f"{self.k_len:,}), weights in steps of 1/255; they hold "
                f"{100 * float(self.kept.mean()):.0f}% of a row's weight on average (least: "
                f"layer {self.layer_ids[low[0]]} head {low[1]}, "
                f"{100 * float(self.kept[low]):.0f}%); the rest of each row is left out")
        if n_l < self.n_layers:
            text += (f"; {n_l} of the model's {self.n_layers} layers are kept "
                     f"({_ranges(self.layer_ids)}): attnlab show --layer N holds another")
        return text


def _ranges(ids: Sequence[int]) -> str:
    ids = list(ids)
    return f"{ids[0]}-{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 1 \
        else ", ".join(map(str, ids))


def is_long(n_layers: int, n_heads: int, seq: int) -> bool:
    """True when the weights of every layer x head over ``seq`` tokens exceed
    :data:`DENSE_MAX_WEIGHTS` (the page then holds :class:`TopKeys`)."""
    return n_layers * n_heads * seq * seq > DENSE_MAX_WEIGHTS


def plan(n_heads: int, seq: int, layers: Sequence[int]) -> tuple[int, list[int]]:
    """``(k, kept layers)`` for a page of ``layers`` within :data:`TOPK_BUDGET`."""
    per_key = 3 * n_heads * seq  # bytes of one key per row, for one layer
    k = min(MAX_TOPK, seq, TOPK_BUDGET // (per_key * len(layers)))
    if k >= MIN_TOPK or k == seq:
        return max(k, 1), list(layers)
    fit = max(1, TOPK_BUDGET // (per_key * MIN_TOPK))
    return min(MIN_TOPK, seq), list(layers)[:fit]


def top_keys(record: list, seq: int, layers: Sequence[int] | None = None) -> TopKeys:
    """:class:`TopKeys` of one forward pass.

    Args:
        record: per layer ``(module, q, k, v)``, ``(heads, seq, head_dim)`` each, as
            :func:`attnlab.viz.capture.run` records them; every module must offer
            ``attention_rows`` (:class:`attnlab.modules.MultiHeadAttention` does).
        seq: the number of tokens.
        layers: the layers to keep (default all), fewer when they do not fit.
    """
    import torch

    from .capture import rule_of

    if seq > MAX_TOKENS:
        raise ValueError(f"text is {seq:,} tokens; the explorer holds up to {MAX_TOKENS:,}")
    wanted = list(range(len(record))) if layers is None else list(layers)
    n_heads = record[0][1].shape[0]
    k, kept_layers = plan(n_heads, seq, wanted)
    index = np.zeros((len(kept_layers), n_heads, seq, k), np.uint16)
    weight = np.zeros((len(kept_layers), n_heads, seq, k), np.float32)
    for n, layer in enumerate(kept_layers):
        module, q, keys, v = record[layer]
        for start in range(0, seq, ROW_BLOCK):
            stop = min(seq, start + ROW_BLOCK)
            with torch.no_grad():  # (a learned sink would make the weights need grad)
                w = module.attention_rows(q[None], keys[None], v[None],
                                          range(start, stop))[0]
            top = torch.topk(w.float(), k, dim=-1)  # of (H, rows, seq): no more is kept
            index[n, :, start:stop] = top.indices.numpy().astype(np.uint16)
            weight[n, :, start:stop] = top.values.numpy()
    return TopKeys(index=index, weight=weight, k_len=seq, layer_ids=tuple(kept_layers),
                   n_layers=len(record), rules=tuple(rule_of(record[i][0]) for i in kept_layers),
                   kept=weight.astype(np.float64).sum(-1).mean(-1))


def _allowed_blocks(rule: tuple[bool, int | None], seq: int, size: int) -> np.ndarray:
    """``(size, size)`` bool: a block of the pooled picture holds at least one key its
    queries may see (the same rule as :mod:`attnlab.masks`, per block of positions)."""
    causal, window = rule
    edges = np.linspace(0, seq, size + 1).astype(int)
    first, last = edges[:-1], edges[1:] - 1  # positions each block covers
    q0, q1 = first[:, None], last[:, None]
    k0, k1 = first[None, :], last[None, :]
    ok = np.ones((size, size), bool)
    if causal:
        ok &= k0 <= q1
    if window is not None:
        ok &= k1 > q0 - window
        if not causal:
            ok &= k0 < q1 + window
    return ok


def pooled(top: TopKeys, size: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """``(weights, allowed)``: each head's kept weights max-pooled onto a ``(size, size)``
    grid (a pixel is the strongest kept weight in its block of about ``seq / size``
    positions squared), ``(layers, heads, size, size)``, and ``(layers, size, size)``
    bool: the blocks a query could see anything in."""
    seq = top.k_len
    size = min(size, seq)
    n_l, n_h, q_len, k = top.index.shape
    rows = np.minimum(np.arange(q_len) * size // seq, size - 1)  # block of each query
    out = np.zeros((n_l, n_h, size, size))
    cols = np.minimum(top.index.astype(np.int64) * size // seq, size - 1)
    for layer in range(n_l):
        for head in range(n_h):
            np.maximum.at(out[layer, head], (np.repeat(rows, k), cols[layer, head].ravel()),
                          top.weight[layer, head].ravel())
    allowed = np.stack([_allowed_blocks(r, seq, size) for r in top.rules])
    return out, allowed


def long_figure(top: TopKeys, tokens: Sequence[str], *, heads: Sequence[int] | None = None,
                labels: Any = None):
    """The heatmap grid of a long input (:func:`attnlab.viz.heatmap_grid`) from the kept
    keys, max-pooled (:func:`pooled`), with a title that says so."""
    from .heatmap import heatmap_grid

    weights, allowed = pooled(top)
    size = weights.shape[-1]
    heads = list(range(weights.shape[1])) if heads is None else list(heads)
    starts = np.linspace(0, top.k_len, size + 1).astype(int)[:-1]
    names = None if labels is None else [[labels[i][h] for h in heads] for i in top.layer_ids]
    fig = heatmap_grid([tokens[s] for s in starts], weights[:, heads], layer_ids=top.layer_ids,
                       head_ids=heads, mask=allowed, labels=names)
    fig.suptitle(f"{top.k_len:,} tokens: each pixel is the strongest of the {top.k} kept keys "
                 f"per row in a block of ~{top.k_len / size:.0f}x{top.k_len / size:.0f} cells",
                 fontsize=9, y=0.999, va="top")
    return fig
