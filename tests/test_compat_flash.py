"""``attnlab.compat.flash_attn_func`` / ``flash_attn_varlen_func`` against FlashAttention's
documented semantics, written out here from its README (not from attnlab's rule) and
evaluated by the NumPy oracle:

- layout ``(batch, seqlen, nheads, headdim)``; MQA/GQA by fewer k/v heads;
- "If causal=True, the causal mask is aligned to the bottom right corner";
- "If window_size != (-1, -1), implements sliding window local attention. Query at
  position i will only attend to keys between [i + seqlen_k - seqlen_q - window_size[0],
  i + seqlen_k - seqlen_q + window_size[1]] inclusive" (causal: window_size[1] = 0);
- "alibi_slopes: (nheads,) or (batch_size, nheads) ... a bias of
  (-alibi_slope * |i + seqlen_k - seqlen_q - j|) is added to the attention score";
- softcap: ``softcap * tanh(qk * softmax_scale / softcap)`` before the softmax;
- varlen: each sequence of ``cu_seqlens`` on its own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import reference as ref
from attnlab.compat import flash_attn_func, flash_attn_varlen_func


def _fa_bias(seqlen_q, seqlen_k, causal, window_size, slopes, max_seqlen_k=None):
    """FlashAttention's mask and ALiBi bias as one additive ``(heads, seqlen_q, seqlen_k)``
    array: ``-inf`` where a key is out, ``-slope * |i + sk - sq - j|`` elsewhere. The
    window's sides as the kernel sets them: one of ``max_seqlen_k`` (varlen's; else
    seqlen_k) or more is -1 (mha_fwd, mha_varlen_fwd), then a -1 beside a non-negative side
    is ``max_seqlen_k`` (set_params_fprop)."""
    left, right = window_size
    if causal:
        right = 0
    most = seqlen_k if max_seqlen_k is None else max_seqlen_k
    left, right = (-1 if side >= most else side for side in (left, right))
    if (left < 0) != (right < 0):
        left, right = (most if side < 0 else side for side in (left, right))
    i = np.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q
    j = np.arange(seqlen_k)[None, :]
    ok = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if causal:
        ok &= j <= i
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    bias = np.zeros((len(slopes), seqlen_q, seqlen_k))
    bias -= np.asarray(slopes)[:, None, None] * np.abs(i - j)
    return np.where(ok, bias, -np.inf)


def _expected(q, k, v, causal, window_size, slopes, softcap, scale=None, max_seqlen_k=None):
    """FlashAttention's output for one sequence ``(seqlen, heads, dim)`` by the oracle,
    with the masks above; plus its probabilities and lse."""
    qh, kh, vh = (np.asarray(t, dtype=np.float64).transpose(1, 0, 2) for t in (q, k, v))
    heads = qh.shape[0]
    slopes = np.zeros(heads) if slopes is None else np.asarray(slopes)
    bias = _fa_bias(qh.shape[1], kh.shape[1], causal, window_size, slopes, max_seqlen_k)
    out, weights = ref.attention(qh, kh, vh, bias, scale=scale, return_weights=True,
                                 softcap=softcap or None)
    group = heads // kh.shape[0]
    s = np.einsum("hqd,hkd->hqk", qh, np.repeat(kh, group, 0)) * (
        scale if scale is not None else 1 / np.sqrt(qh.shape[-1]))
    if softcap:
        s = softcap * np.tanh(s / softcap)
    s = s + bias
    with np.errstate(divide="ignore"):
        top = np.max(s, -1, keepdims=True)
        safe = np.where(np.isfinite(top), top, 0)
        lse = np.log(np.exp(s - safe).sum(-1)) + safe[..., 0]
    lse = np.where(np.isfinite(lse), lse, np.inf)  # FlashAttention: +inf for an empty row
    return out.transpose(1, 0, 2), weights, lse


windows = st.tuples(st.integers(-1, 4), st.integers(-1, 4))


@st.composite
def problems(draw):
    kv_heads = draw(st.integers(1, 2))
    return dict(batch=draw(st.integers(1, 2)), kv_heads=kv_heads,
                heads=kv_heads * draw(st.sampled_from([1, 2])),
                seqlen_q=draw(st.sampled_from([1, 3, 6, 9])),
                seqlen_k=draw(st.sampled_from([1, 4, 6, 9])),
                causal=draw(st.booleans()), window_size=draw(windows),
                softcap=draw(st.sampled_from([0.0, 0.0, 0.5, 20.0])),
                alibi=draw(st.sampled_from([None, "heads", "batch"])),
                scale=draw(st.sampled_from([None, 0.3])),
                seed=draw(st.integers(0, 2**16)))


def _tensors(p):
    g = torch.Generator().manual_seed(p["seed"])
    q = torch.randn(p["batch"], p["seqlen_q"], p["heads"], 8, generator=g, dtype=torch.float64)
    k = torch.randn(p["batch"], p["seqlen_k"], p["kv_heads"], 8, generator=g,
                    dtype=torch.float64)
    v = torch.randn(p["batch"], p["seqlen_k"], p["kv_heads"], 8, generator=g,
                    dtype=torch.float64)
    slopes = None
    if p["alibi"] == "heads":
        slopes = torch.rand(p["heads"], generator=g, dtype=torch.float64)
    elif p["alibi"] == "batch":
        slopes = torch.rand(p["batch"], p["heads"], generator=g, dtype=torch.float64)
    return q, k, v, slopes


@settings(max_examples=40, deadline=None)
@given(p=problems())
def test_flash_attn_func_is_flashattentions_definition(p):
    q, k, v, slopes = _tensors(p)
    out, lse, probs = flash_attn_func(q, k, v, softmax_scale=p["scale"], causal=p["causal"],
                                      window_size=p["window_size"], softcap=p["softcap"],
                                      alibi_slopes=slopes, return_attn_probs=True)
    assert out.shape == q.shape and out.is_contiguous()
    assert lse.shape == (p["batch"], p["heads"], p["seqlen_q"]) and lse.dtype == torch.float32
    for b in range(p["batch"]):
        row = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b])
        want, want_w, want_lse = _expected(q[b], k[b], v[b], p["causal"], p["window_size"],
                                           None if row is None else row.numpy(), p["softcap"],
                                           p["scale"])
        np.testing.assert_allclose(out[b].numpy(), want, atol=1e-10)
        np.testing.assert_allclose(probs[b].numpy(), want_w, atol=1e-10)
        np.testing.assert_allclose(lse[b].numpy(), want_lse, rtol=1e-6)
    torch.testing.assert_close(flash_attn_func(
        q, k, v, softmax_scale=p["scale"], causal=p["causal"], window_size=p["window_size"],
        softcap=p["softcap"], alibi_slopes=slopes), out, atol=1e-12, rtol=1e-12)


@st.composite
def packed(draw):
    n = draw(st.integers(1, 3))
    lens_q = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    lens_k = draw(st.lists(st.integers(1, 7), min_size=n, max_size=n))
    return dict(lens_q=lens_q, lens_k=lens_k, causal=draw(st.booleans()),
                window_size=draw(windows), softcap=draw(st.sampled_from([0.0, 1.5])),
                alibi=draw(st.booleans()), gqa=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)))


@settings(max_examples=30, deadline=None)
@given(p=packed())
def test_varlen_is_each_sequence_on_its_own(p):
    g = torch.Generator().manual_seed(p["seed"])
    heads, kv_heads = 4, 2 if p["gqa"] else 4
    total_q, total_k = sum(p["lens_q"]), sum(p["lens_k"])
    q = torch.randn(total_q, heads, 8, generator=g, dtype=torch.float64)
    k = torch.randn(total_k, kv_heads, 8, generator=g, dtype=torch.float64)
    v = torch.randn(total_k, kv_heads, 8, generator=g, dtype=torch.float64)
    cu_q = torch.tensor([0, *np.cumsum(p["lens_q"])], dtype=torch.int32)
    cu_k = torch.tensor([0, *np.cumsum(p["lens_k"])], dtype=torch.int32)
    slopes = torch.rand(heads, generator=g, dtype=torch.float64) if p["alibi"] else None
    kw = dict(causal=p["causal"], window_size=p["window_size"], softcap=p["softcap"],
              alibi_slopes=slopes)
    out, lse, probs = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(p["lens_q"]) + 1,
                                             max(p["lens_k"]), return_attn_probs=True, **kw)
    assert out.shape == q.shape and lse.shape == (heads, total_q)
    for b in range(len(p["lens_q"])):
        qa, qb, ka, kb = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        want, want_w, want_lse = _expected(q[qa:qb], k[ka:kb], v[ka:kb], p["causal"],
                                           p["window_size"],
                                           None if slopes is None else slopes.numpy(),
                                           p["softcap"], max_seqlen_k=max(p["lens_k"]))
        np.testing.assert_allclose(out[qa:qb].numpy(), want, atol=1e-10)
        np.testing.assert_allclose(probs[b, :, :qb - qa, :kb - ka].numpy(), want_w, atol=1e-10)
        np.testing.assert_allclose(lse[:, qa:qb].numpy(), want_lse, rtol=1e-6)
        assert not bool(probs[b, :, qb - qa:].any()) and not bool(probs[b, :, :, kb - ka:].any())


def _fa_torch(q, k, v, causal, window_size, softcap):
    """FlashAttention's definition in plain torch, one sequence ``(seqlen, heads, dim)``:
    the gradients' reference."""
    bias = torch.from_numpy(_fa_bias(q.shape[0], k.shape[0], causal, window_size,
                                     np.zeros(q.shape[1])))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    s = softcap * torch.tanh(s / softcap) + bias
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


