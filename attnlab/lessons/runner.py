"""``attnlab learn N``: a lesson printed and run in the terminal, pictures saved as PNGs.

The text is printed in the chosen language, each code cell is shown and then run
(in one namespace, as a notebook would), and the lesson's final check decides
the verdict on the last line.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from . import kit
from .cells import Code, Lesson, Markdown, setup_source
from .cells import check_sentence as _check_sentence
from .registry import check_lang, lesson

__all__ = ["run_lesson", "DEFAULT_OUT"]

DEFAULT_OUT = "attnlab-lessons"
_RULE = "─" * 60


def _show_code(source: str, log: Callable[[str], None]) -> None:
    log(_RULE)
    for line in source.splitlines():
        log(f"│ {line}")
    log(_RULE)


def _run_cells(le: Lesson, lang: str, setup: str, log: Callable[[str], None]) -> int:
    """Run the lesson's cells; returns how many checks ran before its last code cell."""
    namespace: dict = {"__name__": f"attnlab_lesson_{le.number:02d}"}
    exec(compile(setup, f"<lesson {le.number} setup>", "exec"), namespace)  # noqa: S102
    last = max(i for i, c in enumerate(le.cells) if isinstance(c, Code))
    before_last = 0
    for i, cell in enumerate(le.cells):
        if isinstance(cell, Markdown):
            log(cell.text[lang])
            log("")
            continue
        if i == last:
            before_last = len(kit.checks_run())
        _show_code(cell.text(lang), log)
        exec(compile(cell.text(lang), f"<lesson {le.number} cell {i}>", "exec"),  # noqa: S102
             namespace)
        log("")
    return before_last


def run_lesson(number: int, *, lang: str = "en", out: str | os.PathLike[str] = DEFAULT_OUT,
               text: str | None = None, log: Callable[[str], None] = print) -> dict:
    """Print and run lesson ``number`` in ``lang``; pictures go to folder ``out``.

    Args:
        number: the lesson, 1 to 14 (:data:`attnlab.lessons.LESSONS`).
        lang: ``"en"`` or ``"zh"``.
        out: folder for the PNGs (``lesson-NN-<name>.png``). Like every attnlab output
            folder it must be new, empty or hold only files attnlab writes
            (:func:`attnlab.io.outdir.check_own_dir`): a user's file is never replaced.
        text: the learner's own sentence for the lessons that use one (default: "I like
            the blue sky" / "我喜欢蓝色的天空").
        log: where the lesson's text goes.

    Returns:
        ``{"lesson", "passed", "checks", "out"}``; ``passed`` is True when the final
        check ran and held. A failed check does not raise: it is the verdict.
    """
    from ..io.locks import output_lock
    from ..io.outdir import check_own_dir

    check_lang(lang)
    le = lesson(number, lang)
    if text is not None:
        _check_sentence(text, lang)
    check_own_dir(out)
    zh = lang == "zh"
    log(f"══ {'第 ' if zh else 'Lesson '}{le.number}{' 课' if zh else ''} · {le.title[lang]} ══")
    log(("图片保存在 " if zh else "Pictures are saved in ") + f"{Path(out)}/")
    if text is not None and not le.sentence:
        log("（这一课不用 --text 的句子）" if zh else "(this lesson does not use --text)")
    log("")
    failure = None
    with output_lock(out), kit.terminal(out, log):
        try:
            before_last = _run_cells(le, lang, setup_source(le, lang, text), log)
        except AssertionError as exc:
            failure = str(exc) or "AssertionError"
        checks = kit.checks_run()
    if failure is None and len(checks) == before_last:
        failure = "最后一步没有运行检查" if zh else "the last step ran no check"
    passed = failure is None and all(c["passed"] for c in checks)
    if passed:
        log(f"✓ 第 {le.number} 课：检查通过，结果与 attnlab 一致。" if zh else
            f"✓ Lesson {le.number}: the check passed; the result equals attnlab's.")
    else:
        log(f"✗ 第 {le.number} 课：检查没有通过：{failure}" if zh else
            f"✗ Lesson {le.number}: the check failed: {failure}")
    return {"lesson": le.number, "passed": passed, "checks": checks, "out": Path(out)}
