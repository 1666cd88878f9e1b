"""`attnlab bench`: the CPU, the FMA peak and each case's share of it; --under-load (issue 27)."""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

import pytest
import torch

from attnlab import cli, masks
from attnlab.bench import attention, load, machine, runner

ZEN4 = """processor	: 0
vendor_id	: AuthenticAMD
cpu family	: 25
model		: 17
model name	: AMD EPYC 9R14 96-Core Processor
flags		: fpu vme sse sse2 avx fma avx2 avx512f avx512dq avx512_bf16 avx512_vnni vaes

processor	: 1
vendor_id	: AuthenticAMD
cpu family	: 25
model		: 17
model name	: AMD EPYC 9R14 96-Core Processor
flags		: fpu vme sse sse2 avx fma avx2 avx512f avx512dq avx512_bf16 avx512_vnni vaes
"""


def test_describe_cpu_parses_a_zen4_cpuinfo():
    cpu = machine.describe_cpu(ZEN4)
    assert cpu == {"model": "AMD EPYC 9R14 96-Core Processor", "vendor": "AuthenticAMD",
                   "family": 25, "model_id": 17,
                   "flags": ["avx512f", "avx512_bf16", "avx512_vnni", "avx2", "fma"],
                   "logical_cpus": 2}
    assert machine.cpu_line(cpu) == ("AMD EPYC 9R14 96-Core Processor (family 25 model 17, "
                                     "2 CPUs; avx512f avx512_bf16 avx512_vnni avx2 fma)")


def test_describe_cpu_without_avx512_or_without_cpuinfo():
    old = ZEN4.replace(" avx512f avx512dq avx512_bf16 avx512_vnni", "")
    assert machine.describe_cpu(old)["flags"] == ["avx2", "fma"]
    empty = machine.describe_cpu("")
    assert empty["model"] == "unknown CPU" and empty["family"] is None
    assert empty["flags"] == [] and "none of avx512f" in machine.cpu_line(empty)


def test_the_peak_is_read_off_torch_mm_and_attnlab_s_own_tile_product():
    """On AMD CPUs MKL's torch.mm takes its AVX2 path (half a Zen 5's 512-bit rate): the
    kernel's own tile product is timed too where it is built, and both compute the same
    product (a yardstick that skipped work would read high)."""
    from attnlab import _flash

    products = machine._products(128)
    assert len(products) == (2 if _flash.tile_kernel() else 1)
    for product in products[1:]:
        torch.testing.assert_close(product(), products[0](), rtol=1e-4, atol=1e-3)


def test_fma_peak_is_positive_finite_and_restores_threads():
    before = torch.get_num_threads()
    for threads in (1, 2):
        peak = machine.fma_peak(threads, rounds=2, seconds=0.005)
        assert math.isfinite(peak) and peak > 0
        assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads must be an int >= 1, got 0"):
        machine.fma_peak(0)
    a = {"cpu": {}, "threads": 2, "peak_gflops_1": 90.0, "peak_gflops": 20.0}
    b = {"cpu": {}, "threads": 2, "peak_gflops_1": 80.0, "peak_gflops": 170.0}
    assert machine.best(a, b) == {**a, "peak_gflops_1": 90.0, "peak_gflops": 170.0}


# ------------------------------------------------------------------ FLOP counts

def test_flops_against_hand_counts():
    # dense: 4 * B * H * T * T * D
    assert attention.attention_flops(1, 12, 256, 256, 64) == 4 * 12 * 256 * 256 * 64
    assert attention.attention_flops(2, 3, 5, 7, 8) == 4 * 2 * 3 * 5 * 7 * 8
    # causal T=4: 1 + 2 + 3 + 4 = 10 pairs
    assert attention.attention_flops(1, 1, 4, 4, 8, causal=True) == 4 * 10 * 8
    # causal, end-aligned, 2 queries over 5 keys: the queries sit at 3 and 4: 4 + 5 pairs
    assert attention.attention_flops(1, 1, 2, 5, 8, causal=True) == 4 * 9 * 8
    # causal window 2 over T=5: 1 + 2 + 2 + 2 + 2 pairs
    assert attention.attention_flops(1, 1, 5, 5, 8, causal=True, window=2) == 4 * 9 * 8
    # symmetric window 2 over T=4: 2 + 3 + 3 + 2 pairs
    assert attention.attention_flops(1, 1, 4, 4, 8, window=2) == 4 * 10 * 8
    # a window wider than the sequence is no window
    assert attention.allowed_pairs(6, 6, True, 100) == attention.allowed_pairs(6, 6, True)
    # backward is 2.5x the forward: forward+backward 3.5x
    assert attention.attention_flops(1, 1, 4, 4, 8, causal=True, backward=True) == 1120


