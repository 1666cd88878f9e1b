"""The native kernel's build, its fallback, and what only it does (strides, BLAS fallback).

Its exactness against the NumPy reference runs in test_functional.py with the
other backends (backend "flash").
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from threads import threads as thread_count
from torch.utils._python_dispatch import TorchDispatchMode

import attnlab
from attnlab import _fakes, _flash, _native
from attnlab import reference as ref
from attnlab.functional import _choose

needs_native = pytest.mark.skipif(not _native.available(),
                                  reason=f"native kernel: {_native.unavailable_reason()}")


def _qkv(*shape, kv_heads=None, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, h, t, d = shape
    q = torch.randn(b, h, t, d, generator=g)
    k, v = (torch.randn(b, kv_heads or h, t, d, generator=g) for _ in range(2))
    return [x.requires_grad_(grad) for x in (q, k, v)]


def test_switched_off_auto_still_works_and_flash_says_why(monkeypatch):
    monkeypatch.setenv(_native.ENV_SWITCH, "0")
    q, k, v = _qkv(1, 2, 2048, 8)  # long enough for auto's window rule
    want = attnlab.attention(q, k, v, causal=True, window=16, backend="tiled")
    assert _choose(q, k, None, 16, None, causal=True) == "tiled"
    torch.testing.assert_close(attnlab.attention(q, k, v, causal=True, window=16), want)
    with pytest.raises(ValueError, match="backend='flash'.*not available.*ATTNLAB_NATIVE=0"):
        attnlab.attention(q, k, v, backend="flash")


@pytest.mark.slow
def test_failed_build_says_so_once_and_falls_back(tmp_path):
    """No compiler: one line on stderr, however often attention is called, and the
    PyTorch paths answer."""
    code = (
        "import torch, attnlab\n"
        "q = torch.randn(1, 2, 300, 8)\n"
        "for _ in range(3):\n"
        "    attnlab.attention(q, q, q, causal=True)\n"
        "try:\n"
        "    attnlab.attention(q, q, q, backend='flash')\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"),
           _native.ENV_DIR: str(tmp_path / "build"), _native.ENV_SWITCH: "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "native attention kernel unavailable" in lines[0], lines
    assert "no C++ compiler" in lines[0] and "PyTorch paths" in lines[0]
    assert "refused: backend='flash'" in done.stdout and "no C++ compiler" in done.stdout


def test_build_step_never_fails(monkeypatch, capsys):
    monkeypatch.setenv(_native.ENV_SWITCH, "0")
    assert _native.main(["--build"]) == 0
    assert "switched off" in capsys.readouterr().out


def test_the_tile_shapes_know_how_many_keys_a_worker_holds_packed():
    """_flash.HEAD_PACK_KEYS (small forward query blocks up to it) is the kernel's
    HeadPack::MAX_KEYS (up to it a worker packs a head's keys once)."""
    header = (Path(_flash.__file__).parent / "csrc" / "flash_common.h").read_text()
    assert f"MAX_KEYS = {_flash.HEAD_PACK_KEYS};" in header
    assert _flash._blocks(4096, _flash.HEAD_PACK_KEYS, True, 0)[0] == 32
    assert _flash._blocks(4096, _flash.HEAD_PACK_KEYS + 1, True, 0)[0] == 128


@needs_native
def test_short_packed_documents_tile_by_32_rows_and_agree_with_the_oracle():
    """Documents of at most SHORT_DOCUMENT keys (packed sentences) take query blocks of 32
    rows, longer ones keep the blocks they had; the kernel's values are the oracle's."""
    short, long = _flash.SHORT_DOCUMENT, _flash.SHORT_DOCUMENT + 1
    for causal in (False, True):
        assert _flash._blocks(4096, 4096, causal, 0, documents=short) == (32, 512)
    assert _flash._blocks(4096, 4096, False, 0, documents=long) == _flash._blocks(
        4096, 4096, False, 0)
    assert _flash._blocks(4096, 4096, True, 0, documents=long) == (128, 512)
    # the backward: 64 x 64 up to SHORT_DOCUMENT, 64 x 128 up to four times it
    for causal in (False, True):
        tiles = [_flash._blocks(4096, 4096, causal, 0, backward=True, documents=n)
                 for n in (short, long, 4 * short, 4 * short + 1, None)]
        assert tiles[:3] == [(64, 64), (64, 128), (64, 128)]
        assert tiles[3] == tiles[4] == _flash._blocks(4096, 4096, causal, 0, backward=True)
    lengths = torch.tensor([3, 17, 1, 40, 9, 30, 64, 12])
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[None]
    q, k, v = _qkv(1, 3, int(lengths.sum()), 16, kv_heads=1, seed=5)
    for causal in (False, True):
        want = attnlab.reference.attention(q.double().numpy(), k.double().numpy(),
                                           v.double().numpy(), causal=causal,
                                           document_ids=doc.numpy())
        got = attnlab.attention(q, k, v, causal=causal, document_ids=doc, backend="flash")
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)
        # and the gradients, tiled 64 x 64, equal the eager path's in float64
        grads = {}
        for backend, dtype in (("flash", torch.float32), ("eager", torch.float64)):
            leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
            out = attnlab.attention(*leaves, causal=causal, document_ids=doc, backend=backend)
            out.backward(torch.ones_like(out))
            grads[backend] = [t.grad.double() for t in leaves]
        for got_grad, want_grad in zip(grads["flash"], grads["eager"]):
            torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-4)


