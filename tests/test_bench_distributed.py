"""``attnlab bench --suite distributed``: its records, its overlap measure, and that a
plain ``attnlab bench`` leaves it out."""

from __future__ import annotations

import pytest

from attnlab import bench
from attnlab.bench import distributed
from attnlab.bench.runner import Case, Impl


def test_the_distributed_suite_runs_only_when_named():
    assert "distributed" in bench.SUITES
    assert "distributed" not in bench.available_suites()
    names = [c.name for c in distributed.cases(quick=False)]
    assert "fwd T=65536 H=8/8 D=64 N=4 causal zigzag" in names
    assert all("65536" not in c.name for c in distributed.cases(quick=True))


def test_exposed_communication_counts_from_when_the_piece_was_sent():
    """Rank 1 waited 0.0-3.0 s for piece (7, 1), which rank 0 sent at 2.0 s and which
    arrived at 3.0 s: 1.0 s of communication; the first 2.0 s were rank 0 still busy.
    A wait that began after the send counts from its own start."""
    ring = [{"events": [[("sent", 7, 1, 2.0), ("sent", 8, 1, 2.0)]]},
            {"events": [[("received", 7, 1, 0.0, 3.0), ("received", 8, 1, 3.5, 3.75)]]}]
    assert distributed._exposed(ring, 0, 1) == pytest.approx(1.25)
    assert distributed._exposed(ring, 0, 0) == 0.0


def test_a_case_of_no_timed_rounds_takes_its_slowest_rank():
    """The T=65536 case runs no timed rounds: its median was rank 0's first call, where
    its own times_ms (and the suite's definition of a step) take the slowest rank."""
    case = distributed.cases(quick=False)[-1]
    ring = [{"times_ms": [], "first_ms": f, "peak_mb": 10.0} for f in (100., 180., 150., 120.)]
    single = {"times_ms": [], "first_ms": 200., "peak_mb": 20., "gflops": 1.}
    record = distributed._records(case, distributed._spec(65536, rounds=0), ring, single)[0]
    assert record["median_ms"] == 180.0 and record["times_ms"] == [180.0]


def test_under_load_is_said_to_be_left_out():
    lines = []
    distributed.run_cases([], log=lines.append, under_load=True)
    assert len(lines) == 1 and "run quiet only" in lines[0]


@pytest.mark.slow
def test_a_small_case_gives_exact_records_with_memory_and_overlap():
    spec = distributed._spec(97, world=2, heads=4, kv_heads=2, dim=16, backward=True,
                             rounds=1, check=True)
    case = Case("distributed", "exact tiny", [Impl(distributed.RING, ("m", "f", {})),
                                              Impl(distributed.BASELINE, ("m", "f", {}))],
                repeats=1, extra={"spec": spec})
    ring, single = distributed.run_cases([case], log=lambda _line: None)
    assert ring["impl"] == distributed.RING and single["impl"] == distributed.BASELINE
    assert ring["max_error"] < 1e-5
    assert len(ring["per_rank_peak_mb"]) == 2 and single["peak_mb"] > 0
    assert ring["peak_ratio"] is None  # every rank built the whole sequence to check it
    assert all(0.0 <= h <= 1.0 for h in ring["hidden_fraction"])
    assert 0.0 <= ring["hidden_total"] <= 1.0
    assert ring["ratio_to"][distributed.BASELINE] == pytest.approx(
        ring["median_ms"] / single["median_ms"])
    assert "| exact tiny |" in distributed.summary_table([ring, single])
