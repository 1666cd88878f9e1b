"""The backend table says what each backend takes, and the backends do what it says.

For every backend and every capability: declared False, an explicit call with that
feature raises ValueError; declared True, the result equals the eager backend's (which
test_functional holds to the NumPy oracle). And ``auto`` only ever picks a backend
that supports the call.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlab
from attnlab import backends
from attnlab.cache import KVCache
from attnlab.functional import _choose, backend_table, decode_step, may_decode

TABLE = backend_table()
NAMES = [b.name for b in TABLE]
TOL = dict(atol=1e-5, rtol=1e-5)


def _qkv(*, dtype=torch.float32, grad=False, t=9, s=11):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, t, 8, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(2, 2, s, 8, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(2, 2, s, 8, generator=g, dtype=torch.float64).to(dtype)
    return [x.requires_grad_(grad) for x in (q, k, v)]


def _runs_here(backend):
    why = backend.unavailable and backend.unavailable(torch.zeros(1, 1, 1, 1))
    if why:
        pytest.skip(f"{backend.name} not available here: {why}")


def test_the_table_is_the_list_of_backends():
    assert attnlab.BACKENDS == ("auto", *NAMES) == ("auto", "eager", "sdpa", "tiled", "flash")
    for b in TABLE:
        caps = b.capabilities()
        assert set(caps) == {"masks", "mask_gradients", "windows", "dropout", "weights",
                             "gradients", "devices", "dtypes", "decoding", "softcap",
                             "alibi", "sinks", "documents", "mask_mod", "score_mod",
                             "func_gradients", "mapped_variants", "log_sum_exp"}
    assert TABLE[0].supports(backends.Request(*_qkv()[:2], None, True, 3, 0.5,
                                              torch.arange(2))) is None  # eager takes all


@pytest.mark.parametrize("name", NAMES)
def test_masks_and_windows(name):
    backend = backends.TABLE[name]
    _runs_here(backend)
    q, k, v = _qkv()
    allowed = torch.rand(2, 1, 9, 11, generator=torch.Generator().manual_seed(1)) > 0.3
    bias = torch.randn(1, 4, 9, 11, generator=torch.Generator().manual_seed(2))
    cases = []
    if backend.masks:
        cases += [dict(mask=allowed), dict(mask=bias), dict(mask=allowed, causal=True)]
    if backend.windows:
        cases += [dict(window=3), dict(window=3, causal=True), dict(window=2**40)]
    assert cases, f"{name} declares neither masks nor windows"
    for kw in cases:
        want = attnlab.attention(q, k, v, backend="eager", **kw)
        torch.testing.assert_close(attnlab.attention(q, k, v, backend=name, **kw), want, **TOL)


@pytest.mark.parametrize("name", NAMES)
def test_weights(name):
    backend = backends.TABLE[name]
    _runs_here(backend)
    q, k, v = _qkv()
    if not backend.weights:
        with pytest.raises(ValueError, match=f"backend='{name}' cannot return weights"):
            attnlab.attention(q, k, v, return_weights=True, backend=name)
        return
    for rows in (True, [0, 5, -1]):
        out, w = attnlab.attention(q, k, v, causal=True, return_weights=rows, backend=name)
        want, want_w = attnlab.attention(q, k, v, causal=True, return_weights=rows,
                                         backend="eager")
        torch.testing.assert_close(out, want, **TOL)
        torch.testing.assert_close(w, want_w, **TOL)


@pytest.mark.parametrize("name", NAMES)
def test_gradients_and_mask_gradients(name):
    backend = backends.TABLE[name]
    _runs_here(backend)
    assert backend.gradients, f"{name}: every backend differentiates q, k, v today"
    grads = {}
    for which in (name, "eager"):
        q, k, v = _qkv(dtype=torch.float64, grad=True)
        attnlab.attention(q, k, v, causal=True, window=4, backend=which).square().sum().backward()
        grads[which] = (q.grad, k.grad, v.grad)
    torch.testing.assert_close(grads[name], grads["eager"])

    q, k, v = _qkv(dtype=torch.float64)
    bias = torch.randn(1, 4, 9, 11, dtype=torch.float64, requires_grad=True)
    if not backend.mask_gradients:
        with pytest.raises(ValueError, match=f"{name}.*mask requires grad"):
            attnlab.attention(q, k, v, mask=bias, backend=name)
        return
    got = torch.autograd.grad(attnlab.attention(q, k, v, mask=bias, backend=name).sum(), bias)
    want = torch.autograd.grad(attnlab.attention(q, k, v, mask=bias, backend="eager").sum(),
                               bias)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", NAMES)
def test_dropout(name):
    backend = backends.TABLE[name]
    _runs_here(backend)
    assert backend.dropout, f"{name}: every backend takes dropout today"
    q, k, v = _qkv()
    # p = 1 drops every weight: the one value dropout has to give on every backend.
    out = attnlab.attention(q, k, v, dropout_p=1.0, backend=name)
    torch.testing.assert_close(out, torch.zeros_like(out))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_dtypes(name, dtype):
    backend = backends.TABLE[name]
    _runs_here(backend)
    q, k, v = _qkv(dtype=dtype)
    if backend.dtypes is not None and dtype not in backend.dtypes:
        with pytest.raises(ValueError, match=f"backend='{name}'"):
            attnlab.attention(q, k, v, backend=name)
        return
    want = attnlab.attention(q, k, v, causal=True, backend="eager")
    got = attnlab.attention(q, k, v, causal=True, backend=name)
    tol = {} if dtype == torch.float64 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("name", NAMES)
def test_devices(name):
    backend = backends.TABLE[name]
    _runs_here(backend)
    if backend.devices is None:
        assert name != "flash"
        return
    assert "cpu" in backend.devices
    meta = torch.zeros(1, 2, 4, 8, device="meta")  # a device it does not run on
    with pytest.raises(ValueError, match=f"backend='{name}'.*meta"):
        attnlab.attention(meta, meta, meta, backend=name)


def _cache_and_step(window):
    g = torch.Generator().manual_seed(3)
    cache = KVCache(1, 16, 2, 8)
    past_k, past_v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(2))
    cache.update(past_k, past_v)
    qkv = torch.randn(1, 1, (4 + 2 * 2) * 8, generator=g)
    q, k, v = qkv.view(1, 1, 8, 8).transpose(1, 2).split_with_sizes([4, 2, 2], dim=1)
    want = attnlab.attention(q, torch.cat([past_k, k], 2), torch.cat([past_v, v], 2),
                             causal=True, window=window, backend="eager")
    return qkv, cache, want.transpose(1, 2).reshape(1, 1, 32)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("window", [None, 3])
def test_decoding(name, window):
    backend = backends.TABLE[name]
    qkv, cache, want = _cache_and_step(window)
    with torch.inference_mode():
        if not backend.decoding:
            assert not may_decode(name)
            with pytest.raises(ValueError, match=f"backend='{name}' has no fused decoding"):
                decode_step(qkv, cache, None, window, 4, 2, backend=name)
            assert cache.seq_len == 5
            return
        assert may_decode(name) and may_decode("auto")
        assert not may_decode(name, mask=torch.ones(1, 6, dtype=torch.bool))
        assert not may_decode(name, weights=True) and not may_decode(name, dropout_p=0.1)
        _runs_here(backend)
        out = decode_step(qkv, cache, None, window, 4, 2, backend=name)
    assert out is not None and cache.seq_len == 6
    torch.testing.assert_close(out, want, **TOL)
    with torch.enable_grad():
        assert not may_decode(name)  # the step has no backward


@pytest.mark.parametrize("change, words", [
    (dict(window=0), "window must be a positive int >= 1 or None, got 0"),
    (dict(window=-3), "window must be a positive int >= 1 or None, got -3"),
    (dict(sinks=torch.tensor([0.0, float("nan"), 0.0, 0.0])), "sinks must hold finite"),
    (dict(sinks=torch.zeros(3)), r"sinks must have shape \(4,\)"),
    (dict(softcap=-1.0), "softcap must be a positive finite number"),
    (dict(alibi_slopes=torch.zeros(2, 4)), "alibi_slopes must have shape"),
    (dict(scale=float("nan")), "scale"),
    (dict(qkv=torch.zeros(1, 1, 60)), r"qkv must have shape \(1, 1, 64\)"),
    (dict(qkv=torch.zeros(2, 1, 64)), r"qkv must have shape \(1, 1, 64\)"),
    (dict(num_kv_heads=4), "num_kv_heads=4: expected"),
])
@pytest.mark.parametrize("grad", [False, True])
def test_decode_step_refuses_what_attention_refuses(change, words, grad):
    """decode_step read a window of 0 or below as none, ran NaN sinks into NaN heads and
    left the rest to the kernel's RuntimeError (or, with gradients on, to a silent None)."""
    qkv, cache, _ = _cache_and_step(None)
    args = dict(qkv=qkv, num_kv_heads=2, window=None)
    args.update(change)
    with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=words):
        decode_step(args.pop("qkv"), cache, None, args.pop("window"), 4,
                    args.pop("num_kv_heads"), backend="auto", **args)
    assert cache.seq_len == 5


