"""The offline HTML attention explorer: one self-contained file, no network.

The page (``explorer.html`` next to this module) holds its CSS and vanilla JS
inline; the weights travel as JSON inside
``<script type="application/json" id="attnlab-data">``:

``{"format": "attnlab-explorer", "version": 3, "title": str, "tokens": [str, ...],
"layers": L, "heads": H, "q_len": Q, "k_len": K, "encoding": "uint8-base64",
"scale": 255, "weights": base64, "masked": base64 | null, "rollout": base64 | null,
"steps": {...} | {"note": str} | null, "labels": [[str]] | null, "compare": {...} | null,
"layer_ids": [int] | null}``

where ``weights`` is the base64 of ``L*H*Q*K`` bytes in C order
(layer, head, query, key), each byte ``round(weight * 255)`` of a weight in [0, 1].
Query ``i`` is token ``K - Q + i``. ``L`` counts the model's layers only; the
attention rollout, when given, is ``rollout``: ``Q*K`` more such bytes.
``masked`` is ``np.packbits`` (big-endian bit order) of a ``(L + 1 if rollout
else L, Q, K)`` bool array, 1 where the key is masked (the picture draws it grey).
``steps`` holds what the step-by-step view of one score needs: ``{"head_dim": D,
"kv_heads": Hkv, "scale": [L floats], "encoding": "float32-base64", "q": base64 of
(L, H, Q, D), "k": base64 of (L, Hkv, K, D), "v": base64 of (L, Hkv, K, D)}``
little-endian float32, as attention received them (after RoPE); or ``{"note"}``
saying why they were left out. ``labels`` names what each head does
(:func:`attnlab.heads.head_labels`), ``L x H`` strings.

A long input (:class:`attnlab.viz.long.TopKeys`) is ``"encoding": "topk-base64"``
instead: ``"topk": k``, ``"index"``: base64 of ``L*H*Q*k`` little-endian uint16 key
positions and ``"weights"``: as many bytes (their weights, as above), strongest first;
``"rules"``: per layer ``[causal, window]`` (masked cells follow from them, no bits),
``"kept"``: ``L x H`` mean weight the kept keys hold, ``"left_out"``: the sentence the
page shows, ``"layer_ids"``: the model's numbers of the ``L`` layers held,
``"model_layers"``: how many it has.

``compare`` (a second input, :mod:`attnlab.viz.compare`) is ``{"title", "label",
"tokens", "q_len", "k_len", "weights", "masked", "align"}``: its weights and mask as
above (same ``L`` and ``H``), ``align`` the partner of each first-input token in its
tokens or -1. The JSON is escaped so that no token can
close the script element or inject markup: ``<``, ``>``, ``&``, U+2028, U+2029
and lone surrogates are written as ``\\uXXXX`` escapes.
"""

from __future__ import annotations

import base64
import html
import importlib.resources
import json
import os
import pathlib
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..io import atomic_write_bytes
from .align import align_tokens
from .data import as_labels, as_layers, as_mask, as_rollout, as_tokens, to_numpy
from .long import TopKeys

__all__ = ["write_html", "render_html", "payload_json", "Explorer", "explorer"]

DEFAULT_TITLE = "attnlab explorer"
_PLACEHOLDER = re.compile(r"\{\{(TITLE|DATA)\}\}")
# Characters that must never appear raw inside the data <script> element.
_JSON_UNSAFE = re.compile("[<>&\u2028\u2029\ud800-\udfff]")


def _template() -> str:
    return importlib.resources.files(__package__).joinpath("explorer.html").read_text("utf-8")


def _uint8(data: np.ndarray) -> str:
    quantised = np.rint(np.clip(data, 0.0, 1.0) * 255.0).astype(np.uint8)
    return base64.b64encode(quantised.tobytes(order="C")).decode("ascii")


def _float32(data: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(data, dtype="<f4").tobytes()).decode("ascii")


def _bits(masked: np.ndarray | None) -> str | None:
    if masked is None:
        return None
    return base64.b64encode(np.packbits(masked.astype(bool), axis=None).tobytes()).decode("ascii")


def _weights_fields(data: Any) -> dict:
    """The fields that hold the weights: whole (uint8) or a long input's top keys."""
    if isinstance(data, TopKeys):
        n_layers, n_heads, q_len, k = data.index.shape
        return {"layers": n_layers, "heads": n_heads, "q_len": q_len, "k_len": data.k_len,
                "encoding": "topk-base64", "scale": 255, "topk": k,
                "index": base64.b64encode(np.ascontiguousarray(data.index, dtype="<u2")
                                          .tobytes()).decode("ascii"),
                "weights": _uint8(data.weight), "rules": [list(r) for r in data.rules],
                "kept": np.round(data.kept, 4).tolist(), "left_out": data.note(),
                "layer_ids": list(data.layer_ids), "model_layers": data.n_layers}
    n_layers, n_heads, q_len, k_len = data.shape
    return {"layers": n_layers, "heads": n_heads, "q_len": q_len, "k_len": k_len,
            "encoding": "uint8-base64", "scale": 255, "weights": _uint8(data)}


