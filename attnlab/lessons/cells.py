"""A lesson as data: markdown cells in two languages and code cells shared by both
(their comments in each language).

One source gives both outputs: :mod:`.runner` prints and runs a lesson in the
terminal, :mod:`.notebooks` writes it as a Jupyter notebook per language.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Lesson", "Markdown", "Code", "md", "code", "LANGS"]

LANGS = ("en", "zh")


@dataclass(frozen=True)
class Markdown:
    text: dict[str, str]  # {"en": ..., "zh": ...}

    def __post_init__(self) -> None:
        if set(self.text) != set(LANGS) or not all(v.strip() for v in self.text.values()):
            raise ValueError(f"a markdown cell needs non-empty {LANGS} texts, got "
                             f"{sorted(self.text)}")


@dataclass(frozen=True)
class Code:
    """A code cell: ``source`` with English comments, ``zh`` each comment's Chinese
    (``{english: chinese}``, the text after ``# ``). Every comment has one, and every
    entry is a comment of the cell, so the two never drift apart."""

    source: str
    zh: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        comments = _comments(self.source)
        missing = [c for c in comments if c not in self.zh]
        unused = [c for c in self.zh if c not in comments]
        if missing or unused:
            raise ValueError(f"a code cell's comments and their zh texts differ: "
                             f"{'untranslated ' + repr(missing[0]) if missing else ''}"
                             f"{'; ' if missing and unused else ''}"
                             f"{'not in the code ' + repr(unused[0]) if unused else ''}")

    def text(self, lang: str) -> str:
        """The cell's code with its comments in ``lang``."""
        if lang == "en":
            return self.source
        import io
        import tokenize

        lines = io.StringIO(self.source).readlines()  # (tokenize's rows, not splitlines')
        for tok in reversed(list(tokenize.generate_tokens(io.StringIO(self.source).readline))):
            if tok.type == tokenize.COMMENT:  # right to left: earlier columns stay put
                (row, col), (_, end) = tok.start, tok.end
                line = lines[row - 1]
                lines[row - 1] = line[:col] + "# " + self.zh[tok.string[1:].strip()] + line[end:]
        return "".join(lines)


def _comments(source: str) -> list[str]:
    """The texts of ``source``'s comments (after ``#``, stripped), in order."""
    import io
    import tokenize

    return [tok.string[1:].strip()
            for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT]


def md(en: str, zh: str) -> Markdown:
    """A text cell; leading/trailing blank lines are dropped."""
    return Markdown({"en": en.strip("\n"), "zh": zh.strip("\n")})


def code(source: str, zh: dict[str, str] | None = None) -> Code:
    """A code cell, the same in both languages but its comments (``zh``: each English
    comment's Chinese); leading/trailing blank lines are dropped."""
    return Code(source.strip("\n"), dict(zh or {}))


@dataclass(frozen=True)
class Lesson:
    """Lesson ``number``: ``slug`` names its files (``NN-slug.ipynb``); ``title`` per
    language; ``sentence`` is True when its code reads ``SENTENCE``, the learner's own
    sentence. The last code cell ends with :func:`attnlab.lessons.kit.check`."""

    number: int
    slug: str
    title: dict[str, str]
    cells: list[Markdown | Code] = field(default_factory=list)
    sentence: bool = False

    @property
    def name(self) -> str:
        return f"{self.number:02d}-{self.slug}"


DEFAULT_SENTENCE = {"en": "I like the blue sky", "zh": "我喜欢蓝色的天空"}

# Imports the setup cell writes when a lesson's code uses the name (ruff-clean notebooks).
_STDLIB = (("math.", "import math"),)
_THIRD_PARTY = (("np.", "import numpy as np"), ("torch.", "import torch"))


def setup_source(lesson: Lesson, lang: str, sentence: str | None = None) -> str:
    """The first code cell: imports, :func:`attnlab.lessons.kit.setup` and, for the lessons
    that use one, ``SENTENCE`` (the learner's own sentence, ``DEFAULT_SENTENCE`` unless
    given)."""
    body = "\n".join(c.source for c in lesson.cells if isinstance(c, Code))
    lines: list[str] = []
    for group in (_STDLIB, _THIRD_PARTY):  # isort's groups, so the notebooks pass ruff
        found = [line for used, line in group if used in body]
        lines += [*found, ""] if found else []
    lines += ["import attnlab"] if "attnlab." in body else []
    lines += ["from attnlab.lessons import kit", "",
              f"kit.setup(lesson={lesson.number}, lang={lang!r})"]
    if lesson.sentence:
        text = DEFAULT_SENTENCE[lang] if sentence is None else sentence
        comment = "你自己的句子：改掉它，再运行一遍" if lang == "zh" else \
            "your own sentence: change it and run the cells again"
        lines.append(f"SENTENCE = {text!r}  # {comment}")
    return "\n".join(lines)


MAX_WORDS = 24


def check_sentence(text: object, lang: str = "en") -> str:
    """The learner's sentence (``--text``): 2 to :data:`MAX_WORDS` words; a bad one is told
    in ``lang``."""
    from .kit import words

    zh = lang == "zh"
    shown = repr(text) if not isinstance(text, str) or len(text) <= 80 else \
        repr(text[:60]) + (f"... ({len(text)} 字符)" if zh else f"... ({len(text)} characters)")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"text (--text) 必须是一个非空的句子，得到 {shown}" if zh else
                         f"text (--text) must be a non-empty sentence, got {shown}")
    n = len(words(text))
    if not 2 <= n <= MAX_WORDS:
        raise ValueError(
            f"text (--text) 必须有 2 到 {MAX_WORDS} 个词（中文按已知词或单字计，"
            f"每个表情符号算一个），{shown} 有 {n} 个" if zh else
            f"text (--text) must have 2 to {MAX_WORDS} words (Chinese: known words or "
            f"characters; each emoji one), got {n} in {shown}")
    return text