def test_the_row_thresholds_are_the_kernels():
    """_fakes.F32_DOT_ROWS (past it a float32 weight by rows needs the tile kernel, which
    the fake kernel repeats) is csrc/decode.cpp's."""
    source = (Path(_native.__file__).parent / "csrc" / "decode.cpp").read_text()
    assert f"constexpr int64_t F32_DOT_ROWS = {_fakes.F32_DOT_ROWS};" in source


@needs_native
def test_auto_picks_flash_where_a_rule_leaves_work_to_skip(monkeypatch):
    q, k, _ = _qkv(1, 2, 256, 8)
    assert _choose(q, k, None, None, None, causal=True) == "flash"
    assert _choose(q, k, None, 64, None) == "flash"
    # Dense rows: flash with the AVX-512 tile products (faster than SDPA there), SDPA
    # with BLAS tiles (which only match it).
    for tiles, dense in ((True, "flash"), (False, "sdpa")):
        monkeypatch.setattr(_flash, "_tiles", tiles)
        assert _choose(q, k, None, None, None) == dense
        assert _choose(q[:, :, :5], k, None, None, None) == dense  # short rows alike
        assert _choose(q, k, None, None, None, causal=True) == "flash"
    monkeypatch.setattr(_flash, "_tiles", None)
    assert _flash.tile_kernel() == _native.load().tile_kernel_active()
    assert _choose(q[:, :, :1], k, None, None, None, causal=True) == "flash"  # decoding
    assert _choose(q.double(), k.double(), None, None, None, causal=True) == "sdpa"
    meta = torch.zeros(1, 2, 256, 8, device="meta")  # stands in for CUDA: never the CPU kernel
    assert _choose(meta, meta, None, None, None, causal=True) == "sdpa"
    with pytest.raises(ValueError, match="flash.*CPU tensors only"):
        attnlab.attention(meta, meta, meta, backend="flash")


