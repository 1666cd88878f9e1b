"""The lessons as Jupyter notebooks: ``lessons/<lang>/NN-slug.ipynb``, one per language.

``python -m attnlab.lessons --write-notebooks lessons/`` writes them; the files are
committed, and a test holds them equal to what this module writes, so the notebooks
and ``attnlab learn`` never drift apart. Cell ids are fixed and no outputs are
stored, so the same source always gives the same bytes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .cells import LANGS, Code, Lesson, setup_source

__all__ = ["notebook", "notebook_text", "write_notebooks"]

_KERNEL = {"display_name": "Python 3", "language": "python", "name": "python3"}
_BLOCK = re.compile(r"\s*([-*>|#]|```|\d+\.\s)")


def _markdown(text: str, lang: str) -> str:
    """Chinese text is written one sentence a line; a notebook would join such lines with
    a space, so they are joined without one (fenced code, lists, tables stay as written)."""
    if lang != "zh":
        return text
    out: list[str] = []
    fenced = False
    for line in text.split("\n"):
        starts_block = _BLOCK.match(line) is not None or not line.strip()
        joinable = out and out[-1].strip() and not fenced and not starts_block \
            and _BLOCK.match(out[-1]) is None
        if line.strip().startswith("```"):
            fenced = not fenced
        if joinable:
            out[-1] += line.strip()
        else:
            out.append(line)
    return "\n".join(out)


def notebook(le: Lesson, lang: str):
    """Lesson ``le`` in ``lang`` as an ``nbformat`` v4 notebook (no outputs)."""
    import nbformat

    title = f"# {'第 ' if lang == 'zh' else 'Lesson '}{le.number}" \
            f"{' 课' if lang == 'zh' else ''}: {le.title[lang]}"
    cells = [nbformat.v4.new_markdown_cell(title),
             nbformat.v4.new_code_cell(setup_source(le, lang))]
    for cell in le.cells:
        if isinstance(cell, Code):
            cells.append(nbformat.v4.new_code_cell(cell.source))
        else:
            cells.append(nbformat.v4.new_markdown_cell(_markdown(cell.text[lang], lang)))
    for i, cell in enumerate(cells):
        cell["id"] = f"{le.name}-{i:02d}"  # fixed, not random: the build is reproducible
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata = {"kernelspec": dict(_KERNEL), "language_info": {"name": "python"}}
    return nb


def notebook_text(le: Lesson, lang: str) -> str:
    import nbformat

    return nbformat.writes(notebook(le, lang)) + "\n"


def write_notebooks(folder: str | os.PathLike[str]) -> list[Path]:
    """Write every lesson in every language into ``folder/<lang>/NN-slug.ipynb``.

    Only the notebooks are (re)written; a notebook file of another name already in
    ``folder/<lang>/`` (a renamed lesson) is reported by the test, not deleted here.
    Returns the paths written.
    """
    from ..io import atomic_write_text
    from .registry import all_lessons

    written = []
    for lang in LANGS:
        target = Path(folder) / lang
        target.mkdir(parents=True, exist_ok=True)
        for le in all_lessons():
            path = target / f"{le.name}.ipynb"
            atomic_write_text(path, notebook_text(le, lang))
            written.append(path)
    return written
