"""What a lesson's code cells call besides attnlab itself: pictures, the final check, words.

A lesson's code is the same in the notebook and in ``attnlab learn N``; this module is
where the two differ. In a notebook a picture is shown inline; in the terminal
(:func:`terminal`, used by :mod:`attnlab.lessons.runner`) it is written as a PNG into
the output folder. :func:`check` is the last step of every lesson: it raises
``AssertionError`` when a result differs from attnlab's beyond the tolerance.
"""

from __future__ import annotations

import contextlib
import re
import unicodedata
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["setup", "T", "show", "check", "heatmap", "matrix", "bars", "words", "embed",
           "EMBEDDINGS", "terminal", "checks_run"]

# The five words of the first lessons, as small hand-made vectors (three features:
# roughly "person", "action", "colour/nature"): blue and sky point the same way, so
# their dot product and cosine similarity are large. The Chinese words share them.
EMBEDDINGS: dict[str, tuple[float, float, float]] = {
    "i": (0.90, 0.20, 0.10), "like": (0.40, 0.85, 0.20), "the": (0.20, 0.20, 0.25),
    "blue": (0.10, 0.30, 0.90), "sky": (0.15, 0.20, 0.95),
    "我": (0.90, 0.20, 0.10), "喜欢": (0.40, 0.85, 0.20), "的": (0.20, 0.20, 0.25),
    "蓝色": (0.10, 0.30, 0.90), "天空": (0.15, 0.20, 0.95),
}

_STATE: dict[str, Any] = {"lang": "en", "lesson": 0, "out": None, "log": print, "checks": []}


def setup(lesson: int, lang: str = "en") -> None:
    """Start lesson ``lesson`` in ``lang`` (``"en"`` or ``"zh"``): the first code cell."""
    if lang not in ("en", "zh"):
        raise ValueError(f"lang must be 'en' or 'zh', got {lang!r}")
    _STATE.update(lang=lang, lesson=int(lesson), checks=[])


def T(en: str, zh: str) -> str:  # noqa: N802 - short on purpose: it sits inside print()
    """The text in the lesson's language."""
    return zh if _STATE["lang"] == "zh" else en


@contextlib.contextmanager
def terminal(out: str | Path, log: Callable[[str], None] = print) -> Iterator[None]:
    """Inside this block pictures are written into folder ``out`` instead of shown; the
    lesson's cells may time their kernels on one thread (``torch.set_num_threads``), and
    the caller's thread count comes back after it."""
    import torch

    saved, threads = dict(_STATE), torch.get_num_threads()
    _STATE.update(out=Path(out), log=log)
    try:
        yield
    finally:
        _STATE.clear()
        _STATE.update(saved)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def checks_run() -> list[dict]:
    """The checks of the current lesson so far: ``{"what", "diff", "atol", "passed"}``."""
    return list(_STATE["checks"])


# --------------------------------------------------------------------------- the check


def _numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def check(what: str, got: Any, want: Any, atol: float = 1e-6) -> float:
    """Assert that ``got`` equals ``want`` within ``atol`` (largest absolute difference).

    ``want`` is what attnlab (``attnlab.attention`` or the NumPy oracle
    ``attnlab.reference``) computes on the same inputs. Raises ``AssertionError``
    naming ``what`` and the difference when they differ; prints the verdict otherwise.
    """
    got, want = _numpy(got), _numpy(want)
    if got.shape != want.shape:
        _STATE["checks"].append({"what": what, "diff": float("inf"), "atol": atol,
                                 "passed": False})
        raise AssertionError(f"{what}: shape {got.shape} != {want.shape}")
    diff = float(np.max(np.abs(got - want))) if got.size else 0.0
    passed = bool(diff <= atol)  # NaN compares False: a NaN fails too
    _STATE["checks"].append({"what": what, "diff": diff, "atol": atol, "passed": passed})
    if not passed:
        raise AssertionError(T(f"{what}: differs by {diff:.3g}, more than {atol:g}",
                               f"{what}：相差 {diff:.3g}，超过了容差 {atol:g}"))
    print(T(f"✓ check passed: {what} (largest difference {diff:.1e} <= {atol:g})",
            f"✓ 检查通过：{what}（最大差值 {diff:.1e} <= {atol:g}）"))
    return diff


