"""NaN and inf in q, k or v never come out hidden: on every backend, forward and backward.

The rule (what every backend keeps, checked here against a float64 reading of it):

- A query row that the mask and the causal/window rules leave no key is *empty*:
  it gives zeros, whatever its data (NaN in q included).
- Otherwise only the keys the row may attend decide. If one of their scores is NaN
  (NaN in q_i or k_j, inf * 0, inf - inf) or +inf, the whole row is NaN.
- Else the weights are finite (a score of -inf gets weight 0) and out[i, c] is the
  IEEE sum over the keys with weight > 0 of p_ij * v[j, c]: a NaN or inf in a value
  entry that gets weight reaches out[i, c] (NaN stays NaN, inf stays non-finite).
- Data the row does not read may or may not reach it: a forbidden key's NaN or inf
  (0 * NaN is NaN in the weighted sum; torch's SDPA adds its mask, NaN + -inf is
  NaN), or a value entry whose key gets weight 0. And a row whose allowed scores are
  all -inf (infinite data, no NaN) has no softmax: zeros or NaN.

Gradients: an output that must be NaN or inf makes the gradients that read it
non-finite (dq_i; dk_j and dv_j of every key j it weighs with a NaN weight); in
(batch, head) slices without a single non-finite input they equal float64 eager's.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlab
from attnlab import _flash, _native, _sdpa

# "sdpa-carried": the sdpa backend as it runs on a GPU (no check of the inputs, which
# would sync the device; the NaN that the fused kernel drops is carried instead).
BACKENDS = (["eager", "sdpa", "sdpa-carried", "tiled", "auto"]
            + (["flash"] if _native.available() else []))


@contextlib.contextmanager
def _backend(name: str):
    """The backend's name for ``attention``, with the GPU's route where it is carried."""
    if name != "sdpa-carried":
        yield name
        return
    before = _sdpa._checks_inputs
    _sdpa._checks_inputs = lambda q: False
    try:
        yield "sdpa"
    finally:
        _sdpa._checks_inputs = before
_SPECIALS = (float("nan"), float("inf"), float("-inf"))


def _allowed(b, hq, lq, lk, causal, window, mask):
    """(B, Hq, Lq, Lk) bool: which keys each row may attend (spelled out, as the oracle)."""
    i = np.arange(lq)[:, None] + (lk - lq)
    j = np.arange(lk)[None, :]
    ok = np.ones((lq, lk), dtype=bool)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= j > i - window
        if not causal:
            ok &= j < i + window
    ok = np.broadcast_to(ok, (b, hq, lq, lk))
    return ok if mask is None else ok & np.broadcast_to(mask.numpy(), ok.shape)


def _rule(q, k, v, allowed, scale):
    """The rule above in float64: (want, may) with ``want`` NaN where the output must be
    NaN, +-inf where it must be infinite, and ``may`` True where anything goes."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.double().numpy() for t in (q, k, v))
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    with np.errstate(all="ignore"):
        s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
        bad = np.isnan(s) | (s == np.inf)
        empty = ~allowed.any(-1)
        row_nan = (allowed & bad).any(-1)
        all_neg = ~empty & ~row_nan & ~(allowed & (s > -np.inf)).any(-1)
        live = np.where(allowed & ~bad, s, -np.inf)
        top = live.max(-1, keepdims=True)
        e = np.exp(live - np.where(np.isfinite(top), top, 0.0))
        p = e / np.where(e.sum(-1, keepdims=True) > 0, e.sum(-1, keepdims=True), 1.0)
        weighed = p > 0
        # IEEE sum over the weighed keys only (0 * inf would add a NaN the rule lacks)
        terms = np.where(weighed[..., None], p[..., None] * v[:, :, None], 0.0)
        want = terms.sum(-2)
    want[row_nan] = np.nan
    want[empty] = 0.0
    unread = ~np.isfinite(v)[:, :, None] & ~weighed[..., None]  # (B, H, Lq, Lk, Dv)
    may = unread.any(-2)
    may |= ((~allowed & ~np.isfinite(s)).any(-1) | all_neg)[..., None]
    return want, may, p, row_nan, allowed


