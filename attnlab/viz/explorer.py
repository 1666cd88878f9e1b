"""The offline HTML attention explorer: one self-contained file, no network.

The page (``explorer.html`` next to this module) holds its CSS and vanilla JS
inline; the weights travel as JSON inside
``<script type="application/json" id="attnlab-data">``:

``{"format": "attnlab-explorer", "version": 1, "title": str, "tokens": [str, ...],
"layers": L, "heads": H, "q_len": Q, "k_len": K, "encoding": "uint8-base64",
"scale": 255, "weights": base64}``

where ``weights`` is the base64 of ``L*H*Q*K`` bytes in C order
(layer, head, query, key), each byte ``round(weight * 255)`` of a weight in [0, 1].
Query ``i`` is token ``K - Q + i``. The JSON is escaped so that no token can
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
from .data import as_layers

__all__ = ["write_html", "render_html", "payload_json"]

DEFAULT_TITLE = "attnlab explorer"
_PLACEHOLDER = re.compile(r"\{\{(TITLE|DATA)\}\}")
# Characters that must never appear raw inside the data <script> element.
_JSON_UNSAFE = re.compile("[<>&\u2028\u2029\ud800-\udfff]")


def _template() -> str:
    return importlib.resources.files(__package__).joinpath("explorer.html").read_text("utf-8")


def payload_json(tokens: Sequence[str], data: np.ndarray, title: str) -> str:
    """The data JSON for checked ``(layers, heads, q_len, k_len)`` weights in [0, 1],
    safe to place verbatim inside a ``<script>`` element."""
    n_layers, n_heads, q_len, k_len = data.shape
    quantised = np.rint(np.clip(data, 0.0, 1.0) * 255.0).astype(np.uint8)
    payload = {
        "format": "attnlab-explorer",
        "version": 1,
        "title": title,
        "tokens": list(tokens),
        "layers": n_layers,
        "heads": n_heads,
        "q_len": q_len,
        "k_len": k_len,
        "encoding": "uint8-base64",
        "scale": 255,
        "weights": base64.b64encode(quantised.tobytes(order="C")).decode("ascii"),
    }
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def render_html(tokens: Sequence[str], attentions: Any, title: str | None = None) -> str:
    """The explorer page as a string (what :func:`write_html` writes)."""
    data, tokens = as_layers(attentions, tokens)
    if title is None:
        title = DEFAULT_TITLE
    elif not isinstance(title, str):
        raise TypeError(f"title: expected a string or None, got {type(title).__name__}")
    values = {"TITLE": html.escape(title, quote=True), "DATA": payload_json(tokens, data, title)}
    # One pass, so text substituted for one placeholder is never scanned for another.
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], _template())


def write_html(path: str | os.PathLike[str], tokens: Sequence[str], attentions: Any,
               title: str | None = None) -> pathlib.Path:
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
            weights in [0, 1]; queries are the last ``q_len`` tokens.
        title: page title, HTML-escaped; defaults to "attnlab explorer".

    Returns:
        The path written. The write is atomic (:func:`attnlab.io.atomic_write_bytes`:
        temp file, fsync, rename, directory fsync). Weights are stored as uint8
        (error <= 1/510).

    Raises:
        ValueError: shapes disagree with each other or with ``tokens``, or the
            weights are non-finite or outside [0, 1].
    """
    path = pathlib.Path(path)
    text = render_html(tokens, attentions, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Lone surrogates (only possible in the title; the JSON escapes them) become "?".
    atomic_write_bytes(path, text.encode("utf-8", errors="replace"))
    return path
