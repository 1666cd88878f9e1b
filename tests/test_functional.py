"""attnlab.attention against the NumPy float64 reference, on every backend."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlab
from attnlab import _flash, _native, _tiled
from attnlab import reference as ref

# The native kernel is tested wherever it builds; where it cannot, these say why.
FLASH = pytest.param("flash", marks=pytest.mark.skipif(
    not _native.available(), reason=f"native kernel: {_native.unavailable_reason()}"))
BACKENDS = ["eager", "sdpa", "tiled", FLASH, "auto"]


@contextlib.contextmanager
def tiny_tiles():
    """Tiny tiles so that short sequences still cross many tile boundaries."""
    saved = _tiled.BLOCK_Q, _tiled.BLOCK_K, _flash.BLOCK_Q, _flash.BLOCK_K
    _tiled.BLOCK_Q, _tiled.BLOCK_K = 3, 4
    _flash.BLOCK_Q, _flash.BLOCK_K = 3, 4
    try:
        yield
    finally:
        _tiled.BLOCK_Q, _tiled.BLOCK_K, _flash.BLOCK_Q, _flash.BLOCK_K = saved


@pytest.fixture
def small_tiles():
    with tiny_tiles():
        yield


@st.composite
def problems(draw):
    batch = draw(st.integers(1, 2))
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3]))  # 1 = MHA; kv_heads=1 with group>1 = MQA
    q_len = draw(st.sampled_from([1, 2, 5, 9]))
    k_len = draw(st.sampled_from([1, 3, 5, 12]))
    head_dim = draw(st.sampled_from([1, 4, 8]))
    v_dim = draw(st.sampled_from([head_dim, 3]))
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, 6)))
    mask_kind = draw(st.sampled_from(["none", "bool", "bool-rows-empty", "float", "padding"]))
    seed = draw(st.integers(0, 2**16))
    return dict(batch=batch, kv_heads=kv_heads, q_heads=kv_heads * group, q_len=q_len,
                k_len=k_len, head_dim=head_dim, v_dim=v_dim, causal=causal, window=window,
                mask_kind=mask_kind, seed=seed)


def make(p, dtype=torch.float32):
    g = torch.Generator().manual_seed(p["seed"])
    q = torch.randn(p["batch"], p["q_heads"], p["q_len"], p["head_dim"], generator=g)
    k = torch.randn(p["batch"], p["kv_heads"], p["k_len"], p["head_dim"], generator=g)
    v = torch.randn(p["batch"], p["kv_heads"], p["k_len"], p["v_dim"], generator=g)
    shape = (p["batch"], p["q_heads"], p["q_len"], p["k_len"])
    kind = p["mask_kind"]
    mask = None
    if kind == "bool":
        mask = torch.rand(shape, generator=g) > 0.3
    elif kind == "bool-rows-empty":
        mask = torch.rand(p["batch"], 1, p["q_len"], p["k_len"], generator=g) > 0.5
        mask[:, :, 0] = False  # the first query row may attend to nothing
    elif kind == "float":
        mask = torch.randn(shape, generator=g)
        mask[torch.rand(shape, generator=g) > 0.7] = float("-inf")
    elif kind == "padding":
        lengths = torch.randint(0, p["k_len"] + 1, (p["batch"],), generator=g)
        mask = attnlab.masks.padding(lengths, p["k_len"])
    return q.to(dtype), k.to(dtype), v.to(dtype), mask


def oracle(q, k, v, mask, p):
    m = None if mask is None else mask.double().numpy() if mask.dtype != torch.bool else (
        mask.numpy()
    )
    return ref.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), m,
                         causal=p["causal"], window=p["window"], return_weights=True)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(p=problems())
def test_matches_reference_fp32(backend, p):
    with tiny_tiles():
        check_fp32(backend, p)


def check_fp32(backend, p):
    q, k, v, mask = make(p)
    want_out, want_w = oracle(q, k, v, mask, p)
    kw = dict(mask=mask, causal=p["causal"], window=p["window"], backend=backend)
    if backend == "sdpa":
        out = attnlab.attention(q, k, v, **kw)
    else:
        out, w = attnlab.attention(q, k, v, return_weights=True, **kw)
        np.testing.assert_allclose(w.numpy(), want_w, atol=1e-5, rtol=1e-5)
    assert not torch.isnan(out).any()
    np.testing.assert_allclose(out.numpy(), want_out, atol=1e-5, rtol=1e-5)
    if backend == "auto":  # without weights auto makes its other choices (sdpa, tiled)
        out = attnlab.attention(q, k, v, **kw)
        np.testing.assert_allclose(out.numpy(), want_out, atol=1e-5, rtol=1e-5)


# bf16 keeps 8 bits of mantissa (output rounding ~4e-3 relative), fp16 keeps 11.
LOW_PRECISION = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.mark.parametrize("dtype", list(LOW_PRECISION))
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=20, deadline=None)
@given(p=problems())
def test_matches_reference_low_precision(backend, dtype, p):
    q, k, v, mask = make(p, dtype)
    want_out, _ = oracle(q, k, v, mask, p)  # the oracle sees the same rounded inputs
    with tiny_tiles():
        out = attnlab.attention(q, k, v, mask=mask, causal=p["causal"], window=p["window"],
                                backend=backend)
    assert out.dtype == dtype
    tol = LOW_PRECISION[dtype]
    np.testing.assert_allclose(out.float().numpy(), want_out, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", list(LOW_PRECISION))
@pytest.mark.parametrize("backend", ["eager", "sdpa", "tiled", FLASH])
def test_low_precision_softmax_accumulates_in_float32(backend, dtype):
    # 4096 keys of equal score: in bf16 a running sum would stall at 256 (256 + 1 ==
    # 256), in fp16 at 2048; float32 accumulation gives exactly 1/4096 each.
    q = torch.zeros(1, 1, 1, 8, dtype=dtype)
    k = torch.zeros(1, 1, 4096, 8, dtype=dtype)
    v = torch.ones(1, 1, 4096, 8, dtype=dtype)
    v[..., ::2, :] = -1.0  # the mean is 0 only if every key gets the same weight
    if backend == "sdpa":
        out = attnlab.attention(q, k, v, backend=backend)
    else:
        out, w = attnlab.attention(q, k, v, return_weights=True, backend=backend)
        assert torch.allclose(w.float().sum(-1), torch.ones(1), atol=1e-2)
    assert torch.allclose(out.float(), torch.zeros(1), atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_large_finite_float_masks_are_added_exactly(backend, dtype, causal):
    """Hugging Face masks with finfo.min (or -1e9): a key with it gets no weight,
    and a row that has the same huge value everywhere is unchanged by it. fp16's
    range ends at 65504, so a naive cast would turn such rows into empty ones."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g).to(dtype) for _ in range(3))
    mask = torch.zeros(2, 1, 5, 5)
    mask[..., 1, :] = torch.finfo(torch.float32).min  # the whole row: no effect
    mask[..., 2, 3:] = -1e9                           # keys 3, 4 ruled out
    mask[..., 3, :] = -1e9
    mask[..., 3, 0] = -1e9 - 1e3                      # only key 0 ruled out
    mask[..., 4, :] = float("-inf")                   # empty: zeros
    want = ref.attention(*(t.double().numpy() for t in (q, k, v)), mask.double().numpy(),
                         causal=causal)
    out = attnlab.attention(q, k, v, mask=mask, causal=causal, backend=backend)
    tol = LOW_PRECISION.get(dtype, 1e-5)
    np.testing.assert_allclose(out.double().numpy(), want, atol=tol, rtol=tol)
    plain = ref.attention(*(t.double().numpy() for t in (q, k, v)), causal=causal)
    np.testing.assert_allclose(want[..., 1, :], plain[..., 1, :], atol=1e-12)
    assert not want[..., 4, :].any()


