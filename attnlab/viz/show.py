"""Run a model on a text with its attention captured, and draw what it did.

Duck-typed on purpose: any attnlab model whose forward takes
``output_attentions=True`` and returns ``(output, [weights per layer])`` works
(ToyAttnLM, GPT, Encoder), with any attnlab tokenizer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..checks import is_int
from ..io import EXPLORER_FILE, HEATMAP_FILE, atomic_write_bytes
from ..io.locks import output_lock
from ..io.outdir import check_own_dir
from ..text.labels import token_labels, unknown_note
from .explorer import Explorer
from .heatmap import heatmap, png_bytes, save_heatmaps
from .rollout import rollout as _rollout


def token_strings(tokenizer: Any, ids: list[int]) -> list[str]:
    """One display string per id (special tokens such as ``[CLS]`` included), for ids
    without their text; :func:`capture` labels tokens from the text itself instead."""
    if hasattr(tokenizer, "id_to_token"):
        return [tokenizer.id_to_token(i) for i in ids]
    return [tokenizer.decode([i]) for i in ids]


def capture(model: Any, tokenizer: Any, text: str, *,
            log: Callable[[str], None] | None = None,
            example: str | None = None) -> tuple[list[str], list]:
    """Tokens of ``text`` and the model's weights: one ``(heads, seq, seq)`` tensor per layer.

    The tokens are readable labels, the text each token covers
    (:func:`attnlab.text.labels.token_labels`). When a notable share of them is
    the unknown token, one line saying so goes to ``log`` (default: stderr).
    A text with characters a character-level tokenizer lacks is refused with the
    characters it knows and ``example``, a text it can read, when given.
    """
    labels, attentions, _ = _capture(model, tokenizer, text, log, example)
    return labels, attentions


def _capture(model: Any, tokenizer: Any, text: str, log, example) -> tuple[list, list, list]:
    """:func:`capture`, and per attention module (in call order) ``(module, q, k, v)`` of
    the one sequence, as attention received them (through the modules' ``qkv_hook``)."""
    import torch

    if not isinstance(text, str) or not text:
        raise ValueError(f"text must be a non-empty string, got {text!r}")
    try:
        ids, labels = token_labels(tokenizer, text)
    except ValueError as exc:
        raise ValueError(_unknown_hint(str(exc), tokenizer, example)) from None
    limit = getattr(model, "context_length", None)
    if limit is not None and len(ids) > limit:
        raise ValueError(f"text is {len(ids)} tokens but the model's context_length is {limit}")
    note = unknown_note(tokenizer, ids, text)
    if note is not None:
        (log or _stderr)(f"note: {note}")
    record: list = []
    modules = [m for m in model.modules() if hasattr(m, "qkv_hook")]
    previous = [m.qkv_hook for m in modules]
    was_training = model.training
    model.eval()
    try:
        for m, prev in zip(modules, previous):
            m.qkv_hook = _recorder(m, prev, record)
        with torch.no_grad():
            _, attentions = model(torch.tensor([ids]), output_attentions=True)
    finally:
        for m, prev in zip(modules, previous):
            m.qkv_hook = prev
        model.train(was_training)
    return labels, [a[0] for a in attentions], record


def _recorder(module: Any, previous: Callable | None, record: list) -> Callable:
    def hook(q, k, v):
        if previous is not None:  # a hook already there (an ablation) runs first
            q, k, v = previous(q, k, v)
        record.append((module, q[0].detach(), k[0].detach(), v[0].detach()))
        return q, k, v

    return hook


def _masks_and_steps(record: list, n_layers: int, seq: int) -> tuple[Any, dict | None]:
    """The ``(layers, seq, seq)`` mask of what each layer's rule let a query see (None when
    the modules are not one per layer) and the explorer's ``steps`` (q, k, v, scale)."""
    import math

    from .. import masks

    if len(record) != n_layers:
        return None, None
    rules = []
    for module, *_ in record:
        rule = masks.structural(seq, seq, causal=bool(getattr(module, "causal", False)),
                                window=getattr(module, "window", None))
        rules.append(np.ones((seq, seq), bool) if rule is None else rule.numpy())
    steps = {"q": [r[1].float().cpu() for r in record], "k": [r[2].float().cpu() for r in record],
             "v": [r[3].float().cpu() for r in record],
             # attention's default scale: no attnlab module passes another
             "scale": [1.0 / math.sqrt(r[1].shape[-1]) for r in record]}
    return np.stack(rules), steps


_KNOWN_SHOWN = 60  # characters of a vocabulary listed in an error; a Chinese one has hundreds


def _unknown_hint(message: str, tokenizer: Any, example: str | None) -> str:
    """``message`` (the tokenizer's refusal) and what the model can read instead."""
    chars = getattr(tokenizer, "chars", None)
    if not isinstance(chars, list) or not chars:
        return message
    known = "".join(chars)
    listed = repr(known[:_KNOWN_SHOWN]) + (" ..." if len(known) > _KNOWN_SHOWN else "")
    hint = f"{message}; the model knows only these {len(known)} characters: {listed}"
    return hint + (f"; try a text it knows, such as {example!r}" if example else "")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


class ShowResult(dict):
    """``{"png": path, "html": path}``, which a notebook displays as the explorer itself."""

    def __init__(self, png: Path, html: Path, explorer: Explorer) -> None:
        super().__init__(png=png, html=html)
        self.explorer = explorer

    def _repr_html_(self) -> str:
        return self.explorer._repr_html_()


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
                   title: str | None = None, rollout: bool = False,
                   log: Callable[[str], None] | None = None,
                   example: str | None = None) -> ShowResult:
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
        rollout: add the attention rollout (:func:`attnlab.viz.rollout`) as one more
            row, drawn once, labelled "rollout" in the PNG and in the explorer (which
            counts the model's layers only).

    Masked cells (the future, for a causal model) are drawn grey. The explorer also
    holds the queries, keys and values of every head (texts of up to
    :data:`attnlab.viz.explorer.STEPS_MAX_TOKENS` tokens) for its step-by-step view
    of one score.
        log: where the one-line unknown-token note goes (default: stderr).
        example: a text the model can read, offered when ``text`` has characters
            its tokenizer lacks (:func:`attnlab.interop.auto.known_text`).

    Returns:
        ``{"png": path, "html": path}``; in a notebook it displays as the explorer.
    """
    # The rule every writer follows: a folder holding files attnlab did not write
    # is the user's, and is refused before any work.
    check_own_dir(out)
    tokens, attentions, record = _capture(model, tokenizer, text, log, example)
    layers = _pick(len(attentions), layer, "layer")
    heads = _pick(attentions[0].shape[0], head, "head")
    mask, steps = _masks_and_steps(record, len(attentions), len(tokens))
    with output_lock(out):
        return _write(out, tokens, attentions, layers, heads, title or text, rollout, mask,
                      steps)


def _write(out, tokens, attentions, layers, heads, title, rollout, mask, steps) -> ShowResult:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    png = out / HEATMAP_FILE
    flow = _rollout(attentions) if rollout else None  # (seq, seq)
    picked = None if mask is None else mask[layers]
    if flow is None and len(layers) == 1 and len(heads) == 1:
        fig = heatmap(attentions[layers[0]][heads[0]], tokens,
                      mask=None if picked is None else picked[0])
        atomic_write_bytes(png, png_bytes(fig))
    else:
        save_heatmaps(png, tokens, [attentions[i][heads] for i in layers], layer_ids=layers,
                      head_ids=heads, mask=picked, rollout=flow)
    if flow is not None:
        title = f"{title} (with the attention rollout)"
    page = Explorer(tokens, attentions, title=title, mask=mask, rollout=flow, steps=steps)
    return ShowResult(png, page.save(out / EXPLORER_FILE), page)
