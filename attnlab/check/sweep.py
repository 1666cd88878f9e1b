"""The cases ``attnlab check`` runs (shapes, masks, causal, batch, empty rows) and, for
each, the learner's output and the oracle's (with any set of known mistakes applied)."""

from __future__ import annotations

import dataclasses
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from . import oracle, targets


@dataclass(frozen=True)
class Case:
    label: str
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    k_len: int
    mask: str | None = None  # None, "random", "empty_row" (one query sees nothing), "padding"
    causal: bool = False
    optional: bool = False  # grouped-query inputs: a plain attention need not take them


def make_mask(kind: str | None, q_len: int, k_len: int) -> np.ndarray | None:
    """``(q_len, k_len)`` bool, True = may attend."""
    if kind is None:
        return None
    rng = np.random.default_rng(7)
    if kind == "padding":  # the last keys are padding
        m = np.ones((q_len, k_len), dtype=bool)
        m[:, k_len - max(1, k_len // 3):] = False
        return m
    m = rng.random((q_len, k_len)) < 0.6
    m[np.arange(q_len), rng.integers(0, k_len, q_len)] = True  # every query sees a key
    if kind == "empty_row":
        m[min(1, q_len - 1)] = False
    return m


# What the OK line says of code found causal by its outputs alone.
_INFERRED = {"en": "causal (by its outputs) ", "zh": "（由输出判断为）因果、"}


def _causal_only(target: Target, cases: list[Case]) -> list[Case]:
    """``cases`` as they are, or, where the target's outputs showed it causal with no flag
    saying so (``always_causal``, from :meth:`Target.behaves_causal`), all causal and
    square: a rule written for one sequence has no say on q_len != k_len."""
    if not getattr(target, "always_causal", False):
        return cases
    return [dataclasses.replace(c, causal=True) for c in cases if c.q_len == c.k_len]


class Target:
    """The learner's code and its oracle, one subclass per signature."""

    name: str
    what: str  # what was checked, for the OK line
    rank: int  # the rank of the inputs the learner takes (probed)
    scale: float | None = None  # the oracle's scale; None: 1/sqrt(head_dim)
    head_dim = d_model = d_in = 1

    def cases(self) -> list[Case]:
        raise NotImplementedError

    def inputs(self, case: Case) -> tuple[np.ndarray, ...]:
        raise NotImplementedError

    def call(self, case: Case, arrays: tuple[np.ndarray, ...]) -> object:
        raise NotImplementedError

    def expected(self, case: Case, bugs: frozenset[str], empty: str) -> np.ndarray | None:
        raise NotImplementedError

    def run(self, case: Case) -> np.ndarray:
        with warnings.catch_warnings():  # the learner's deprecations are not findings
            warnings.simplefilter("ignore")
            return targets.as_array(self.call(case, self.inputs(case)))

    def _mask(self, case: Case, bugs: frozenset[str], window: int | None = None) -> np.ndarray:
        return oracle.allowed(case.q_len, case.k_len, causal=case.causal, window=window,
                              mask=make_mask(case.mask, case.q_len, case.k_len), bugs=bugs)

    def behaves_causal(self) -> bool:
        """Whether the code is causal though nothing in its signature or buffers says so
        (a mask built inside ``forward``, a buffer of another name): moving the inputs at
        any position j moves output row j and none before it. (Code that drops the last
        key is not causal by this: moving position 1 moves row 0.)"""
        case = self.cases()[0]  # seq=5, no mask
        arrays = self.inputs(case)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                base = targets.as_array(self.call(case, arrays))
                if base.ndim < 2 or base.shape[-2] < 2:
                    return False
                for j in range(1, base.shape[-2]):
                    moved = tuple(a.copy() for a in arrays)
                    for a in moved:
                        a[..., j, :] += 1.0
                    out = targets.as_array(self.call(case, moved))
                    if out.shape != base.shape or not np.allclose(
                            out[..., :j, :], base[..., :j, :], rtol=0, atol=1e-6) or np.allclose(
                            out[..., j, :], base[..., j, :], rtol=0, atol=1e-6):
                        return False
        except targets.LEARNER_ERRORS:  # said by the cases themselves
            return False
        return True

    def probe_rank(self, ranks: tuple[int, ...], first: Case, square: Case) -> None:
        """Use the first input rank the learner's code takes (a tutorial function may be
        written for ``(seq, d)`` only); try the square case too, where ``q @ k`` runs."""
        for case in (first, square):
            for rank in ranks:
                self.rank = rank
                try:
                    self.run(case)
                    return
                except targets.LEARNER_ERRORS:  # the learner's code: anything may come
                    continue
        self.rank = ranks[0]


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.float32))