def test_gradients_are_those_of_flashattentions_definition():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(10, h, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for h in (4, 2, 2))
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    kw = dict(causal=False, window_size=(1, 3), softcap=2.0)
    outs = {"dense": flash_attn_func(q[None], k[None], v[None], **kw)[0],
            "varlen": flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, **kw)}
    want = {"dense": _fa_torch(q, k, v, **kw),
            "varlen": torch.cat([_fa_torch(q[a:b], k[a:b], v[a:b], **kw)
                                 for a, b in ((0, 3), (3, 10))])}
    for name, out in outs.items():
        g_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
        got = torch.autograd.grad(out, (q, k, v), g_out)
        expected = torch.autograd.grad(want[name], (q, k, v), g_out)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("call, kind, match", [
    (dict(softcap=-1.0), ValueError, r"softcap must be a number >= 0"),
    (dict(window_size=3), TypeError, r"window_size must be a pair of ints"),
    (dict(window_size=(1.5, 2)), TypeError, r"window_size must be a pair of ints"),
    (dict(deterministic="yes"), TypeError, r"deterministic must be a bool"),
])
def test_flash_attn_func_refuses_in_one_line(call, kind, match):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(kind, match=match):
        flash_attn_func(q, q, q, **call)
    with pytest.raises(ValueError, match=r"q must be \(batch, seqlen, nheads, headdim\)"):
        flash_attn_func(q[0], q[0], q[0])


