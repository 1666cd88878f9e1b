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
    nbformat = _nbformat()

    title = f"# {'第 ' if lang == 'zh' else 'Lesson '}{le.number}" \
            f"{' 课' if lang == 'zh' else ''}: {le.title[lang]}"
    cells = [nbformat.v4.new_markdown_cell(title),
             nbformat.v4.new_code_cell(setup_source(le, lang))]
    for cell in le.cells:
        if isinstance(cell, Code):
            cells.append(nbformat.v4.new_code_cell(cell.text(lang)))
        else:
            cells.append(nbformat.v4.new_markdown_cell(_markdown(cell.text[lang], lang)))
    for i, cell in enumerate(cells):
        cell["id"] = f"{le.name}-{i:02d}"  # fixed, not random: the build is reproducible
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata = {"kernelspec": dict(_KERNEL), "language_info": {"name": "python"},
                   "attnlab": {"cells_sha256": _cells_hash(cells)}}
    return nb


def _cells_hash(cells) -> str:
    """The notebook's mark (its metadata ``attnlab.cells_sha256``): a hash of its cells'
    sources as attnlab wrote them. Running the notebook adds outputs and keeps it; a
    learner's edit of any cell breaks it, and the file is then theirs."""
    import hashlib
    import json

    sources = [["".join(c["source"]) if isinstance(c["source"], list) else c["source"],
                c["cell_type"]] for c in cells]
    return hashlib.sha256(json.dumps(sources, ensure_ascii=False).encode()).hexdigest()


def _as_written(path: Path) -> tuple[str, bool] | None:
    """``(mark, run)`` of the notebook at ``path`` where attnlab wrote it and its cells
    are as written (its mark matches its cells), ``run`` whether it holds a run's outputs
    (the learner's); None where it is not attnlab's or was edited."""
    from ..io.reading import MiB, read_json

    try:
        nb = read_json(path, 16 * MiB, "notebook")
        mark = nb.get("metadata", {}).get("attnlab", {}).get("cells_sha256")
        if not isinstance(mark, str) or mark != _cells_hash(nb.get("cells", [])):
            return None
        return mark, any(c.get("outputs") or c.get("execution_count") is not None
                         for c in nb["cells"] if c.get("cell_type") == "code")
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _nbformat():
    """Jupyter's notebook writer, which attnlab does not install: a clear error without."""
    try:
        import nbformat
    except ImportError as exc:
        raise ModuleNotFoundError("writing notebooks needs the nbformat package (pip install "
                                  "nbformat)", name="nbformat") from exc
    return nbformat


def notebook_text(le: Lesson, lang: str) -> str:
    nbformat = _nbformat()

    return nbformat.writes(notebook(le, lang)) + "\n"


def write_notebooks(folder: str | os.PathLike[str]) -> list[Path]:
    """Write every lesson in every language into ``folder/<lang>/NN-slug.ipynb``.

    Only the notebooks are (re)written, and an existing one only where attnlab wrote it,
    its cells are as written and it holds no outputs (:func:`_as_written`). A run
    notebook whose cells are already the lesson's is left as it is, with its outputs; one
    a learner edited or ran on another version of the lesson is theirs, and the whole
    call is refused, naming it, before anything is written. A notebook file of another
    name already in ``folder/<lang>/`` (a renamed lesson) is reported by the test, not
    deleted here. Returns the paths written (not those kept).
    """
    from ..io import atomic_write_text
    from ..io.locks import output_lock
    from ..io.outdir import check_writable, make_dir
    from .registry import all_lessons

    _nbformat()  # before anything is made
    check_writable(folder, "--write-notebooks")
    plan = [(Path(folder) / lang / f"{le.name}.ipynb", le, lang)
            for lang in LANGS for le in all_lessons()]
    with output_lock(folder, "--write-notebooks"):
        theirs, kept = [], set()
        for path, le, lang in plan:
            if not (path.exists() or path.is_symlink()):
                continue
            found = None if path.is_symlink() or not path.is_file() else _as_written(path)
            run = found is not None and found[1]
            if run and found[0] == notebook(le, lang).metadata["attnlab"]["cells_sha256"]:
                kept.add(path)  # run on this very lesson: its outputs stay
            elif found is None or run:
                theirs.append((path, "run on another version of its lesson (the outputs are "
                               "yours)" if run else "not written by attnlab, or edited since "
                               "(the cells differ from what it wrote)"))
        if theirs:
            (first, why), more = theirs[0], len(theirs) - 1
            raise ValueError(
                f"--write-notebooks {str(folder)!r}: {str(first)!r}"
                f"{f' (and {more} more)' if more else ''}: {why}; left as they are: move "
                "them away or choose another folder")
        make_dir(folder)
        for path, le, lang in plan:
            if path not in kept:
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(path, notebook_text(le, lang))
    return [path for path, _, _ in plan if path not in kept]
