"""Threads at first use of the native kernel (issue 25, defect 6), as a property: however
many threads arrive, through whichever entry point, while the one load is slow or
failing, the load runs once, every thread waits for it and gets its outcome (the kernel
and the oracle's numbers, or the PyTorch paths after one line on stderr), never a
half-done state (``available()`` True with ``load()`` None).

The load itself is replaced by one that takes its time and hands back the real kernel
(or fails as a missing compiler does): a real first load happens once per process, and
tests/test_native.py checks that one in a fresh process."""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import attnlab
from attnlab import _native, reference

ENTRIES = ["attention flash", "attention auto", "load", "available", "unavailable_reason",
           "for_inference", "flash backward"]


def _entry(name: str, i: int, fails: bool, real) -> None:
    """One thread's first call through ``name``, checked against what it must see."""
    g = torch.Generator().manual_seed(i)
    q, k, v = (torch.randn(1, 2, 40 + i, 8, generator=g) for _ in range(3))
    if name == "load":
        assert _native.load() is (None if fails else real)
    elif name == "available":
        assert _native.available() is not fails
    elif name == "unavailable_reason":
        reason = _native.unavailable_reason()
        assert (reason is None) if not fails else "no C++ compiler" in reason
    elif name == "for_inference":
        with torch.no_grad():
            assert _native.for_inference(q) is (None if fails else real)
    else:
        backend = "auto" if name == "attention auto" else "flash"
        if fails and backend == "flash":
            with pytest.raises(ValueError, match="backend='flash'.*not available"):
                attnlab.attention(q, k, v, causal=True, backend=backend)
            return
        grad = name == "flash backward"
        ins = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        out = attnlab.attention(*ins, causal=True, backend=backend)
        want = reference.attention(*(t.double().numpy() for t in (q, k, v)), None, causal=True)
        np.testing.assert_allclose(out.detach().numpy(), want, atol=2e-5, rtol=1e-4)
        if grad:
            got = torch.autograd.grad(out.sum(), ins)
            eager = [t.double().requires_grad_() for t in (q, k, v)]
            ref = attnlab.attention(*eager, causal=True, backend="eager")
            for a, b in zip(got, torch.autograd.grad(ref.sum(), eager)):
                torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)


@settings(max_examples=40, deadline=None)
@given(entries=st.lists(st.sampled_from(ENTRIES), min_size=2, max_size=8),
       delay=st.sampled_from([0.0, 0.005, 0.05]), fails=st.booleans())
def test_threads_at_first_use_share_one_load(entries, delay, fails):
    real = None if fails else _native.load()
    assume(fails or real is not None)  # the kernel's side needs the kernel built
    calls: list[int] = []

    def slow_first_load(verbose: bool):
        calls.append(threading.get_ident())
        time.sleep(delay)  # the other threads arrive meanwhile
        if fails:
            raise RuntimeError("no C++ compiler (c++) on PATH")
        return real

    barrier = threading.Barrier(len(entries))
    errors: list[str] = []

    def work(i: int, name: str) -> None:
        barrier.wait()
        try:
            _entry(name, i, fails, real)
        except BaseException as exc:  # every failure is reported, with its thread
            errors.append(f"{name} (thread {i}): {exc!r}")

    stderr = io.StringIO()
    with mock.patch.dict(os.environ), mock.patch.object(_native, "_open", slow_first_load), \
            mock.patch.object(_native, "_write_log", lambda exc: None), \
            mock.patch.dict(_native._state, {"ops": None, "reason": None, "tried": False}), \
            contextlib.redirect_stderr(stderr):
        os.environ.pop(_native.ENV_SWITCH, None)
        threads = [threading.Thread(target=work, args=(i, name))
                   for i, name in enumerate(entries)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a thread hung"
    assert errors == []
    assert len(calls) == 1  # one load, whoever came first
    lines = stderr.getvalue().splitlines()
    if fails:
        assert len(lines) == 1 and "unavailable" in lines[0] and "PyTorch paths" in lines[0]
    else:
        assert lines == []