def test_tiled_skips_the_tiles_a_window_rules_out(monkeypatch, small_tiles):
    """Sliding window W: each query block (3 rows) needs keys p-W+1..p, i.e. at most
    3 key blocks of 4; visiting more would make the cost O(seq^2) again."""
    calls = []
    real = _tiled._tile_scores
    monkeypatch.setattr(_tiled, "_tile_scores",
                        lambda *a, **kw: calls.append(a[4:8]) or real(*a, **kw))
    seq, window = 96, 4
    q, k, v = (torch.randn(1, 2, seq, 8, requires_grad=True) for _ in range(3))
    out = attnlab.attention(q, k, v, causal=True, window=window, backend="tiled")
    forward = len(calls)
    out.sum().backward()
    q_blocks = seq // 3
    assert q_blocks <= forward <= 3 * q_blocks  # dense would be 32 x 24 = 768 tiles
    assert len(calls) - forward <= 3 * q_blocks
    for q_start, q_end, k_start, _ in calls:  # no tile lies wholly outside the window
        assert k_start <= q_end - 1 and k_start + 4 > q_start - window


@pytest.mark.parametrize("backend", ["tiled", "sdpa", FLASH])
@settings(max_examples=30, deadline=None)
@given(p=problems())
def test_gradients_match_eager(backend, p):
    with tiny_tiles():
        q, k, v, mask = make(p, torch.float64)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.double()
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        kw = dict(mask=mask, causal=p["causal"], window=p["window"])
        out_e = attnlab.attention(*ins, backend="eager", **kw)
        grad = torch.randn_like(out_e)
        want = torch.autograd.grad(out_e, ins, grad)
        got = torch.autograd.grad(attnlab.attention(*ins, backend=backend, **kw), ins, grad)
        for w, g in zip(want, got):
            assert not torch.isnan(g).any()
            torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("backend", ["tiled", FLASH])
