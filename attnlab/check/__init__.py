"""``attnlab check``: run a learner's own attention against the oracle and name each bug.

``attnlab.check(fn_or_module)`` in a notebook, ``attnlab check FILE:NAME`` on the
command line. The learner's code runs over a sweep of shapes, masks, causal,
batch and empty rows (:mod:`.sweep`); where it differs from the oracle, the
oracle is run again with each mistake the tutorials make applied (:mod:`.oracle`),
alone and in pairs and triples, and the mistakes whose variant reproduces every
output are reported, one sentence each (:mod:`.messages`, English and Chinese).
When nothing reproduces a mismatch, it is reported as it is: by how much and where.

This module can be called: ``attnlab.check(x)`` is ``attnlab.check.check(x)``. (The
package and the function share the name the issue gives them; without this, the
first ``import attnlab.check`` would hide the function behind the module.)
"""

from __future__ import annotations

import itertools
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from torch import nn

from . import messages, oracle, sweep, targets
from .targets import load

__all__ = ["check", "check_spec", "Finding", "Report", "load"]


@dataclass(frozen=True)
class Finding:
    code: str  # a mistake of oracle.FAMILIES, or nan_masked_row, dropout_in_eval, differs, ...
    message: str
    severity: str = "bug"  # "note" findings do not fail the check

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


@dataclass
class Report:
    name: str
    findings: list[Finding] = field(default_factory=list)
    cases: int = 0
    what: str = ""
    lang: str = "en"

    @property
    def ok(self) -> bool:
        return not any(f.severity == "bug" for f in self.findings)

    @property
    def codes(self) -> list[str]:
        return [f.code for f in self.findings]

    def lines(self) -> list[str]:
        out = [str(f) for f in self.findings]
        if self.ok:
            out.insert(0, messages.text("ok", self.lang, name=self.name, n=self.cases,
                                        what=self.what))
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def __repr__(self) -> str:  # what a notebook shows
        return str(self)


