"""Two inputs side by side: the same head on both, and their difference where the tokens
align (how tokens pair up when the texts differ, and the lengths with them: :mod:`.align`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .align import align_tokens, difference
from .data import as_layers

# Cells of the difference with no aligned partner: a lighter grey than masked cells.
NO_PARTNER_COLOUR = "#e8e8e8"

__all__ = ["align_tokens", "difference", "biggest_difference", "compare_figure",
           "Comparison", "compare"]


def biggest_difference(diff: np.ndarray) -> tuple[int, int]:
    """``(layer, head)`` whose aligned cells differ most (mean absolute difference)."""
    with np.errstate(all="ignore"):
        score = np.nan_to_num(np.nanmean(np.abs(diff), axis=(-2, -1)), nan=0.0)
    layer, head = np.unravel_index(int(np.argmax(score)), score.shape)
    return int(layer), int(head)


def _axis_labels(tokens_a: list[str], tokens_b: list[str], align: Sequence[int]) -> list[str]:
    """The first input's tokens, "cat→dog" where the partner reads otherwise."""
    return [t if p < 0 or tokens_b[p] == t else f"{t}\u2192{tokens_b[p]}"
            for t, p in zip(tokens_a, align)]


def compare_figure(tokens_a: Sequence[str], a: Any, tokens_b: Sequence[str], b: Any, *,
                   layer: int, head: int, titles: Sequence[str] = ("A", "B"),
                   mask_a: Any = None, mask_b: Any = None, label: str | None = None):
    """A Figure of one head on both inputs and their difference: three heatmaps, ``A``
    and ``B`` (viridis, each on its own tokens; ``mask_*``: True = may attend, the rest
    grey) and ``A - B`` on the first input's tokens (red: A attends more, blue: B does;
    light grey: no aligned partner, see the module docstring; grey: masked). ``label``
    (what the head does) goes in the title."""
    import matplotlib

    from .fonts import font_context
    from .heatmap import MASKED_COLOUR, _new_figure, _set_token_ticks, heatmap

    da, tokens_a = as_layers(a, tokens_a)
    db, tokens_b = as_layers(b, tokens_b)
    if da.shape[:2] != db.shape[:2]:
        raise ValueError(f"b: expected the same layers and heads as a {da.shape[:2]}, got "
                         f"{db.shape[:2]}")
    align = align_tokens(tokens_a, tokens_b)
    diff = difference(da, db, align)[layer, head]
    span = [float(np.clip(2.0 + 0.12 * len(t), 3.5, 9.0)) for t in (tokens_a, tokens_b, tokens_a)]
    # The figure and its axes are made inside the fonts' block: a text's fonts are fixed
    # when it is created, and the axes create their tick labels and titles then.
    with font_context([*tokens_a, *tokens_b, *titles, label or ""]):
        fig = _new_figure(sum(span) + 4.5, max(span) + 1.6, layout="constrained")
        axes = fig.subplots(1, 3, width_ratios=span)
        for ax, toks, w, m, name in ((axes[0], tokens_a, da, mask_a, titles[0]),
                                     (axes[1], tokens_b, db, mask_b, titles[1])):
            heatmap(w[layer, head], toks, ax=ax,
                    mask=None if m is None else np.asarray(m)[layer] if np.ndim(m) == 3 else m)
            ax.set_title(name, fontsize=10)
        lim = max(float(np.nanmax(np.abs(diff), initial=0.0)), 1e-6)
        ax = axes[2]
        cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad=NO_PARTNER_COLOUR)
        image = ax.imshow(np.ma.masked_invalid(diff), cmap=cmap, vmin=-lim, vmax=lim,
                          interpolation="nearest", aspect="equal")
        if mask_a is not None:  # the cells the first input's rule forbids: grey, as elsewhere
            hidden = ~(np.asarray(mask_a)[layer] if np.ndim(mask_a) == 3 else np.asarray(mask_a))
            grey = matplotlib.colors.ListedColormap([MASKED_COLOUR])
            ax.imshow(np.ma.masked_array(np.zeros(diff.shape), mask=~hidden), cmap=grey,
                      interpolation="nearest", aspect="equal")
        labels = _axis_labels(tokens_a, tokens_b, align)
        q_a = diff.shape[0]
        _set_token_ticks(ax, labels, labels[len(labels) - q_a:], 8.0)
        ax.set_xlabel("key")
        ax.set_title(f"{titles[0]} \u2212 {titles[1]} (light grey: no partner)", fontsize=10)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.03, label="weight difference")
        fig.suptitle(f"layer {layer}, head {head}" + (f": {label}" if label else ""),
                     fontsize=11)
    return fig


