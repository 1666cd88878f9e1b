"""Every command checks what it will write and every size it is given before any model
is trained, loaded or measured: a bad option is one line and exit 2 within seconds,
with nothing written, never a failure at the end of a run or a run that never ends.

A run that got past its checks would train, load or benchmark for minutes: the short
subprocess timeouts here are part of each assertion."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab.models.generation import MAX_NEW_TOKENS
from attnlab.training import MAX_STEPS

pytestmark = pytest.mark.slow

FAST = 45  # seconds: the checks take an interpreter start; a run would take minutes


def _place(tmp: Path) -> dict[str, str]:
    """A folder, a file and a FIFO to aim outputs at; a checkpoint that is not there
    (a command that loads it before checking its outputs names it instead)."""
    (tmp / "adir").mkdir()
    (tmp / "afile").write_text("mine\n")
    os.mkfifo(tmp / "afifo")
    return {"dir": "adir", "file": "afile", "fifo": "afifo", "ckpt": "no-such-ckpt"}


OUTPUTS = [
    # (arguments, what the line must name)
    (["ablate", "--json", "/nonexistent/x.json"], ["--json", "does not exist"]),
    (["ablate", "--ckpt", "{ckpt}", "--json", "missing/x.json"], ["--json", "does not exist"]),
    (["ablate", "--ckpt", "{ckpt}", "--json", "{dir}"], ["--json", "is a directory"]),
    (["ablate", "--ckpt", "{ckpt}", "--json", "{file}/x.json"], ["--json", "is a file"]),
    (["ablate", "--ckpt", "{ckpt}", "--json", "{fifo}"], ["--json", "not a regular file"]),
    (["ablate", "--ckpt", "{ckpt}", "--json", "{file}"], ["--json", "attnlab did not write"]),
    (["ablate", "--ckpt", "{ckpt}", "--heads", "--png", "{file}"],
     ["--png", "attnlab did not write"]),
    (["ablate", "--heads", "--png", "{dir}"], ["--png", "is a directory"]),
    (["ablate", "--ckpt", "{ckpt}", "--heads", "--png", "{file}/h.png"], ["--png", "is a file"]),
    (["ablate", "--model", "minilm", "--text", "{file}", "--heads", "--png", "no/h.png"],
     ["--png", "does not exist"]),
    (["ablate", "--out", "{file}"], ["--out", "is a file"]),
    (["ablate", "--out", "{file}/sub"], ["--out", "cannot be written"]),
    (["bench", "--suite", "attention", "--quick", "--json", "{dir}"],
     ["--json", "is a directory"]),
    (["bench", "--suite", "attention", "--quick", "--json", "missing/b.json"],
     ["--json", "does not exist"]),
    (["bench", "--suite", "attention", "--quick", "--json", "{file}"],
     ["--json", "attnlab did not write"]),
    (["show", "hi", "--ckpt", "{ckpt}", "--out", "{file}"], ["--out", "is a file"]),
    (["show", "hi", "--ckpt", "{ckpt}", "--out", "."], ["--out", "did not write"]),
    (["show", "hi", "--ckpt", "{ckpt}", "--out", "{file}/sub"], ["--out", "cannot be written"]),
]


@pytest.mark.parametrize("args, needles", OUTPUTS, ids=lambda v: " ".join(v)[:60])
def test_every_output_is_checked_before_any_work(tmp_path, cli, one_line_error, snap, args,
                                                 needles):
    names = _place(tmp_path)
    before = snap(tmp_path)
    proc = cli([a.format(**names) for a in args], cwd=tmp_path, timeout=FAST)
    one_line_error(proc, *needles)
    assert proc.stdout == ""  # not even the demo's "training first" banner
    assert snap(tmp_path) == before


@pytest.mark.parametrize("extra, needles", [
    (["--markdown"], ["--baseline", "'xyz'", "torch-sdpa", "attnlab-flash"]),
    ([], ["--baseline", "add --markdown"]),
])
def test_bench_baseline_is_checked_before_any_case_runs(tmp_path, cli, one_line_error, extra,
                                                        needles):
    proc = cli(["bench", "--suite", "attention", "--quick", "--baseline", "xyz", *extra,
                "--json", "b.json"], cwd=tmp_path, timeout=FAST)
    one_line_error(proc, *needles)
    assert proc.stdout == "" and not any(tmp_path.iterdir())


def test_bench_run_takes_a_baseline_of_the_chosen_cases(monkeypatch):
    from attnlab import bench

    ran = []
    monkeypatch.setattr(bench, "run_cases", lambda cases, **kw: ran.append(cases) or [])
    assert bench.run(["attention"], quick=True, baseline="torch-sdpa", log=None) == []
    assert ran  # a peer of the chosen cases: the run goes on
    with pytest.raises(ValueError, match=r"baseline \(--baseline\) must be one of .*"
                                         r"'torch-sdpa'.*got 'book PyTorchMHA'"):
        bench.run(["attention"], quick=True, baseline="book PyTorchMHA", log=None)
    assert len(ran) == 1  # refused before any case ran


def test_bench_case_names_one_case_exactly_or_all_that_contain_it(monkeypatch):
    from attnlab import bench
    from attnlab.bench import attention

    ran = []
    monkeypatch.setattr(bench, "run_cases", lambda cases, **kw: ran.append(cases) or [])
    names = {c.name for c in attention.cases()}
    assert {"fwd T=4096 causal", "fwd T=4096 causal softcap"} <= names

    def chosen(case_filter):
        ran.clear()
        bench.run(["attention"], case_filter=case_filter, log=None)
        return [c.name for c in ran[0]]

    assert chosen("fwd T=4096 causal") == ["fwd T=4096 causal"]  # not its variants
    assert chosen(["fwd T=4096 causal", "fwd T=512 causal"]) == [
        n for n in (c.name for c in attention.cases())
        if n in ("fwd T=4096 causal", "fwd T=512 causal")]  # the suite's order
    contain = chosen("T=4096 causal")  # no case of that name: every one containing it
    assert "fwd T=4096 causal softcap" in contain and all("T=4096 causal" in n for n in contain)
    assert len(contain) == sum("T=4096 causal" in n for n in names) > 2
    with pytest.raises(ValueError, match=r"--case 'T=4097' matches no case"):
        bench.run(["attention"], case_filter=["T=4096", "T=4097"], log=None)


# --------------------------------------------------------------------------- sizes

TEXT_NOT_AN_INT = st.sampled_from(["1e23", "1.5", "abc", "", " ", "0x10", "nan", "inf",
                                   "-inf", "1_0e3", "2**70"])
NOT_POSITIVE = st.integers(max_value=0).map(str)


def _ints_over(bound: int):
    return st.one_of(st.integers(min_value=bound + 1, max_value=bound * 10),
                     st.integers(min_value=10**20, max_value=10**40)).map(str)


# (command before the flag, flag, strategy of bad values, what the one line names)
STEPS = st.one_of(NOT_POSITIVE, TEXT_NOT_AN_INT,
                  _ints_over(MAX_STEPS))
MEMORY = st.one_of(NOT_POSITIVE, TEXT_NOT_AN_INT,
                   st.integers(min_value=10**12, max_value=10**40).map(str))
INDEX = st.one_of(st.integers(max_value=-1).map(str), TEXT_NOT_AN_INT)
FLAGS = [
    (["demo", "--out", "o"], "--steps", STEPS, "steps"),
    (["train", "--out", "o"], "--steps", STEPS, "steps"),
    (["train", "--out", "o"], "--checkpoint-every", STEPS, "checkpoint-every"),
    (["train", "--out", "o"], "--batch-size", MEMORY, "batch-size"),
    (["train", "--out", "o"], "--context", MEMORY, "context"),
    (["train", "--out", "o", "--model", "toy"], "--context", MEMORY, "context"),
    (["generate", "--ckpt", "ck", "--prompt", "ab"], "--max-new-tokens",
     st.one_of(NOT_POSITIVE, TEXT_NOT_AN_INT,
               _ints_over(MAX_NEW_TOKENS)), "max-new-tokens"),
    (["generate", "--ckpt", "ck", "--prompt", "ab"], "--top-k",
     st.one_of(NOT_POSITIVE, TEXT_NOT_AN_INT), "top-k"),
    (["generate", "--ckpt", "ck", "--prompt", "ab"], "--temperature",
     st.sampled_from(["nan", "inf", "-inf", "-1", "-1e-300", "x", ""]), "temperature"),
    (["show", "hi", "--ckpt", "ck"], "--layer", INDEX, "layer"),
    (["show", "hi", "--ckpt", "ck"], "--head", INDEX, "head"),
    (["ablate", "--out", "o"], "--layer", INDEX, "layer"),
    (["ablate", "--out", "o", "--layer", "0"], "--head", INDEX, "head"),
    (["ablate", "--out", "o"], "--seed", st.one_of(st.integers(max_value=-1).map(str),
                                                  st.just(str(2**63))), "seed"),
]


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_numeric_option_refuses_bad_values_at_once(cli, one_line_error, snap, data):
    """A bad size, count or index is one line naming its flag, at once: before any text
    is read, model loaded or step trained (a nonexistent --ckpt would be named instead,
    and a run would outlast the timeout), and nothing is written."""
    head, flag, values, named = data.draw(st.sampled_from(FLAGS), label="flag")
    value = data.draw(values, label="value")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "keep.txt").write_text("mine\n")
        before = snap(Path(tmp))  # the fixtures are plain functions: safe to share
        proc = cli([*head, f"{flag}={value}"], cwd=Path(tmp), timeout=FAST)
        one_line_error(proc, named)
        assert proc.stdout == ""
        assert snap(Path(tmp)) == before


def test_text_from_standard_input_trains_and_ablates(tmp_path, cli, one_line_error):
    """`cat notes.txt | attnlab train --text -`: the text comes through the pipe (Chinese
    and emoji), the checkpoint holds its characters, and ablate reads its --text the same
    way; bytes that are not UTF-8, or nothing at all, are one line."""
    import json

    from conftest import ROOT

    text = "我喜欢蓝色的天空。😀 注意力机制让模型学会关注重要的词。\n" * 30
    done = cli(["train", "--text", "-", "--steps", "3", "--batch-size", "2", "--context", "16",
                "--out", "run"], cwd=tmp_path, stdin=text)
    assert done.returncode == 0, done.stderr
    vocab = json.loads((tmp_path / "run" / "tokenizer.json").read_text(encoding="utf-8"))
    assert "😀" in json.dumps(vocab, ensure_ascii=False) and "蓝" in json.dumps(
        vocab, ensure_ascii=False)
    done = cli(["ablate", "--ckpt", "run", "--text", "-", "--layer", "0", "--head", "0"],
               cwd=tmp_path, stdin=text[:200])
    assert done.returncode == 0, done.stderr
    assert "evaluating on --text '-'" in done.stdout
    proc = subprocess.run([sys.executable, "-m", "attnlab", "train", "--text", "-", "--out",
                           "bad"], cwd=tmp_path, input=b"\xff\xfe", capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    proc.stderr, proc.stdout = proc.stderr.decode(), proc.stdout.decode()
    one_line_error(proc, "--text - (standard input) is not UTF-8 text")
    one_line_error(cli(["train", "--text", "-", "--out", "empty"], cwd=tmp_path, stdin=""),
                   "--text '-' is empty")
