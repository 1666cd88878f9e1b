"""The `attnlab` command: help, the worked example, bench records, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from attnlab import cli


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnlab", *args], capture_output=True,
                          text=True, timeout=300)


def test_help_lists_commands():
    done = run("--help")
    assert done.returncode == 0
    for command in ("demo", "bench"):
        assert command in done.stdout


def test_bad_argument_is_one_line_exit_2():
    done = run("bench", "--suite", "nope")
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1
    assert "nope" in done.stderr and "Traceback" not in done.stderr


def test_library_value_error_becomes_one_line(capsys, monkeypatch):
    def boom(args):
        raise ValueError("window must be an int >= 1 or None, got 0\nsecond line")

    monkeypatch.setattr(cli, "cmd_demo", boom)
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err
    assert err == "attnlab demo: error: window must be an int >= 1 or None, got 0\n"


def test_bench_records(tmp_path, monkeypatch):
    from attnlab.bench import attention, runner

    case = attention._case("fwd T=64", ["attnlab-auto", "torch-sdpa"], 2, batch=1, heads=2,
                           seq=64)
    monkeypatch.setattr(attention, "cases", lambda quick=False: [case])
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--suite", "attention", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert {r["impl"] for r in records} == {"attnlab-auto", "torch-sdpa"}
    for r in records:
        assert set(r) >= {"suite", "case", "impl", "median_ms", "peak_mb", "ratio_to"}
        assert r["median_ms"] > 0 and r["peak_mb"] is not None
    a, b = records
    assert a["ratio_to"][b["impl"]] == pytest.approx(a["median_ms"] / b["median_ms"])
    table = runner.markdown_table(records).splitlines()
    assert table[0] == "| case | attnlab-auto | torch-sdpa |" and len(table) == 3
    ratio = f"({a['ratio_to']['torch-sdpa']:.2f}x)"  # the default peer of the suite
    assert table[2].startswith("| fwd T=64 |") and ratio in table[2]


def test_bench_json_dash_prints_the_json_alone_and_png_dash_is_refused(tmp_path, monkeypatch,
                                                                      capsys):
    # as the README says of --json -: stdout holds the JSON, the report goes to stderr,
    # and no file named '-' appears; a PNG on stdout is refused in one line.
    from attnlab.bench import attention

    case = attention._case("fwd T=64", ["attnlab-auto"], 2, batch=1, heads=2, seq=64)
    monkeypatch.setattr(attention, "cases", lambda quick=False: [case])
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--suite", "attention", "--no-memory", "--json", "-",
                     "--markdown"]) == 0
    out, err = capsys.readouterr()
    records = json.loads(out)  # (each record signed, as the file's are)
    assert [r["impl"] for r in records] == ["attnlab-auto"]
    assert "fwd T=64" in err and list(tmp_path.iterdir()) == []
    assert cli.main(["ablate", "--heads", "--png", "-"]) == 2
    assert capsys.readouterr().err == ("attnlab ablate: error: --png - : a PNG is an image, "
                                       "not text for standard output; give a file name\n")
    assert list(tmp_path.iterdir()) == []


def test_memprobe_sees_the_step_allocate():
    from attnlab.bench.runner import measure_memory

    small = measure_memory(("attnlab.bench.attention", "make_step",
                            {"impl": "attnlab-eager", "batch": 1, "heads": 4, "seq": 128}))
    big = measure_memory(("attnlab.bench.attention", "make_step",
                          {"impl": "attnlab-eager", "batch": 1, "heads": 4, "seq": 2048}))
    # eager at T=2048, H=4 holds (4, 2048, 2048) float32 scores: at least 64 MB.
    assert small is not None and big is not None
    assert big - small > 60


def test_memprobe_takes_its_baseline_after_the_modules_preload(tmp_path, monkeypatch):
    """What a module's ``preload`` holds (its libraries, as a peer's import loads its own)
    is below the baseline; what ``make_step`` builds is the step's."""
    from attnlab.bench.runner import measure_memory

    (tmp_path / "probe_preload.py").write_text(
        "import numpy as np\n"
        "HELD = []\n"
        "def preload():\n"
        "    HELD.append(np.ones(80 * 2**20 // 8))\n"
        "def make_step(build):\n"
        "    assert HELD, 'preload ran first'\n"
        "    if build:\n"
        "        HELD.append(np.ones(80 * 2**20 // 8))\n"
        "    return lambda: None\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    preloaded = measure_memory(("probe_preload", "make_step", {"build": False}))
    built = measure_memory(("probe_preload", "make_step", {"build": True}))
    assert preloaded is not None and built is not None
    assert preloaded < 20 and built > 70


def test_of_ceiling_pairs_each_round_with_the_ceilings_round():
    """of_ceiling is the median of each round's ratio (a round that ran slow ran slow
    for both), not the ratio of the two medians."""
    from attnlab.bench import generate

    common = {"case": "c", "batch": 1, "new_tokens": 10, "shape": "tiny-llama"}
    ceiling = {"impl": generate.CEILING, "median_ms": 100.0, "times_ms": [100.0, 100.0, 200.0],
               **common}
    ours = {"impl": "attnlab", "median_ms": 230.0, "times_ms": [110.0, 250.0, 230.0], **common}
    generate.annotate([ceiling, ours], log=lambda line: None)
    assert ours["of_ceiling"] == pytest.approx(200 / 230)  # rounds: 0.91, 0.4, 0.87
    assert ours["tokens_per_s"] == pytest.approx(10 / 0.23)
    del ours["times_ms"]  # rounds unknown: the ratio of the medians
    generate.annotate([ceiling, ours], log=lambda line: None)
    assert ours["of_ceiling"] == pytest.approx(100 / 230)
    assert generate.summary_table([ceiling, ours]) == ""  # no transformers record: no row
    peer = {"impl": "transformers", "median_ms": 460.0, **common}
    generate.annotate([ceiling, ours, peer], log=lambda line: None)
    row = generate.summary_table([ceiling, ours, peer]).splitlines()[2]
    assert row.startswith("| c | 43.5 tok/s | 21.7 tok/s |") and row.endswith("| 43%, 2.00x |")
