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
import unicodedata
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..io import atomic_write_bytes
from ..io.outdir import figure_metadata
from .data import as_labels, as_layers, as_mask, as_matrix, as_rollout
from .fonts import font_context

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["heatmap", "heatmap_grid", "save_heatmaps", "figure_bytes", "FORMATS"]

_CMAP = "viridis"


# --------------------------------------------------------------------------- layout helpers


def _label_fontsize(n: int, span_inches: float) -> float:
    """Tick label size in points for ``n`` labels along ``span_inches``: 4 to 10 pt."""
    per_label_pt = span_inches * 72.0 / max(n, 1)
    return float(np.clip(0.75 * per_label_pt, 4.0, 10.0))


def _label_extent(tokens: Sequence[str], fontsize: float) -> float:
    """Roughly how many inches the longest tick label takes along its length."""
    longest = max((_text_width(_fit_label(t)) for t in tokens), default=1.0)
    return longest * fontsize * 0.62 / 72.0 + 0.1


def _text_width(text: str) -> float:
    """Width of ``text`` in average Latin characters: CJK and emoji are full width (~1.6)."""
    return sum(1.6 if unicodedata.east_asian_width(c) in "WF" else 1.0 for c in text)


# Longest tick label, in average Latin characters (a CJK character counts 1.6): a
# longer token is cut with an ellipsis, so every label fits the figure.
_MAX_LABEL = 20.0


def _fit_label(text: str, limit: float = _MAX_LABEL) -> str:
    """``text``, or its start and "…" when it is wider than ``limit``."""
    if _text_width(text) <= limit:
        return text
    out, width = "", 1.0  # room for the ellipsis
    for c in text:
        width += _text_width(c)
        if width > limit:
            break
        out += c
    return out + "\u2026"


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
        if max((_text_width(tokens[i]) for i in idx), default=0.0) <= 2.0:
            rotation = 0  # one CJK character or two Latin ones: upright, as it is read
        # parse_math=False: a token such as "$x$" is text, not TeX.
        set_labels([_fit_label(tokens[i]) for i in idx], fontsize=fontsize, rotation=rotation,
                   parse_math=False)
    ax.tick_params(length=2, pad=1.5)


# --------------------------------------------------------------------------- public API


def heatmap(weights: Any, tokens: Sequence[str], ax: Axes | None = None, *,
            mask: Any = None) -> Figure:
    """Draw one attention matrix with tokens on both axes and a colour bar.

    Args:
        weights: a ``(q_len, k_len)`` torch tensor or NumPy array (row i: how
            query i spreads its attention over the keys).
        tokens: ``k_len`` token strings. Keys (x axis) are all of them; queries
            (y axis) are the last ``q_len`` of them, which is what a decode
            step with a KV cache produces. A label wider than 20 characters is cut
            with "…" so that it fits.
        ax: draw into this Axes; by default a new Figure sized for the token count.
        mask: optional ``(q_len, k_len)`` bool, True = may attend: the cells it
            forbids (future tokens of a causal model) are drawn grey, as
            circuitsvis does, not as a weight of 0.

    Returns:
        The ``matplotlib.figure.Figure`` holding the heatmap.

    Raises:
        ValueError: ``weights`` is not 2-D, has ``q_len > k_len``, holds non-finite
            values, or ``len(tokens) != k_len``.
    """
    w, tokens = as_matrix(weights, tokens)
    allowed = as_mask(mask, 1, *w.shape)
    with font_context(tokens):  # CJK and emoji labels need fonts beyond DejaVu Sans
        return _heatmap(w, tokens, ax, None if allowed is None else allowed[0])


# Masked cells: grey, as circuitsvis draws them; never the colour of a weight of 0.
MASKED_COLOUR = "#c8c8c8"


def _image(ax: Axes, w: np.ndarray, allowed: np.ndarray | None, **kw: Any):
    import matplotlib

    if allowed is None or allowed.all():
        return ax.imshow(w, cmap=_CMAP, **kw)
    cmap = matplotlib.colormaps[_CMAP].with_extremes(bad=MASKED_COLOUR)
    return ax.imshow(np.ma.masked_array(w, mask=~allowed), cmap=cmap, **kw)


def _bar_label(masked: bool) -> str:
    return "attention weight (grey: masked)" if masked else "attention weight"


def _heatmap(w: np.ndarray, tokens: list[str], ax: Axes | None,
             allowed: np.ndarray | None) -> Figure:
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
    image = _image(ax, w, allowed, vmin=min(0.0, float(w.min())),
                   vmax=vmax if vmax > 0 else 1.0, interpolation="nearest", aspect="equal")
    _set_token_ticks(ax, tokens, tokens[k_len - q_len:], fontsize)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.03,
                 label=_bar_label(allowed is not None and not allowed.all()))
    return fig


