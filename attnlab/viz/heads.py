"""Layers x heads pictures: the head-importance heatmap of ``attnlab ablate --heads`` (one
panel per way of knocking a head out, the colour the damage done) and the table of what
each head does (``attnlab heads``: the colour its kind, the shade its score)."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..io import atomic_write_bytes
from .data import to_numpy
from .heatmap import figure_bytes, png_bytes

__all__ = ["head_importance_figure", "save_head_importance", "head_kinds_figure",
           "save_head_kinds", "KIND_COLOURS"]


def head_importance_figure(tables: Mapping[str, Any], *, measure: str = "loss"):
    """A Figure with one ``layers x heads`` heatmap per entry of ``tables`` (title ->
    ``(layers, heads)`` values, e.g. ``{"zeroed": ..., "uniform": ...}``), each cell
    annotated with its value; red = the measure rises when that head is knocked out."""
    panels = {title: to_numpy(values, title) for title, values in tables.items()}
    if not panels:
        raise ValueError("tables: expected at least one (layers, heads) table")
    for title, values in panels.items():
        if values.ndim != 2 or 0 in values.shape:
            raise ValueError(f"{title}: expected a (layers, heads) table, got {values.shape}")
    n_layers, n_heads = next(iter(panels.values())).shape
    cell = 0.55
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(len(panels) * (n_heads * cell + 1.6) + 0.4, n_layers * cell + 1.4),
                 layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, values) in zip(axes, panels.items()):
        lim = max(float(np.abs(values).max()), 1e-12)
        image = ax.imshow(values, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(values.shape[1]))
        ax.set_yticks(range(values.shape[0]))
        if values.size <= 400:
            for (i, j), v in np.ndenumerate(values):
                ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=6)
        fig.colorbar(image, ax=ax, label=f"{measure} increase", shrink=0.9)
    return fig


def save_head_importance(path: str | os.PathLike[str], tables: Mapping[str, Any], *,
                         measure: str = "loss") -> pathlib.Path:
    """Write :func:`head_importance_figure` as a PNG, atomically; returns the path."""
    path = pathlib.Path(path)
    fig = head_importance_figure(tables, measure=measure)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, png_bytes(fig))
    return path


# One colour per kind of head (attnlab.heads.KINDS), grey for "other".
KIND_COLOURS = {"previous-token": "#1f77b4", "induction": "#d62728", "sink": "#7f7f7f",
                "self": "#2ca02c", "duplicate-token": "#9467bd", "other": "#ffffff"}


def head_kinds_figure(kinds: Sequence[Sequence[str]], scores: Any, *,
                      title: str | None = None):
    """A Figure of the ``layers x heads`` table of :func:`attnlab.heads.classify`: each
    cell coloured by its head's kind (:data:`KIND_COLOURS`), paler the lower its score,
    and written out ("prev 0.98") where the grid leaves room; a legend names the kinds."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import to_rgb
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    values = to_numpy(scores, "scores")
    kinds = [[str(k) for k in row] for row in kinds]
    if values.ndim != 2 or 0 in values.shape or [len(r) for r in kinds] != [values.shape[1]] * \
            values.shape[0]:
        raise ValueError(f"kinds and scores: expected the same (layers, heads) table, got "
                         f"{[len(r) for r in kinds]} kinds per layer and scores "
                         f"{values.shape}")
    unknown = sorted({k for row in kinds for k in row} - set(KIND_COLOURS))
    if unknown:
        raise ValueError(f"kinds: expected names among {sorted(KIND_COLOURS)}, got {unknown}")
    n_layers, n_heads = values.shape
    rgb = np.ones((n_layers, n_heads, 3))
    for (i, j), v in np.ndenumerate(values):
        strength = float(np.clip(v, 0.0, 1.0)) if kinds[i][j] != "other" else 0.0
        rgb[i, j] = 1 - (0.25 + 0.75 * strength) * (1 - np.array(to_rgb(KIND_COLOURS[kinds[i][j]])))
    cell = float(np.clip(12.0 / max(n_heads, 1), 0.35, 1.1))
    fig = Figure(figsize=(n_heads * cell + 2.8, n_layers * cell * 0.55 + 1.6),
                 layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.imshow(rgb, aspect="auto", interpolation="nearest")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(n_layers))
    ax.tick_params(labelsize=8 if max(n_heads, n_layers) <= 16 else 6)
    if values.size <= 600:
        short = {"previous-token": "prev", "induction": "ind", "sink": "sink", "self": "self",
                 "duplicate-token": "dup", "other": ""}
        for (i, j), v in np.ndenumerate(values):
            dark = float(rgb[i, j] @ np.array([0.299, 0.587, 0.114])) < 0.5
            ax.text(j, i, f"{short[kinds[i][j]]}\n{v:.2f}" if short[kinds[i][j]] else f"{v:.2f}",
                    ha="center", va="center", fontsize=6 if cell < 0.8 else 7,
                    color="white" if dark else "black")
    present = [k for k in KIND_COLOURS if any(k in row for row in kinds)]
    ax.legend(handles=[Patch(facecolor=KIND_COLOURS[k], edgecolor="#999999", label=k)
                       for k in present], loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize=8, frameon=False)
    ax.set_title(title or "what each head does (darker: stronger)", fontsize=10)
    return fig


def save_head_kinds(path: str | os.PathLike[str], kinds: Sequence[Sequence[str]],
                    scores: Any, *, title: str | None = None,
                    fmt: str = "png") -> pathlib.Path:
    """Write :func:`head_kinds_figure` as a PNG or SVG (``fmt``), atomically; returns the
    path."""
    path = pathlib.Path(path)
    fig = head_kinds_figure(kinds, scores, title=title)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, figure_bytes(fig, fmt))
    return path
