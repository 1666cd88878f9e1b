"""Which lessons there are, in which order, and in which language to show them."""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping

from .cells import LANGS, Lesson

__all__ = ["LESSONS", "lesson", "all_lessons", "default_lang", "check_lang", "listing"]

# Lesson number -> module, in the order of the learner's path.
LESSONS = {
    1: "l01_dot_product", 2: "l02_by_hand", 3: "l03_numpy", 4: "l04_simplified",
    5: "l05_self_attention", 6: "l06_causal", 7: "l07_multihead", 8: "l08_toy_model",
    9: "l09_cheat", 10: "l10_knockout", 11: "l11_dropout", 12: "l12_kv_cache",
    13: "l13_gqa", 14: "l14_flash",
}


def lesson(number: object, lang: str = "en") -> Lesson:
    """Lesson ``number`` (1 to 14); a bad number is told in ``lang``."""
    if isinstance(number, bool) or not isinstance(number, int) or number not in LESSONS:
        raise ValueError(
            f"课程编号必须是 1 到 {len(LESSONS)} 的数字，得到 {number!r}；"
            "'attnlab learn' 列出全部课程" if lang == "zh" else
            f"lesson must be a number from 1 to {len(LESSONS)}, got {number!r}; "
            "'attnlab learn' lists them")
    return importlib.import_module(f".{LESSONS[number]}", __package__).LESSON


def all_lessons() -> list[Lesson]:
    return [lesson(n) for n in LESSONS]


def check_lang(lang: object) -> str:
    if lang not in LANGS:
        raise ValueError(f"lang must be one of {', '.join(LANGS)}, got {lang!r}")
    return str(lang)


def default_lang(environ: Mapping[str, str] | None = None) -> str:
    """``"zh"`` when the locale is Chinese (the first set of LC_ALL, LC_MESSAGES, LANG
    starts with ``zh``), else ``"en"``."""
    env = os.environ if environ is None else environ
    for name in ("LC_ALL", "LC_MESSAGES", "LANG"):
        if env.get(name):
            return "zh" if env[name].lower().startswith("zh") else "en"
    return "en"


def listing(lang: str = "en") -> str:
    """The lessons, one line each, and how to start one."""
    check_lang(lang)
    head = "学习路线（attnlab learn N --lang zh）：" if lang == "zh" else \
        "The learner's path (attnlab learn N --lang en):"
    lines = [head]
    lines += [f"  {le.number:2d}  {le.title[lang]}" for le in all_lessons()]
    return "\n".join(lines)