def _call_with_mask(fn: Callable, args: list, mask: np.ndarray | None, shapes: list[tuple],
                    name: str | None, keyword: bool, extra: dict) -> object:
    """Call with the mask in the first layout the code takes: ``(q_len, k_len)``
    broadcasts over any batch and heads; then the full layouts."""
    if mask is None or name is None:
        return fn(*args, **extra)
    error: BaseException | None = None
    for shape in shapes:
        m = torch.from_numpy(np.broadcast_to(mask, shape).copy())
        try:
            return fn(*args, **extra, **{name: m}) if keyword else fn(*args, m, **extra)
        except targets.LEARNER_ERRORS as exc:  # the learner's code
            error = error or exc
    raise error  # type: ignore[misc]


class FunctionQKV(Target):
    """``fn(q, k, v[, mask][, causal=])``, compared with the oracle directly."""

    def __init__(self, fn: Callable, name: str) -> None:
        self.fn, self.name = fn, name
        self.mask_name, self.mask_kw = targets.mask_param(fn, 3)
        self.causal_name = targets.causal_param(fn)
        self.head_dim = self.d_model = self.d_in = 8
        base = Case("batch=2 heads=3 seq=5", 2, 3, 3, 5, 5)
        self.probe_rank((4, 3, 2), base, Case("batch=2 heads=3 seq=8=head_dim", 2, 3, 3, 8, 8))
        # a causal function that takes no causal flag (the OK line says how it was known)
        self.always_causal = self.causal_name is None and self.behaves_causal()
        kind = _INFERRED if self.always_causal else {"en": "", "zh": ""}
        self.what = {"en": f"{kind['en']}(q, k, v) of rank {self.rank}",
                     "zh": f"{kind['zh']}{self.rank} 维的 (q, k, v)"}

    def cases(self) -> list[Case]:
        b, h = {4: (2, 3), 3: (2, 1), 2: (1, 1)}[self.rank]
        lead = {4: f"batch={b} heads={h} ", 3: f"batch={b} ", 2: ""}[self.rank]
        out = [Case(f"{lead}seq=5", b, h, h, 5, 5), Case(f"{lead}q_len=3 k_len=6", b, h, h, 3, 6),
               Case(f"{lead}seq=8=head_dim", b, h, h, 8, 8), Case(f"{lead}seq=1", b, h, h, 1, 1)]
        if self.rank == 4:
            out.append(Case("batch=2 q_heads=4 kv_heads=2 seq=5 (GQA)", 2, 4, 2, 5, 5,
                            optional=True))
        if self.mask_name:
            out += [Case(f"{lead}seq=5 random mask", b, h, h, 5, 5, "random"),
                    Case(f"{lead}q_len=3 k_len=6 padding mask", b, h, h, 3, 6, "padding"),
                    Case(f"{lead}seq=5 mask with a fully masked row", b, h, h, 5, 5,
                         "empty_row")]
        if self.causal_name:
            out += [Case(f"{lead}seq=5 causal", b, h, h, 5, 5, causal=True),
                    Case(f"{lead}q_len=3 k_len=6 causal", b, h, h, 3, 6, causal=True)]
            if self.mask_name:
                out.append(Case(f"{lead}seq=5 causal random mask", b, h, h, 5, 5, "random",
                                causal=True))
        return _causal_only(self, out)

    def _shape(self, case: Case, heads: int, length: int) -> tuple[int, ...]:
        return {4: (case.batch, heads, length, 8), 3: (case.batch, length, 8),
                2: (length, 8)}[self.rank]

    def inputs(self, case: Case) -> tuple[np.ndarray, ...]:
        rng = np.random.default_rng(zlib.crc32(case.label.encode()))
        q = rng.standard_normal(self._shape(case, case.heads, case.q_len)).astype(np.float32)
        k, v = (rng.standard_normal(self._shape(case, case.kv_heads, case.k_len)).astype(
            np.float32) for _ in range(2))
        return q, k, v

    def call(self, case: Case, arrays: tuple[np.ndarray, ...]) -> object:
        extra = {self.causal_name: True} if case.causal and self.causal_name else {}
        full = (case.batch, case.heads, case.q_len, case.k_len)[4 - self.rank:]
        return _call_with_mask(self.fn, [_tensor(a) for a in arrays],
                               make_mask(case.mask, case.q_len, case.k_len),
                               [(case.q_len, case.k_len), full], self.mask_name,
                               self.mask_kw, extra)

    def expected(self, case: Case, bugs: frozenset[str], empty: str) -> np.ndarray | None:
        q, k, v = (a.astype(np.float64) for a in self.inputs(case))
        q4, k4, v4 = (a.reshape((1,) * (4 - a.ndim) + a.shape) if self.rank != 3
                      else a[:, None] for a in (q, k, v))
        out = oracle.attend(q4, k4, v4, self._mask(case, bugs),
                            oracle.scale_of(bugs, 8, 8, 8, None), bugs, empty)
        return None if out is None else out.reshape(q.shape)