# --------------------------------------------------------------------------- words


_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")


def _clusters(text: str) -> list[str]:
    """``text`` in the characters a reader sees (grapheme clusters, as far as lessons need
    them): an emoji with its skin tone, variation selector or ``ZWJ``-joined parts (👨‍👩‍👧),
    a flag's two regional letters, a letter with its combining marks, each one piece."""
    out: list[str] = []
    for ch in text:
        regional = "\U0001F1E6" <= ch <= "\U0001F1FF"
        joins = out and (ch in "\u200d\ufe0e\ufe0f" or "\U0001F3FB" <= ch <= "\U0001F3FF"
                         or unicodedata.category(ch).startswith("M")
                         or out[-1].endswith("\u200d")
                         or (regional and len(out[-1]) == 1
                             and "\U0001F1E6" <= out[-1] <= "\U0001F1FF"))
        if joins:
            out[-1] += ch
        else:
            out.append(ch)
    return out


def _symbol(piece: str) -> bool:
    """An emoji: a token of its own wherever it stands (a degree sign, a dash stay in
    their word: "20°C")."""
    first = ord(piece[0])
    return first >= 0x1F000 or 0x2600 <= first <= 0x27BF or "\ufe0f" in piece or \
        "\u200d" in piece


def _split_chunk(chunk: str) -> list[str]:
    """One space-free stretch holding Chinese or emoji: the longest known Chinese word at
    each place (:data:`EMBEDDINGS`), else one character; a run of other letters and digits
    one word; every emoji and punctuation mark a token."""
    tokens: list[str] = []
    pieces = _clusters(chunk)
    i = 0
    while i < len(pieces):
        piece = pieces[i]
        if _CJK.match(piece):
            n = next((n for n in (3, 2) if "".join(pieces[i:i + n]) in EMBEDDINGS), 1)
            tokens.append("".join(pieces[i:i + n]))
            i += n
        elif piece[0].isalnum() and not _symbol(piece):
            j = i  # a word of other letters: an apostrophe or hyphen inside it stays ("I'm")
            while j < len(pieces) and not _CJK.match(pieces[j]) and not _symbol(pieces[j]) \
                    and (pieces[j][0].isalnum() or pieces[j] in "'’-" and j + 1 < len(pieces)
                         and pieces[j + 1][0].isalnum() and not _CJK.match(pieces[j + 1])):
                j += 1
            tokens.append("".join(pieces[i:j]))
            i = j
        else:
            tokens.append(piece)
            i += 1
    return tokens


def words(sentence: str) -> list[str]:
    """Split ``sentence`` into tokens: at spaces; a stretch holding Chinese or emoji further
    (:func:`_split_chunk`: the longest known Chinese word at each place, one character
    otherwise, each emoji whole), so that "我喜欢 blue sky", "I like 蓝色的天空" and
    "🐱🐶" split alike; other stretches ("sky.") stay whole."""
    if not isinstance(sentence, str) or not sentence.strip():
        raise ValueError(f"sentence must be a non-empty string, got {sentence!r}")
    tokens: list[str] = []
    for chunk in sentence.split():
        if _CJK.search(chunk) or any(_symbol(p) for p in _clusters(chunk)):
            tokens += _split_chunk(chunk)
        else:
            tokens.append(chunk)
    return tokens