@pytest.mark.parametrize("kw", [
    dict(causal=True), dict(causal=True, window=2), dict(window=3), dict(dropout_p=0.4),
])
def test_tiled_gradcheck_float64(kw, backend, small_tiles):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 7, 2, generator=g, dtype=torch.float64, requires_grad=True)

    def f(q, k, v):
        torch.manual_seed(7)  # the same dropout pattern on every call gradcheck makes
        return attnlab.attention(q, k, v, backend=backend, **kw)

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("backend", ["eager", "sdpa", "tiled", FLASH])
def test_empty_rows_are_zero_with_finite_gradients(backend):
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k = torch.randn(1, 2, 6, 8, requires_grad=True)
    v = torch.randn(1, 2, 6, 8, requires_grad=True)
    mask = torch.ones(1, 1, 4, 6, dtype=torch.bool)
    mask[..., 1, :] = False
    out = attnlab.attention(q, k, v, mask=mask, backend=backend)
    assert torch.equal(out[:, :, 1], torch.zeros(1, 2, 8))
    assert out[:, :, 0].abs().sum() > 0
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :, 1], torch.zeros(1, 2, 8))


@pytest.mark.parametrize("backend", ["eager", "sdpa", "tiled", FLASH])
def test_causal_is_end_aligned_when_fewer_queries(backend):
    # One new token after a 9-token prefix sees all 10 keys; torch's is_causal would
    # let it see only the first key.
    q, k, v = torch.randn(1, 1, 1, 4), torch.randn(1, 1, 10, 4), torch.randn(1, 1, 10, 4)
    out = attnlab.attention(q, k, v, causal=True, backend=backend)
    full = attnlab.attention(q, k, v, backend=backend)
    torch.testing.assert_close(out, full)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "tiled", FLASH])
