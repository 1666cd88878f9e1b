"""Hostile properties of the mask arithmetic (issue 25: 3, 5, 8), on every backend.

- Additive float masks as people build them (ALiBi-like ``slope * j``, one huge entry,
  ``-inf`` entries, rows left empty, HF's ``finfo.min`` rows) combined with causal
  and/or window, in float32/bf16/fp16: equal to the NumPy float64 oracle computed
  from the same rounded inputs, within what the dtype can hold.
- Any scale (negative, 0, tiny, large) with causal/window: equal to the oracle.
- Masks of every rank: broadcast as PyTorch broadcasts them, or refused by the check
  with one line naming ``mask``, the same on every backend.
"""

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

FLASH = pytest.param("flash", marks=pytest.mark.skipif(
    not _native.available(), reason=f"native kernel: {_native.unavailable_reason()}"))
BACKENDS = ["eager", "sdpa", "tiled", FLASH, "auto"]
# Outputs are averages of values of size ~1: float32 keeps ~7 digits (the mask shift
# and the float32 scores add a few ulps); bf16 rounds the output to 8 bits of mantissa
# (~4e-3 relative, and its inputs to the scores), fp16 to 11 bits.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
HALF_MAX = {torch.bfloat16: 3e38, torch.float16: 6e4}  # beyond: the mask stays float32


@contextlib.contextmanager
def tiny_tiles():
    """Tiny tiles, so that short sequences cross many tile boundaries."""
    saved = _tiled.BLOCK_Q, _tiled.BLOCK_K, _flash.BLOCK_Q, _flash.BLOCK_K
    _tiled.BLOCK_Q, _tiled.BLOCK_K, _flash.BLOCK_Q, _flash.BLOCK_K = 3, 4, 3, 4
    try:
        yield
    finally:
        _tiled.BLOCK_Q, _tiled.BLOCK_K, _flash.BLOCK_Q, _flash.BLOCK_K = saved


def _inputs(seed, batch, q_heads, kv_heads, q_len, k_len, head_dim, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, q_len, head_dim, generator=g)
    k = torch.randn(batch, kv_heads, k_len, head_dim, generator=g)
    v = torch.randn(batch, kv_heads, k_len, head_dim, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _oracle(q, k, v, mask, **kw):
    """The float64 oracle on exactly the (rounded) values attention() was given."""
    m = None if mask is None else mask.numpy() if mask.dtype == torch.bool else (
        mask.double().numpy())
    return ref.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), m, **kw)


def _rule(draw):
    """causal and/or window, at least one of them."""
    which = draw(st.sampled_from(["causal", "causal", "window", "both"]))
    window = draw(st.integers(1, 8)) if which != "causal" else None
    return which != "window", window


# ------------------------------------------------------------- additive masks


@st.composite
def additive_problems(draw):
    kv_heads = draw(st.integers(1, 2))
    shape = dict(batch=draw(st.integers(1, 2)), kv_heads=kv_heads,
                 q_heads=kv_heads * draw(st.sampled_from([1, 2])),
                 q_len=draw(st.sampled_from([1, 3, 7, 13])),
                 k_len=draw(st.sampled_from([1, 4, 9, 16])),
                 head_dim=draw(st.sampled_from([4, 8])))
    causal, window = _rule(draw)
    kind = draw(st.sampled_from(["alibi", "alibi-keys", "huge-entry", "neg-inf",
                                 "empty-rows", "huge-rows"]))
    return dict(shape=shape, causal=causal, window=window, kind=kind,
                slope=draw(st.sampled_from([0.05, 0.3, 1.0, 8.0, 1e3])),
                big=draw(st.sampled_from([1e5, -1e5, 1e9, 1e30, -1e30, 3e38])),
                mask_dtype=draw(st.sampled_from(["float32", "input", "float64"])),
                seed=draw(st.integers(0, 2**16)))


def _additive_mask(p, g):
    s = p["shape"]
    full = (s["batch"], s["q_heads"], s["q_len"], s["k_len"])
    kind = p["kind"]
    if kind == "alibi":  # BLOOM: a bias growing along the keys, one slope per head
        slopes = p["slope"] / 2.0 ** torch.arange(s["q_heads"], dtype=torch.float32)
        return slopes[:, None, None] * torch.arange(s["k_len"], dtype=torch.float32)
    if kind == "alibi-keys":  # the same for every head and query: a 1-D mask
        return p["slope"] * torch.arange(s["k_len"], dtype=torch.float32)
    mask = torch.randn(full, generator=g)
    if kind == "huge-entry":  # one huge value anywhere, often on a key the rule forbids
        flat = mask.view(-1)
        flat[int(torch.randint(0, flat.numel(), (1,), generator=g))] = p["big"]
    elif kind == "neg-inf":
        mask[torch.rand(full, generator=g) > 0.6] = float("-inf")
    elif kind == "empty-rows":
        mask[..., int(torch.randint(0, s["q_len"], (1,), generator=g)), :] = float("-inf")
    elif kind == "huge-rows":  # HF padding: finfo.min rows or columns, -1e9 elsewhere
        mask[..., 0, :] = torch.finfo(torch.float32).min
        mask[..., -1] = -1e9
    return mask


