"""CI executes every lesson notebook, in both languages, with nbclient.

A notebook fails when any cell raises, which includes its final check
(:func:`attnlab.lessons.kit.check` raises AssertionError when a result differs
from attnlab's). The last cell's output must also show the check's verdict.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "lessons").glob("*/*.ipynb"))
# Every notebook runs in a fresh kernel; the slowest train a toy model for a few seconds.
CELL_TIMEOUT = 240


def test_every_lesson_has_a_notebook_in_both_languages():
    names = {p.relative_to(ROOT / "lessons").as_posix() for p in NOTEBOOKS}
    assert len(names) == 28
    assert {n.split("/", 1)[1] for n in names if n.startswith("en/")} == \
        {n.split("/", 1)[1] for n in names if n.startswith("zh/")}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_the_notebook_runs_and_its_final_check_passes(path, tmp_path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    # The kernel imports attnlab from this checkout, whatever is installed.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError when a cell (the final check too) raises
    last = [c for c in nb.cells if c.cell_type == "code"][-1]
    text = "".join(o.get("text", "") for o in last.outputs if o.get("output_type") == "stream")
    verdict = "✓ 检查通过" if path.parent.name == "zh" else "✓ check passed"
    assert verdict in text, text
    assert not [o for o in last.outputs if o.get("output_type") == "error"]
    assert list(tmp_path.iterdir()) == []  # a notebook shows its pictures, writes no file


@pytest.mark.slow
def test_a_wrong_result_fails_the_notebook(tmp_path, monkeypatch):
    """The run fails when a lesson's final check does: lesson 2 with a planted bug."""
    path = ROOT / "lessons" / "en" / "02-by-hand.ipynb"
    nb = nbformat.read(path, as_version=4)
    last = [c for c in nb.cells if c.cell_type == "code"][-1]
    assert "context, oracle" in last.source
    last.source = last.source.replace("context, oracle", "[[1.0, 2.0], [3.0, 4.0]], oracle")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT,
                                     resources={"metadata": {"path": str(tmp_path)}})
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="AssertionError"):
        client.execute()
