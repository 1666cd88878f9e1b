"""``attnlab show``: a model's attention on a text, as a picture and an HTML explorer.

The weights come from :mod:`.capture`; a long input's from :mod:`.long` (the top keys
of each row, no ``seq x seq`` matrix held); two inputs side by side from :mod:`.compare`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..io import EXPLORER_FILE, HEATMAP_FILE, HEATMAP_SVG, atomic_write_bytes
from ..io.locks import output_lock
from ..io.outdir import check_own_dir, drop_stale, make_dir
from .capture import (
    attention_modules,
    capture,
    masks_and_steps,
    pick,
    run,
    token_strings,
    tokenize,
)
from .data import as_labels
from .explorer import Explorer
from .heatmap import FORMATS, figure_bytes, heatmap, heatmap_grid
from .rollout import rollout as _rollout

__all__ = ["show_attention", "ShowResult", "capture", "token_strings", "pick"]


class ShowResult(dict):
    """``{"png": path, "html": path}`` (``"svg"`` instead of ``"png"`` with
    ``fmt="svg"``), which a notebook displays as the explorer itself."""

    def __init__(self, picture: Path, html: Path, explorer: Explorer,
                 picked: tuple[int, int] | None = None) -> None:
        super().__init__({picture.suffix[1:]: picture, "html": html})
        self.explorer = explorer
        self.picked = picked  # with compare: the (layer, head) the picture draws

    def _repr_html_(self) -> str:
        return self.explorer._repr_html_()


def show_attention(model: Any, tokenizer: Any, text: str, out: str | os.PathLike[str], *,
                   layer: int | None = None, head: int | None = None,
                   title: str | None = None, rollout: bool = False,
                   log: Callable[[str], None] | None = None,
                   example: str | None = None, compare: str | None = None,
                   head_labels: Any = None, fmt: str = "png") -> ShowResult:
    """Write ``attention.png`` (or ``attention.svg``) and ``attention.html``
    (``io.HEATMAP_FILE``, ``io.HEATMAP_SVG``, ``io.EXPLORER_FILE``) for ``text`` into
    directory ``out``.

    Args:
        model: an attnlab model (its weights are captured with ``output_attentions``).
        tokenizer: the model's tokenizer.
        text: the input.
        out: directory to write into (created if missing); it must be new, empty or
            hold only files attnlab writes (:func:`attnlab.io.outdir.check_own_dir`).
        layer, head: restrict the picture to one layer and/or head; the HTML explorer
            holds every layer and head (a long input: the layers that fit, ``layer`` first).
        title: heading of the explorer page (default: the text).
        rollout: add the attention rollout (:func:`attnlab.viz.rollout`) as one more
            row, drawn once, labelled "rollout" in the picture and in the explorer (which
            counts the model's layers only).
        log: where the one-line unknown-token note goes (default: stderr).
        example: a text the model can read, offered when ``text`` has characters
            its tokenizer lacks (:func:`attnlab.interop.auto.known_text`).
        compare: a second text: the picture draws one head (``layer``/``head``, default
            the one that differs most) on both texts and their difference where the
            tokens align (:mod:`attnlab.viz.compare`); the explorer gets a diff mode.
        head_labels: what each head does, ``layers x heads`` strings
            (:func:`attnlab.heads.head_labels`): written on the picture's panels and on
            the explorer's heads ("L5 H2: previous-token 0.81").
        fmt: ``"png"`` or ``"svg"``, the picture's format.

    Masked cells (the future, for a causal model) are drawn grey. The explorer also
    holds the queries, keys and values of every head (texts of up to
    :data:`attnlab.viz.explorer.STEPS_MAX_TOKENS` tokens) for its step-by-step view
    of one score. A long text (:func:`attnlab.viz.long.is_long`) is captured without any
    ``seq x seq`` matrix: the picture max-pools each row's strongest keys and the page
    holds those (it says what it left out).

    Returns:
        ``{"png" or "svg": path, "html": path}``; in a notebook it displays as the explorer.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt (--format) must be one of {', '.join(FORMATS)}, got {fmt!r}")
    # The rule every writer follows: a folder holding files attnlab did not write
    # is the user's, and is refused before any work.
    check_own_dir(out)
    picture = Path(out) / (HEATMAP_FILE if fmt == "png" else HEATMAP_SVG)
    if compare is not None:
        if rollout:
            raise ValueError("rollout (--rollout) and compare (--compare): one at a time")
        from .compare import compare as _compare

        found = _compare(model, tokenizer, text, compare, layer=layer, head=head,
                         head_labels=head_labels, title=title, log=log, example=example)
        fig, page, picked = found.figure(), found.explorer, (found.layer, found.head)
    else:
        fig, page = _show(model, tokenizer, text, layer, head, title or _heading(text),
                          rollout, log, example, head_labels)
        picked = None
    with output_lock(out):
        check_own_dir(out)  # again: a file of the user's may have come while it computed
        make_dir(out)
        atomic_write_bytes(picture, figure_bytes(fig, fmt, dpi=fig.dpi))
        drop_stale(Path(out) / (HEATMAP_SVG if fmt == "png" else HEATMAP_FILE))
        return ShowResult(picture, page.save(Path(out) / EXPLORER_FILE), page, picked)


def _heading(text: str, most: int = 80) -> str:
    """The page's title by default: the text, its first ``most`` characters where longer
    (a long text's whole heading filled half the first screen)."""
    if len(text) <= most:
        return text
    return " ".join(text.split())[:most - 1].rstrip() + "\u2026"


def _show(model, tokenizer, text, layer, head, title, rollout, log, example, labels):
    """``(figure, explorer)`` of one text: whole weights, or a long text's top keys."""
    from .long import MAX_TOKENS, is_long, long_figure, top_keys

    ids, tokens = tokenize(model, tokenizer, text, log=log, example=example)
    modules = attention_modules(model)
    if modules and all(hasattr(m, "attention_rows") for m in modules) and is_long(
            len(modules), modules[0].num_heads, len(ids)):
        if rollout:
            raise ValueError(f"rollout (--rollout) multiplies whole {len(ids)} x {len(ids)} "
                             "matrices; it is drawn for shorter texts only")
        if len(ids) > MAX_TOKENS:  # (said before the forward, not after it: 35 s at 6,200)
            raise ValueError(f"text is {len(ids):,} tokens; the explorer holds up to "
                             f"{MAX_TOKENS:,}")
        _, record = run(model, ids, weights=False)
        layers = pick(len(record), layer, "layer")
        heads = pick(record[0][1].shape[0], head, "head")
        names = as_labels(labels, len(record), record[0][1].shape[0])
        # The page holds every layer that fits, the chosen one first; the picture that one
        # alone, with the keys a page of one layer keeps (its own pass: a page of all the
        # layers shares its budget of keys among them).
        order = [*layers, *(i for i in range(len(record)) if i not in layers)]
        top = top_keys(record, len(ids), order)
        drawn = top if layer is None else top_keys(record, len(ids), layers)
        fig = long_figure(drawn, tokens, heads=heads, labels=names)
        return fig, Explorer(tokens, top, title=title, labels=names)
    attentions, record = run(model, ids, weights=True)
    layers = pick(len(attentions), layer, "layer")
    heads = pick(attentions[0].shape[0], head, "head")
    names = as_labels(labels, len(attentions), attentions[0].shape[0])
    mask, steps = masks_and_steps(record, len(attentions), len(tokens))
    flow = _rollout(attentions) if rollout else None  # (seq, seq)
    picked = None if mask is None else mask[layers]
    if flow is None and len(layers) == 1 and len(heads) == 1:
        fig = heatmap(attentions[layers[0]][heads[0]], tokens,
                      mask=None if picked is None else picked[0])
        kind = "" if names is None else f": {names[layers[0]][heads[0]]}"
        fig.axes[0].set_title(f"layer {layers[0]}, head {heads[0]}{kind}", fontsize=10)
    else:
        fig = heatmap_grid(tokens, [attentions[i][heads] for i in layers], layer_ids=layers,
                           head_ids=heads, mask=picked, rollout=flow,
                           labels=None if names is None else
                           [[names[i][h] for h in heads] for i in layers])
    if flow is not None:
        title = f"{title} (with the attention rollout)"
    page = Explorer(tokens, attentions, title=title, mask=mask, rollout=flow, steps=steps,
                    labels=names)
    return fig, page