def _mask_in(mask, p, dtype):
    if p["mask_dtype"] == "float64":
        return mask.double()
    finite = mask[torch.isfinite(mask)]
    fits = not finite.numel() or float(finite.abs().max()) < HALF_MAX.get(dtype, 3.4e38)
    return mask.to(dtype) if p["mask_dtype"] == "input" and fits else mask


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(p=additive_problems())
def test_additive_masks_with_rules_match_the_oracle(backend, dtype, p):
    s = p["shape"]
    q, k, v = _inputs(p["seed"], **s, dtype=dtype)
    mask = _mask_in(_additive_mask(p, torch.Generator().manual_seed(p["seed"] + 1)), p, dtype)
    want = _oracle(q, k, v, mask, causal=p["causal"], window=p["window"])
    with tiny_tiles():
        out = attnlab.attention(q, k, v, mask=mask, causal=p["causal"], window=p["window"],
                                backend=backend)
    assert out.dtype == dtype and out.shape == want.shape
    np.testing.assert_allclose(out.double().numpy(), want, atol=TOL[dtype], rtol=TOL[dtype])


# ------------------------------------------------------------------- scales

SCALES = [-1e3, -2.5, -1e-3, -0.0, 0.0, 1e-30, 1e-3, 30.0, 1e3]


@st.composite
def scale_problems(draw):
    causal, window = _rule(draw)
    q_len = draw(st.sampled_from([1, 4, 9, 70]))
    # Equal lengths and no mask often: where the sdpa route may hand causal to torch.
    return dict(scale=draw(st.sampled_from(SCALES)), causal=causal, window=window,
                q_len=q_len, k_len=draw(st.sampled_from([q_len, q_len, 1, 4, 9, 70])),
                mask=draw(st.sampled_from(["none", "none", "bool", "float"])),
                seed=draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(p=scale_problems())
def test_any_scale_with_rules_matches_the_oracle(backend, p):
    q, k, v = _inputs(p["seed"], 1, 2, 2, p["q_len"], p["k_len"], 8, torch.float32)
    q_len = p["q_len"]
    g = torch.Generator().manual_seed(p["seed"] + 1)
    mask = None
    if p["mask"] == "bool":
        mask = torch.rand(q_len, p["k_len"], generator=g) > 0.3
    elif p["mask"] == "float":
        mask = torch.randn(q_len, p["k_len"], generator=g)
    rules = dict(causal=p["causal"], window=p["window"], scale=p["scale"])
    want = _oracle(q, k, v, mask, **rules)
    kw = dict(mask=mask, **rules)
    with tiny_tiles():
        out = attnlab.attention(q, k, v, backend=backend, **kw)
        eager = attnlab.attention(q, k, v, backend="eager", **kw)
    # float32 scores are exact to ~1e-7 relative; a large scale magnifies their error
    # in the exponent by |scale| (the oracle multiplies in float64).
    tol = 2e-5 * max(1.0, abs(p["scale"]))
    np.testing.assert_allclose(out.numpy(), want, atol=tol, rtol=tol)
    np.testing.assert_allclose(out.numpy(), eager.numpy(), atol=tol, rtol=tol)


# ------------------------------------------------------------ masks of any rank


@st.composite
def ranked_masks(draw):
    """A mask of rank 0..q.ndim+1 against q of rank 3..5: each of its dims the
    target's size or 1 (broadcasts), or, when ``bad``, one dim of a size that cannot
    broadcast (or one dim too many)."""
    lead = draw(st.sampled_from([(), (2,), (2, 1), (1, 3)]))
    kv_heads = draw(st.integers(1, 2))
    q_heads = kv_heads * draw(st.sampled_from([1, 2]))
    q_len, k_len = draw(st.sampled_from([1, 3, 5])), draw(st.sampled_from([1, 4, 6]))
    q_dims = (*lead, q_heads, q_len)  # the 3-D case has no batch: q is (heads, q_len, d)
    target = (*q_dims, k_len)
    rank = draw(st.integers(0, len(target)))
    shape = [draw(st.sampled_from([n, 1])) for n in target[len(target) - rank:]]
    bad = draw(st.sampled_from([None, "size", "rank"]))
    if bad == "size" and shape:
        at = draw(st.integers(0, len(shape) - 1))
        shape[at] = target[len(target) - rank + at] + 1
    elif bad == "rank":
        shape = [1, *target]
    else:
        bad = None
    return dict(lead=lead, kv_heads=kv_heads, q_heads=q_heads, q_len=q_len, k_len=k_len,
                shape=tuple(shape), bad=bad, causal=draw(st.booleans()),
                kind=draw(st.sampled_from(["bool", "float"])),
                seed=draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(p=ranked_masks())
def test_masks_of_every_rank_broadcast_or_are_refused_in_one_line(backend, p):
    g = torch.Generator().manual_seed(p["seed"])
    q = torch.randn(*p["lead"], p["q_heads"], p["q_len"], 8, generator=g)
    k = torch.randn(*p["lead"], p["kv_heads"], p["k_len"], 8, generator=g)
    v = torch.randn(*p["lead"], p["kv_heads"], p["k_len"], 8, generator=g)
    if p["kind"] == "bool":
        mask = torch.rand(p["shape"], generator=g) > 0.3
    else:
        mask = torch.randn(p["shape"], generator=g)
        mask[torch.rand(p["shape"], generator=g) > 0.7] = float("-inf")
    call = dict(mask=mask, causal=p["causal"], backend=backend)
    if p["bad"] is not None:
        with pytest.raises(ValueError) as info:
            attnlab.attention(q, k, v, **call)
        message = str(info.value)
        assert "mask" in message and str(tuple(mask.shape)) in message, message
        assert "\n" not in message, message
        return
    with tiny_tiles():
        out = attnlab.attention(q, k, v, **call)
    want = _oracle(q, k, v, mask, causal=p["causal"])  # NumPy broadcasts like PyTorch
    assert out.shape == want.shape
    np.testing.assert_allclose(out.numpy(), want, atol=1e-5, rtol=1e-5)