class FunctionX(Target):
    """A weight-free ``fn(x[, mask])``: ``softmax(x x^T * scale) x``."""

    scale = 1.0

    def __init__(self, fn: Callable, name: str) -> None:
        self.fn, self.name = fn, name
        self.mask_name, self.mask_kw = targets.mask_param(fn, 1)
        self.head_dim = self.d_model = self.d_in = 8
        self.probe_rank((3, 2), Case("batch=2 seq=5", 2, 1, 1, 5, 5),
                        Case("batch=2 seq=8=d", 2, 1, 1, 8, 8))
        self.always_causal = self.behaves_causal()
        kind = _INFERRED if self.always_causal else {"en": "", "zh": ""}
        self.what = {"en": f"{kind['en']}x of rank {self.rank}",
                     "zh": f"{kind['zh']}{self.rank} 维的 x"}

    def cases(self) -> list[Case]:
        b, lead = (2, "batch=2 ") if self.rank == 3 else (1, "")
        out = [Case(f"{lead}seq=5", b, 1, 1, 5, 5), Case(f"{lead}seq=8=d", b, 1, 1, 8, 8),
               Case(f"{lead}seq=1", b, 1, 1, 1, 1)]
        if self.mask_name:
            out += [Case(f"{lead}seq=5 random mask", b, 1, 1, 5, 5, "random"),
                    Case(f"{lead}seq=5 mask with a fully masked row", b, 1, 1, 5, 5,
                         "empty_row")]
        return _causal_only(self, out)

    def inputs(self, case: Case) -> tuple[np.ndarray, ...]:
        rng = np.random.default_rng(zlib.crc32(case.label.encode()))
        shape = (case.batch, case.q_len, 8) if self.rank == 3 else (case.q_len, 8)
        return (0.5 * rng.standard_normal(shape)).astype(np.float32),

    def call(self, case: Case, arrays: tuple[np.ndarray, ...]) -> object:
        full = (case.batch, case.q_len, case.k_len) if self.rank == 3 else (case.q_len,) * 2
        return _call_with_mask(self.fn, [_tensor(arrays[0])],
                               make_mask(case.mask, case.q_len, case.k_len),
                               [(case.q_len, case.k_len), full], self.mask_name,
                               self.mask_kw, {})

    def expected(self, case: Case, bugs: frozenset[str], empty: str) -> np.ndarray | None:
        x = self.inputs(case)[0].astype(np.float64)
        x4 = x[:, None] if self.rank == 3 else x[None, None]
        out = oracle.attend(x4, x4, x4, self._mask(case, bugs),
                            oracle.scale_of(bugs, 8, 8, 8, 1.0), bugs, empty)
        return None if out is None else out.reshape(x.shape)


