"""The learner's path: one source for ``attnlab learn N`` and the committed notebooks.

Fast checks: the notebooks in lessons/ are exactly what the build writes, every lesson
has both languages and ends with a check, the check fails when a result is wrong,
and ``attnlab learn`` keeps the CLI's rules (one line + exit 2, a user's folder is
never written into). tests/test_lesson_notebooks.py runs every notebook.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from attnlab import lessons
from attnlab.io.outdir import foreign_entries
from attnlab.lessons import kit
from attnlab.lessons.cells import Code, Lesson, Markdown, code, md
from tests.hostile.conftest import assert_one_line_error, run_cli, snapshot

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "lessons"


def test_the_path_has_fourteen_lessons_in_order():
    numbers = [le.number for le in lessons.all_lessons()]
    assert numbers == list(range(1, 15))
    slugs = [le.slug for le in lessons.all_lessons()]
    assert len(set(slugs)) == 14 and all(re.fullmatch(r"[a-z0-9-]+", s) for s in slugs)


@pytest.mark.parametrize("le", lessons.all_lessons(), ids=lambda le: le.name)
def test_every_lesson_is_bilingual_and_ends_with_a_check(le):
    assert le.title["en"] and le.title["zh"]
    for cell in le.cells:
        if isinstance(cell, Markdown):
            assert re.search(r"[\u4e00-\u9fff]", cell.text["zh"]), cell.text["zh"][:40]
            assert not re.search(r"[\u4e00-\u9fff]", cell.text["en"]), cell.text["en"][:40]
    codes = [c for c in le.cells if isinstance(c, Code)]
    assert codes, "a lesson runs code"
    for c in codes:
        ast.parse(c.source)  # valid Python
    last_call = [n for n in ast.walk(ast.parse(codes[-1].source)) if isinstance(n, ast.Call)
                 and ast.unparse(n.func) == "kit.check"]
    assert last_call, f"lesson {le.number}: its last code cell must call kit.check"
    assert ast.unparse(ast.parse(codes[-1].source).body[-1]).startswith("kit.check("), \
        f"lesson {le.number}: the check must be the last statement"
    if le.sentence:
        assert any("SENTENCE" in c.source for c in codes)


def test_committed_notebooks_equal_the_build():
    from attnlab.lessons.notebooks import notebook_text

    expected = {f"{lang}/{le.name}.ipynb": notebook_text(le, lang)
                for lang in lessons.LANGS for le in lessons.all_lessons()}
    found = {str(p.relative_to(NOTEBOOKS)): p.read_text(encoding="utf-8")
             for p in NOTEBOOKS.glob("*/*.ipynb")}
    assert sorted(found) == sorted(expected), \
        "run: python -m attnlab.lessons --write-notebooks lessons/"
    stale = [name for name in expected if found[name] != expected[name]]
    assert stale == [], f"stale notebooks {stale}; run: python -m attnlab.lessons " \
                        "--write-notebooks lessons/"


def test_the_build_writes_the_same_bytes_twice(tmp_path):
    first = lessons.write_notebooks(tmp_path / "a")
    lessons.write_notebooks(tmp_path / "b")
    assert len(first) == 28
    for path in first:
        twin = tmp_path / "b" / path.relative_to(tmp_path / "a")
        assert path.read_bytes() == twin.read_bytes()


def test_chinese_notebook_text_joins_lines_without_spaces():
    from attnlab.lessons.notebooks import _markdown

    text = "第一句。\n第二句。\n\n- 列表一\n- 列表二\n```\ncode\nmore\n```"
    assert _markdown(text, "zh") == "第一句。第二句。\n\n- 列表一\n- 列表二\n```\ncode\nmore\n```"
    assert _markdown(text, "en") == text


@pytest.mark.parametrize(("env", "want"), [
    ({"LANG": "zh_CN.UTF-8"}, "zh"), ({"LANG": "en_US.UTF-8"}, "en"), ({}, "en"),
    ({"LC_ALL": "zh_TW.UTF-8", "LANG": "en_US.UTF-8"}, "zh"),
    ({"LC_ALL": "C.UTF-8", "LANG": "zh_CN.UTF-8"}, "en"), ({"LANG": "C"}, "en"),
])
def test_default_language_follows_the_locale(env, want):
    assert lessons.default_lang(env) == want


def test_words_and_embeddings():
    assert kit.words("我喜欢蓝色的天空") == ["我", "喜欢", "蓝色", "的", "天空"]
    assert kit.words("I like the blue sky") == ["I", "like", "the", "blue", "sky"]
    assert kit.words("我爱猫") == ["我", "爱", "猫"]
    # mixed scripts split alike whichever comes first; emoji whole, one token each
    assert kit.words("我喜欢 blue sky") == ["我", "喜欢", "blue", "sky"]
    assert kit.words("I like 蓝色的天空") == ["I", "like", "蓝色", "的", "天空"]
    assert kit.words("🐱🐶") == ["🐱", "🐶"]
    assert kit.words("我爱🐱和🐶，你呢？") == ["我", "爱", "🐱", "和", "🐶", "，", "你", "呢", "？"]
    assert kit.words("👨\u200d👩\u200d👧和👍🏽 🇨🇳") == ["👨\u200d👩\u200d👧", "和", "👍🏽", "🇨🇳"]
    assert kit.words("I like the blue sky.") == ["I", "like", "the", "blue", "sky."]
    assert kit.words("It is 20°C today") == ["It", "is", "20°C", "today"]  # not an emoji
    assert kit.words("I'm😀") == ["I'm", "😀"]
    np.testing.assert_array_equal(kit.embed(["蓝色"]), kit.embed(["blue"]))
    np.testing.assert_array_equal(kit.embed(["猫"]), kit.embed(["猫"]))  # fixed, not random
    x = kit.embed(["blue", "sky", "I"])
    cos = (x @ x.T) / np.outer(np.linalg.norm(x, axis=1), np.linalg.norm(x, axis=1))
    assert cos[0, 1] > 0.95 > 0.5 > cos[0, 2]


def test_check_raises_on_a_wrong_result_and_passes_a_right_one():
    kit.setup(lesson=1, lang="en")
    assert kit.check("same", [1.0, 2.0], np.array([1.0, 2.0 + 1e-9])) < 1e-6
    with pytest.raises(AssertionError, match="differs by 0.1"):
        kit.check("wrong", [1.0, 2.1], [1.0, 2.0])
    with pytest.raises(AssertionError):
        kit.check("nan", [float("nan")], [0.0])
    with pytest.raises(AssertionError, match="shape"):
        kit.check("shape", [1.0], [[1.0]])
    assert [c["passed"] for c in kit.checks_run()] == [True, False, False, False]


def _fake(source: str) -> Lesson:
    return Lesson(2, "fake", {"en": "fake", "zh": "假的"}, cells=[md("x", "x"), code(source)])


@pytest.mark.parametrize(("source", "passed"), [
    ("kit.check('ok', 1.0, 1.0)", True),
    ("kit.check('off by 0.5', 1.5, 1.0)", False),  # a planted wrong result
    ("x = 1", False),  # no final check: no verdict of success
])
def test_the_runner_verdict_is_the_final_check(monkeypatch, tmp_path, source, passed):
    from attnlab.lessons import runner

    monkeypatch.setattr(runner, "lesson", lambda n, lang="en": _fake(source))
    lines: list[str] = []
    result = runner.run_lesson(2, lang="en", out=tmp_path / "out", log=lines.append)
    assert result["passed"] is passed
    assert lines[-1].startswith("✓" if passed else "✗")


def test_a_lesson_that_times_on_one_thread_gives_the_callers_threads_back(monkeypatch,
                                                                           tmp_path):
    # lessons 8 and 11 time their kernels on one thread: run_lesson in a notebook or a
    # script left the rest of that process on one thread
    import torch

    from attnlab.lessons import runner

    monkeypatch.setattr(runner, "lesson", lambda n, lang="en": _fake(
        "import torch\ntorch.set_num_threads(1)\nkit.check('ok', 1.0, 1.0)"))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert runner.run_lesson(2, out=tmp_path / "out", log=lambda s: None)["passed"]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_lesson_figures_count_as_attnlabs_own_files(tmp_path):
    """By name and, for a picture, by attnlab's signature in it: a user's own picture that
    happens to be called like a lesson's is theirs."""
    import matplotlib.pyplot as plt

    from attnlab.viz.heatmap import png_bytes

    fig = plt.figure(figsize=(1, 1))
    (tmp_path / "lesson-01-cosine.png").write_bytes(png_bytes(fig))
    plt.close(fig)
    plt.figure(figsize=(1, 1)).savefig(tmp_path / "lesson-02-mine.png")  # not signed
    plt.close("all")
    for name in (".lesson-07-heads.png.k2j3.tmp", "notes.png", "lesson-1-x.png",
                 "lesson-01-x.png.bak"):
        (tmp_path / name).write_bytes(b"x")
    assert foreign_entries(tmp_path) == ["lesson-01-x.png.bak", "lesson-02-mine.png",
                                         "lesson-1-x.png", "notes.png"]