@st.composite
def poisoned(draw):
    kv = draw(st.integers(1, 2))
    b, hq = draw(st.integers(1, 2)), kv * draw(st.sampled_from([1, 2]))
    lq, lk, d = draw(st.integers(1, 9)), draw(st.integers(1, 9)), draw(st.sampled_from([1, 3, 8]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q, k, v = torch.randn(b, hq, lq, d, generator=g), torch.randn(b, kv, lk, d, generator=g), (
        torch.randn(b, kv, lk, draw(st.sampled_from([1, d])), generator=g))
    for t in (q, k, v):  # a few special values at random positions
        for _ in range(draw(st.integers(0, 3))):
            idx = tuple(draw(st.integers(0, n - 1)) for n in t.shape)
            t[idx] = draw(st.sampled_from(_SPECIALS))
    mask = None
    if draw(st.booleans()):
        mask = torch.rand(b, 1, lq, lk, generator=g) > draw(st.sampled_from([0.2, 0.6, 1.0]))
    causal, window = draw(st.booleans()), draw(st.sampled_from([None, 1, 3]))
    tiles = draw(st.sampled_from([None, (2, 2), (1, 3)]))  # tiny flash tiles: many tiles
    return q, k, v, mask, causal, window, tiles


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(case=poisoned())
def test_nan_and_inf_follow_the_rule_forward_and_backward(backend, case):
    q, k, v, mask, causal, window, tiles = case
    before = _flash.BLOCK_Q, _flash.BLOCK_K
    _flash.BLOCK_Q, _flash.BLOCK_K = tiles or before
    try:
        _check_case(backend, q, k, v, mask, causal, window)
    finally:
        _flash.BLOCK_Q, _flash.BLOCK_K = before


def _check_case(backend, q, k, v, mask, causal, window):
    b, hq, lq, d = q.shape
    lk = k.shape[2]
    scale = d ** -0.5
    want, may, p, row_nan, allowed = _rule(q, k, v, _allowed(b, hq, lq, lk, causal, window,
                                                               mask), scale)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    with _backend(backend) as name:
        out = attnlab.attention(*ins, mask=mask, causal=causal, window=window, backend=name)
        with torch.no_grad():  # the decoding route: carried in place
            torch.testing.assert_close(attnlab.attention(q, k, v, mask=mask, causal=causal,
                                                         window=window, backend=name),
                                       out.detach(), equal_nan=True)
    got = out.detach().double().numpy()
    sure = ~may
    assert np.isnan(got[sure & np.isnan(want)]).all(), "a NaN came out hidden"
    assert not np.isfinite(got[sure & np.isinf(want)]).any(), "an inf came out finite"
    fin = sure & np.isfinite(want)
    assert np.isfinite(got[fin]).all(), "NaN or inf where the rule says finite"
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-4, atol=1e-5)

    # Backward: the gradients that read a non-finite output are non-finite.
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    dq, dk, dv = (t.double().numpy() for t in torch.autograd.grad(out, ins, grad))
    group = hq // k.shape[1]
    bad_out = (sure & ~np.isfinite(want)).any(-1) & allowed.any(-1)  # (B, Hq, Lq)
    assert not np.isfinite(dq[bad_out]).all(-1).any(), "dq of a non-finite row is finite"
    nan_w = (row_nan[..., None] & allowed)  # keys weighed with NaN: (B, Hq, Lq, Lk)
    reads = (nan_w | (bad_out[..., None] & (p > 0))).any(2)  # (B, Hq, Lk)
    reads = reads.reshape(b, -1, group, lk).any(2)
    assert not np.isfinite(dk[reads]).all(-1).any(), "dk of a key read by a NaN row is finite"
    nan_keys = nan_w.any(2).reshape(b, -1, group, lk).any(2)
    assert not np.isfinite(dv[nan_keys]).all(-1).any(), "dv of a key weighed NaN is finite"

    # Slices without a single non-finite input: float64 eager's gradients.
    ins64 = [t.double().requires_grad_() for t in (q, k, v)]
    ref = attnlab.attention(*ins64, mask=mask, causal=causal, window=window, backend="eager")
    rq, rk, rv = (t.numpy() for t in torch.autograd.grad(ref, ins64, grad.double()))
    for bi in range(b):
        for hk in range(k.shape[1]):
            heads = slice(hk * group, (hk + 1) * group)
            clean = all(torch.isfinite(t).all() for t in (q[bi, heads], k[bi, hk], v[bi, hk]))
            if not clean:
                continue
            np.testing.assert_allclose(dq[bi, heads], rq[bi, heads], rtol=1e-3, atol=1e-4)
            np.testing.assert_allclose(dk[bi, hk], rk[bi, hk], rtol=1e-3, atol=1e-4)
            np.testing.assert_allclose(dv[bi, hk], rv[bi, hk], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_len", [4, 64, 100])
def test_a_nan_query_row_is_nan_with_nan_gradients(backend, q_len):
    """The issue's case: a NaN query row (auto sends float32 rows to flash, which gave
    zeros and zero gradients); rows that the mask empties stay zeros."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, q_len, 16, generator=g) for _ in range(3))
    q[0, 1, 2, 5] = float("nan")
    mask = torch.ones(q_len, q_len, dtype=torch.bool)
    mask[3] = False  # row 3 empty by the mask
    q[0, 0, 3, 0] = float("nan")  # ... NaN data in an empty row: still zeros
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    with _backend(backend) as name:
        out = attnlab.attention(*ins, mask=mask, causal=True, backend=name)
    assert out[0, 1, 2].isnan().all()
    assert torch.equal(out[0, 0, 3], torch.zeros(16))
    clean = torch.ones(q_len, dtype=torch.bool)
    clean[2:4] = False
    assert torch.isfinite(out[0, 1, clean]).all() and torch.isfinite(out[0, 0]).all()
    dq, dk, dv = torch.autograd.grad(out, ins, torch.ones_like(out))
    assert dq[0, 1, 2].isnan().all()
    assert dk[0, 1, :3].isnan().all() and dv[0, 1, :3].isnan().all()  # keys row 2 reads
    # The empty row's own NaN may reach head 0's dk and dv (0 * NaN where its zero
    # weights meet its q; sdpa lets it see every key, then zeroes it), not other rows' dq.
    assert torch.isfinite(dq[0, 0, torch.arange(q_len) != 3]).all()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("poisoned", ["query", "key"])
def test_the_nan_torchs_kernel_drops_is_carried_back(causal, poisoned):
    """No mask: torch's fused kernel itself gives a NaN query row zeros (and, on a GPU, a
    NaN key's rows too); the route that cannot check its inputs carries the NaN back:
    the poisoned head's rows (just the row, for a query) and its gradients are NaN,
    the other kv head's equal eager's. GQA: two query heads a kv head."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 6, 8, generator=g)
    k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(2))
    (q[0, 1, 4, 3] if poisoned == "query" else k[0, 0, 2, 1]).fill_(float("nan"))
    grads = []
    for name in ("eager", "sdpa-carried"):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        with _backend(name) as backend:
            out = attnlab.attention(*ins, causal=causal, backend=backend)
        grads.append((out, *torch.autograd.grad(out, ins, torch.ones_like(out))))
    (out, dq, dk, dv), (want, want_dq, want_dk, want_dv) = grads[1], grads[0]
    if poisoned == "query":
        assert out[0, 1, 4].isnan().all() and dq[0, 1, 4].isnan().all()
    else:
        assert out[0, :2].isnan().all() and dq[0, :2].isnan().all()
    assert dk[0, 0].isnan().all() and dv[0, 0].isnan().all()
    torch.testing.assert_close(out[0, 2:], want[0, 2:])  # the other kv head's query heads
    for got, expected in ((dq[0, 2:], want_dq[0, 2:]), (dk[0, 1], want_dk[0, 1]),
                          (dv[0, 1], want_dv[0, 1])):
        torch.testing.assert_close(got, expected)


def test_flash_nan_row_behind_an_allowed_tile(monkeypatch):
    """Tiny tiles: the row's first key tile holds only NaN scores, the next finite
    ones. The NaN must survive the later tiles' rescaling."""
    if not _native.available():
        pytest.skip(f"native kernel: {_native.unavailable_reason()}")
    monkeypatch.setattr(_flash, "BLOCK_Q", 1)
    monkeypatch.setattr(_flash, "BLOCK_K", 2)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 6, 8, generator=g) for _ in range(3))
    k[0, 0, :2, 1] = float("nan")
    out = attnlab.attention(q, k, v, backend="flash")
    assert out.isnan().all()


