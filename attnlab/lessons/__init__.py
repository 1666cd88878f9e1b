"""The learner's path: fourteen lessons from a dot product to the flash kernel.

Each lesson is written once (``lNN_*.py``: markdown in English and Chinese, code
shared by both) and comes out two ways: ``attnlab learn N [--lang zh|en]`` prints
and runs it in the terminal (:func:`run_lesson`), and
``python -m attnlab.lessons --write-notebooks lessons/`` writes it as
``lessons/<lang>/NN-slug.ipynb`` (:func:`write_notebooks`). Every lesson ends with
a check that its result equals ``attnlab.attention`` or the NumPy oracle.
"""

from __future__ import annotations

from .cells import LANGS
from .registry import LESSONS, all_lessons, check_lang, default_lang, lesson, listing

__all__ = ["LESSONS", "LANGS", "lesson", "all_lessons", "default_lang", "check_lang",
           "listing", "run_lesson", "write_notebooks", "notebook"]


def run_lesson(*args, **kwargs):
    """See :func:`attnlab.lessons.runner.run_lesson`."""
    from .runner import run_lesson as run

    return run(*args, **kwargs)


def notebook(*args, **kwargs):
    """See :func:`attnlab.lessons.notebooks.notebook`."""
    from .notebooks import notebook as build

    return build(*args, **kwargs)


def write_notebooks(*args, **kwargs):
    """See :func:`attnlab.lessons.notebooks.write_notebooks`."""
    from .notebooks import write_notebooks as write

    return write(*args, **kwargs)