def test_varlen_refuses_what_it_cannot_state_exactly():
    q = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, block_table=torch.zeros(2, 1))
    with pytest.raises(ValueError, match=r"max_seqlen_q must be an int >= the longest "
                                         r"sequence \(4\), got 3"):
        flash_attn_varlen_func(q, q, q, cu, cu, 3, 4)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must start at 0, never decrease and "
                                         r"end at or before the number of tokens \(6\)"):
        flash_attn_varlen_func(q, q, q, cu, torch.tensor([0, 4, 2, 6]), 4, 4)
    with pytest.raises(ValueError, match=r"end at or before the number of tokens \(6\), got "
                                         r"\[0, 2, 7\]"):
        flash_attn_varlen_func(q, q, q, cu, torch.tensor([0, 2, 7]), 4, 5)
    with pytest.raises(ValueError, match=r"differ between sequences are not supported"):
        flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, alibi_slopes=torch.rand(2, 2))
    # the shapes FlashAttention documents, for these 2 heads and 2 sequences (helper-found:
    # a wrong head count was told about sequences, a (3,) about a (1, 2) it then refused)
    for slopes in (torch.rand(3), torch.rand(2, 3), torch.rand(1, 2), torch.rand(3, 2)):
        with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(2,\) or \(2, "
                                             r"2\) \(nheads, or batch x nheads\), got"):
            flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, alibi_slopes=slopes)
    same = torch.tensor([[0.5, 0.25], [0.5, 0.25]])
    torch.testing.assert_close(
        flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, alibi_slopes=same),
        flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, alibi_slopes=same[0]))