def payload_json(tokens: Sequence[str], data: Any, title: str, *,
                 masked: np.ndarray | None = None, rollout: np.ndarray | None = None,
                 steps: dict | None = None, labels: list | None = None,
                 compare: dict | None = None) -> str:
    """The data JSON for checked ``(layers, heads, q_len, k_len)`` weights in [0, 1] (or
    :class:`~attnlab.viz.long.TopKeys`), safe to place verbatim inside a ``<script>``
    element (``masked``, ``rollout``, ``steps``, ``labels``, ``compare`` as checked by
    :func:`render_html`)."""
    if steps is not None and "note" not in steps:
        steps = {"head_dim": steps["head_dim"], "kv_heads": steps["kv_heads"],
                 "scale": steps["scale"], "encoding": "float32-base64",
                 **{name: _float32(steps[name]) for name in ("q", "k", "v")}}
    if compare is not None:
        b = compare["attentions"]
        compare = {"title": compare["title"], "label": compare["label"],
                   "tokens": compare["tokens"], "q_len": b.shape[2], "k_len": b.shape[3],
                   "weights": _uint8(b), "masked": _bits(compare["masked"]),
                   "align": compare["align"]}
    payload = {
        "format": "attnlab-explorer",
        "version": 3,
        "title": title,
        "tokens": list(tokens),
        **_weights_fields(data),
        "masked": _bits(masked),
        "rollout": None if rollout is None else _uint8(rollout),
        "steps": steps,
        "labels": labels,
        "compare": compare,
    }
    payload.setdefault("layer_ids", None)
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


#: The step-by-step view's q, k and v go into a page for texts up to this many tokens,
#: and up to this many numbers in all (4 MiB of float32): the page stays a few MB.
STEPS_MAX_TOKENS = 64
STEPS_MAX_VALUES = 1 << 20


def _check_steps(steps: Any, n_layers: int, n_heads: int, q_len: int, k_len: int) -> dict:
    """``steps`` as the page needs it: ``{"q", "k", "v", "scale"}`` checked and stacked, or
    ``{"note": str}`` (why the vectors are not there)."""
    if not isinstance(steps, dict):
        raise TypeError(f"steps: expected a dict with q, k, v, scale (or note), got "
                        f"{type(steps).__name__}")
    if "note" in steps:
        if not isinstance(steps["note"], str):
            raise TypeError("steps: note must be a string")
        return {"note": steps["note"]}
    missing = {"q", "k", "v", "scale"} - set(steps)
    if missing:
        raise ValueError(f"steps: expected keys q, k, v, scale, missing {sorted(missing)}")
    if k_len > STEPS_MAX_TOKENS:
        return {"note": f"the step-by-step view needs q, k and v, kept for texts of up to "
                        f"{STEPS_MAX_TOKENS} tokens; this one has {k_len}"}
    q = np.stack([to_numpy(a, f"steps q[{i}]") for i, a in enumerate(steps["q"])])
    k = np.stack([to_numpy(a, f"steps k[{i}]") for i, a in enumerate(steps["k"])])
    v = np.stack([to_numpy(a, f"steps v[{i}]") for i, a in enumerate(steps["v"])])
    if q.ndim != 4 or q.shape[:3] != (n_layers, n_heads, q_len):
        raise ValueError(f"steps: q must be one ({n_heads}, {q_len}, head_dim) array per "
                         f"layer ({n_layers}), got {q.shape}")
    head_dim, kv_heads = q.shape[3], k.shape[1] if k.ndim == 4 else 0
    for name, a in (("k", k), ("v", v)):
        if a.ndim != 4 or a.shape[0] != n_layers or a.shape[2:] != (k_len, head_dim) or \
                not kv_heads or a.shape[1] != kv_heads or n_heads % kv_heads:
            raise ValueError(f"steps: {name} must be one (kv_heads, {k_len}, {head_dim}) array "
                             f"per layer ({n_layers}), kv_heads dividing {n_heads}; got "
                             f"{a.shape}")
    scale = [float(x) for x in steps["scale"]]
    if len(scale) != n_layers or not all(np.isfinite(x) and x > 0 for x in scale):
        raise ValueError(f"steps: scale must be {n_layers} positive numbers, got {scale}")
    if not all(np.isfinite(a).all() for a in (q, k, v)):
        raise ValueError("steps: q, k and v must be finite")
    if q.size + k.size + v.size > STEPS_MAX_VALUES:
        return {"note": f"the step-by-step view needs q, k and v: {q.size + k.size + v.size:,} "
                        f"numbers here, more than the {STEPS_MAX_VALUES:,} a page keeps"}
    return {"q": q, "k": k, "v": v, "scale": scale, "head_dim": head_dim,
            "kv_heads": kv_heads}