@needs_native
def test_strided_rows_are_read_in_place():
    """Heads split from (B, T, H, D) projections, as modules do: no copy, same numbers."""
    x = torch.randn(2, 70, 3, 16)
    q = x.transpose(1, 2)  # (B, H, T, D) with row stride H*D
    k = torch.randn(2, 80, 3, 16).transpose(1, 2)
    v = torch.randn(2, 80, 3, 16).transpose(1, 2)
    assert _flash._rows(q) is q
    want = attnlab.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True,
                             backend="eager")
    torch.testing.assert_close(attnlab.attention(q, k, v, causal=True, backend="flash"), want,
                               atol=1e-5, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("threads", [1, 3])
def test_backward_is_bitwise_reproducible(threads):
    q, k, v = _qkv(1, 4, 333, 16, kv_heads=2, grad=True)
    grads = []
    for _ in range(2):
        with thread_count(threads):
            out = attnlab.attention(q, k, v, causal=True, window=100, backend="flash")
            grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@needs_native
def test_a_small_forward_takes_one_worker_while_the_machine_is_seen_busy():
    """After a region whose last worker started late (another process had its core), a
    forward of little work runs on one worker for a while (waiting at the region's end for
    a descheduled worker cost more than the call); a large one keeps every worker; the
    results are the same bits either way (a forward's items never depend on the worker
    count)."""
    ops = _native.load()
    q, k, v = _qkv(1, 12, 256, 64)  # about 1e8 flops: small
    with thread_count(2):
        try:
            quiet = attnlab.attention(q, k, v, causal=True, backend="flash")
            # (forgotten after the call: on a busy machine it may have seen a busy core)
            assert ops.workers_for(1e8, 0) == 2  # nothing remembered
            assert ops.workers_for(1e8, 1) == 1 and ops.workers_for(1e10) == 2
            busy = attnlab.attention(q, k, v, causal=True, backend="flash")
            assert ops.workers_for(1e8) == 1  # still remembered
        finally:
            ops.workers_for(0.0, 0)
        assert ops.workers_for(1e8) == 2
    assert torch.equal(quiet, busy)
    with thread_count(1):
        assert ops.workers_for(1e8, 1) == 1 and ops.workers_for(1e10) == 1
        ops.workers_for(0.0, 0)


@needs_native
def test_any_forward_takes_one_worker_per_core_its_workers_were_seen_on():
    """After a region whose two workers started on one core (the OS paired them there,
    beside busy processes on the other), every forward, large ones too, runs on as many
    workers as there were cores, until CONTENDED_NS have passed; the same bits."""
    ops = _native.load()
    q, k, v = _qkv(1, 12, 256, 64)
    with thread_count(2):
        try:
            quiet = attnlab.attention(q, k, v, causal=True, backend="flash")
            assert ops.workers_for(1e10, 2) == 1 and ops.workers_for(1e8) == 1
            shared = attnlab.attention(q, k, v, causal=True, backend="flash")
        finally:
            ops.workers_for(0.0, 0)
        assert ops.workers_for(1e10) == 2
    assert torch.equal(quiet, shared)


_ONE_CORE = """
import os
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before torch starts its threads
import torch
torch.set_num_threads(2)
import attnlab
from attnlab import _native
ops = _native.load()
ops.workers_for(0.0, 0)
q, k, v = (torch.randn(1, 12, 512, 64, generator=torch.Generator().manual_seed(i))
           for i in range(3))
both = attnlab.attention(q, k, v, causal=True, backend="flash")
seen = ops.workers_for(1e10)  # what the next large forward takes
print(seen, torch.equal(both, attnlab.attention(q, k, v, causal=True, backend="flash")))
"""


@needs_native
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_two_workers_pinned_to_one_core_are_seen_sharing_it():
    """A process held to one core with two torch threads: its first large forward finds
    both workers on that core, and the next takes one worker (the same bits)."""
    done = subprocess.run([sys.executable, "-c", _ONE_CORE], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "True"], done.stdout


class _OpDtypes(TorchDispatchMode):
    """The dtypes of the tensors each aten/attnlab op is called with."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kinds = [a.dtype for a in args if isinstance(a, torch.Tensor)]
        self.calls.append((str(func.overloadpacket), kinds))
        return func(*args, **(kwargs or {}))


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["auto", "blas"])
def test_low_precision_runs_in_the_kernel_without_a_float32_copy(dtype, path):
    """bf16/fp16 q, k, v go to the kernel as they are (tiles are converted as they are
    read: no float32 copy of an input is made) and come back in their dtype; values and
    gradients equal float64 eager on the same rounded inputs to the dtype's rounding."""
    q, k, v = (t.to(dtype) for t in _qkv(2, 4, 200, 64, kv_heads=2))
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    grad = torch.randn(2, 4, 200, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    ops = _native.load()
    before = ops.set_gemm_path(path)
    try:
        with _OpDtypes() as seen:
            out = attnlab.attention(*ins, causal=True, window=150, backend="flash")
            got = torch.autograd.grad(out, ins, grad)
    finally:
        ops.set_gemm_path(before)
    kernel = [kinds for name, kinds in seen.calls if name.startswith("attnlab_native.flash")]
    assert len(kernel) == 2 and all(kinds[:3] == [dtype] * 3 for kinds in kernel)
    copies = [name for name, kinds in seen.calls if "copy" in name or name.endswith("to")]
    assert not copies, f"inputs copied: {copies}"
    assert out.dtype == dtype and all(g.dtype == dtype for g in got)
    wide = [t.double().requires_grad_() for t in (q, k, v)]
    want = attnlab.attention(*wide, causal=True, window=150, backend="eager")
    want_grads = torch.autograd.grad(want, wide, grad.double())
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), want, atol=2 * eps, rtol=2 * eps)
    for a, b in zip(got, want_grads):  # the products accumulate in float32: a few eps
        torch.testing.assert_close(a.double(), b, atol=8 * eps * float(b.abs().max()),
                                   rtol=4 * eps)