@pytest.mark.parametrize("q_len,k_len", [(1, 1), (3, 7), (7, 7), (9, 4)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 1, 3, 20])
def test_allowed_pairs_counts_the_mask_rule(q_len, k_len, causal, window):
    m = masks.structural(q_len, k_len, causal=causal, window=window)
    expected = q_len * k_len if m is None else int(m.sum())
    assert attention.allowed_pairs(q_len, k_len, causal, window) == expected


# ------------------------------------------------------------------ records and table

def _tiny_case(name="fwd T=64 causal", **kw):
    return attention._case(name, ["attnlab-auto", "torch-sdpa"], 2, batch=1, heads=2,
                           seq=64, causal=True, **kw)


def test_records_carry_gflops_and_peak_share(tmp_path, monkeypatch, capsys):
    cases = [_tiny_case(), _tiny_case("fwd+bwd T=64 causal", backward=True)]
    monkeypatch.setattr(attention, "cases", lambda quick=False: cases)
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--suite", "attention", "--json", str(out), "--no-memory",
                     "--markdown"]) == 0
    printed = capsys.readouterr().out
    records = json.loads(out.read_text())
    assert len(records) == 4
    flop = {"fwd T=64 causal": 4 * 2 * (64 * 65 // 2) * 64}
    flop["fwd+bwd T=64 causal"] = flop["fwd T=64 causal"] * 7 // 2
    peaks = {r["peak_gflops"] for r in records}
    assert len(peaks) == 1 and all(math.isfinite(p) and p > 0 for p in peaks)
    for r in records:  # the old keys stay, the new ones agree with each other
        assert set(r) >= {"suite", "case", "impl", "median_ms", "times_ms", "peak_mb",
                          "ratio_to", "flop", "gflops", "peak_share", "peak_gflops", "cpu"}
        assert 1 <= r["calls_per_sample"] <= runner.MAX_CALLS
        assert r["flop"] == flop[r["case"]]
        assert r["gflops"] == pytest.approx(r["flop"] / r["median_ms"] * 1e-6)
        assert r["peak_share"] == pytest.approx(r["gflops"] / r["peak_gflops"])
        assert r["cpu"] == machine.cpu_line(machine.describe_cpu())
        assert "median_ms_under_load" not in r  # quiet unless asked
    # the log and the table name the CPU and the peak; each cell its share of it
    assert f"CPU: {records[0]['cpu']}" in printed
    assert "float32 FMA peak (torch.mm" in printed
    row = next(line for line in printed.splitlines() if line.startswith("| fwd T=64 causal |"))
    auto = next(r for r in records if r["impl"] == "attnlab-auto" and "+" not in r["case"])
    assert f"{auto['gflops']:.0f} GFLOP/s ({auto['peak_share']:.0%} of peak)" in row


# ------------------------------------------------------------------ under load

def _busy_children() -> list[int]:
    """Pids of this process's children that are busy-loop spinners (zombies included)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and load.MARKER.encode() in cmdline:
            found.append(int(stat.parent.name))
    return found


@pytest.fixture
def seen_busy(monkeypatch):
    """Count the spinners alive while each step is timed."""
    seen: list[int] = []
    time_once = runner._time_once

    def counting(step, calls=1):
        seen.append(len(_busy_children()))
        return time_once(step, calls)

    monkeypatch.setattr(runner, "_time_once", counting)
    return seen


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_under_load_runs_beside_one_spinner_per_core_and_stops_them(
        tmp_path, monkeypatch, seen_busy, capsys):
    # flash where the native kernel runs here (the under-load table is flash's)
    impl = "attnlab-flash" if attention._flash_skip() is None else "attnlab-auto"
    case = attention._case("fwd T=64 causal", [impl, "torch-sdpa"], 2, batch=1, heads=2,
                           seq=64, causal=True)
    monkeypatch.setattr(attention, "cases", lambda quick=False: [case])
    monkeypatch.setattr(attention.machine, "fma_peak", lambda threads, **kw: 100.0)
    monkeypatch.setattr(runner, "LOADED_MS", 0.0)  # (rounds for time: the test below)
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--suite", "attention", "--under-load", "--no-memory",
                     "--json", str(out), "--markdown"]) == 0
    # 2 implementations x 2 rounds quiet, then 3x as many beside a spinner per core
    assert seen_busy == [0] * 4 + [load.cores()] * 12
    assert _busy_children() == []
    records = {r["impl"]: r for r in json.loads(out.read_text())}
    ours, sdpa = records[impl], records["torch-sdpa"]
    assert len(ours["times_ms_under_load"]) == 6 and ours["median_ms_under_load"] > 0
    quiet = ours["ratio_to"]["torch-sdpa"]
    loaded = ours["ratio_to_under_load"]["torch-sdpa"]
    assert loaded == pytest.approx(ours["median_ms_under_load"] / sdpa["median_ms_under_load"])
    assert ours["load_over_quiet"] == pytest.approx(loaded / quiet)
    if impl == "attnlab-flash":
        added = [r["median_ms_under_load"] - r["median_ms"] for r in (ours, sdpa)]
        row = f"| fwd T=64 causal | {quiet:.2f}x | {loaded:.2f}x | {loaded / quiet:.2f}"
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(row))
        assert line.endswith(f" | {added[0]:+.2f} | {added[1]:+.2f} |")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_under_load_stops_the_spinners_when_a_case_fails(monkeypatch, error):
    calls = []
    time_once = runner._time_once

    def failing(step, n=1):  # the quiet rounds pass; the first loaded one fails (Ctrl-C)
        calls.append(len(_busy_children()))
        if calls[-1]:
            raise error("boom")
        return time_once(step, n)

    monkeypatch.setattr(runner, "_time_once", failing)
    with pytest.raises(error):
        runner.run_cases([_tiny_case()], memory=False, log=lambda line: None,
                         under_load=True)
    assert calls[-1] == load.cores()
    assert _busy_children() == []


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_busy_stops_every_spinner_even_if_one_already_died():
    with load.busy(2) as procs:
        assert sorted(_busy_children()) == sorted(p.pid for p in procs)
        procs[0].kill()
    assert _busy_children() == []
    assert all(p.returncode is not None for p in procs)
    with pytest.raises(ValueError, match=r"n \(busy processes\) must be an int >= 0, got -1"), \
            load.busy(-1):
        pass


def test_a_short_call_is_timed_in_blocks_and_a_long_one_alone(monkeypatch):
    """A sample of a short step is several calls back to back, timed per call; a step
    longer than a sample is one call. Every call is counted: warm-up, the calibrating
    call, then repeats x calls_per_sample."""
    clock = [0.0]
    monkeypatch.setattr(runner.time, "perf_counter", lambda: clock[0])
    calls = {"short": 0, "long": 0}

    def step_of(name, seconds):
        def step():
            calls[name] += 1
            clock[0] += seconds
        return step

    steps = {"short": step_of("short", 0.002), "long": step_of("long", 0.030)}
    monkeypatch.setattr(runner, "build", lambda factory: steps[factory[2]["name"]])
    impls = [runner.Impl(name, ("x", "y", {"name": name})) for name in steps]
    case = runner.Case("attention", "blocks", impls, repeats=3)
    results = runner.time_case(case)
    assert results["short"]["calls_per_sample"] == int(runner.SAMPLE_MS / 2.0) == 10
    assert results["long"]["calls_per_sample"] == 1
    assert results["short"]["times_ms"] == pytest.approx([2.0] * 3)
    assert results["long"]["times_ms"] == pytest.approx([30.0] * 3)
    assert calls == {"short": 1 + 1 + 3 * 10, "long": 1 + 1 + 3}
    # A short step that is subtracted from a long one is timed as often as it.
    impls[0].calls_like = "long"
    results = runner.time_case(runner.Case("attention", "pair", impls, repeats=3))
    assert results["short"]["calls_per_sample"] == 1
    assert results["short"]["times_ms"] == pytest.approx([2.0] * 3)


@pytest.mark.parametrize(("loaded_ms", "most", "rounds"), [(200.0, 100, 10), (100.0, 100, 9),
                                                            (1000.0, 12, 12)])
def test_a_short_case_runs_long_enough_under_load(monkeypatch, loaded_ms, most, rounds):
    """Under load, LOADED_ROUNDS rounds per quiet one, or as many as let the fastest
    implementation's samples (here 10 calls of 2 ms) add up to LOADED_MS, at most
    MAX_LOADED_ROUNDS."""
    clock = [0.0]
    monkeypatch.setattr(runner.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(runner.load, "busy", contextlib.nullcontext)
    monkeypatch.setattr(runner, "LOADED_MS", loaded_ms)
    monkeypatch.setattr(runner, "MAX_LOADED_ROUNDS", most)

    def step_of(seconds):
        def step():
            clock[0] += seconds
        return step

    steps = {"short": step_of(0.002), "long": step_of(0.030)}
    monkeypatch.setattr(runner, "build", lambda factory: steps[factory[2]["name"]])
    impls = [runner.Impl(name, ("x", "y", {"name": name})) for name in steps]
    results = runner.time_case(runner.Case("attention", "loaded", impls, repeats=3),
                               under_load=True)
    assert runner.LOADED_ROUNDS * 3 == 9
    for name in steps:
        assert len(results[name]["times_ms"]) == 3
        assert len(results[name]["times_ms_under_load"]) == rounds
