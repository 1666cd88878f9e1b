"""Time to the first token and the decoding rate after it, for every engine of a case.

A generate step makes its first token out of the prompt (prefill) and every later one
out of one decoding step. The read bound (:mod:`.bandwidth`) bounds the later ones only:
a decoding step reads every weight once, the prompt is a product of many rows. So each
engine of a batch-1 case runs beside a *twin*: the same step making one token. In each
round, ``time(N tokens) - time(1 token)`` is the time of the ``N - 1`` decoding steps,
whatever the engine does inside (llama.cpp's ``eval``, OpenVINO's ``generate``), which
is how serving measurements split time to first token (TTFT) and time per output token
(TPOT). Twin and step run in the same round a second apart, as every pair the bench reads
against each other; the twin's own model (a second copy loaded) keeps the step's state
out of it.
"""

from __future__ import annotations

import statistics

from . import bandwidth
from .runner import Impl

SUFFIX = " (first token)"


def twin(impl: Impl) -> Impl:
    """``impl``'s step making one token: the same factory with ``new_tokens=1``, timed
    with as many calls per sample as the step (a twin of a small model, a millisecond,
    was timed in blocks of ten or more back to back, warmer than its step); no memory
    probe (its peak is the step's)."""
    module, function, kwargs = impl.factory
    return Impl(impl.name + SUFFIX, (module, function, {**kwargs, "new_tokens": 1}),
                skip=impl.skip, memory=False, isolated=impl.isolated, calls_like=impl.name)


def is_twin(name: str) -> bool:
    return name.endswith(SUFFIX)


def in_table(name: str) -> bool:
    """Whether the suite's main Markdown table has a column for ``name`` (and whether it
    may be ``--baseline``): not a twin, whose one token is in the first-token table, and
    whose time over another engine's whole call would mean nothing."""
    return not is_twin(name)


def decode_ms(step: dict, first: dict) -> list[float]:
    """Per round, the step's time less its twin's: the decoding steps after the first token
    (the medians' difference where the rounds do not pair up)."""
    ts, fs = step.get("times_ms") or [], first.get("times_ms") or []
    if len(ts) != len(fs) or not ts:
        ts, fs = [step["median_ms"]], [first["median_ms"]]
    return [t - f for t, f in zip(ts, fs)]


def annotate(records: list[dict], read: dict | None, read_bytes: float) -> None:
    """Add to each record that has a twin in ``records`` (same case): ``first_token_ms``
    (the twin's median), ``decode_tokens_per_s`` (the median over rounds of ``new_tokens -
    1`` over the step's time less the twin's) and, with the case's ``read`` record
    (``read_bytes`` read per round) and the record's ``bytes_per_token``,
    ``decode_of_bound``: that rate's share of the read bound, paired by round."""
    twins = {(r["case"], r["impl"]): r for r in records
             if is_twin(r["impl"]) and r.get("median_ms")}
    for r in records:
        first = twins.get((r["case"], r["impl"] + SUFFIX))
        if first is None or not r.get("median_ms") or r["new_tokens"] < 2:
            continue
        steps = r["new_tokens"] - 1
        rest = decode_ms(r, first)
        if min(rest) <= 0:  # a round in which the twin was the slower: nothing to read
            continue
        r["first_token_ms"] = first["median_ms"]
        r["decode_tokens_per_s"] = statistics.median(steps / (ms / 1000.0) for ms in rest)
        if read is not None and r.get("bytes_per_token"):
            r["decode_of_bound"] = bandwidth.paired_share(
                read.get("times_ms") or [read["median_ms"]], read_bytes, rest, steps,
                r["bytes_per_token"])