@needs_native
@pytest.mark.parametrize("path", ["auto", "blas", "aten"])
@pytest.mark.parametrize("head_dim", [8, 64, 80])
def test_every_tile_product_path_gives_the_same_numbers(path, head_dim):
    """The tile products run through the AVX-512 tile kernel where the CPU has it
    ("auto"), the BLAS torch links, or ATen where torch exposes no BLAS symbol: each
    gives the eager path's values and gradients (head_dim 80: a masked last vector)."""
    q, k, v = _qkv(1, 2, 150, head_dim, kv_heads=1, grad=True)
    ops = _native.load()
    before = ops.set_gemm_path(path)
    try:
        out = attnlab.attention(q, k, v, causal=True, window=100, backend="flash")
        got = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    finally:
        ops.set_gemm_path(before)
    ref = attnlab.attention(q, k, v, causal=True, window=100, backend="eager")
    want = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@needs_native
def test_gemm_path_names_are_checked():
    with pytest.raises(RuntimeError, match="auto, blas or aten"):
        _native.load().set_gemm_path("fast")
    assert _native.load().set_gemm_path("auto") == "auto"


@needs_native
def test_multihead_attention_trains_through_the_kernel(monkeypatch):
    calls = []
    real = _flash.flash_attention
    monkeypatch.setattr(_flash, "flash_attention", lambda *a: calls.append(1) or real(*a))
    mha = attnlab.MultiHeadAttention(32, 32, 4, causal=True, context_length=64)
    x = torch.randn(2, 64, 32)
    mha(x).sum().backward()
    assert calls and all(p.grad is not None for p in mha.parameters())


@needs_native
def test_backward_tiles_differently_from_the_forward_and_agrees():
    """The causal forward tiles 64 x 256 up to 1024 keys and 128 x 512 beyond, the
    backward 128 x 128 (recomputed from the log-sum-exp): the gradients still equal the
    eager path's."""
    for seq in (300, 1100):
        assert _flash._blocks(seq, seq, True, 0) != _flash._blocks(seq, seq, True, 0,
                                                                  backward=True)
        _grads_agree(seq)