def test_decode_step_keeps_nan():
    """The fused one-token step (csrc/decode_step.cpp) shares the row max that skips
    NaN: a NaN query, or a NaN cached key, still gives NaN, never zeros."""
    ops = _native.load()
    if ops is None:
        pytest.skip(f"native kernel: {_native.unavailable_reason()}")
    hq, hkv, d, lmax, pos = 2, 1, 16, 40, 30
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for where in ("query", "key", "all keys"):
            kc, vc = torch.randn(1, hkv, lmax, d, generator=g), torch.randn(1, hkv, lmax, d,
                                                                            generator=g)
            qkv = torch.randn(1, 1, (hq + 2 * hkv) * d, generator=g)
            if where == "query":
                qkv[0, 0, :d] = float("nan")  # head 0's query
            elif where == "key":
                kc[0, 0, 7, 3] = float("nan")
            else:
                kc[0, 0, : pos + 1, 3] = float("nan")
            out = ops.decode_step(qkv, None, None, kc, vc, pos, 0, hq, hkv, d ** -0.5)
            heads = out.view(hq, d)
            if where == "query":
                assert heads[0].isnan().all() and torch.isfinite(heads[1]).all()
            else:
                assert heads.isnan().all(), where


def test_nan_survives_inductor_on_the_sdpa_backend():
    """Under torch.compile nothing checks the inputs, so the carry is the route: inductor
    folded the old ``q.sum() * 0`` flag to 0 and a NaN query row came out as zeros."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    q[0, 1, 2, 3] = float("nan")

    def call(q, k, v):
        return attnlab.attention(q, k, v, causal=True, backend="sdpa")

    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.compile(call, fullgraph=True)(*ins)
    assert out[0, 1, 2].isnan().all() and torch.isfinite(out[0, 0]).all()
    dq, dk, dv = torch.autograd.grad(out, ins, torch.ones_like(out))
    assert dq[0, 1, 2].isnan().all() and dk[0, 1].isnan().any() and dv[0, 1].isnan().any()
    assert torch.isfinite(dq[0, 0]).all() and torch.isfinite(dk[0, 0]).all()
    with torch.no_grad():
        out = torch.compile(call, fullgraph=True)(q, k, v)
    assert out[0, 1, 2].isnan().all() and torch.isfinite(out[0, 0]).all()


def test_large_finite_half_precision_rows_are_not_taken_for_nan():
    """The carried route's old flag, ``q.sum() * 0``, overflowed to inf * 0 = NaN for a
    finite fp16 row whose sum passes 65504 (and float32 rows near 3e38)."""
    g = torch.Generator().manual_seed(0)
    q = (torch.rand(1, 1, 4, 128, generator=g) + 1).mul(400).half()  # sums past 65504
    k = torch.randn(1, 1, 4, 128, generator=g).mul(0.01).half()
    v = torch.randn(1, 1, 4, 128, generator=g).half()
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attnlab.attention(q, k, v, backend="eager")
    with _backend("sdpa-carried") as name:
        out = attnlab.attention(*ins, backend=name)
    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out, ins,
                                                                   torch.ones_like(out)))


def test_the_carry_takes_torch_func_transforms():
    """``torch.func.grad`` through the carried route (an autograd.Function with its own
    ``setup_context``), equal to eager's gradient on finite inputs."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    with _backend("sdpa-carried") as name:
        got = torch.func.grad(lambda q: attnlab.attention(q, k, v, causal=True,
                                                           backend=name).sum())(q)
    want = torch.func.grad(lambda q: attnlab.attention(q, k, v, causal=True,
                                                        backend="eager").sum())(q)
    torch.testing.assert_close(got, want)
