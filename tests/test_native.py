"""The native kernel's build, its fallback, and what only it does (strides, BLAS fallback).

Its exactness against the NumPy reference runs in test_functional.py with the
other backends (backend "flash").
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import attnlab
from attnlab import _flash, _native
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


@needs_native
def test_auto_picks_flash_where_a_rule_leaves_work_to_skip():
    q, k, _ = _qkv(1, 2, 256, 8)
    assert _choose(q, k, None, None, None, causal=True) == "flash"
    assert _choose(q, k, None, 64, None) == "flash"
    assert _choose(q, k, None, None, None) == "sdpa"  # dense rows: SDPA matches it
    assert _choose(q[:, :, :1], k, None, None, None, causal=True) == "sdpa"  # decoding
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
def test_backward_is_bitwise_reproducible():
    q, k, v = _qkv(1, 4, 333, 16, kv_heads=2, grad=True)
    grads = []
    for _ in range(2):
        out = attnlab.attention(q, k, v, causal=True, window=100, backend="flash")
        grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@needs_native
def test_aten_gemm_fallback_gives_the_same_numbers():
    """Where torch exposes no BLAS symbol, the tile products go through ATen."""
    q, k, v = _qkv(1, 2, 150, 8, grad=True)
    ops = _native.load()
    ops.set_aten_gemm(True)
    try:
        out = attnlab.attention(q, k, v, causal=True, backend="flash")
        got = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    finally:
        ops.set_aten_gemm(False)
    ref = attnlab.attention(q, k, v, causal=True, backend="eager")
    want = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


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
    """Beyond 1024 keys the causal forward tiles 256 x 256 and the backward 128 x 128
    (recomputed from the log-sum-exp): the gradients still equal the eager path's."""
    assert _flash._blocks(1100, 1100, True, 0) != _flash._blocks(1100, 1100, True, 0,
                                                                backward=True)
    q, k, v = _qkv(1, 2, 1100, 8, kv_heads=1, grad=True, seed=3)
    grads = {}
    for backend in ("flash", "eager"):
        out = attnlab.attention(q, k, v, causal=True, backend=backend)
        grads[backend] = torch.autograd.grad(out, (q, k, v), torch.randn_like(out,
                                             generator=torch.Generator().manual_seed(4)))
    for got, want in zip(grads["flash"], grads["eager"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