def test_dropout_in_effect_and_unbiased(backend):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    clean = attnlab.attention(q, k, v, backend=backend)
    runs = torch.stack([attnlab.attention(q, k, v, dropout_p=0.5, backend=backend)
                        for _ in range(200)])
    assert not torch.allclose(runs[0], clean)
    assert (runs.mean(0) - clean).abs().mean() < 0.05 * clean.abs().mean() + 0.02


def test_weights_of_chosen_rows_and_leading_dims():
    q, k, v = torch.randn(2, 3, 4, 5, 8), torch.randn(2, 3, 2, 7, 8), torch.randn(2, 3, 2, 7, 8)
    out_all, w_all = attnlab.attention(q, k, v, causal=True, return_weights=True,
                                       backend="eager")
    assert out_all.shape == (2, 3, 4, 5, 8) and w_all.shape == (2, 3, 4, 5, 7)
    for backend in ("eager", "tiled", "flash") if _native.available() else ("eager", "tiled"):
        _, w = attnlab.attention(q, k, v, causal=True, return_weights=[0, 4, -1],
                                 backend=backend)
        torch.testing.assert_close(w, w_all[..., [0, 4, 4], :])


@pytest.mark.parametrize("mask_kind", [None, "bool"])
def test_tiled_weights_carry_gradients(mask_kind, small_tiles):
    """A loss on the returned weights back-propagates as it does through eager."""
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(1, 4, 6, 3, generator=g), torch.randn(1, 2, 7, 3, generator=g),
            torch.randn(1, 2, 7, 3, generator=g)]
    mask = None
    if mask_kind:
        mask = torch.rand(1, 1, 6, 7, generator=g) > 0.3
        mask[..., 2, :] = False  # an empty row: zero weights, zero gradient
    target = torch.randn(1, 4, 6, 7, generator=g)
    grads = {}
    for backend in ("eager", "tiled"):
        q, k, v = (t.clone().requires_grad_() for t in base)
        _, w = attnlab.attention(q, k, v, mask=mask, causal=True, return_weights=True,
                                 backend=backend)
        (w * target).sum().backward()
        grads[backend] = (q.grad, k.grad)
    for got, want in zip(grads["tiled"], grads["eager"]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert grads["eager"][0].abs().sum() > 0


@pytest.mark.parametrize("backend", ["eager", "sdpa", "tiled", FLASH])
def test_dropout_one_gives_zeros_not_nan(backend):
    q, k, v = (torch.randn(1, 2, 5, 4, requires_grad=True) for _ in range(3))
    out = attnlab.attention(q, k, v, causal=True, dropout_p=1.0, backend=backend)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in (q, k, v))


@pytest.mark.parametrize("backend", ["eager", "sdpa", "tiled", FLASH])
@pytest.mark.parametrize("causal", [False, True])
def test_no_keys_gives_zero_rows(backend, causal):
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 0, 4), torch.randn(1, 2, 0, 4)
    mask = torch.ones(1, 1, 3, 0, dtype=torch.bool)
    out = attnlab.attention(q, k, v, causal=causal, mask=mask, backend=backend)
    assert torch.equal(out, torch.zeros(1, 2, 3, 4))


def test_learned_additive_mask_never_silently_loses_its_gradient():
    q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    bias = torch.zeros(1, 1, 5, 5, requires_grad=True)
    for backend in ("eager", "sdpa", "auto"):
        bias.grad = None
        attnlab.attention(q, k, v, mask=bias, causal=True, backend=backend)[..., 0].sum().backward()
        assert bias.grad is not None and bias.grad.abs().sum() > 0, backend
    with pytest.raises(ValueError, match="tiled.*mask requires grad"):
        attnlab.attention(q, k, v, mask=bias, backend="tiled")
    with torch.no_grad():  # nothing to differentiate: tiled is fine
        attnlab.attention(q, k, v, mask=bias, backend="tiled")