def embed(tokens: Sequence[str]) -> np.ndarray:
    """One 3-d vector per token: :data:`EMBEDDINGS` for the known words, a fixed
    pseudo-random vector (seeded by the word itself) for any other."""
    rows = []
    for t in tokens:
        known = EMBEDDINGS.get(t.lower())
        if known is None:
            rng = np.random.default_rng(zlib.crc32(t.encode("utf-8")))
            known = tuple(np.round(rng.uniform(-1.0, 1.0, 3), 2))
        rows.append(known)
    return np.array(rows, dtype=np.float64)


# --------------------------------------------------------------------------- pictures


def _font(labels: Sequence[str]):
    from ..viz import font_context

    return font_context([str(x) for x in labels])


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def heatmap(weights: Any, tokens: Sequence[str], title: str = ""):
    """:func:`attnlab.viz.heatmap` with a title and the axes named in the lesson's language."""
    from ..viz import heatmap as draw

    labels = T("key", "键 (key)"), T("query", "查询 (query)"), T("attention weight", "注意力权重")
    with _font([*tokens, title, *labels]):  # what is drawn: no CJK font asked for in English
        fig = draw(weights, list(tokens))
        ax = fig.axes[0]
        ax.set_xlabel(labels[0])
        ax.set_ylabel(labels[1])
        fig.axes[-1].set_ylabel(labels[2])  # the colour bar
        if title:
            ax.set_title(title)
    return fig


def matrix(values: Any, rows: Sequence[str], cols: Sequence[str], title: str = "",
           label: str = ""):
    """Any matrix (signed values allowed) with its numbers written in the cells."""
    values = _numpy(values)
    with _font([*rows, *cols, title, label]):
        fig = _figure(1.6 + 0.75 * len(cols), 1.2 + 0.6 * len(rows))
        ax = fig.add_subplot()
        image = ax.imshow(values, cmap="viridis")
        ax.set_xticks(range(len(cols)), [str(c) for c in cols])
        ax.set_yticks(range(len(rows)), [str(r) for r in rows])
        for (i, j), x in np.ndenumerate(values):
            ax.text(j, i, f"{x:.2f}", ha="center", va="center", fontsize=8,
                    color="white" if x < values.mean() else "black")
        if title:
            ax.set_title(title)
        fig.colorbar(image, ax=ax, label=label)
    return fig


def bars(labels: Sequence[str], values: Sequence[float], title: str = "", ylabel: str = ""):
    """A bar chart with each value written over its bar."""
    with _font([*labels, title, ylabel]):
        fig = _figure(1.5 + 1.1 * len(labels), 3.6)
        ax = fig.add_subplot()
        drawn = ax.bar([str(x) for x in labels], [float(v) for v in values], color="#3b75af")
        ax.bar_label(drawn, fmt="%.3g", fontsize=8)
        ax.set_ylabel(ylabel)
        if title:
            ax.set_title(title)
    return fig


def show(fig: Any, name: str) -> Path | None:
    """Show ``fig`` inline (notebook) or write ``lesson-NN-<name>.png`` (terminal)."""
    from ..io import atomic_write_bytes
    from ..io.outdir import is_signed, make_dir
    from ..viz.heatmap import png_bytes

    if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name):
        raise ValueError(f"name must be lower-case letters, digits and '-', got {name!r}")
    data = png_bytes(fig)
    out = _STATE["out"]
    if out is None:
        try:
            from IPython.display import Image, display
        except ImportError:  # a plain Python run outside the terminal runner: nothing to show
            return None
        display(Image(data=data))
        return None
    path = out / f"lesson-{_STATE['lesson']:02d}-{name}.png"
    make_dir(out)
    if (path.exists() or path.is_symlink()) and not is_signed(path):
        # a file of the user's that came while the lesson ran (--out was checked before)
        raise ValueError(T(f"{path} is not a picture attnlab wrote; it is left as it is",
                           f"{path} 不是 attnlab 画的图，保持原样"))
    atomic_write_bytes(path, data)
    _STATE["log"](T(f"[picture: {path}]", f"[图片：{path}]"))
    return path
