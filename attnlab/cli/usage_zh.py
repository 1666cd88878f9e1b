"""argparse's own usage errors in Chinese, for the learner's commands (``learn``,
``check``) when their language is Chinese: ``--lang zh``, or no ``--lang`` and a Chinese
locale (:func:`attnlab.lessons.default_lang`). The lessons and ``check`` already speak
Chinese there; a mistyped option should not be the one English line a learner meets.

argparse builds each message from a few English templates (Python's ``argparse``
module, not translated by the standard library); each is matched here whole, with what
it names (options, values, choices) kept as argparse wrote it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_TYPES = {"int": "整数", "float": "数字"}

# (argparse's template as a regex, the Chinese one); tried in order, the first match wins.
_TEMPLATES: tuple[tuple[str, str], ...] = (
    (r"the following arguments are required: (?P<a>.+)", "缺少必需的参数：{a}"),
    (r"unrecognized arguments: (?P<a>.+)", "无法识别的参数：{a}"),
    (r"one of the arguments (?P<a>.+) is required", "必须给出以下参数之一：{a}"),
    (r"ambiguous option: (?P<a>\S+) could match (?P<b>.+)", "有歧义的选项：{a} 可能是 {b}"),
    (r"invalid choice: (?P<a>.+) \(choose from (?P<b>.+)\)", "无效的选择：{a}（可选：{b}）"),
    (r"invalid (?P<t>\w+) value: (?P<a>.+)", "无效的{t}值：{a}"),
    (r"not allowed with argument (?P<a>.+)", "不能与参数 {a} 同时使用"),
    (r"ignored explicit argument (?P<a>.+)", "忽略了显式给出的值 {a}"),
    (r"expected one argument", "需要一个值"),
    (r"expected at most one argument", "最多需要一个值"),
    (r"expected at least one argument", "至少需要一个值"),
    (r"expected (?P<a>\d+) arguments?", "需要 {a} 个值"),
)


def translate(message: str) -> str:
    """``message`` (an argparse error) in Chinese; ``argument X: ...`` keeps X and
    translates what follows. A message argparse did not write (an option's own check,
    already in the library's words) comes back as it was."""
    head = re.fullmatch(r"argument (?P<name>[^:]+): (?P<rest>.+)", message, re.DOTALL)
    if head is not None:
        return f"参数 {head['name']}：{translate(head['rest'])}"
    for pattern, chinese in _TEMPLATES:
        found = re.fullmatch(pattern, message, re.DOTALL)
        if found is not None:
            parts = found.groupdict()
            if "t" in parts:
                parts["t"] = _TYPES.get(parts["t"], parts["t"])
            return chinese.format(**parts)
    return message


def wants_chinese(args: Sequence[str]) -> bool:
    """Whether a learner's command given ``args`` (the whole command line) speaks
    Chinese, read as argparse reads ``--lang``: the last one given wins, an abbreviation
    (``--la zh``) counts; with none, the locale's language."""
    from ..lessons import default_lang

    lang = None
    for i, arg in enumerate(args):
        if arg == "--":
            break
        name, eq, value = arg.partition("=")
        if len(name) >= 3 and "--lang".startswith(name):
            if eq:
                lang = value
            elif i + 1 < len(args):
                lang = args[i + 1]
    return (lang if lang is not None else default_lang()) == "zh"