def _close(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # The learner computes in float32; the mistakes move outputs by far more than this.
    tol = 2e-4 * (1.0 + float(np.nanmax(np.abs(b), initial=0.0)))
    return np.abs(a - b) <= tol


class _Diagnosis:
    def __init__(self, target: sweep.Target) -> None:
        self.t = target
        self.cases = target.cases()
        self.results: dict[sweep.Case, np.ndarray | BaseException] = {}
        for case in self.cases:
            try:
                self.results[case] = target.run(case)
            except targets.LEARNER_ERRORS as exc:  # the learner's code: anything may come
                self.results[case] = exc
        self._cache: dict[tuple, np.ndarray | None] = {}

    def variant(self, case: sweep.Case, bugs: frozenset[str], empty: str = "zero"):
        key = (case, bugs, empty)
        if key not in self._cache:
            self._cache[key] = self.t.expected(case, bugs, empty)
        return self._cache[key]

    def matches(self, case: sweep.Case, bugs: frozenset[str]) -> bool:
        got, want = self.results[case], self.variant(case, bugs)
        if want is None or isinstance(got, BaseException):
            return want is None and isinstance(got, BaseException)
        if got.shape != want.shape:
            return False
        if bool(np.all(_close(got, want))):
            return True
        free = np.isnan(self.variant(case, bugs, "nan"))  # rows with no key to attend
        if not free.any() or not np.all(_close(got, want)[~free]):
            return False
        mean = self.variant(case, bugs, "mean")
        return bool(np.all((np.isnan(got) | _close(got, want) | _close(got, mean))[free]))

    def applicable(self) -> list[str]:
        """The mistakes that change at least one case's output (or that make it raise)."""
        weight_free = self.t.scale == 1.0
        out = []
        for bug in oracle.FAMILY_OF:
            if (oracle.FAMILY_OF[bug] == "scale" and weight_free) or (
                    bug == "scaled" and not weight_free):
                continue
            for case in self.cases:
                a, b = self.variant(case, frozenset()), self.variant(case, frozenset({bug}))
                if (a is None) != (b is None) or (a is not None and not np.allclose(a, b)):
                    out.append(bug)
                    break
        return out

    def explain(self) -> tuple[frozenset[str], list[sweep.Case]]:
        """The smallest set of mistakes (one per family) that reproduces every case, else the
        set that reproduces the most failing ones; and the cases left unexplained."""
        failing = [c for c in self.cases if not self.matches(c, frozenset())]
        if not failing:
            return frozenset(), []
        bugs = self.applicable()
        passing = [c for c in self.cases if c not in failing]
        best: tuple[int, frozenset[str]] = (0, frozenset())
        for size in (1, 2, 3):
            for combo in itertools.combinations(bugs, size):
                if len({oracle.FAMILY_OF[b] for b in combo}) < size:
                    continue
                s = frozenset(combo)
                if all(self.matches(c, s) for c in failing):
                    if all(self.matches(c, s) for c in passing):
                        return s, []
                elif size < 3 and all(self.matches(c, s) for c in passing):
                    # Counted only where the code gave numbers: a mistake that would also
                    # raise on some inputs (K left untransposed, on non-square ones) does
                    # not explain code that raises on every input, or returns None.
                    n = sum(self.matches(c, s) for c in failing
                            if not isinstance(self.results[c], BaseException))
                    best = max(best, (n, s), key=lambda p: p[0])
        return best[1], [c for c in failing if not self.matches(c, best[1])]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _describe(d: _Diagnosis, case: sweep.Case) -> tuple[str, dict]:
    got, want = d.results[case], d.variant(case, frozenset())
    if isinstance(got, BaseException):
        return "raises", {"exc": _one_line(got), "case": case.label}
    if want is None or got.shape != want.shape:
        return "wrong_shape", {"got": tuple(got.shape), "expected": None if want is None
                               else tuple(want.shape), "case": case.label}
    diff = np.abs(np.nan_to_num(got, nan=np.inf) - want)
    return "differs", {"diff": float(np.max(diff)), "case": case.label}


def diagnose(target: sweep.Target, lang: str) -> tuple[list[Finding], int]:
    """The findings for one target, and the number of cases run."""
    t = lambda code, **kw: messages.text(code, lang, **kw)  # noqa: E731
    first = target.cases()[0]
    try:  # the same input twice: in eval mode the output must not change
        a, b = target.run(first), target.run(first)
        if a.shape == b.shape and not np.all(_close(a, b) | (np.isnan(a) & np.isnan(b))):
            return [Finding("dropout_in_eval", t("dropout_in_eval"))], 1
    except targets.LEARNER_ERRORS:  # reported below, case by case
        pass
    d = _Diagnosis(target)
    findings: list[Finding] = []
    for case in [c for c in d.cases if c.optional and isinstance(d.results[c], Exception)]:
        findings.append(Finding("gqa_skipped", t("gqa_skipped", exc=_one_line(d.results[case])),
                                "note"))
        d.cases.remove(case)
    bugs, unexplained = d.explain()
    info = {"head_dim": target.head_dim, "d_model": target.d_model, "d_in": target.d_in}
    for bug in oracle.FAMILY_OF:
        if bug in bugs and bug not in oracle.BENIGN:
            findings.append(Finding(bug, t(bug, **info)))
    nan_rows = mean_rows = False
    for case in d.cases:
        got = d.results[case]
        if isinstance(got, BaseException) or case in unexplained:
            continue
        free = d.variant(case, frozenset(), "nan")
        want = d.variant(case, bugs)
        if free is None or want is None or free.shape != got.shape:
            continue
        free = np.isnan(free) & np.isnan(d.variant(case, bugs, "nan"))
        nan_rows |= bool(np.isnan(got[free]).any())
        mean_rows |= bool((~np.isnan(got[free]) & ~_close(got[free], want[free])).any())
    if nan_rows:
        findings.append(Finding("nan_masked_row", t("nan_masked_row")))
    if mean_rows:
        findings.append(Finding("masked_row_mean", t("masked_row_mean"), "note"))
    for case in unexplained[:3]:
        code, params = _describe(d, case)
        findings.append(Finding(code, t(code, **params)))
    if len(unexplained) > 3:
        findings.append(Finding("more", t("more", n=len(unexplained) - 3)))
    return findings, len(d.cases)


def _targets(obj: object, name: str) -> list[sweep.Target]:
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        return [sweep.ModuleTarget(m, f"{name}({how})") for m, how in targets.build(obj)]
    if isinstance(obj, nn.Module):
        return [sweep.ModuleTarget(obj, name)]
    if callable(obj):
        n = targets.positional_count(obj)
        if n >= 3:
            return [sweep.FunctionQKV(obj, name)]
        if n >= 1:
            return [sweep.FunctionX(obj, name)]
        raise messages.InputError("no_positional", name=name)
    raise messages.InputError("not_callable", name=name, kind=type(obj).__name__)


def check(obj: Callable | nn.Module | type, *, lang: str | None = None,
          name: str | None = None) -> Report:
    """Check a learner's attention (a function or an ``nn.Module``, a class or an instance)
    against the oracle and return a :class:`Report` (``ok``, ``findings``, printable).

    ``lang``: ``"en"`` or ``"zh"`` (default: from the locale).
    """
    lang = _language(lang)
    name = name or getattr(obj, "__name__", None) or type(obj).__name__
    try:
        return _check(obj, lang, name)
    except messages.InputError as exc:  # said in the report's language
        raise exc.said_in(lang) from None


def _check(obj, lang: str, name: str) -> Report:
    report = Report(name, lang=lang)
    seen: set[str] = set()
    whats = []
    for target in _targets(obj, name):
        findings, n = diagnose(target, lang)
        report.cases += n
        whats.append(target.what[lang])  # what was checked, in the report's language
        for f in findings:
            if f.code not in seen or f.code in ("raises", "differs", "wrong_shape"):
                seen.add(f.code)
                report.findings.append(f)
    report.what = "; ".join(dict.fromkeys(whats))
    return report


def _language(lang: str | None) -> str:
    lang = messages.default_lang() if lang is None else lang
    if lang not in messages.LANGS:
        raise ValueError(f"lang must be one of {', '.join(messages.LANGS)}, got {lang!r}")
    return lang


def check_spec(spec: str, *, lang: str | None = None) -> Report:
    """``FILE:NAME`` -> :func:`check` of that object (what ``attnlab check`` runs)."""
    lang = _language(lang)
    try:
        obj, name = load(spec)
    except messages.InputError as exc:  # said in the report's language
        raise exc.said_in(lang) from None
    return check(obj, lang=lang, name=name)


class _CallableModule(types.ModuleType):
    def __call__(self, obj: Callable | nn.Module | type, *, lang: str | None = None,
                 name: str | None = None) -> Report:
        return check(obj, lang=lang, name=name)


sys.modules[__name__].__class__ = _CallableModule
