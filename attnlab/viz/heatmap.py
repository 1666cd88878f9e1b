"""Attention heatmaps as matplotlib figures and PNG files.

matplotlib is imported lazily, inside the functions, and only through the
object-oriented API with the Agg canvas, so nothing here ever needs a display.
torch is never imported: tensors are recognised by duck typing.
"""

from __future__ import annotations

import io
import math
import os
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..io import atomic_write_bytes
from .data import as_layers, as_matrix

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["heatmap", "heatmap_grid", "save_heatmaps"]

_CMAP = "viridis"


# --------------------------------------------------------------------------- layout helpers


def _label_fontsize(n: int, span_inches: float) -> float:
    """Tick label size in points for ``n`` labels along ``span_inches``: 4 to 10 pt."""
    per_label_pt = span_inches * 72.0 / max(n, 1)
    return float(np.clip(0.75 * per_label_pt, 4.0, 10.0))


def _label_extent(tokens: Sequence[str], fontsize: float) -> float:
    """Roughly how many inches the longest tick label takes along its length."""
    longest = max((len(t) for t in tokens), default=1)
    return min(longest, 24) * fontsize * 0.62 / 72.0 + 0.1


def _label_step(n: int) -> int:
    """Label every token up to 128 of them, then every k-th so labels never overlap."""
    return max(1, math.ceil(n / 128))


def _new_figure(width: float, height: float, dpi: float = 100.0,
                layout: str | None = None) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def _set_token_ticks(ax: Axes, x_tokens: Sequence[str], y_tokens: Sequence[str],
                     fontsize: float) -> None:
    for tokens, set_ticks, set_labels, rotation in (
        (x_tokens, ax.set_xticks, ax.set_xticklabels, 90),
        (y_tokens, ax.set_yticks, ax.set_yticklabels, 0),
    ):
        step = _label_step(len(tokens))
        idx = list(range(0, len(tokens), step))
        set_ticks(idx)
        # parse_math=False: a token such as "$x$" is text, not TeX.
        set_labels([tokens[i] for i in idx], fontsize=fontsize, rotation=rotation,
                   parse_math=False)
    ax.tick_params(length=2, pad=1.5)


# --------------------------------------------------------------------------- public API


def heatmap(weights: Any, tokens: Sequence[str], ax: Axes | None = None) -> Figure:
    """Draw one attention matrix with tokens on both axes and a colour bar.

    Args:
        weights: a ``(q_len, k_len)`` torch tensor or NumPy array (row i: how
            query i spreads its attention over the keys).
        tokens: ``k_len`` token strings. Keys (x axis) are all of them; queries
            (y axis) are the last ``q_len`` of them, which is what a decode
            step with a KV cache produces.
        ax: draw into this Axes; by default a new Figure sized for the token count.

    Returns:
        The ``matplotlib.figure.Figure`` holding the heatmap.

    Raises:
        ValueError: ``weights`` is not 2-D, has ``q_len > k_len``, holds non-finite
            values, or ``len(tokens) != k_len``.
    """
    w, tokens = as_matrix(weights, tokens)
    q_len, k_len = w.shape

    span = float(np.clip(2.0 + 0.12 * k_len, 4.0, 17.0))  # inches for the matrix itself
    fontsize = _label_fontsize(k_len, span)
    if ax is None:
        labels = _label_extent(tokens, fontsize) + 0.5
        height = span * max(q_len / k_len, 0.1) + labels + 0.4
        fig = _new_figure(span + labels + 1.3, height, layout="constrained")
        ax = fig.add_subplot()
    fig = ax.figure
    vmax = float(w.max())
    image = ax.imshow(w, cmap=_CMAP, vmin=min(0.0, float(w.min())), vmax=vmax if vmax > 0 else 1.0,
                      interpolation="nearest", aspect="equal")
    _set_token_ticks(ax, tokens, tokens[k_len - q_len:], fontsize)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.03, label="attention weight")
    return fig