def heatmap_grid(tokens: Sequence[str], attentions: Any, *,
                 layer_ids: Sequence[int] | None = None,
                 head_ids: Sequence[int] | None = None,
                 mask: Any = None, rollout: Any = None, labels: Any = None) -> Figure:
    """A Figure with one heatmap per layer (rows) and head (columns), sharing one colour bar.

    ``attentions`` is a sequence, one per layer, of ``(heads, q_len, k_len)``
    (or ``(1, heads, q_len, k_len)``) tensors or arrays of weights in [0, 1].
    Every cell shares the 0..1 colour scale so heads can be compared. Token
    tick labels appear on the left column and bottom row when there is room
    (cut with "…" beyond 20 characters), and the axes say which are the queries
    and which the keys. ``layer_ids``/``head_ids`` number the rows and columns
    when ``attentions`` holds a selection (layer 3 alone is "layer 3", not
    "layer 0"); by default 0, 1, ...

    ``mask`` (bool, True = may attend; ``(q_len, k_len)`` or one per layer) draws the
    cells it forbids grey. ``rollout``, a ``(q_len, k_len)`` matrix
    (:func:`attnlab.viz.rollout`), is drawn once, as one more row labelled
    "rollout" (with a mask, its cells that no token reaches, exactly 0, are grey).
    ``labels``, ``layers x heads`` strings (what :func:`attnlab.heads.head_labels` says
    each head does: "previous-token 0.81"), are written in a corner of each panel.
    The figure holds ``layers * heads`` heatmap Axes (plus one for the rollout)
    and the colour bar.
    """
    data, tokens = as_layers(attentions, tokens)
    n_layers, n_heads, q_len, k_len = data.shape
    layer_ids = _ids("layer_ids", layer_ids, n_layers)
    head_ids = _ids("head_ids", head_ids, n_heads)
    allowed = as_mask(mask, n_layers, q_len, k_len)
    flow = as_rollout(rollout, tokens, q_len, k_len)
    names = as_labels(labels, n_layers, n_heads)
    with font_context(tokens):  # CJK and emoji labels need fonts beyond DejaVu Sans
        fig = _grid(data, tokens, layer_ids, head_ids, allowed, flow)
    if names is not None:
        for ax, name in zip(fig.axes, (n for row in names for n in row)):
            ax.text(0.03, 0.97, name, transform=ax.transAxes, ha="left", va="top", fontsize=6,
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none",
                          "alpha": 0.8})
    return fig


def _ids(name: str, ids: Sequence[int] | None, n: int) -> list[int]:
    if ids is None:
        return list(range(n))
    ids = list(ids)
    if len(ids) != n:
        raise ValueError(f"{name}: expected {n} numbers (one per row or column), got {len(ids)}")
    return ids


# Smallest tick label, in points, a grid makes room for (up to 4-inch cells): CJK
# characters below ~7 pt turn into blots at 100 dpi.
_MIN_GRID_LABEL_PT = 7.0


def _grid(data: np.ndarray, tokens: list[str], layer_ids: list[int], head_ids: list[int],
          allowed: np.ndarray | None, flow: np.ndarray | None) -> Figure:
    n_layers, n_heads, q_len, k_len = data.shape
    rows_n = n_layers + (flow is not None)
    row_names = [f"layer {i}" for i in layer_ids] + (["rollout"] if flow is not None else [])

    cell = float(np.clip(1.0 + 0.022 * k_len, 1.6, 4.0))
    cell = max(cell, min(4.0, _MIN_GRID_LABEL_PT * k_len / (0.8 * 72.0)))
    cell = min(cell, 40.0 / n_heads, 40.0 / rows_n)  # keep huge grids within ~40 inches
    fontsize = min(9.0, 0.8 * cell * 72.0 / k_len)
    show_labels = fontsize >= 4.0  # "only where readable"
    extent = _label_extent(tokens, fontsize) if show_labels else 0.0
    margins = {"left": 0.85 + extent, "bottom": 0.45 + extent, "top": 0.45, "right": 1.1}
    gap = 0.12
    row_h = max(cell * q_len / k_len, 0.3)
    width = margins["left"] + n_heads * cell + (n_heads - 1) * gap + margins["right"]
    height = margins["bottom"] + rows_n * row_h + (rows_n - 1) * gap + margins["top"]
    fig = _new_figure(width, height)
    axes = fig.subplots(rows_n, n_heads, squeeze=False)
    fig.subplots_adjust(wspace=gap / cell, hspace=gap / row_h)
    image = None
    masked = False
    for i in range(rows_n):
        for j in range(n_heads):
            ax = axes[i][j]
            if i == n_layers:  # the rollout: one matrix, drawn once
                if j > 0:
                    ax.set_axis_off()
                    continue
                cells = None if allowed is None else flow > 0
                ax.imshow(np.ma.masked_array(flow, mask=~cells) if cells is not None else flow,
                          cmap=_cmap(cells), vmin=0.0, vmax=1.0, interpolation="nearest",
                          aspect="auto")
                masked |= cells is not None and not cells.all()
            else:
                cells = None if allowed is None else allowed[i]
                image = _image(ax, data[i, j], cells, vmin=0.0, vmax=1.0,
                               interpolation="nearest", aspect="auto")
                masked |= cells is not None and not cells.all()
            left, bottom = j == 0, i == rows_n - 1 or (i == n_layers - 1 and j > 0)
            if show_labels and (left or bottom):
                _set_token_ticks(ax, tokens, tokens[k_len - q_len:], fontsize)
                if not left:
                    ax.set_yticks([])
                if not bottom:
                    ax.set_xticks([])
                else:
                    ax.set_xlabel("key", fontsize=9)
            else:
                ax.set_xticks([])
                ax.set_yticks([])
            if i == 0:
                ax.set_title(f"head {head_ids[j]}", fontsize=10)
            if left:
                # horizontal, so short rows (decode steps) never overlap their labels
                ax.set_ylabel(row_names[i], fontsize=10, rotation=0, ha="right",
                              va="center", labelpad=6)
    # which axis holds what: above the query labels, level with the head titles
    axes[0][0].annotate("query \u2193", xy=(0, 1), xycoords="axes fraction",
                        xytext=(-4, 4 if show_labels else 14), textcoords="offset points",
                        ha="right", va="bottom", fontsize=9, color="#444444")
    cax = fig.add_axes((0, 0, 1, 1), label="<colorbar>")
    fig.colorbar(image, cax=cax, label=_bar_label(masked))
    _fit(fig, axes, cax, margins, width, height)
    return fig


