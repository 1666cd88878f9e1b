"""Run a model on a text with its attention captured, and draw what it did.

Duck-typed on purpose: any attnlab model whose forward takes
``output_attentions=True`` and returns ``(output, [weights per layer])`` works
(ToyAttnLM, GPT, Encoder), with any attnlab tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..checks import is_int
from ..io import EXPLORER_FILE, HEATMAP_FILE, atomic_write_bytes
from ..io.locks import output_lock
from ..io.outdir import check_own_dir
from .explorer import write_html
from .heatmap import heatmap, png_bytes, save_heatmaps


def token_strings(tokenizer: Any, ids: list[int]) -> list[str]:
    """One display string per id (special tokens such as ``[CLS]`` included)."""
    if hasattr(tokenizer, "id_to_token"):
        return [tokenizer.id_to_token(i) for i in ids]
    return [tokenizer.decode([i]) for i in ids]


def capture(model: Any, tokenizer: Any, text: str) -> tuple[list[str], list]:
    """Tokens of ``text`` and the model's weights: one ``(heads, seq, seq)`` tensor per layer."""
    import torch

    if not isinstance(text, str) or not text:
        raise ValueError(f"text must be a non-empty string, got {text!r}")
    ids = tokenizer.encode(text)
    limit = getattr(model, "context_length", None)
    if limit is not None and len(ids) > limit:
        raise ValueError(f"text is {len(ids)} tokens but the model's context_length is {limit}")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _, attentions = model(torch.tensor([ids]), output_attentions=True)
    finally:
        model.train(was_training)
    return token_strings(tokenizer, ids), [a[0] for a in attentions]


def _pick(n: int, value: int | None, name: str) -> list[int]:
    """All ``n`` indices, or just ``value``; errors name both the keyword and the
    ``attnlab show`` option, since this is where a bad ``--layer``/``--head`` lands."""
    if value is None:
        return list(range(n))
    if not is_int(value):
        raise TypeError(f"{name} (--{name}) must be an int or None, got {value!r}")
    if not 0 <= value < n:
        raise ValueError(f"{name} (--{name}) must be in [0, {n - 1}] (the model has {n} "
                         f"{name}s), got {value}")
    return [int(value)]


def show_attention(model: Any, tokenizer: Any, text: str, out: str | os.PathLike[str], *,
                   layer: int | None = None, head: int | None = None,
                   title: str | None = None) -> dict[str, Path]:
    """Write ``attention.png`` and ``attention.html`` (``io.HEATMAP_FILE``,
    ``io.EXPLORER_FILE``) for ``text`` into directory ``out``.

    Args:
        model: an attnlab model (its weights are captured with ``output_attentions``).
        tokenizer: the model's tokenizer.
        text: the input.
        out: directory to write into (created if missing); it must be new, empty or
            hold only files attnlab writes (:func:`attnlab.io.outdir.check_own_dir`).
        layer, head: restrict the PNG to one layer and/or head; the HTML explorer
            always holds every layer and head.
        title: heading of the explorer page (default: the text).

    Returns:
        ``{"png": path, "html": path}``.
    """
    # The rule every writer follows: a folder holding files attnlab did not write
    # is the user's, and is refused before any work.
    check_own_dir(out)
    tokens, attentions = capture(model, tokenizer, text)
    layers = _pick(len(attentions), layer, "layer")
    heads = _pick(attentions[0].shape[0], head, "head")
    with output_lock(out):
        return _write(out, tokens, attentions, layers, heads, title or text)


def _write(out, tokens, attentions, layers, heads, title) -> dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    png = out / HEATMAP_FILE
    if len(layers) == 1 and len(heads) == 1:
        fig = heatmap(attentions[layers[0]][heads[0]], tokens)
        atomic_write_bytes(png, png_bytes(fig))
    else:
        save_heatmaps(png, tokens, [attentions[i][heads] for i in layers])
    html = write_html(out / EXPLORER_FILE, tokens, attentions, title=title)
    return {"png": png, "html": Path(html)}