def test_auto_picks_documented_backends():
    from attnlab.functional import _choose

    q = torch.zeros(1, 1, 8192, 4)
    rows = torch.arange(8192)
    # dense rows: the native kernel where its AVX-512 tile products run, else SDPA
    assert _choose(q, q, None, None, None) == ("flash" if _flash.tile_kernel() else "sdpa")
    # a window: the native kernel where it builds, else the tiled path
    assert _choose(q, q, None, 256, None) == ("flash" if _native.available() else "tiled")
    # short rows too (the native kernel pays at any length; the tiled path does not)
    assert _choose(q[:, :, :32], q[:, :, :32], None, 16, None) == (
        "flash" if _native.available() else "sdpa")
    assert _choose(q[:, :, :64], q[:, :, :64], None, None, rows[:64]) == "eager"
    assert _choose(q, q, None, None, rows) == "tiled"


def test_worked_example_numbers():
    # Two 2-d queries and keys; see `attnlab demo` and README.
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    k = torch.tensor([[[1.0, 1.0], [0.0, 2.0]]])
    v = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    out, w = attnlab.attention(q, k, v, return_weights=True)
    # scores: [[1, 0], [1, 2]] / sqrt(2)
    e = np.exp(np.array([[1.0, 0.0], [1.0, 2.0]]) / np.sqrt(2.0))
    want_w = e / e.sum(-1, keepdims=True)
    np.testing.assert_allclose(w[0].numpy(), want_w, rtol=1e-6)
    np.testing.assert_allclose(w[0].numpy(), [[0.6697615, 0.3302385], [0.3302385, 0.6697615]],
                               rtol=1e-6)
    np.testing.assert_allclose(out[0].numpy(), [[1.660477, 2.660477], [2.339523, 3.339523]],
                               rtol=1e-6)


# --------------------------------------------------------------------------- bad input

q4, k4, v4 = torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8)