def _cmap(cells: np.ndarray | None):
    import matplotlib

    return matplotlib.colormaps[_CMAP].with_extremes(bad=MASKED_COLOUR) if cells is not None \
        else _CMAP


def _place(fig: Figure, cax: Axes, margins: dict, width: float, height: float) -> None:
    fig.set_size_inches(width, height)
    fig.subplots_adjust(left=margins["left"] / width, right=1 - margins["right"] / width,
                        bottom=margins["bottom"] / height, top=1 - margins["top"] / height)
    cax.set_position((1 - (margins["right"] - 0.25) / width, margins["bottom"] / height,
                      0.15 / width, 1 - (margins["bottom"] + margins["top"]) / height))


def _fit(fig: Figure, axes, cax: Axes, margins: dict, width: float, height: float) -> None:
    """Place the grid, then grow the margins by whatever text still falls outside the
    figure (long labels, the layer names), so nothing is clipped."""
    _place(fig, cax, margins, width, height)
    box = fig.get_tightbbox(fig.canvas.get_renderer())  # inches
    pad = 0.08
    grow = {"left": max(0.0, pad - box.x0), "bottom": max(0.0, pad - box.y0),
            "right": max(0.0, box.x1 - width + pad), "top": max(0.0, box.y1 - height + pad)}
    if any(v > 0 for v in grow.values()):
        margins = {k: margins[k] + grow[k] for k in margins}
        _place(fig, cax, margins, width + grow["left"] + grow["right"],
               height + grow["bottom"] + grow["top"])


#: The picture formats every writer of a figure takes (``--format``).
FORMATS = ("png", "svg")


def figure_bytes(fig: Figure, fmt: str = "png", **savefig_kw: Any) -> bytes:
    """``fig`` rendered as PNG or SVG (``fmt``, one of :data:`FORMATS`) bytes, in memory,
    so the file is then written in one atomic step (:func:`attnlab.io.atomic_write_bytes`).
    An SVG draws its text as paths: it shows the same glyphs wherever it is opened. The
    picture is signed as attnlab's (:func:`attnlab.io.outdir.figure_metadata`), so that a
    later run may replace it and no other file."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt (--format) must be one of {', '.join(FORMATS)}, got {fmt!r}")
    buf = io.BytesIO()
    from matplotlib.text import Text

    texts = [t.get_text() for t in fig.findobj(Text)]
    with font_context(texts):  # glyph warnings for what the hint already named stay quiet
        fig.savefig(buf, format=fmt, **{"metadata": figure_metadata(fmt), **savefig_kw})
    return buf.getvalue()


def png_bytes(fig: Figure, **savefig_kw: Any) -> bytes:
    """``fig`` rendered as PNG bytes (:func:`figure_bytes`)."""
    return figure_bytes(fig, "png", **savefig_kw)


def save_heatmaps(path: str | os.PathLike[str], tokens: Sequence[str],
                  attentions: Any, *, layer_ids: Sequence[int] | None = None,
                  head_ids: Sequence[int] | None = None, mask: Any = None,
                  rollout: Any = None, labels: Any = None, fmt: str = "png") -> pathlib.Path:
    """Write a layers x heads grid of heatmaps (see :func:`heatmap_grid`) as one PNG (or
    SVG: ``fmt="svg"``).

    The file is written atomically (:func:`attnlab.io.atomic_write_bytes`: temp
    file, fsync, rename, directory fsync). Parent directories are created.
    ``layer_ids``/``head_ids``/``mask``/``rollout`` as in :func:`heatmap_grid`.
    Returns the path written.
    """
    path = pathlib.Path(path)
    fig = heatmap_grid(tokens, attentions, layer_ids=layer_ids, head_ids=head_ids, mask=mask,
                       rollout=rollout, labels=labels)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, figure_bytes(fig, fmt, dpi=fig.dpi))
    return path
