"""tools/measure.py, the measurements the README quotes beyond `attnlab bench`: each
subcommand runs at a small size and prints its numbers (so the README's commands do not
rot)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "measure.py"


@pytest.fixture(scope="module")
def measure():
    spec = importlib.util.spec_from_file_location("measure", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _numbers(line: str, pattern: str = r"\d+\.\d+") -> list[float]:
    """The values after a line's first colon (not the p of p10)."""
    return [float(x) for x in re.findall(pattern, line.split(":", 1)[-1])]


@pytest.mark.parametrize("argv, per_line", [
    (["stretches", "--seq", "64", "--stretches", "2", "--seconds", "0.02"], 3),
    (["spread", "--seq", "64", "--calls", "4"], 6),
])
def test_loaded_timings_print_a_line_per_implementation(measure, capsys, argv, per_line):
    measure.main(argv)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" ")[0] for line in lines] == ["flash", "sdpa"]
    for line in lines:
        values = _numbers(line)
        assert len(values) == per_line and all(v > 0 for v in values), line


def test_embed_threads_prints_both_ways_per_pair(measure, capsys):
    measure.main(["embed-threads", "--pairs", "1", "--sentences", "12"])
    (line,) = capsys.readouterr().out.splitlines()
    side, serial = (int(x) for x in re.findall(r"(\d+) ms", line))
    assert line.startswith("side by side") and side > 0 and serial > 0


def test_ort_needs_the_peer(measure, capsys):
    pytest.importorskip("onnxruntime")
    measure.main(["ort", "--calls", "2", "--sentences", "8", "--spinning", "0"])
    line = capsys.readouterr().out.strip()
    assert line.startswith("onnxruntime spinning=0:")
    assert len(_numbers(line, r"\b\d+\b")) == 3  # two calls and their median


def test_decode_prints_a_rate_per_call(measure, capsys):
    pytest.importorskip("gguf")
    from attnlab.interop import smollm2

    try:
        smollm2.gguf_path()
    except ValueError as exc:
        pytest.skip(str(exc))
    measure.main(["decode", "--tokens", "3", "--calls", "2", "--temperature", "0", "--quiet"])
    line = capsys.readouterr().out.strip()
    assert line.startswith("decode threads=") and "quiet" in line
    assert len(_numbers(line.split("T=0.0 ", 1)[1])) == 3  # two calls and their median
