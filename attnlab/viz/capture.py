"""Run a model on a text with its attention captured: what every picture draws from.

Duck-typed on purpose: any attnlab model whose forward takes
``output_attentions=True`` and returns ``(output, [weights per layer])`` works
(ToyAttnLM, GPT, Encoder), with any attnlab tokenizer. The queries, keys and values
each attention module received are recorded through the modules' ``qkv_hook``, so a
long input's weights can be computed a few rows at a time instead
(:mod:`attnlab.viz.long`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ..checks import is_int
from ..text.labels import token_labels, unknown_note

__all__ = ["token_strings", "capture", "tokenize", "run", "masks_and_steps", "attention_modules",
           "pick"]


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
    ids, labels = tokenize(model, tokenizer, text, log=log, example=example)
    attentions, _ = run(model, ids, weights=True)
    return labels, attentions


def tokenize(model: Any, tokenizer: Any, text: str, *, log: Callable[[str], None] | None = None,
             example: str | None = None, name: str = "text") -> tuple[list[int], list[str]]:
    """``(ids, labels)`` of ``text``, checked against the model's context (``name``: the
    argument the text came from, for the errors)."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"{name} must be a non-empty string, got {text!r}")
    try:
        ids, labels = token_labels(tokenizer, text)
    except ValueError as exc:
        hint = _unknown_hint(str(exc), tokenizer, example)
        raise ValueError(hint if name == "text" else f"{name}: {hint}") from None
    limit = getattr(model, "context_length", None)
    if limit is not None and len(ids) > limit:
        raise ValueError(f"{name} is {len(ids)} tokens but the model's context_length is {limit}")
    note = unknown_note(tokenizer, ids, text)
    if note is not None:
        (log or _stderr)(f"note: {note}")
    return ids, labels


def attention_modules(model: Any) -> list:
    """The model's attention modules (those with a ``qkv_hook``), in module order."""
    return [m for m in model.modules() if hasattr(m, "qkv_hook")]


def run(model: Any, ids: list[int], *, weights: bool) -> tuple[list | None, list]:
    """One forward pass over ``ids`` in eval mode, without gradients.

    Returns ``(attentions, record)``: with ``weights``, one ``(heads, seq, seq)`` tensor
    per layer (``output_attentions``), else None (no ``seq x seq`` matrix is formed
    beyond what the backend needs); ``record`` holds per attention call ``(module, q, k,
    v)`` of the one sequence, ``(heads, seq, head_dim)`` each, as attention received them
    (through the modules' ``qkv_hook``).
    """
    import torch

    record: list = []
    modules = attention_modules(model)
    previous = [m.qkv_hook for m in modules]
    was_training = model.training
    model.eval()
    try:
        for m, prev in zip(modules, previous):
            m.qkv_hook = _recorder(m, prev, record)
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_attentions=weights)
    finally:
        for m, prev in zip(modules, previous):
            m.qkv_hook = prev
        model.train(was_training)
    return ([a[0] for a in out[1]] if weights else None), record


def _recorder(module: Any, previous: Callable | None, record: list) -> Callable:
    def hook(q, k, v):
        if previous is not None:  # a hook already there (an ablation) runs first
            q, k, v = previous(q, k, v)
        record.append((module, q[0].detach(), k[0].detach(), v[0].detach()))
        return q, k, v

    return hook


def rule_of(module: Any) -> tuple[bool, int | None]:
    """``(causal, window)``: the rule a recorded module's queries followed."""
    return bool(getattr(module, "causal", False)), getattr(module, "window", None)


def masks_and_steps(record: list, n_layers: int, seq: int) -> tuple[Any, dict | None]:
    """The ``(layers, seq, seq)`` mask of what each layer's rule let a query see (None when
    the modules are not one per layer) and the explorer's ``steps`` (q, k, v, scale)."""
    from .. import masks

    if len(record) != n_layers:
        return None, None
    rules = []
    for module, *_ in record:
        causal, window = rule_of(module)
        rule = masks.structural(seq, seq, causal=causal, window=window)
        rules.append(np.ones((seq, seq), bool) if rule is None else rule.numpy())
    options = [set(getattr(module, "score_options", dict)()) - {"scale"}
               for module, *_ in record]
    beyond = sorted(set().union(*options))
    if beyond:  # the page recomputes plain softmax(q . k * scale) only
        names = {"softcap": "softcapping", "alibi_slopes": "ALiBi", "sinks": "sinks"}
        return np.stack(rules), {"note": "the step-by-step view recomputes plain scaled "
                                 "dot-product attention, and this model's scores also take "
                                 + " and ".join(names.get(n, n) for n in beyond)
                                 + ": see the weights themselves"}
    steps = {"q": [r[1].float().cpu() for r in record], "k": [r[2].float().cpu() for r in record],
             "v": [r[3].float().cpu() for r in record],
             # the module's own scale (Gemma 2's query_pre_attn_scalar), else attention's
             "scale": [getattr(r[0], "scale", None) or 1.0 / math.sqrt(r[1].shape[-1])
                       for r in record]}
    return np.stack(rules), steps


def pick(n: int, value: int | None, name: str) -> list[int]:
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