class ModuleTarget(Target):
    """An ``nn.Module`` ``forward(x[, mask])``; the oracle uses the module's own weights."""

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module, self.name = targets.prepare(module), name
        self.d_in = next((getattr(module, n) for n in ("d_in", "in_features", "d_model",
                                                       "embed_dim") if isinstance(
                                                           getattr(module, n, None), int)), 0)
        self.weights = targets.read_weights(self.module, self.d_in or targets.D_IN)
        if self.weights is not None and not self.d_in:
            self.d_in = self.weights.blocks[0].wq.shape[1]
        # (else the width its layers read: feeding another one failed in the learner's code,
        # which the check then blamed on it)
        self.d_in = self.d_in or targets.input_width(self.module) or 8
        learned = [n for n, p in self.module.named_parameters() if p.is_floating_point()]
        if self.weights is None and learned:  # the weight-free oracle would be no reference
            raise targets.InputError("unknown_weights", cls=type(module).__name__,
                                     names=", ".join(learned[:4]) + (", ..." if len(learned) > 4
                                                                     else ""))
        if self.weights is None:
            self.scale, self.head_dim, self.d_model = 1.0, self.d_in, self.d_in
            self.heads = self.kv_heads = 1
        else:
            blk = self.weights.blocks[0]
            self.head_dim, self.heads, self.kv_heads = blk.head_dim, blk.heads, blk.kv_heads
            self.d_model = sum(b.heads * b.head_dim for b in self.weights.blocks)
        said = targets.is_causal(self.module)
        self.causal = bool(said)
        self.window = getattr(self.module, "window", None)
        self.window = self.window if isinstance(self.window, int) else None
        self.context = next((getattr(self.module, n) for n in targets._CTOR["context"]
                             if isinstance(getattr(self.module, n, None), int)),
                            targets.mask_buffer_length(self.module) or 10**9)
        self.mask_name, self.mask_kw = targets.mask_param(self.module.forward, None)
        square = self.head_dim if self.head_dim <= self.context else 5
        self.probe_rank((3, 2), Case("batch=3 seq=5", 3, 1, 1, 5, 5),
                        Case(f"batch=3 seq={square}", 3, 1, 1, square, square))
        if said is None:
            self.causal = self.behaves_causal()
        kind = ({"en": "causal ", "zh": "因果、"} if said else _INFERRED if self.causal
                else {"en": "", "zh": ""})
        weights = "no weights" if self.weights is None else "its own weights"
        self.what = {"en": f"{kind['en']}x of rank {self.rank}, {weights}",
                     "zh": f"{kind['zh']}{self.rank} 维的 x，"
                           f"{'没有权重' if self.weights is None else '用它自己的权重'}"}

    def cases(self) -> list[Case]:
        b = 3 if self.rank == 3 else 1
        lead = "batch=3 " if self.rank == 3 else ""
        c = self.causal
        out = [Case(f"{lead}seq=5", b, 1, 1, 5, 5, causal=c), Case("seq=1", 1, 1, 1, 1, 1,
                                                                  causal=c)]
        if 1 < self.head_dim <= self.context and self.head_dim != 5:
            d = self.head_dim
            out.append(Case(f"{lead}seq={d}=head_dim", b, 1, 1, d, d, causal=c))
        if self.rank == 3:
            out.append(Case("batch=1 seq=4", 1, 1, 1, 4, 4, causal=c))
        if self.mask_name:
            out += [Case(f"{lead}seq=5 random mask", b, 1, 1, 5, 5, "random", causal=c),
                    Case(f"{lead}seq=5 mask with a fully masked row", b, 1, 1, 5, 5,
                         "empty_row", causal=c)]
        return out

    def inputs(self, case: Case) -> tuple[np.ndarray, ...]:
        rng = np.random.default_rng(zlib.crc32(case.label.encode()))
        shape = (case.batch, case.q_len, self.d_in)
        # Weight-free scores are x_i . x_j, unscaled: smaller inputs keep the softmax soft.
        x = (rng.standard_normal(shape) * (0.5 if self.weights is None else 1.0)).astype(
            np.float32)
        return (x if self.rank == 3 else x[0]),

    def call(self, case: Case, arrays: tuple[np.ndarray, ...]) -> object:
        full = [(case.q_len, case.k_len), (case.batch, case.q_len, case.k_len),
                (case.batch, 1, case.q_len, case.k_len)]
        with torch.no_grad():
            return _call_with_mask(self.module, [_tensor(arrays[0])],
                                   make_mask(case.mask, case.q_len, case.k_len),
                                   full if self.rank == 3 else full[:1], self.mask_name,
                                   self.mask_kw, {})

    def expected(self, case: Case, bugs: frozenset[str], empty: str) -> np.ndarray | None:
        x = self.inputs(case)[0].astype(np.float64)
        x3 = x if self.rank == 3 else x[None]
        ok = self._mask(case, bugs, self.window)
        if self.weights is None:
            out = oracle.attend(x3[:, None], x3[:, None], x3[:, None], ok,
                                oracle.scale_of(bugs, self.d_in, self.d_in, self.d_in, 1.0),
                                bugs, empty)
            out = None if out is None else out[:, 0]
        else:
            out = oracle.module_forward(x3, self.weights, ok, None, bugs, self.d_in, empty)
        return None if out is None else out.reshape(*x.shape[:-1], out.shape[-1])