@settings(max_examples=60, deadline=None)
@given(t=st.integers(1, 300), s=st.integers(1, 300), causal=st.booleans(),
       window=st.one_of(st.none(), st.integers(1, 400)), rows=st.booleans(),
       learned=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_auto_picks_only_backends_that_take_the_call(t, s, causal, window, rows, learned,
                                                     dtype):
    q, k = torch.zeros(1, 2, t, 8, dtype=dtype), torch.zeros(1, 2, s, 8, dtype=dtype)
    mask = torch.zeros(1, 1, t, s, dtype=dtype, requires_grad=learned)
    picked = backends.TABLE[_choose(q, k, mask, window, torch.arange(t) if rows else None,
                                    causal=causal)]
    request = backends.Request(q, k, mask, causal, window, 0.0,
                               torch.arange(t) if rows else None)
    assert picked.supports(request) is None
    assert picked.mask_gradients or not learned


# --------------------------------------------------------------------------- log-sum-exp steps


# The CPU, and a CUDA device where torch sees one (torch's CUDA kernels in the sdpa step).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", [b.name for b in TABLE if b.lse is not None])
@settings(max_examples=15, deadline=None)
@given(q_len=st.integers(1, 9), k_len=st.integers(1, 12), cut=st.floats(0, 1),
       causal=st.booleans(), window=st.sampled_from([None, 1, 3]), group=st.sampled_from([1, 2]),
       padding=st.booleans(), variant=st.sampled_from([None, "softcap", "alibi"]),
       dtype=st.sampled_from([torch.float64, torch.float64, torch.bfloat16]),
       seed=st.integers(0, 99))
def test_lse_steps_merge_into_the_whole_attention(device, name, q_len, k_len, cut, causal,
                                                  window, group, padding, variant, dtype, seed):
    """Keys cut in two blocks, each attended with its own offset and merged by the
    log-sum-exp, give attention over all the keys; each block's backward with the
    merged output and log-sum-exp gives its share of the gradients (their sum is the
    whole gradient), with the variants a split call passes to its blocks (ALiBi at the
    blocks' offsets). What ring attention builds on. bf16 blocks (torch's fused kernels
    where they take them) are checked against float64 on the same rounded inputs."""
    from attnlab import _variants
    from attnlab.distributed.pieces import merge

    backend = backends.TABLE[name]
    _runs_here(backend)
    if variant == "softcap" and not backend.softcap or (
            device not in (backend.devices or (device,))):
        return
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2 * group, q_len, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, k_len, 8, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(2, 1, 1, k_len, generator=g) > 0.3 if padding else None
    grad = torch.randn(2, 2 * group, q_len, 8, generator=g, dtype=torch.float64)
    q, k, v, grad = (t.to(dtype).double() for t in (q, k, v, grad))  # rounded as the step sees them
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    options = ({"softcap": 1.5} if variant == "softcap" else
               {"alibi_slopes": torch.tensor([0.5, 0.25] * group, dtype=torch.float64)}
               if variant == "alibi" else {})
    want = attnlab.attention(*leaves, mask=mask, causal=causal, window=window, backend="eager",
                             **options)
    want_grads = torch.autograd.grad(want, leaves, grad)
    tol = 1e-10 if dtype == torch.float64 else 3e-2
    q, k, v, grad = (t.to(device, dtype) for t in (q, k, v, grad))
    mask = None if mask is None else mask.to(device)
    options = {n: x.to(device, dtype) if isinstance(x, torch.Tensor) else x
               for n, x in options.items()}
    variants = _variants.check(q, k, **options)

    at = round(cut * k_len)
    blocks = [(s, e) for s, e in ((0, at), (at, k_len)) if e > s]
    out = torch.zeros(want.shape, dtype=torch.float64, device=device)
    lse = torch.full(want.shape[:3], float("-inf"), dtype=torch.float64, device=device)
    scale = 8 ** -0.5
    for s, e in blocks:
        m = None if mask is None else mask[..., s:e]
        part, part_lse = backend.lse.forward(q, k[:, :, s:e], v[:, :, s:e], m, causal, window,
                                             scale, 0.0, variants, k_len - q_len - s)
        merge(out, lse, part.double(), part_lse.double())
    torch.testing.assert_close(out.cpu(), want.detach(), atol=tol, rtol=tol)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    dq = torch.zeros(q.shape, dtype=torch.float64, device=device)
    dks, dvs = [], []
    for s, e in blocks:
        m = None if mask is None else mask[..., s:e]
        bq, bk, bv = backend.lse.backward(q, k[:, :, s:e], v[:, :, s:e], m, out.to(dtype),
                                          lse.float() if dtype != torch.float64 else lse, grad,
                                          causal, window, scale, variants, k_len - q_len - s)
        dq += bq.double()
        dks.append(bk)
        dvs.append(bv)
    for got, expected in zip((dq, torch.cat(dks, 2), torch.cat(dvs, 2)), want_grads):
        torch.testing.assert_close(got.double().cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("variant, seq, want", [
    ({}, 4096, "sdpa"),
    ({"softcap": 30.0}, 4096, "eager"),
    ({"alibi_slopes": torch.ones(12)}, 4096, "sdpa"),
    ({"document_ids": (torch.arange(4096) * 8 // 4096)[None]}, 4096, "sdpa"),  # 8 documents
    ({"softcap": 30.0}, 16384, "tiled"),  # 12 GiB of float32 scores: tiles
    ({"document_ids": (torch.arange(16384) * 8 // 16384)[None]}, 16384, "sdpa"),  # 256 MB
    ({"document_ids": (torch.arange(32768) * 8 // 32768)[None]}, 32768, "sdpa"),  # 1 GiB
    ({"document_ids": (torch.arange(36864) * 8 // 36864)[None]}, 36864, "tiled"),
    ({}, 65536, "sdpa"),  # torch's kernels form no scores: no bound
])
def test_auto_off_the_cpu_takes_whole_matrix_kernels_until_they_pass_a_gib(variant, seq,
                                                                          want):
    """On a GPU (here the meta device, which no CPU-only backend takes) the tiled
    path's Python loop of small kernels lost to eager and sdpa in every case measured;
    auto takes it only where the other route would build more than 1 GiB (eager's
    scores, sdpa's dense mask)."""
    from attnlab import _variants

    host = torch.empty(1, 1, 1, 1).expand(1, 12, seq, 64)  # the variants checked on the CPU
    q = torch.empty(1, 12, seq, 64, device="meta")
    request = backends.Request(q, q, None, True, None, 0.0, None,
                               _variants.check(host, host, **variant))
    assert backends.choose(request).name == want


@pytest.mark.parametrize("batch, seq, window, rows, want", [
    (8, 2048, None, None, "sdpa"),
    (1, 8192, None, None, "sdpa"),
    (1, 8192, 128, None, "sdpa"),      # a 64 MB bool mask for the window
    (1, 65536, 128, None, "tiled"),    # a 4 GiB one
    (1, 1024, None, [0, 5], "eager"),  # weights: eager's 48 MB of scores
    (1, 16384, None, [0, 5], "tiled"),  # eager forms every row's scores, 12 GiB
])
def test_auto_off_the_cpu_counts_what_the_untiled_route_builds(batch, seq, window, rows,
                                                                want):
    q = torch.empty(batch, 12, seq, 64, device="meta")
    request = backends.Request(q, q, None, True, window, 0.0,
                               None if rows is None else torch.tensor(rows))
    assert backends.choose(request).name == want