def render_html(tokens: Sequence[str], attentions: Any, title: str | None = None, *,
                mask: Any = None, rollout: Any = None, steps: Any = None, labels: Any = None,
                compare: Any = None) -> str:
    """The explorer page as a string (what :func:`write_html` writes)."""
    if title is None:
        title = DEFAULT_TITLE
    elif not isinstance(title, str):
        raise TypeError(f"title: expected a string or None, got {type(title).__name__}")
    if isinstance(attentions, TopKeys):
        return _render_long(tokens, attentions, title, mask, rollout, labels, compare)
    data, tokens = as_layers(attentions, tokens)
    n_layers, n_heads, q_len, k_len = data.shape
    allowed = as_mask(mask, n_layers, q_len, k_len)
    flow = as_rollout(rollout, tokens, q_len, k_len)
    masked = None
    if allowed is not None:
        # the rollout's masked cells: those no token reaches through the masks (exactly 0)
        masked = ~allowed if flow is None else np.concatenate([~allowed, (flow == 0)[None]])
    checked = None if steps is None else _check_steps(steps, n_layers, n_heads, q_len, k_len)
    other = None if compare is None else _check_compare(compare, tokens, n_layers, n_heads)
    return _fill(title, payload_json(tokens, data, title, masked=masked,
                                     rollout=None if flow is None else flow, steps=checked,
                                     labels=as_labels(labels, n_layers, n_heads), compare=other))


def _fill(title: str, data: str) -> str:
    values = {"TITLE": html.escape(title, quote=True), "DATA": data}
    # One pass, so text substituted for one placeholder is never scanned for another.
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], _template())


def _render_long(tokens, top: TopKeys, title, mask, rollout, labels, compare) -> str:
    """A long input's page: its top keys; the rule per layer stands for the mask."""
    tokens = as_tokens(tokens)
    if len(tokens) != top.k_len or top.index.shape[2] != top.k_len:
        raise ValueError(f"tokens: expected {top.index.shape[2]} tokens (the kept rows), "
                         f"got {len(tokens)}")
    for name, given in (("mask", mask), ("rollout", rollout), ("compare", compare)):
        if given is not None:
            raise ValueError(f"{name}: not taken with a long input's top keys (the page "
                             "holds each layer's rule, not its mask)")
    n_layers, n_heads = top.index.shape[:2]
    names = as_labels(labels, top.n_layers, n_heads)
    # (whatever made it: a long text's page holds its strongest keys, never q, k and v)
    checked = {"note": "the step-by-step view needs q, k and v, which a long text's page "
                       "of its strongest keys does not hold"}
    return _fill(title, payload_json(
        tokens, top, title, steps=checked,
        labels=None if names is None else [names[i] for i in top.layer_ids]))


def _check_compare(compare: Any, tokens: list[str], n_layers: int, n_heads: int) -> dict:
    """``compare`` (``{"tokens", "attentions"[, "mask", "title", "label"]}``) checked, with
    the alignment of its tokens to ``tokens`` (:func:`attnlab.viz.compare.align_tokens`)."""
    if not isinstance(compare, dict) or not {"tokens", "attentions"} <= set(compare):
        raise TypeError("compare: expected a dict with tokens and attentions (and optional "
                        "mask, title, label)")
    data, other = as_layers(compare["attentions"], compare["tokens"])
    if data.shape[:2] != (n_layers, n_heads):
        raise ValueError(f"compare: expected {n_layers} layers of {n_heads} heads, as the "
                         f"first input, got {data.shape[:2]}")
    allowed = as_mask(compare.get("mask"), n_layers, *data.shape[2:])
    for key in ("title", "label"):
        if not isinstance(compare.get(key, ""), str):
            raise TypeError(f"compare: {key} must be a string")
    return {"tokens": other, "attentions": data, "masked": None if allowed is None else ~allowed,
            "title": compare.get("title") or "B", "label": compare.get("label") or "A",
            "align": align_tokens(tokens, other)}