@pytest.mark.parametrize("args, kwargs, exc, words", [
    ((q4, torch.zeros(1, 2, 5, 7), v4), {}, ValueError, ["head_dim 7", "head_dim 8"]),
    ((torch.zeros(1, 3, 3, 8), k4, v4), {}, ValueError, ["3 heads", "multiple of kv heads"]),
    ((q4, k4, torch.zeros(1, 2, 6, 8)), {}, ValueError, ["length 5", "length 6"]),
    ((q4, k4, v4), {"mask": torch.ones(2, 1, 3, 4, dtype=torch.bool)}, ValueError,
     ["(2, 1, 3, 4)", "does not broadcast", "(1, 4, 3, 5)"]),
    ((q4, k4, v4), {"backend": "fast"}, ValueError, ["backend", "'fast'", "tiled"]),
    ((q4, k4, v4), {"dropout_p": 1.5}, ValueError, ["dropout_p", "1.5", "[0, 1]"]),
    ((q4, k4, v4), {"dropout_p": -0.1}, ValueError, ["dropout_p", "-0.1"]),
    ((q4, k4, v4), {"window": 0}, ValueError, ["window", ">= 1", "0"]),
    ((torch.zeros(3, 8), k4, v4), {}, ValueError, ["q", "at least 3 dimensions", "(3, 8)"]),
    ((q4, k4.double(), v4), {}, TypeError, ["k", "float64", "float32"]),
    ((q4, k4, v4), {"mask": torch.ones(1, 1, 3, 5, dtype=torch.int64)}, TypeError,
     ["mask", "int64", "from_attention_mask"]),
    ((q4, k4, v4), {"return_weights": True, "backend": "sdpa"}, ValueError,
     ["sdpa", "cannot return weights"]),
    ((q4, [1.0], v4), {}, TypeError, ["k", "torch.Tensor", "list"]),
    ((q4, k4, v4), {"return_weights": [3]}, ValueError, ["rows", "q_len=3", "[3]"]),
])
def test_bad_input_messages(args, kwargs, exc, words):
    with pytest.raises(exc) as info:
        attnlab.attention(*args, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_mixed_devices_named():
    meta = torch.zeros(1, 2, 5, 8, device="meta")
    with pytest.raises(ValueError, match="k is on meta but q is on cpu"):
        attnlab.attention(q4, meta, v4)


# ---------------------------------------------------------- issue 25


def _issue25_inputs(dtype, n=256, seed=25):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, n, 16, generator=g).to(dtype) for _ in range(3))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["bf16 bias", "bf16 inputs, float32 bias", "fp16 one huge"])
def test_additive_mask_with_causal_shifts_by_the_allowed_maximum(backend, case):
    """A bias that grows along the keys (BLOOM's slope * j) or one huge entry on a key
    the causal rule forbids: shifting each row by its maximum over *all* keys pushed
    the allowed entries to -76 or -1e5, where bf16/fp16 cannot resolve them (every
    backend was off by 0.25 in bf16; the sdpa route, which cast the mask to the
    inputs' dtype, by 0.28-3.0). The oracle sees the same rounded inputs."""
    if case == "bf16 bias":
        q, k, v = _issue25_inputs(torch.bfloat16)
        mask = (0.3 * torch.arange(256.0)).to(torch.bfloat16).expand(1, 2, 256, 256)
    elif case == "bf16 inputs, float32 bias":
        q, k, v = _issue25_inputs(torch.bfloat16)
        mask = 0.3 * torch.arange(256.0)[None, None, None, :]
    else:
        q, k, v = _issue25_inputs(torch.float16)
        mask = torch.zeros(256, 256)
        mask[0, 200] = 1e5  # forbidden by causal: must change nothing
    want = ref.attention(*(t.double().numpy() for t in (q, k, v)), mask.double().numpy(),
                         causal=True)
    out = attnlab.attention(q, k, v, mask=mask, causal=True, backend=backend)
    tol = LOW_PRECISION[q.dtype]
    np.testing.assert_allclose(out.double().numpy(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [0.0, -1.0, -0.05])
@pytest.mark.parametrize("q_len", [5, 70])
def test_causal_with_scale_zero_or_negative_matches_the_oracle(backend, scale, q_len):
    """torch's CPU SDPA returns NaN with is_causal for scale <= 0; the sdpa route (and
    auto through it) passed is_causal on, eager was right."""
    q, k, v = (t[:, :, :q_len] for t in _issue25_inputs(torch.float32, n=70))
    want = ref.attention(*(t.double().numpy() for t in (q, k, v)), causal=True, scale=scale)
    out = attnlab.attention(q, k, v, causal=True, scale=scale, backend=backend)
    np.testing.assert_allclose(out.numpy(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
def test_one_dimensional_mask_broadcasts_over_the_keys(backend, kind, causal):
    """A (k_len,) mask passes the broadcast check and is read as PyTorch reads it,
    (1, 1, 1, k_len); the sdpa route raised IndexError from torch on it."""
    q, k, v = (t[:, :, :9] for t in _issue25_inputs(torch.float32, n=9))
    g = torch.Generator().manual_seed(8)
    if kind == "bool":
        mask = torch.rand(9, generator=g) > 0.3
        mask[0] = False
        want_mask = mask.numpy()
    else:
        mask = torch.randn(9, generator=g)
        mask[2] = float("-inf")
        want_mask = mask.double().numpy()
    want = ref.attention(*(t.double().numpy() for t in (q, k, v)), want_mask, causal=causal)
    out = attnlab.attention(q, k, v, mask=mask, causal=causal, backend=backend)
    np.testing.assert_allclose(out.numpy(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "tiled", "flash", "auto"])
def test_autocast_gives_every_backend_its_dtype_as_sdpa_does(backend):
    """Under torch.autocast (CPU, bf16) a float32 query from a layer may meet a bf16 cache:
    q, k, v are taken in bf16, as torch's SDPA takes them, and every backend returns bf16,
    equal to the same call on bf16 inputs outside autocast."""
    if backend == "flash" and _native.unavailable_reason() is not None:
        pytest.skip("native kernel not built")
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 24, 16), torch.randn(2, 2, 24, 16), torch.randn(2, 2, 24, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = attnlab.attention(q, k.bfloat16(), v.bfloat16(), causal=True, backend=backend)
        plain = attnlab.attention(q, k, v, causal=True, backend=backend)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k.bfloat16().repeat_interleave(2, 1), v.bfloat16().repeat_interleave(2, 1),
            is_causal=True)
    bf16 = attnlab.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True,
                             backend=backend)
    assert mixed.dtype == plain.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(mixed, bf16) and torch.equal(plain, bf16)
    torch.testing.assert_close(mixed.float(), ref.float(), atol=2e-2, rtol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float64 is left as it is
        assert attnlab.attention(q.double(), k.double(), v.double(),
                                 backend=backend).dtype == torch.float64


def test_weight_rows_out_of_range_are_named_with_the_range_python_indexing_allows():
    q = torch.randn(1, 1, 5, 4)
    assert torch.equal(attnlab.attention(q, q, q, return_weights=[-5])[1],
                       attnlab.attention(q, q, q, return_weights=[0])[1])
    for bad in ([-6], [5]):
        with pytest.raises(ValueError, match=r"\[-q_len, q_len\) with q_len=5 .*" + str(bad[0])):
            attnlab.attention(q, q, q, return_weights=bad)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "tiled", "flash", "auto"])
