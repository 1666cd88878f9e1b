"""The benchmark runner behind ``attnlab bench``.

A case is one workload (``"fwd T=4096 causal"``) run by several implementations
(``"attnlab auto"``, ``"torch sdpa"``, ...). Each implementation is described by
a *factory*: ``(module, function, kwargs)``; calling it returns a zero-argument
``step`` that runs the workload once on inputs it has already built. The same
factory is used in this process for timing and in a fresh subprocess for memory,
so both measure the same thing.

Timing: every implementation of a case is warmed up, then the implementations
take turns (``repeats`` rounds, each in its own order, seeded by the case's name)
so that a noisy neighbour, or the one before, slows all of them alike; we report
the median and the ratio of medians to each peer. A sample is one call, or as many
back-to-back calls as fill about ``SAMPLE_MS`` for a short one (``calls_per_sample``
in the record; the time is per call), as ``timeit`` and ``torch.utils.benchmark`` time
blocks: a 1 ms call timed alone right after another implementation measures that
one's leftovers in the caches and the thread pool's wake-up as much as itself.

Memory: a fresh ``python -m attnlab.bench.memprobe`` per (case, implementation)
builds the step and runs it once; ``peak_mb`` is its RSS high-water mark
(``VmHWM``) minus its RSS after imports, so it includes the inputs and
outputs the step holds.

Peers (``Impl.isolated``) are timed in a worker process of their own
(:mod:`.worker`), called from the same rounds: they run as they do in use, not beside
this process's torch threads.

Under load (``under_load=True``): after the quiet rounds, the same warm steps run
``LOADED_ROUNDS`` times as many rounds (more for a short case: ``LOADED_MS``) beside one
spinning process per core
(:mod:`.load`), started before and stopped after them (a sample there is 1x-5x its quiet
time by where the OS puts the threads: a median of five said more about that than about
the implementation); the records get ``median_ms_under_load``,
``times_ms_under_load`` and ``ratio_to_under_load`` next to the quiet numbers, so
both ratios come from one run.
"""

from __future__ import annotations

import gc
import importlib
import json
import math
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from . import load, worker
from .factory import Factory, build

# Suite name -> the module whose ``cases(quick)`` lists its cases.
SUITES = {
    "attention": "attnlab.bench.attention",
    "modules": "attnlab.bench.modules",
    "generate": "attnlab.bench.generate",
    "encode": "attnlab.bench.encode",
    "distributed": "attnlab.bench.distributed",
    "gpu": "attnlab.bench.gpu",
}


@dataclass
class Impl:
    name: str
    factory: Factory
    # Some peers only run where their dependencies or hardware allow; a reason here
    # is reported instead of a number.
    skip: str | None = None
    # False for a yardstick whose memory means nothing (a loop over bare matrices).
    memory: bool = True
    # True: timed in a process of its own (:mod:`.worker`), as a peer runs in use, not
    # beside torch's thread pool in this one.
    isolated: bool = False
    # Another implementation of the case whose calls per sample this one takes, where
    # their times are subtracted (a step less its one-token twin): both then run as
    # often back to back, one not warm where the other is cold.
    calls_like: str | None = None


@dataclass
class Case:
    suite: str
    name: str
    impls: list[Impl]
    repeats: int = 5
    memory: bool = True
    # Extra numbers a suite wants in every record of the case (e.g. tokens per step).
    extra: dict = field(default_factory=dict)
    # A reference measurement other cases are read against (memory bandwidth): it
    # runs even when ``--case`` selects other cases.
    always: bool = False
    # Checks the implementations' results against each other: called with what each
    # step returned at its first (warm-up) call, ``{impl: output}``; returns
    # ``{impl: {field: value}}``, fields added to those records (e.g. how many greedy
    # tokens agree with a reference). The outputs are kept only for cases that check.
    check: Callable[[dict[str, Any]], dict[str, dict]] | None = None


# A short call is timed in blocks of back-to-back calls of about this many ms (at most
# MAX_CALLS calls): see the module docstring.
SAMPLE_MS = 20.0
MAX_CALLS = 50
# Rounds under load per quiet round, and at least as many as let the fastest
# implementation's samples add up to LOADED_MS beside the load (at most MAX_LOADED_ROUNDS):
# fifteen 20 ms samples of a short case had covered 0.3 s, a few of the OS's time slices,
# and its loaded / quiet ratio to SDPA moved between 0.6 and 1.5 from run to run (fwd T=256
# and T=512 causal, two Zen 4 cores; with 100 rounds 0.56-0.73 and 1.24-1.65 in three runs
# each). See the module docstring.
LOADED_ROUNDS = 3
LOADED_MS = 2000.0
MAX_LOADED_ROUNDS = 100