def write_html(path: str | os.PathLike[str], tokens: Sequence[str], attentions: Any,
               title: str | None = None, *, mask: Any = None, rollout: Any = None,
               steps: Any = None, labels: Any = None, compare: Any = None) -> pathlib.Path:
    """Write the interactive attention explorer as one self-contained HTML file.

    The page works opened from disk (``file://``) and makes no network request:
    CSS, JS and data are inline. It has a head view (queries left, keys right,
    line opacity = weight, hover a token to isolate its lines), a matrix view
    of the selected head, and a clickable overview of every layer x head.

    Args:
        path: the ``.html`` file to write (parent directories are created).
        tokens: ``k_len`` token strings, shown as text (never markup).
        attentions: a sequence, one per layer, of ``(heads, q_len, k_len)``
            (or ``(1, heads, q_len, k_len)``) torch tensors or NumPy arrays of
            weights in [0, 1]; queries are the last ``q_len`` tokens. Or a long input's
            :class:`~attnlab.viz.long.TopKeys` (the page then says what it left out).
        title: page title, HTML-escaped; defaults to "attnlab explorer".
        mask: optional bool, True = may attend, ``(q_len, k_len)`` or one per layer:
            the cells it forbids are drawn grey (not as a weight of 0).
        rollout: optional ``(q_len, k_len)`` attention rollout, shown once after the
            layers (not counted as a layer).
        steps: optional ``{"q", "k", "v", "scale"}``: per layer ``(heads, q_len, D)``
            queries, ``(kv_heads, k_len, D)`` keys and values as attention received
            them, and the scale; they feed the step-by-step view of one score (q, k,
            their product, sum, scale, mask, softmax row, weighted sum of values).
            Kept up to :data:`STEPS_MAX_TOKENS` tokens; ``{"note": str}`` says why
            they are missing. :func:`attnlab.viz.show_attention` fills all three.
        labels: optional ``layers x heads`` strings, what each head does
            (:func:`attnlab.heads.head_labels`): shown on the head buttons, the overview
            and the captions ("L5 H2: previous-token 0.81").
        compare: optional second input ``{"tokens", "attentions", "mask", "title",
            "label"}`` through the same model: the page gets a diff mode (``A - B`` where
            the tokens align, :mod:`attnlab.viz.compare`) and shows the selected head on
            both inputs side by side.

    Returns:
        The path written. The write is atomic (:func:`attnlab.io.atomic_write_bytes`:
        temp file, fsync, rename, directory fsync). Weights are stored as uint8
        (error <= 1/510).

    Raises:
        ValueError: shapes disagree with each other or with ``tokens``, or the
            weights are non-finite or outside [0, 1].
    """
    path = pathlib.Path(path)
    text = render_html(tokens, attentions, title, mask=mask, rollout=rollout, steps=steps,
                       labels=labels, compare=compare)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Lone surrogates (only possible in the title; the JSON escapes them) become "?".
    atomic_write_bytes(path, text.encode("utf-8", errors="replace"))
    return path


class Explorer:
    """The explorer of one set of attentions, for notebooks: Jupyter shows it inline.

    ``_repr_html_`` returns an ``<iframe>`` whose ``srcdoc`` is the whole
    self-contained page (still offline: no network, no CDN). Each explorer
    lives in its own frame, so several on one notebook page never share
    element ids, styles, key handlers or state. ``html`` is the page itself
    and :meth:`save` writes it as a file, like :func:`write_html`.
    """

    def __init__(self, tokens: Sequence[str], attentions: Any, title: str | None = None,
                 height: int = 760, *, mask: Any = None, rollout: Any = None,
                 steps: Any = None, labels: Any = None, compare: Any = None) -> None:
        # checks the input now, not on display
        self.html = render_html(tokens, attentions, title, mask=mask, rollout=rollout,
                                steps=steps, labels=labels, compare=compare)
        if not isinstance(height, int) or isinstance(height, bool) or height < 100:
            raise ValueError(f"height must be an int >= 100 (pixels), got {height!r}")
        self.height = height

    def _repr_html_(self) -> str:
        # srcdoc is an attribute: escaping &, <, > and quotes keeps the page text intact.
        doc = html.escape(self.html, quote=True)
        # allow-downloads: the PNG and SVG buttons save files; nothing else leaves the frame
        return (f'<iframe srcdoc="{doc}" sandbox="allow-scripts allow-downloads" '
                f'style="width: 100%; height: {self.height}px; border: 0;" '
                'title="attnlab explorer"></iframe>')

    def save(self, path: str | os.PathLike[str]) -> pathlib.Path:
        """Write the page as a standalone HTML file (atomically); returns the path."""
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, self.html.encode("utf-8", errors="replace"))
        return path

    def __repr__(self) -> str:
        return f"Explorer({len(self.html)} characters of HTML; display it in a notebook)"


def explorer(tokens: Sequence[str], attentions: Any, title: str | None = None, *,
             mask: Any = None, rollout: Any = None, steps: Any = None, labels: Any = None,
             compare: Any = None) -> Explorer:
    """An :class:`Explorer` of ``attentions`` (one ``(heads, q_len, k_len)`` per layer)
    over ``tokens``; the last expression of a notebook cell shows it inline.
    ``mask``, ``rollout``, ``steps``, ``labels``, ``compare`` as in :func:`write_html`."""
    return Explorer(tokens, attentions, title, mask=mask, rollout=rollout, steps=steps,
                    labels=labels, compare=compare)