def heatmap_grid(tokens: Sequence[str], attentions: Any) -> Figure:
    """A Figure with one heatmap per layer (rows) and head (columns), sharing one colour bar.

    ``attentions`` is a sequence, one per layer, of ``(heads, q_len, k_len)``
    (or ``(1, heads, q_len, k_len)``) tensors or arrays of weights in [0, 1].
    Every cell shares the 0..1 colour scale so heads can be compared. Token
    tick labels appear on the left column and bottom row when there is room.
    The figure holds ``layers * heads`` heatmap Axes plus the colour bar.
    """
    data, tokens = as_layers(attentions, tokens)
    n_layers, n_heads, q_len, k_len = data.shape

    cell = float(np.clip(1.0 + 0.022 * k_len, 1.6, 4.0))
    cell = min(cell, 40.0 / n_heads, 40.0 / n_layers)  # keep huge grids within ~40 inches
    fontsize = min(9.0, 0.8 * cell * 72.0 / k_len)
    show_labels = fontsize >= 4.0  # "only where readable"
    extent = _label_extent(tokens, fontsize) if show_labels else 0.0
    margin_l = 0.85 + extent
    margin_b = 0.2 + extent
    margin_t, margin_r, gap = 0.45, 1.1, 0.12
    width = margin_l + n_heads * cell + (n_heads - 1) * gap + margin_r
    row_h = max(cell * q_len / k_len, 0.3)
    rows = n_layers * row_h
    height = margin_b + rows + (n_layers - 1) * gap + margin_t
    fig = _new_figure(width, height)
    fig.subplots_adjust(left=margin_l / width, right=1 - margin_r / width,
                        bottom=margin_b / height, top=1 - margin_t / height,
                        wspace=gap / cell, hspace=gap / row_h)
    axes = fig.subplots(n_layers, n_heads, squeeze=False)
    image = None
    for i in range(n_layers):
        for j in range(n_heads):
            ax = axes[i][j]
            image = ax.imshow(data[i, j], cmap=_CMAP, vmin=0.0, vmax=1.0,
                              interpolation="nearest", aspect="auto")
            left, bottom = j == 0, i == n_layers - 1
            if show_labels and (left or bottom):
                _set_token_ticks(ax, tokens, tokens[k_len - q_len:], fontsize)
                if not left:
                    ax.set_yticks([])
                if not bottom:
                    ax.set_xticks([])
            else:
                ax.set_xticks([])
                ax.set_yticks([])
            if i == 0:
                ax.set_title(f"head {j}", fontsize=10)
            if left:
                # horizontal, so short rows (decode steps) never overlap their labels
                ax.set_ylabel(f"layer {i}", fontsize=10, rotation=0, ha="right", va="center",
                              labelpad=6)
    cax = fig.add_axes((1 - (margin_r - 0.25) / width, margin_b / height,
                        0.15 / width, 1 - (margin_b + margin_t) / height), label="<colorbar>")
    fig.colorbar(image, cax=cax, label="attention weight")
    return fig


def png_bytes(fig: Figure, **savefig_kw: Any) -> bytes:
    """``fig`` rendered as PNG bytes, in memory, so the file is then written in one
    atomic step (:func:`attnlab.io.atomic_write_bytes`)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", **savefig_kw)
    return buf.getvalue()


def save_heatmaps(path: str | os.PathLike[str], tokens: Sequence[str],
                  attentions: Any) -> pathlib.Path:
    """Write a layers x heads grid of heatmaps (see :func:`heatmap_grid`) as one PNG.

    The file is written atomically (:func:`attnlab.io.atomic_write_bytes`: temp
    file, fsync, rename, directory fsync). Parent directories are created.
    Returns the path written.
    """
    path = pathlib.Path(path)
    fig = heatmap_grid(tokens, attentions)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, png_bytes(fig, dpi=fig.dpi))
    return path