def test_torch_func_transforms_take_every_backend(backend):
    """torch.func as code written for F.scaled_dot_product_attention uses it, in float32:
    grad, vmap, grad of vmap (every mapped call reached: flash gave zero gradients),
    per-sample gradients (vmap of grad), jacrev and mapped ALiBi slopes give eager's values;
    a backend that cannot take one (tiled's backward under a transform, the kernels over
    mapped slopes) is refused by name, and auto goes elsewhere."""
    import warnings

    from torch.func import grad, jacrev, vmap

    if backend == "flash" and _native.unavailable_reason() is not None:
        pytest.skip("native kernel not built")
    warnings.simplefilter("ignore")  # torch's "no batching rule" notes under vmap
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 7, 4) for _ in range(3))
    slopes = torch.rand(3, 2)

    def one(b, x, kk=k[:1], vv=v[:1], s=None):  # x: one sample (2, 7, 4)
        return attnlab.attention(x[None], kk, vv, causal=True, alibi_slopes=s, backend=b)[0]

    runs = {
        "grad": lambda b: grad(lambda a: attnlab.attention(a, k, v, causal=True, backend=b)
                               .square().sum())(q),
        "vmap": lambda b: vmap(lambda x: one(b, x))(q),
        "grad of vmap": lambda b: grad(lambda a: vmap(lambda x: one(b, x))(a).square().sum())(q),
        "per-sample": lambda b: vmap(grad(lambda x: one(b, x).square().sum()))(q),
        "jacrev": lambda b: jacrev(lambda a: one(b, a))(q[0]),
        "mapped slopes": lambda b: vmap(lambda x, s: one(b, x, s=s[None]))(q, slopes),
    }
    for name, run in runs.items():
        refused = (backend == "tiled" and name not in ("vmap", "mapped slopes")) or (
            backend in ("tiled", "flash") and name == "mapped slopes")
        if refused:
            with pytest.raises(ValueError, match=f"backend='{backend}'.* does not take torch"):
                run(backend)
        else:
            torch.testing.assert_close(run(backend), run("eager"), atol=2e-5, rtol=2e-5,
                                       msg=name)