def _grads_agree(seq):
    q, k, v = _qkv(1, 2, seq, 8, kv_heads=1, grad=True, seed=3)
    grads = {}
    for backend in ("flash", "eager"):
        out = attnlab.attention(q, k, v, causal=True, backend=backend)
        grads[backend] = torch.autograd.grad(out, (q, k, v), torch.randn_like(out,
                                             generator=torch.Generator().manual_seed(4)))
    for got, want in zip(grads["flash"], grads["eager"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@st.composite
def full_size_problems(draw):
    """Problems at the kernel's own tile sizes: head dims that fill the tile products'
    16-float vectors or leave a masked last one, lengths that cross the 64-key panels
    of packed K^T, windows that start tiles off a panel, query blocks that read a
    worker's packed keys of the block before, GQA, every mask kind."""
    kv_heads = draw(st.integers(1, 2))
    return dict(
        batch=draw(st.integers(1, 2)), kv_heads=kv_heads,
        q_heads=kv_heads * draw(st.sampled_from([1, 3])),
        q_len=draw(st.sampled_from([1, 63, 64, 65, 130, 300])),
        k_len=draw(st.sampled_from([1, 64, 65, 200, 300])),
        head_dim=draw(st.sampled_from([16, 24, 64, 80, 128])),
        v_dim=draw(st.sampled_from([None, 40])),
        causal=draw(st.booleans()), window=draw(st.sampled_from([None, 1, 37, 100])),
        mask=draw(st.sampled_from(["none", "padding", "float"])),
        seed=draw(st.integers(0, 2**16)),
        # make test runs one OpenMP thread per worker: the work split across threads
        # (query blocks forward, key blocks and the dQ sums backward) is drawn here.
        threads=draw(st.sampled_from([1, 2, 3])),
    )


@needs_native
@settings(max_examples=25, deadline=None)
@given(p=full_size_problems())
# One worker takes both query blocks of a symmetric window: the second block's keys lie
# inside the first's but start off its packed panels, so they must be packed anew.
@example(p=dict(batch=1, kv_heads=1, q_heads=1, q_len=65, k_len=65, head_dim=16, v_dim=None,
                causal=False, window=37, mask="none", seed=0, threads=1))
def test_full_size_tiles_match_the_reference_and_eager_gradients(p):
    with thread_count(p["threads"]):
        _full_size_tiles_match(p)


def _full_size_tiles_match(p):
    g = torch.Generator().manual_seed(p["seed"])
    b, hq, hkv, lq, lk, d = (p[n] for n in ("batch", "q_heads", "kv_heads", "q_len", "k_len",
                                             "head_dim"))
    q = torch.randn(b, hq, lq, d, generator=g)
    k = torch.randn(b, hkv, lk, d, generator=g)
    v = torch.randn(b, hkv, lk, p["v_dim"] or d, generator=g)
    mask = None
    if p["mask"] == "padding":
        mask = attnlab.masks.padding(torch.randint(0, lk + 1, (b,), generator=g), lk)
    elif p["mask"] == "float":
        mask = torch.randn(b, 1, lq, lk, generator=g)
        mask[torch.rand(mask.shape, generator=g) > 0.8] = float("-inf")
    kw = dict(mask=mask, causal=p["causal"], window=p["window"])
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnlab.attention(*ins, backend="flash", **kw)
    m = None if mask is None else mask.double().numpy() if mask.is_floating_point() else (
        mask.numpy())
    want = ref.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), m,
                         causal=p["causal"], window=p["window"])
    np.testing.assert_allclose(out.detach().numpy(), want, atol=2e-5, rtol=1e-4)
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, ins, grad)
    ins64 = [t.double().requires_grad_() for t in (q, k, v)]
    out64 = attnlab.attention(*ins64, backend="eager", **dict(
        kw, mask=None if mask is None else mask if mask.dtype == torch.bool else mask.double()))
    for a, e in zip(got, torch.autograd.grad(out64, ins64, grad.double())):
        torch.testing.assert_close(a.double(), e, atol=1e-4, rtol=1e-4)


# --- Loading never hangs, whatever earlier processes left behind (issue 25, defect 1) ---
# Each child below must finish within 30 s. They load a copy of this process's published
# build (one file) from a private ATTNLAB_NATIVE_DIR, so none rebuilds or touches the
# shared cache; only the slow test compiles from scratch.

# A child's first use: the kernel's answer checked against the NumPy oracle.
FIRST_USE = """
import sys, numpy as np, torch, attnlab
from attnlab import _native, reference
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 70, 16, generator=g) for _ in range(3))
backend = "flash" if _native.load() is not None else "eager"
out = attnlab.attention(q, k, v, causal=True, backend=backend)
want = reference.attention(*(t.double().numpy() for t in (q, k, v)), None, causal=True)
np.testing.assert_allclose(out.numpy(), want, atol=2e-5, rtol=1e-4)
print(backend)
"""


def _start(code: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 30) -> subprocess.CompletedProcess:
    """Wait for a child; on timeout kill its whole group (a compiler included) and fail:
    a hang is the defect."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"hung for {timeout} s: {err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _child(code: str, env: dict, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (see :func:`_finish`)."""
    return _finish(_start(code, env), timeout)


def _private_env(tmp_path: Path, published: bool = True, **extra: str) -> tuple[dict, Path]:
    """The environment of a child with its own build folder (holding a copy of this
    process's published build when ``published``), and that folder's keyed directory."""
    root = tmp_path / "native"
    env = {**os.environ, _native.ENV_DIR: str(root), _native.ENV_SWITCH: "1", **extra}
    env.pop("PYTHONFAULTHANDLER", None)
    key = root / _native.build_dir().name
    key.mkdir(parents=True)
    if published:
        shutil.copy2(_native.build_dir() / f"{_native.LIBRARY}.so", key)
    return env, key


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