def _ms_per_call(step: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - start) * 1000.0 / calls


def _time_once(step: Callable[[], object], calls: int = 1) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls of ``step`` (one sample)."""
    return _ms_per_call(step, calls)


def _calls_per_sample(step: Callable[[], object]) -> int:
    """How many calls of the (warm) step fill a sample of about SAMPLE_MS."""
    ms = _ms_per_call(step, 1)
    return max(1, min(MAX_CALLS, int(SAMPLE_MS / max(ms, 1e-3))))


def time_case(case: Case, warmup: int = 1, under_load: bool = False) -> dict[str, dict]:
    """Round-robin timing of every runnable implementation; returns per-impl stats.

    ``under_load``: time ``LOADED_ROUNDS`` times as many rounds beside a busy process per core.
    """
    steps: dict[str, Callable[[], object]] = {}
    calls: dict[str, int] = {}
    results: dict[str, dict] = {}
    outputs: dict[str, Any] = {}
    for impl in case.impls:
        if impl.skip:
            results[impl.name] = {"skipped": impl.skip}
            continue
        try:
            steps[impl.name] = _build_for_timing(impl)
            for i in range(max(warmup, 1 if case.check else 0)):
                out = steps[impl.name]()
                if i == 0 and case.check:
                    outputs[impl.name] = out
            calls[impl.name] = _calls_per_sample(steps[impl.name])
        except Exception as exc:  # a peer that cannot run here is reported, not fatal
            step = steps.pop(impl.name, None)
            if hasattr(step, "close"):
                step.close()
            outputs.pop(impl.name, None)
            results[impl.name] = {"skipped": f"{type(exc).__name__}: {exc}"[:200]}
    for impl in case.impls:
        if impl.calls_like in calls and impl.name in calls:
            calls[impl.name] = calls[impl.calls_like]
    try:
        checked = case.check(outputs) if case.check else {}
        outputs.clear()
        times = _rounds(case, steps, calls)
        for name, ts in times.items():
            results[name] = {"median_ms": statistics.median(ts), "times_ms": ts,
                             "calls_per_sample": calls[name], "checked": checked.get(name, {})}
        if under_load and steps:
            with load.busy():
                loaded = _rounds(case, steps, calls, _loaded_rounds(case, results, calls))
            for name, ts in loaded.items():
                results[name].update(median_ms_under_load=statistics.median(ts),
                                     times_ms_under_load=ts)
    finally:
        for step in steps.values():
            if hasattr(step, "close"):
                step.close()
        steps.clear()
        gc.collect()
    return results


def _loaded_rounds(case: Case, results: dict[str, dict], calls: dict[str, int]) -> int:
    """Rounds under load: see LOADED_MS."""
    sample_ms = min(results[name]["median_ms"] * calls[name] for name in calls)
    enough = math.ceil(LOADED_MS / max(sample_ms, 1e-3))
    return max(LOADED_ROUNDS * case.repeats, min(MAX_LOADED_ROUNDS, enough))


def _build_for_timing(impl: Impl) -> Callable[[], object]:
    return worker.spawn(impl.factory) if impl.isolated else build(impl.factory)


def _rounds(case: Case, steps: dict[str, Callable[[], object]],
            calls: dict[str, int], rounds: int | None = None) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    order = random.Random(f"{case.suite}/{case.name}")  # the same orders on every run
    for _ in range(case.repeats if rounds is None else rounds):
        # A new order every round: no implementation always runs right after the same
        # one (measured: the step after the textbook path or the tiled one, which free
        # large score buffers, ran 10-25% slower on a 2 ms attention).
        order.shuffle(names)
        for name in names:
            times[name].append(_time_once(steps[name], calls[name]))
    return times


def measure_memory(factory: Factory, timeout: float = 600.0) -> float | None:
    """Peak RSS (MB) of a fresh process that builds the step and runs it once."""
    cmd = [sys.executable, "-m", "attnlab.bench.memprobe", json.dumps(list(factory))]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0:
        return None
    try:
        return float(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def run_cases(cases: Iterable[Case], *, memory: bool = True,
              log: Callable[[str], None] = print, under_load: bool = False) -> list[dict]:
    """Run the cases; return one record per (case, implementation)."""
    records: list[dict] = []
    for case in cases:
        log(f"[{case.suite}] {case.name} ..." + (" (quiet, then under load)" if under_load
                                                  else ""))
        stats = time_case(case, under_load=under_load)
        for impl in case.impls:
            s = stats.get(impl.name, {})
            record = {"suite": case.suite, "case": case.name, "impl": impl.name,
                      "median_ms": s.get("median_ms"), "times_ms": s.get("times_ms"),
                      "calls_per_sample": s.get("calls_per_sample"), "peak_mb": None,
                      "ratio_to": {}, **case.extra}
            if "median_ms_under_load" in s:
                record["median_ms_under_load"] = s["median_ms_under_load"]
                record["times_ms_under_load"] = s["times_ms_under_load"]
            record.update(s.get("checked", {}))
            if "skipped" in s:
                record["skipped"] = s["skipped"]
            elif memory and case.memory and impl.memory:
                record["peak_mb"] = measure_memory(impl.factory)
            records.append(record)
        by_name = {r["impl"]: r for r in records if r["case"] == case.name
                   and r["suite"] == case.suite}
        for r in by_name.values():
            if r["median_ms"] is None:
                continue
            r["ratio_to"] = {
                peer: r["median_ms"] / other["median_ms"]
                for peer, other in by_name.items()
                if peer != r["impl"] and other["median_ms"]
            }
            if r.get("median_ms_under_load") is not None:
                r["ratio_to_under_load"] = {
                    peer: r["median_ms_under_load"] / other["median_ms_under_load"]
                    for peer, other in by_name.items()
                    if peer != r["impl"] and other.get("median_ms_under_load")
                }
        for r in by_name.values():
            log("    " + format_record(r))
    return records


def format_record(r: dict) -> str:
    if r.get("skipped"):
        return f"{r['impl']:<28s} skipped: {r['skipped']}"
    mem = f"{r['peak_mb']:8.0f} MB" if r.get("peak_mb") is not None else "       - MB"
    loaded = r.get("median_ms_under_load")
    under = f" {loaded:10.2f} ms under load" if loaded is not None else ""
    return f"{r['impl']:<28s} {r['median_ms']:10.2f} ms {mem}{under}"


def markdown_table(records: list[dict], baseline: str | None = None) -> str:
    """Markdown tables, one per suite: a row per case, a column per implementation.

    A cell is ``median ms (time / baseline's), peak MB``, plus tokens/s where the
    suite computed them, and GFLOP/s with the share of the measured peak where the
    suite counted FLOPs. ``baseline`` defaults to each suite's ``BASELINE`` peer. A
    suite module may leave implementations out of the columns (``in_table(impl)``
    False) and add a table of its own after it (``summary_table(records)``).
    """
    tables = []
    for suite in dict.fromkeys(r["suite"] for r in records):
        rows = [r for r in records if r["suite"] == suite]
        module = importlib.import_module(SUITES[suite])
        impls = table_columns(module, dict.fromkeys(r["impl"] for r in rows))
        peer = baseline or getattr(module, "BASELINE", None)
        lines = [f"| case | {' | '.join(impls)} |", "|---|" + "---:|" * len(impls)]
        for case in dict.fromkeys(r["case"] for r in rows):
            by_impl = {r["impl"]: r for r in rows if r["case"] == case}
            cells = [_cell(by_impl[i], peer) if i in by_impl else "" for i in impls]
            lines.append(f"| {case} | {' | '.join(cells)} |")
        tables.append("\n".join(lines))
        summary = module.summary_table(rows) if hasattr(module, "summary_table") else ""
        if summary:
            tables.append(summary)
    return "\n\n".join(tables)


def table_columns(module, impls) -> list[str]:
    """The implementations of ``impls`` that a suite's Markdown table shows as columns
    (all of them unless the suite module says otherwise with ``in_table``)."""
    shown = getattr(module, "in_table", None)
    return [i for i in impls if shown is None or shown(i)]


def _cell(r: dict, peer: str | None) -> str:
    if r.get("skipped"):
        return "skipped"
    if r.get("median_ms") is None:
        return "-"
    ms = r["median_ms"]
    text = f"{ms / 1000:.2f} s" if ms >= 10_000 else f"{ms:.1f} ms"
    ratio = r["ratio_to"].get(peer) if peer else None
    if ratio is not None:
        text += f" ({ratio:.2f}x)"
    if r.get("tokens_per_s") is not None:
        text += f", {r['tokens_per_s']:.0f} tok/s"
    if r.get("gflops") is not None:
        text += f", {r['gflops']:.0f} GFLOP/s"
        if r.get("peak_share") is not None:
            text += f" ({r['peak_share']:.0%} of peak)"
    if r.get("gb_per_s") is not None:
        text += f", {r['gb_per_s']:.1f} GB/s"
    if r.get("peak_mb") is not None:
        text += f", {r['peak_mb']:.0f} MB"
    return text