@pytest.mark.parametrize("backend", ["tiled", FLASH, "auto"])
def test_a_second_derivative_raises_where_the_backward_is_not_differentiable(backend):
    # The kernels' gradients come without autograd: differentiated again (a gradient
    # penalty, a Hessian) they raise, where they used to pass for constants and give a
    # second derivative of zero. The first derivative with create_graph stays eager's.
    torch.manual_seed(0)
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    want, = torch.autograd.grad(attnlab.attention(q, k, v, causal=True, backend="eager")
                                .square().sum(), q)
    out = attnlab.attention(q, k, v, causal=True, backend=backend)
    grad, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="cannot be differentiated again.*backend='eager'"):
        torch.autograd.grad(grad.square().sum(), q)
    # a q whose last dimension is strided (the kernel saves a copy that needs no
    # gradient) and a loss linear in the output (its gradient needs none either)
    qt = torch.randn(1, 2, 8, 4, requires_grad=True)
    out = attnlab.attention(qt.transpose(-1, -2), k, v, causal=True, backend=backend)
    grad, = torch.autograd.grad((out * v[:, :, :4]).sum(), qt, create_graph=True)
    with pytest.raises(RuntimeError, match="cannot be differentiated again"):
        torch.autograd.grad(grad.square().sum(), qt)
    if backend != "tiled":  # (tiled refuses torch.func's gradient transforms by name)
        def loss(x):
            return attnlab.attention(x, k, v, causal=True, backend=backend).square().sum()
        with pytest.raises(RuntimeError, match="cannot be differentiated again"):
            torch.func.jacrev(torch.func.grad(loss))(q.detach())


@pytest.mark.parametrize("scale", [-0.5, 0.0])
@pytest.mark.parametrize("backend", ["sdpa", "tiled", FLASH, "auto"])
def test_the_lse_of_a_causal_call_with_a_scale_of_zero_or_below(backend, scale):
    # torch's CPU kernel gives NaN with is_causal for such a scale: the sdpa route builds
    # the mask instead, as attention() itself does.
    from attnlab.functional import attention_with_lse

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    want = attention_with_lse(q, k, v, causal=True, scale=scale, backend="eager")
    got = attention_with_lse(q, k, v, causal=True, scale=scale, backend=backend)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("q_len, k_len", [(3, 0), (0, 3), (0, 0)])
@pytest.mark.parametrize("backend", ["sdpa", "tiled", FLASH, "auto"])
def test_the_lse_of_an_empty_sequence_is_the_textbooks(backend, q_len, k_len):
    # torch's CPU flash kernel, which the sdpa route calls for the lse, divided by zero
    # here: the process died of SIGFPE
    from attnlab.functional import attention_with_lse

    q = torch.randn(1, 2, q_len, 4, requires_grad=True)
    k, v = (torch.randn(1, 2, k_len, 4, requires_grad=True) for _ in range(2))
    for causal in (False, True):
        want = attention_with_lse(q, k, v, causal=causal, backend="eager")
        got = attention_with_lse(q, k, v, causal=causal, backend=backend)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        grads = torch.autograd.grad(got[0].sum(), (q, k, v), allow_unused=True)
        assert all(g is None or not g.any() for g in grads)


@pytest.mark.parametrize("rows", [[], (), range(0)])
def test_no_rows_of_weights_asked_give_an_empty_weights_tensor(rows):
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    out, weights = attnlab.attention(q, k, v, return_weights=rows)
    assert weights.shape == (1, 2, 0, 5)
    torch.testing.assert_close(out, attnlab.attention(q, k, v))


def test_the_reference_attends_over_no_keys_with_zeros():
    out, weights = ref.attention(np.ones((1, 1, 3, 4)), np.zeros((1, 1, 0, 4)),
                                 np.zeros((1, 1, 0, 5)), return_weights=True)
    assert out.shape == (1, 1, 3, 5) and not out.any() and weights.shape == (1, 1, 3, 0)
    assert ref.softmax(np.full((2, 3), -np.inf)).tolist() == [[0.0] * 3] * 2
