"""The benchmark suite behind ``attnlab bench``.

Each suite module exposes ``cases(quick) -> list[Case]``; :func:`run` runs the
chosen suites and returns one record per (case, implementation):
``{"suite", "case", "impl", "median_ms", "peak_mb", "ratio_to": {peer: x}}``
where ``x`` is this implementation's median time over the peer's (lower is faster).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from .runner import Case, format_record, markdown_table, run_cases

SUITES = {
    "attention": "attnlab.bench.attention",
    "modules": "attnlab.bench.modules",
    "generate": "attnlab.bench.generate",
    "encode": "attnlab.bench.encode",
}

__all__ = ["SUITES", "run", "Case", "format_record", "markdown_table"]


def available_suites() -> list[str]:
    out = []
    for name, module in SUITES.items():
        try:
            importlib.import_module(module)
        except ImportError:
            continue
        out.append(name)
    return out


def run(suites: Sequence[str] | None = None, *, quick: bool = False, memory: bool = True,
        json_path: str | Path | None = None, log: Callable[[str], None] = print) -> list[dict]:
    """Run the named suites (all available ones by default) and return the records."""
    names = list(suites) if suites else available_suites()
    for name in names:
        if name not in SUITES:
            raise ValueError(f"suite must be one of {sorted(SUITES)}, got {name!r}")
    cases: list[Case] = []
    for name in names:
        try:
            module = importlib.import_module(SUITES[name])
        except ImportError as exc:
            raise ValueError(f"suite {name!r} is not available here: {exc}") from exc
        cases.extend(module.cases(quick=quick))
    records = run_cases(cases, memory=memory, log=log)
    if json_path is not None:
        from ..io import atomic_write_text

        atomic_write_text(json_path, json.dumps(records, indent=1) + "\n")
    return records