@needs_native
def test_a_stale_lock_never_blocks_a_start(tmp_path):
    """torch's baton ``lock`` and a build lock naming a dead process, as a killed start
    or build leaves them, and a killed build's private folder: the next start loads the
    published build at once and says nothing."""
    env, key = _private_env(tmp_path)
    (key / "lock").touch()
    (key / "build.lock").write_text(str(_dead_pid()))
    (key / "tmp-killed").mkdir()
    (key / "tmp-killed" / "lock").touch()
    (key / "tmp-killed" / f"{_native.LIBRARY}.so").write_bytes(b"half a library")
    done = _child(FIRST_USE, env)
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "flash", "")


def test_a_stale_lock_never_blocks_a_build(tmp_path):
    """Stale locks left, and in place of a build half a library (as an older attnlab's
    build killed mid-link left it): the build starts at once (here it finds no compiler:
    one line, and the PyTorch paths answer right)."""
    env, key = _private_env(tmp_path, published=False, CXX=str(tmp_path / "no-such-c++"))
    (key / f"{_native.LIBRARY}.so").write_bytes(b"\x7fELF half a library")
    (key / "lock").touch()
    (key / "build.lock").write_text(str(_dead_pid()))
    done = _child(FIRST_USE, env)
    assert (done.returncode, done.stdout.strip()) == (0, "eager"), done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no C++ compiler" in lines[0] and "PyTorch paths" in lines[0]


# FIRST_USE, killed by its own signal on entering the first function of a given name.
KILLED_AT = """
import os, sys
import torch, attnlab
name, sig = sys.argv[1], int(sys.argv[2])
def kill_on_entry(frame, event, arg):
    if event == "call" and frame.f_code.co_name == name:
        os.kill(os.getpid(), sig)
sys.setprofile(kill_on_entry)
""" + FIRST_USE

# The steps of a start, in this loader and in torch's extension loader (which an older
# attnlab ran on every start, holding its ``lock`` file); a start that never reaches one
# runs through whole.
STEPS = ["load", "_open", "load_library", "_jit_compile", "_run_ninja_build",
         "_import_module_from_library"]


@needs_native
@pytest.mark.slow
def test_a_start_killed_while_loading_leaves_nothing_that_blocks(tmp_path):
    """Starts killed (SIGKILL, SIGTERM in turn) during their imports and on entering
    each step of the load leave nothing behind: the next start loads the kernel within
    30 s, and the build folder holds the published build alone."""
    env, key = _private_env(tmp_path)
    steps = [None, *STEPS]
    for i, step in enumerate(steps):
        sig = (signal.SIGKILL, signal.SIGTERM)[i % 2]
        args = ["-c", FIRST_USE] if step is None else ["-c", KILLED_AT, step, str(int(sig))]
        proc = subprocess.Popen([sys.executable, *args], env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if step is None:  # while torch and attnlab are imported
            time.sleep(0.5)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # waits on what an earlier kill left
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"a start after one killed at {steps[i - 1] or 'import'} hung for 30 s")
    done = _child(FIRST_USE, env)
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "flash", "")
    assert sorted(p.name for p in key.iterdir()) == [f"{_native.LIBRARY}.so"]