class Comparison:
    """Two inputs through one model: ``tokens_a``/``tokens_b``, ``a``/``b`` the weights
    ``(layers, heads, seq, seq)``, ``align`` (:func:`align_tokens`), ``diff``
    (:func:`difference`), ``layer``/``head`` the head drawn by default (the one that
    differs most, unless chosen), and ``explorer``: the page with its diff mode, which a
    notebook shows inline."""

    def __init__(self, tokens_a, a, tokens_b, b, *, titles, masks, layer, head, labels,
                 explorer) -> None:
        self.tokens_a, self.tokens_b, self.a, self.b = tokens_a, tokens_b, a, b
        self.titles, self.masks, self.labels = titles, masks, labels
        self.align = align_tokens(tokens_a, tokens_b)
        self.diff = difference(a, b, self.align)
        # the layer where the head asked (else any head) differs most, then its head
        heads = self.diff if head is None else self.diff[:, head:head + 1]
        self.layer = biggest_difference(heads)[0] if layer is None else layer
        self.head = (biggest_difference(self.diff[self.layer:self.layer + 1])[1]
                     if head is None else head)
        self.explorer = explorer

    def figure(self, layer: int | None = None, head: int | None = None):
        """:func:`compare_figure` of ``(layer, head)`` (default: :attr:`layer`, :attr:`head`)."""
        from .capture import pick

        layer = self.layer if layer is None else pick(len(self.a), layer, "layer")[0]
        head = self.head if head is None else pick(self.a[layer].shape[0], head, "head")[0]
        label = None if self.labels is None else self.labels[layer][head]
        return compare_figure(self.tokens_a, self.a, self.tokens_b, self.b, layer=layer,
                              head=head, titles=self.titles, mask_a=self.masks[0],
                              mask_b=self.masks[1], label=label)

    def _repr_html_(self) -> str:
        return self.explorer._repr_html_()


def compare(model: Any, tokenizer: Any, text: str, other: str, *, layer: int | None = None,
            head: int | None = None, head_labels: Any = None, title: str | None = None,
            log: Callable[[str], None] | None = None, example: str | None = None) -> Comparison:
    """Run ``model`` on ``text`` and ``other`` and compare every head (for notebooks: the
    result shows as the explorer, whose diff mode draws ``A - B``; ``.figure()`` draws
    one head on both and their difference).

    ``layer``/``head`` choose the head :meth:`Comparison.figure` draws (default: the one
    whose aligned cells differ most); ``head_labels`` (``attnlab.heads.head_labels``)
    name what each head does.
    """
    from .capture import masks_and_steps, pick, run, tokenize
    from .explorer import Explorer
    from .long import is_long

    runs = []
    for name, t in (("text", text), ("--compare", other)):
        ids, tokens = tokenize(model, tokenizer, t, log=log, example=example, name=name)
        mods = [m for m in model.modules() if hasattr(m, "qkv_hook")]
        if mods and is_long(len(mods), mods[0].num_heads, len(ids)):
            raise ValueError(f"{name} is {len(ids)} tokens: a comparison holds both inputs' "
                             "weights whole, too many for a page here; compare shorter texts")
        attentions, record = run(model, ids, weights=True)
        mask, steps = masks_and_steps(record, len(attentions), len(ids))
        runs.append((tokens, np.stack([a.float().numpy() for a in attentions]), mask, steps))
    (tokens_a, a, mask_a, steps), (tokens_b, b, mask_b, _) = runs
    layer = None if layer is None else pick(a.shape[0], layer, "layer")[0]
    head = None if head is None else pick(a.shape[1], head, "head")[0]
    titles = (text, other)
    page = Explorer(tokens_a, a, title=title or f"{text}  vs  {other}", mask=mask_a, steps=steps,
                    labels=head_labels,
                    compare={"tokens": tokens_b, "attentions": b, "mask": mask_b,
                             "title": other, "label": text})
    return Comparison(tokens_a, a, tokens_b, b, titles=titles, masks=(mask_a, mask_b),
                      layer=layer, head=head, labels=head_labels, explorer=page)