def test_shape_errors_name_the_callers_layout():
    q, v = torch.randn(2, 5, 4, 16), torch.randn(2, 7, 4, 16)
    with pytest.raises(ValueError, match=r"k and v must have the same sizes but headdim \(q "
                                         r"\(2, 5, 4, 16\), k \(2, 5, 4, 16\), v \(2, 7, 4, 16\); "
                                         r"\(batch, seqlen, nheads, headdim\)\)"):
        flash_attn_func(q, q, v)
    with pytest.raises(ValueError, match=r"q and k must have the same batch and headdim"):
        flash_attn_func(q, torch.randn(2, 5, 4, 8), torch.randn(2, 5, 4, 8))
    with pytest.raises(ValueError, match=r"k's nheads must divide q's"):
        flash_attn_func(q, torch.randn(2, 5, 3, 16), torch.randn(2, 5, 3, 16))
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"v \(7, 4, 16\); \(total_tokens, nheads, headdim\)"):
        flash_attn_varlen_func(q[0], q[0], v[0], cu, cu, 5, 5)


def test_a_window_side_of_seqlen_k_or_more_is_as_flashattentions_kernel_sets_it():
    # mha_fwd sets a side >= seqlen_k to -1, two of them no window: with more queries
    # than keys that is not the band the formula would give (its first rows would see no
    # key at all).
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 2, 8, generator=g) for n in (9, 3, 3))
    full = flash_attn_func(q, k, v)
    for window in ((-1, 3), (-1, 7), (3, 3), (5, -1)):
        torch.testing.assert_close(flash_attn_func(q, k, v, window_size=window), full)
    assert not torch.allclose(flash_attn_func(q, k, v, window_size=(-1, 2)), full)
    # Helper-found: beside a non-negative side, one of seqlen_k or more is seqlen_k, a
    # band (set_params_fprop), not unbounded: (1, 3) here is keys i - 7 ... i - 3.
    _, lse, probs = flash_attn_func(q, k, v, window_size=(1, 3), return_attn_probs=True)
    seen = (probs[0, 0] > 0).int()
    assert seen.tolist() == [[0, 0, 0]] * 3 + [[1, 0, 0], [1, 1, 0]] + [[1, 1, 1]] * 3 + [
        [0, 1, 1]]
    assert bool(torch.isinf(lse[0, 0, :3]).all())
    torch.testing.assert_close(flash_attn_func(q, k, v, window_size=(1, 3)),
                               flash_attn_func(q, k, v, window_size=(1, 30)))
    cu_q, cu_k = torch.tensor([0, 9], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    torch.testing.assert_close(
        flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 9, 3, window_size=(-1, 3)),
        full[0])


def test_numpys_bool_is_a_bool():
    # code ported from a data loader passes causal=np.bool_(True); it was refused as
    # "causal must be a bool, got bool np.True_"
    q = torch.randn(1, 5, 2, 8)
    torch.testing.assert_close(flash_attn_func(q, q, q, causal=np.True_),
                               flash_attn_func(q, q, q, causal=True))
    with pytest.raises(TypeError, match="causal must be a bool, got int 1"):
        flash_attn_func(q, q, q, causal=1)


def test_varlen_tokens_past_the_last_sequence_are_padding():
    # Code that pads q/k/v to a fixed total (FlashAttention leaves those rows alone) was
    # refused; the padding's rows are zeros, the sequences' are as without it.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 8, generator=g) for n in (9, 8, 8))
    cu_q, cu_k = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 3, 6],
                                                                        dtype=torch.int32)
    for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (1, 1))):
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 3, causal=causal,
                                     window_size=window)
        want = flash_attn_varlen_func(q[:6], k[:6], v[:6], cu_q, cu_k, 4, 3, causal=causal,
                                      window_size=window)
        torch.testing.assert_close(out[:6], want)
        assert not out[6:].any()
