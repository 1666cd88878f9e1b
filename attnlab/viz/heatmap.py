"""Attention heatmaps as matplotlib figures and PNG files.

matplotlib is imported lazily, inside the functions, and only through the
object-oriented API with the Agg canvas, so nothing here ever needs a display.
torch is never imported: tensors are recognised by duck typing.
"""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import secrets
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["heatmap", "heatmap_grid", "save_heatmaps"]

_CMAP = "viridis"
# Attention weights may overshoot [0, 1] a little in low precision; more is a caller error.
_WEIGHT_TOLERANCE = 1e-2


# --------------------------------------------------------------------------- input checking


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


def as_layers(attentions: Any, tokens: Sequence[str]) -> np.ndarray:
    """Check ``attentions`` and stack it as one ``(layers, heads, q_len, k_len)`` array.

    Each layer may be ``(heads, q_len, k_len)`` or ``(1, heads, q_len, k_len)``;
    all layers must have the same shape, ``k_len == len(tokens)``,
    ``q_len <= k_len``, and the values must be finite weights in ``[0, 1]``.
    """
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
    return np.clip(stacked, 0.0, 1.0)


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
    tokens = as_tokens(tokens)
    data = as_layers(attentions, tokens)
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


def save_heatmaps(path: str | os.PathLike[str], tokens: Sequence[str],
                  attentions: Any) -> pathlib.Path:
    """Write a layers x heads grid of heatmaps (see :func:`heatmap_grid`) as one PNG.

    The file is written atomically: a temporary file in the same directory,
    flushed to disk, then renamed over ``path``. Parent directories are created.
    Returns the path written.
    """
    path = pathlib.Path(path)
    fig = heatmap_grid(tokens, attentions)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=fig.dpi))
    return path


def atomic_write(path: pathlib.Path, write: Callable[[BinaryIO], object]) -> None:
    """Call ``write(binary_file)`` on a temp file next to ``path``, fsync, then rename.

    A reader never sees a half-written file: ``path`` is either the old file or the new one.
    """
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    # os.open with 0o666 lets the umask decide the permissions, as for an ordinary file.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