# --------------------------------------------------------------------------- the command


def test_learn_without_a_number_lists_the_lessons(tmp_path):
    proc = run_cli(["learn", "--lang", "zh"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "点积与余弦相似度" in proc.stdout and "在 CPU 上理解 FlashAttention" in proc.stdout
    assert len([ln for ln in proc.stdout.splitlines() if re.match(r"\s+\d+\s", ln)]) == 14
    assert list(tmp_path.iterdir()) == []  # a listing writes nothing


@pytest.mark.parametrize("bad", [["15"], ["0"], ["-1"], ["abc"], ["2", "--lang", "fr"],
                                 ["3", "--text", "  "], ["3", "--text", "sky"]])
def test_a_bad_lesson_is_one_line_and_exit_2(tmp_path, bad):
    proc = run_cli(["learn", *bad], cwd=tmp_path)
    assert_one_line_error(proc)
    assert list(tmp_path.iterdir()) == []


def test_learn_runs_a_lesson_writes_its_picture_and_never_a_users_folder(tmp_path):
    proc = run_cli(["learn", "2", "--lang", "zh", "--out", "pics"], cwd=tmp_path,
                   timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().splitlines()[-1].startswith("✓ 第 2 课：检查通过")
    assert "缩放点积注意力" in proc.stdout
    assert [p.name for p in (tmp_path / "pics").iterdir()] == ["lesson-02-weights.png"]
    assert (tmp_path / "pics" / "lesson-02-weights.png").read_bytes()[:4] == b"\x89PNG"
    again = run_cli(["learn", "2", "--lang", "en", "--out", "pics"], cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr  # its own folder: written again
    assert "Lesson 2: the check passed" in again.stdout

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    before = snapshot(tmp_path)
    proc = run_cli(["learn", "2", "--out", "mine"], cwd=tmp_path)
    assert_one_line_error(proc, "--out", "notes.txt")
    assert snapshot(tmp_path) == before


def test_the_chinese_readme_has_the_two_commands_and_a_first_lesson_that_runs():
    zh = (ROOT / "README.zh-CN.md").read_text(encoding="utf-8")
    en = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = re.search(r"```sh\n(make demo.*?\nmake test.*?\n)```", en).group(1)
    assert f"```sh\n{commands}```" in zh
    assert "attnlab learn" in zh and "attnlab learn" in en and "README.zh-CN.md" in en
    for term in ("注意力", "查询", "键", "值", "掩码", "因果注意力", "多头注意力", "键值缓存"):
        assert term in zh, term
    namespace: dict = {}
    exec("\n".join(re.findall(r"```python\n(.*?)```", zh, re.S)), namespace)  # noqa: S102
    assert namespace["tokens"] == ["我", "喜欢", "蓝色", "的", "天空"]
    assert namespace["cos"][2, 4] > 0.99


def test_a_console_that_cannot_show_an_emoji_gets_a_question_mark_not_an_error(tmp_path):
    """A GBK console (a Chinese Windows) has no 🐱: the lesson prints '?' for it and runs to
    its end (it stopped half-way with "'gbk' codec can't encode character")."""
    proc = subprocess.run([sys.executable, "-m", "attnlab", "learn", "3", "--lang", "zh",
                           "--text", "我爱🐱", "--out", str(tmp_path / "pics")],
                          capture_output=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONIOENCODING": "gbk"})
    assert proc.returncode == 0, proc.stderr.decode("gbk", "replace")
    text = proc.stdout.decode("gbk")
    assert "'爱', '?'" in text  # the words of the sentence, 🐱 shown as '?'


def test_writing_the_notebooks_keeps_a_learners_edits(tmp_path):
    """--write-notebooks rewrites a notebook it wrote; one run on the same lesson keeps
    its outputs (they are the learner's); it refuses, naming it and writing nothing, where
    a learner ran an older version of the lesson, edited a cell, or a file of that name
    is not attnlab's; from the command line one line, exit 2."""
    import hashlib
    import json

    from attnlab.lessons.__main__ import main as lessons_main
    from attnlab.lessons.notebooks import _cells_hash, write_notebooks

    paths = write_notebooks(tmp_path)
    first = paths[0]
    nb = json.loads(first.read_text())
    nb["cells"][-1]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "ok"}]
    nb["cells"][-1]["execution_count"] = 1
    first.write_text(json.dumps(nb))  # run in Jupyter: outputs only
    run = first.read_bytes()
    assert write_notebooks(tmp_path) == paths[1:]  # (and says so: the first is kept)
    assert first.read_bytes() == run  # the same lesson: the outputs stay
    # run on an older version of the lesson (its cells and mark those of another text)
    nb["cells"][0]["source"] = "an older lesson\n"
    nb["metadata"]["attnlab"]["cells_sha256"] = _cells_hash(nb["cells"])
    first.write_text(json.dumps(nb))
    with pytest.raises(ValueError, match="run on another version of its lesson"):
        write_notebooks(tmp_path)
    assert hashlib.sha256(first.read_bytes()).hexdigest() == hashlib.sha256(
        json.dumps(nb).encode()).hexdigest()
    nb["cells"][-1]["outputs"], nb["cells"][-1]["execution_count"] = [], None
    nb["metadata"]["attnlab"]["cells_sha256"] = _cells_hash(nb["cells"])
    first.write_text(json.dumps(nb))  # the older lesson, not run: attnlab's to rewrite
    write_notebooks(tmp_path)
    nb = json.loads(first.read_text())
    assert nb["cells"][0]["source"] != "an older lesson\n"
    nb["cells"][-1]["source"] = "# my answer\n" + "".join(nb["cells"][-1]["source"])
    first.write_text(json.dumps(nb))  # edited
    (paths[1]).write_text("my own notes")  # a file of the name, not a notebook
    before = {p: p.read_bytes() for p in paths}
    with pytest.raises(ValueError, match=r"ipynb' \(and 1 more\): not written by attnlab"):
        write_notebooks(tmp_path)
    assert {p: p.read_bytes() for p in paths} == before
    assert lessons_main(["--write-notebooks", str(tmp_path)]) == 2
    assert {p: p.read_bytes() for p in paths} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["en", "zh"]  # no lock left


def test_writing_notebooks_without_nbformat_is_one_line(tmp_path, monkeypatch, capsys):
    """nbformat comes with Jupyter, not with attnlab: without it, one line and exit 2, and
    nothing written."""
    from attnlab.lessons import notebook, write_notebooks
    from attnlab.lessons.__main__ import main as lessons_main
    from attnlab.lessons.registry import all_lessons

    monkeypatch.setitem(sys.modules, "nbformat", None)  # import nbformat raises ImportError
    assert lessons_main(["--write-notebooks", str(tmp_path / "nb")]) == 2
    assert capsys.readouterr().err == ("python -m attnlab.lessons: error: writing notebooks "
                                       "needs the nbformat package (pip install nbformat)\n")
    assert not (tmp_path / "nb").exists()
    for call in (lambda: write_notebooks(tmp_path / "nb"),  # the library says it too
                 lambda: notebook(all_lessons()[0], "en")):
        with pytest.raises(ModuleNotFoundError, match="needs the nbformat package"):
            call()
    assert not (tmp_path / "nb").exists()


@pytest.mark.parametrize("argv, english, chinese", [
    (["15"], "lesson must be a number from 1 to 14", "课程编号必须是 1 到 14 的数字"),
    (["3", "--text", "猫"], "must have 2 to 24 words", "必须有 2 到 24 个词"),
])
def test_a_bad_lesson_or_sentence_is_told_in_the_learners_language(tmp_path, argv, english,
                                                                    chinese):
    for lang, words in (("en", english), ("zh", chinese)):
        proc = run_cli(["learn", *argv, "--lang", lang], cwd=tmp_path)
        assert_one_line_error(proc)
        assert words in proc.stderr, proc.stderr


def test_a_long_sentence_is_refused_in_a_short_line():
    """The error echoed the whole --text (22 KB for 3000 words) as its one line."""
    from attnlab.lessons.cells import check_sentence

    for lang in ("en", "zh"):
        for text, length in (("word " * 3000, "15000"), (" " * 5000, "5000")):
            with pytest.raises(ValueError) as info:
                check_sentence(text, lang)
            assert len(str(info.value)) < 300 and length in str(info.value)


def test_the_chinese_lessons_comment_their_code_in_chinese():
    # One code cell, two languages: the same program (its syntax tree), its comments in
    # the learner's language (a comment that is only symbols is the same in both).
    import ast
    import io
    import re
    import tokenize

    from attnlab.lessons.cells import Code
    from attnlab.lessons.registry import all_lessons

    cells = [c for le in all_lessons() for c in le.cells if isinstance(c, Code)]
    assert sum(bool(c.zh) for c in cells) >= 30
    for cell in cells:
        zh = cell.text("zh")
        assert ast.dump(ast.parse(zh)) == ast.dump(ast.parse(cell.source))
        for tok in tokenize.generate_tokens(io.StringIO(zh).readline):
            prose = re.sub(r'"[^"]*"', "", tok.string)  # (quoted examples stay as they are)
            if tok.type == tokenize.COMMENT and re.search(r"[A-Za-z]{3,} +[A-Za-z]{3,}", prose) \
                    and not re.search(r"[\u4e00-\u9fff]", tok.string):
                raise AssertionError(f"an English comment in a Chinese cell: {tok.string}")
    with pytest.raises(ValueError, match="untranslated 'my note'"):
        Code("x = 1  # my note")
    with pytest.raises(ValueError, match="not in the code 'gone'"):
        Code("x = 1", {"gone": "没了"})


def test_the_c_locale_without_utf8_mode_gets_question_marks_not_an_error(tmp_path):
    # There Python's streams are ascii with surrogateescape, which cannot encode Chinese
    # either: `learn --lang zh` ended with "'ascii' codec can't encode characters".
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG", "PYTHON"))}
    proc = subprocess.run([sys.executable, "-m", "attnlab", "learn", "--lang", "zh"],
                          capture_output=True, timeout=120, cwd=tmp_path,
                          env={**env, "LC_ALL": "C", "PYTHONUTF8": "0",
                               "PYTHONCOERCECLOCALE": "0",
                               "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert proc.returncode == 0, proc.stderr.decode("ascii", "replace")
    assert b"??" in proc.stdout and b"attention" in proc.stdout.lower()


def test_a_cells_comments_are_swapped_where_tokenize_finds_them():
    # str.splitlines breaks at a form feed or U+2028 inside a string, tokenize does not:
    # the Chinese text moved into the string and the next line became a comment.
    from attnlab.lessons.cells import code

    cell = code('s = "a\u2028b"  # hi\nt = 1  # two', {"hi": "嗨", "two": "二"})
    assert cell.text("zh") == 's = "a\u2028b"  # 嗨\nt = 1  # 二'


def test_a_lesson_picture_never_replaces_a_file_of_the_users(tmp_path):
    """--out was checked before the lesson ran; a picture of the user's under a lesson
    picture's name that came meanwhile was replaced."""
    import numpy as np

    from attnlab.lessons import kit

    with kit.terminal(tmp_path, log=lambda line: None):
        fig = kit.heatmap(np.full((2, 2), 0.5), ["a", "b"])
        path = kit.show(fig, "weights")
        assert kit.show(fig, "weights") == path  # attnlab's own: replaced
        path.write_bytes(b"the user's own picture")
        with pytest.raises(ValueError, match="not a picture attnlab wrote"):
            kit.show(fig, "weights")
    assert path.read_bytes() == b"the user's own picture"
