"""The benchmark suite behind ``attnlab bench``.

Each suite module exposes ``cases(quick) -> list[Case]``; :func:`run` runs the
chosen suites and returns one record per (case, implementation):
``{"suite", "case", "impl", "median_ms", "times_ms", "peak_mb", "ratio_to": {peer: x}}``
where ``x`` is this implementation's median time over the peer's (lower is faster)
and ``times_ms`` the time per call of each round's sample (``calls_per_sample`` calls
back to back: one, or more for a short call; see :mod:`.runner`). ``under_load=True`` adds
``median_ms_under_load``, ``times_ms_under_load`` and ``ratio_to_under_load`` (the same
rounds beside a busy process per core); the attention suite adds ``flop``,
``gflops``, ``peak_share``, ``peak_gflops`` and ``cpu`` (see :mod:`.machine`); the
distributed suite (named only: ``--suite distributed``) adds its own (see
:mod:`.distributed`).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from .runner import SUITES, Case, format_record, markdown_table, run_cases, table_columns

__all__ = ["SUITES", "run", "Case", "format_record", "markdown_table"]


def available_suites() -> list[str]:
    """The suites a plain ``attnlab bench`` runs: those that import here, less the ones
    that must be named (``OPT_IN``: the distributed suite)."""
    out = []
    for name, module in SUITES.items():
        try:
            if getattr(importlib.import_module(module), "OPT_IN", False):
                continue
        except ImportError:
            continue
        out.append(name)
    return out


def select(cases: Sequence[Case], texts: Sequence[str]) -> list[Case]:
    """The cases ``--case`` chooses, in their order: for each text, the case of exactly
    that name if there is one (``"fwd T=4096 causal"`` alone, not its variants
    ``"fwd T=4096 causal softcap"`` ...), else every case whose name contains it; and the
    reference cases that always run (``Case.always``)."""
    names = {c.name for c in cases}
    return [c for c in cases if c.always or any(
        c.name == text if text in names else text in c.name for text in texts)]


def run(suites: Sequence[str] | None = None, *, quick: bool = False, memory: bool = True,
        json_path: str | Path | None = None, log: Callable[[str], None] = print,
        case_filter: str | Sequence[str] | None = None, baseline: str | None = None,
        under_load: bool = False) -> list[dict]:
    """Run the named suites (all available ones by default) and return the records.

    ``case_filter``: a text or several: run only the cases :func:`select` chooses. A suite
    module may define ``annotate(records)`` to add derived numbers (tokens/s).
    ``baseline``: the implementation :func:`markdown_table` will divide by; checked
    here, before any case runs, against the implementations of the chosen cases.
    ``json_path`` is checked before any case runs too. A suite module may define
    ``prologue(log, quick)``, run once before its cases (the attention suite measures the
    machine's peak there, quietly). ``under_load``: each case is timed again beside
    a busy process per core (:mod:`.load`), stopped after the case.
    """
    if json_path is not None:
        from ..io.outdir import check_out_file

        check_out_file(json_path, "json_path")
    names = list(suites) if suites else available_suites()
    for name in names:
        if name not in SUITES:
            raise ValueError(f"suite must be one of {sorted(SUITES)}, got {name!r}")
    modules = {}
    for name in names:
        try:
            modules[name] = importlib.import_module(SUITES[name])
        except ImportError as exc:
            raise ValueError(f"suite {name!r} is not available here: {exc}") from exc
    texts = [case_filter] if isinstance(case_filter, str) else case_filter
    chosen = {name: module.cases(quick=quick) for name, module in modules.items()}
    if texts is not None:
        for text in texts:  # each must name something, or it is a typo
            if not any(text in c.name for cases in chosen.values() for c in cases):
                raise ValueError(f"--case {text!r} matches no case of the suites {names}")
        chosen = {name: select(cases, texts) for name, cases in chosen.items()}
    if baseline is not None:
        impls = sorted({column for name, cases in chosen.items() for c in cases
                        for column in table_columns(modules[name], [i.name for i in c.impls])})
        if baseline not in impls:
            raise ValueError(f"baseline (--baseline) must be one of the implementations of "
                             f"the chosen cases {impls}, got {baseline!r}")
    records: list[dict] = []
    for name, module in modules.items():
        if chosen[name] and hasattr(module, "prologue"):
            module.prologue(log=log, quick=quick)
        # A suite that runs its own processes (distributed) brings its own runner.
        runner = getattr(module, "run_cases", run_cases)
        suite_records = runner(chosen[name], memory=memory, log=log, under_load=under_load)
        if hasattr(module, "annotate"):
            module.annotate(suite_records, log=log)
        records.extend(suite_records)
    if json_path is not None:
        from ..io import atomic_write_text
        from ..io.outdir import check_out_file, signed

        check_out_file(json_path, "json_path")  # again: a file may have appeared meanwhile
        atomic_write_text(json_path, json.dumps(signed(records), indent=1) + "\n")
    return records
