"""Fonts for every script: the fallback list attnlab hands matplotlib for token labels.

matplotlib draws each character with the first font of ``font.family`` that
has it (glyph fallback, matplotlib >= 3.6), but its default list holds only
DejaVu Sans, which has no CJK and no emoji: Chinese labels become empty boxes
and every missing character costs a ``UserWarning``. Installing a CJK font is
not enough either, because matplotlib's font cache predates it and nothing
puts it in the family list. So :func:`label_fonts` finds the fonts that are
installed (matplotlib's cache first, then the system font folders, registering
what it finds with ``fontManager.addfont``) and :func:`font_context` applies
them to the figures built inside it, without touching the caller's rcParams
for good.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Iterable, Iterator

__all__ = ["label_fonts", "font_context", "missing_characters", "INSTALL_HINT"]

#: The Latin font comes first, so ASCII labels look as they always did.
_LATIN = ["DejaVu Sans"]
#: CJK fonts by family name, most complete first: Noto/Source Han cover simplified and
#: traditional Chinese, kana and hangul; the platform fonts cover at least Chinese.
_CJK = [
    "Noto Sans CJK SC", "Noto Sans CJK JP", "Noto Sans CJK TC", "Noto Sans CJK KR",
    "Source Han Sans SC", "Source Han Sans CN", "Source Han Sans", "Noto Sans SC",
    "WenQuanYi Zen Hei", "WenQuanYi Micro Hei", "Droid Sans Fallback",
    "PingFang SC", "Hiragino Sans GB", "Hiragino Sans", "Heiti SC", "STHeiti",
    "Microsoft YaHei", "SimHei", "Malgun Gothic", "Yu Gothic", "MS Gothic", "Arial Unicode MS",
]
#: Monochrome emoji and symbols (matplotlib's Agg cannot draw colour bitmap fonts).
_EMOJI = ["Symbola", "Noto Emoji", "Segoe UI Emoji", "Segoe UI Symbol", "Apple Symbols"]
#: File-name fragments of those fonts, for the ones matplotlib's cache does not know yet.
_FILE_HINTS = ("cjk", "sourcehan", "wqy", "droidsansfallback", "pingfang", "hiragino", "msyh",
               "simhei", "malgun", "yugoth", "msgothic", "arialuni", "symbola", "notoemoji-",
               "seguiemj", "seguisym", "heiti")

INSTALL_HINT = (
    "no font with these characters is installed; install one and run again "
    "(Debian/Ubuntu: apt install fonts-noto-cjk fonts-symbola; "
    "macOS: brew install --cask font-noto-sans-cjk; "
    "Windows: Settings > Time & language > Language > add Chinese (Simplified) for its fonts)"
)


def _known_names() -> set[str]:
    from matplotlib import font_manager

    return {f.name for f in font_manager.fontManager.ttflist}


@functools.lru_cache(maxsize=1)
def label_fonts() -> tuple[str, ...]:
    """Family names for token labels: DejaVu Sans, then every installed CJK and emoji font
    of the lists above, in that order. Looked up once per process.

    Fonts installed after matplotlib built its cache are found in the system font
    folders and registered for this process (``fontManager.addfont``).
    """
    from matplotlib import font_manager

    wanted = _CJK + _EMOJI
    names = _known_names()
    if not any(n in names for n in wanted):
        for path in font_manager.findSystemFonts():
            stem = path.replace("\\", "/").rsplit("/", 1)[-1].lower().replace(" ", "")
            if any(h in stem for h in _FILE_HINTS):
                with contextlib.suppress(Exception):  # an unreadable font is just skipped
                    font_manager.fontManager.addfont(path)
        names = _known_names()
    return tuple(n for n in _LATIN + wanted if n in names) or ("DejaVu Sans",)


@functools.cache
def _charmap(family: str) -> frozenset[int]:
    """Code points the font of ``family`` has a glyph for."""
    from matplotlib import font_manager
    from matplotlib.font_manager import FontProperties

    path = font_manager.findfont(FontProperties(family=family), fallback_to_default=False)
    return frozenset(font_manager.get_font(path).get_charmap())


def missing_characters(labels: Iterable[str], fonts: Iterable[str] | None = None) -> list[str]:
    """Characters of ``labels`` that no font of ``fonts`` (default :func:`label_fonts`) draws,
    in order of first appearance. Blanks and control characters are not drawn, so never missing.
    """
    maps = [_charmap(f) for f in (label_fonts() if fonts is None else fonts)]
    seen: dict[str, None] = {}
    for label in labels:
        for ch in label:
            if ch in seen or not ch.isprintable() or ch.isspace():
                continue
            # U+FE0F (emoji presentation) and joiners have no glyph of their own.
            if ord(ch) in (0xFE0E, 0xFE0F, 0x200D) or any(ord(ch) in m for m in maps):
                continue
            seen[ch] = None
    return list(seen)


_hinted = False


def _hint_once(missing: list[str]) -> None:
    """One line on stderr per process: which characters, and which package to install."""
    global _hinted
    if _hinted:
        return
    _hinted = True
    shown = "".join(missing[:8]) + ("..." if len(missing) > 8 else "")
    print(f"attnlab: {len(missing)} characters ({shown}) cannot be drawn: {INSTALL_HINT}",
          file=sys.stderr)


@contextlib.contextmanager
def font_context(labels: Iterable[str] = ()) -> Iterator[tuple[str, ...]]:
    """Build figures inside this block and their text uses :func:`label_fonts`.

    ``font.family`` is set to the concrete family names (not "sans-serif"), so
    the texts created here keep them when they are drawn later, outside the
    block. The caller's rcParams are restored on exit. When some character of
    ``labels`` has no font, one line says what to install (once per process) and
    matplotlib's per-glyph warnings are silenced: the picture is still written,
    with empty boxes for those characters. Yields the family list.
    """
    import matplotlib

    labels = list(labels)
    fonts = label_fonts()
    missing = missing_characters(labels, fonts)
    if missing:
        _hint_once(missing)
    with matplotlib.rc_context({"font.family": list(fonts)}), warnings.catch_warnings():
        if missing:
            warnings.filterwarnings("ignore", message=r"Glyph \d+ .* missing from font")
        yield fonts