@needs_native
@pytest.mark.slow
def test_a_build_killed_mid_compile_is_never_used_and_never_blocks(tmp_path):
    """A start that must build is killed while the compiler runs: nothing is published;
    the next start does not wait (no compiler here: one line, right answers from the
    PyTorch paths); once a whole build is published, the next start loads it."""
    env, key = _private_env(tmp_path, published=False)
    proc = subprocess.Popen([sys.executable, "-c", FIRST_USE], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not list(key.glob("tmp-*/build.ninja")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(key.glob("tmp-*/build.ninja")), "the build never started"
        time.sleep(1.0)  # the compilers are running
        assert proc.poll() is None, "the build ended before it could be killed"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (key / f"{_native.LIBRARY}.so").exists()  # half a build is never published
    done = _child(FIRST_USE, {**env, "CXX": str(tmp_path / "no-such-c++")})
    assert (done.returncode, done.stdout.strip()) == (0, "eager"), done.stderr
    assert "no C++ compiler" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    shutil.copy2(_native.build_dir() / f"{_native.LIBRARY}.so", key)
    done = _child(FIRST_USE, env)
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "flash", "")


@needs_native
def test_a_live_build_is_waited_for_with_a_bound_and_one_line(tmp_path):
    """Another process holds the build lock: a start waits at most ATTNLAB_NATIVE_WAIT
    seconds, saying in one line whom it waits for, then one line and the PyTorch paths;
    a start that is still waiting when the build is published loads it."""
    env, key = _private_env(tmp_path, published=False, **{_native.ENV_WAIT: "1"})
    with open(key / "build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(str(os.getpid()))
        held.flush()
        done = _child(FIRST_USE, env)
        assert (done.returncode, done.stdout.strip()) == (0, "eager"), done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 2, lines
        assert f"waiting up to 1 s for process {os.getpid()}" in lines[0]
        assert "unavailable: waited 1 s" in lines[1] and "PyTorch paths" in lines[1]

        waiter = _start(FIRST_USE, {**env, _native.ENV_WAIT: "60"})
        said = waiter.stderr.readline()  # it waits (else it gives up after 60 s)
        assert f"waiting up to 60 s for process {os.getpid()}" in said, said
        shutil.copy2(_native.build_dir() / f"{_native.LIBRARY}.so", key / "publishing")
        os.replace(key / "publishing", key / f"{_native.LIBRARY}.so")
    done = _finish(waiter)
    assert (done.returncode, done.stdout.strip()) == (0, "flash"), done.stderr
    assert done.stderr == ""  # nothing after the one line


@needs_native
def test_several_threads_first_use_share_one_load(tmp_path):
    """Eight threads of a fresh process call the kernel at once (issue 25, defect 6):
    every one gets it, with the oracle's numbers; none sees a half-done load."""
    code = """
import threading, numpy as np, torch, attnlab
from attnlab import _native, reference
n, errors = 8, []
barrier = threading.Barrier(n)
def work(i):
    g = torch.Generator().manual_seed(i)
    q, k, v = (torch.randn(1, 2, 50 + i, 16, generator=g) for _ in range(3))
    barrier.wait()
    try:
        if i % 4 == 1:
            assert _native.available() and _native.load() is not None
        out = attnlab.attention(q, k, v, causal=i % 2 == 0, backend="flash")
        want = reference.attention(*(t.double().numpy() for t in (q, k, v)), None,
                                   causal=i % 2 == 0)
        np.testing.assert_allclose(out.numpy(), want, atol=2e-5, rtol=1e-4)
    except Exception as exc:
        errors.append(f"thread {i}: {exc!r}")
threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
for t in threads: t.start()
for t in threads: t.join()
print(errors or "ok")
"""
    env, _ = _private_env(tmp_path)
    done = _child(code, env)
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "ok", "")


@pytest.mark.slow
def test_a_fresh_build_is_published_whole_whichever_ninja_is_first(tmp_path):
    """The one real build of the suite (~3 min on two cores). A broken ``ninja`` first
    on PATH does not matter (the ninja wheel's runs); the result is one published file
    (the private folder and a killed build's leftovers are gone); the next start loads
    it without building (it has no compiler)."""
    if _native._compiler() is None:
        pytest.skip("no C++ compiler")
    bad = tmp_path / "bad-bin"
    bad.mkdir()
    (bad / "ninja").write_text("#!/bin/sh\necho broken ninja >&2\nexit 1\n")
    (bad / "ninja").chmod(0o755)
    env, key = _private_env(tmp_path, published=False,
                            PATH=f"{bad}{os.pathsep}{os.environ.get('PATH', '')}")
    (key / "tmp-killed").mkdir()
    (key / "tmp-killed" / "flash_attention.o").write_bytes(b"half an object")
    done = _child(FIRST_USE, env, timeout=900)
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "flash", "")
    assert sorted(p.name for p in key.iterdir()) == ["attnlab_native.so", "build.lock"]
    done = _child(FIRST_USE, {**env, "CXX": str(tmp_path / "no-such-c++")})
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "flash", "")
