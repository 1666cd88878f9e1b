"""The head-importance heatmap of ``attnlab ablate --heads``: layers x heads, one panel
per way of knocking a head out, the colour the damage done."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..io import atomic_write_bytes
from .data import to_numpy
from .heatmap import png_bytes

__all__ = ["head_importance_figure", "save_head_importance"]


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
