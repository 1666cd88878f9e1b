"""Any strides work: permuted, transposed, sliced and expanded (stride 0) views of q, k,
v and grad_out, with dimensions of size 0 and 1 (whose strides are arbitrary), give
the numbers and gradients of the same values laid out contiguously, on every backend.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlab
from attnlab import _native

BACKENDS = ["eager", "sdpa", "tiled", "auto"] + (["flash"] if _native.available() else [])


@st.composite
def layouts(draw, shape):
    """A view with the values of ``torch.randn(shape)`` in a drawn layout."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    kind = draw(st.sampled_from(["contiguous", "permuted", "transposed", "sliced",
                                 "expanded", "odd size-1 strides"]))
    if kind == "permuted":  # stored in another dimension order, viewed back
        order = draw(st.permutations(range(4)))
        stored = torch.randn([shape[i] for i in order], generator=g)
        return stored.permute([order.index(i) for i in range(4)])
    if kind == "transposed":  # the last two dimensions swapped in storage
        return torch.randn(*shape[:2], shape[3], shape[2], generator=g).transpose(-1, -2)
    if kind == "sliced":  # every other element of a larger tensor along drawn dims
        steps = [draw(st.sampled_from([1, 2, 3])) for _ in range(4)]
        big = torch.randn([max(n * s, 1) for n, s in zip(shape, steps)], generator=g)
        return big[tuple(slice(0, n * s, s) for n, s in zip(shape, steps))]
    if kind == "expanded":  # broadcast from size 1 along drawn dims: stride 0
        ones = [draw(st.booleans()) for _ in range(4)]
        small = torch.randn([1 if o else n for o, n in zip(ones, shape)], generator=g)
        return small.expand(shape)
    if kind == "odd size-1 strides":  # as_strided: any stride where the size is 0 or 1
        base = torch.randn(shape, generator=g)
        strides = [s if n > 1 else draw(st.integers(0, 97))
                   for s, n in zip(base.stride(), shape)]
        if any(n == 0 for n in shape):
            return base
        return base.as_strided(shape, strides)
    return torch.randn(shape, generator=g)


@st.composite
def problems(draw):
    kv = draw(st.integers(0, 2)) or 1
    b = draw(st.sampled_from([0, 1, 2]))
    hq = kv * draw(st.sampled_from([1, 2]))
    lq, lk = draw(st.sampled_from([0, 1, 2, 5, 70])), draw(st.sampled_from([0, 1, 3, 70]))
    d, dv = draw(st.sampled_from([1, 2, 8])), draw(st.sampled_from([1, 3, 8]))
    q = draw(layouts((b, hq, lq, d)))
    k = draw(layouts((b, kv, lk, d)))
    v = draw(layouts((b, kv, lk, dv)))
    grad = draw(layouts((b, hq, lq, dv)))
    return q, k, v, grad, draw(st.booleans()), draw(st.sampled_from([None, 2]))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=80, deadline=None)
@given(p=problems())
def test_any_strides_give_the_contiguous_result(backend, p):
    q, k, v, grad, causal, window = p
    # The same layouts on leaves that want gradients: each view made again from a copy
    # of its storage; gradients are taken with respect to the views themselves.
    views = []
    for t in (q, k, v):
        leaf = (t if t._base is None else t._base).detach().clone().requires_grad_()
        views.append(leaf.as_strided(t.shape, t.stride(), t.storage_offset()))
    kw = dict(causal=causal, window=window, backend=backend)
    out = attnlab.attention(*views, **kw)
    flat = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    want = attnlab.attention(*flat, **kw)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    if out.numel() == 0:
        return
    got = torch.autograd.grad(out, views, grad)
    exp = torch.autograd.grad(want, flat, grad.contiguous())
    for a, e in zip(got, exp):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_issues_layouts(backend):
    """The issue's reproduction: a size-1 last dimension transposed."""
    x = torch.randn(1, 2, 1, 70).transpose(-1, -2)  # (1, 2, 70, 1), last stride 70
    assert x.stride(-1) == 70 and x.is_contiguous()
    want = attnlab.attention(x.contiguous(), x.contiguous(), x.contiguous(), backend="eager")
    torch.testing.assert_close(attnlab.attention(x, x, x, backend=backend), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_transposed_grad_out_with_value_head_size_1(backend):
    """The backward's grad_out (B, H, 70, 1) transposed from (B, H, 1, 70): last stride 70."""
    q, k = torch.randn(1, 2, 70, 8, requires_grad=True), torch.randn(1, 2, 70, 8)
    v = torch.randn(1, 2, 70, 1)
    grad = torch.randn(1, 2, 1, 70).transpose(-1, -2)
    out = attnlab.attention(q, k, v, causal=True, backend=backend)
    (dq,) = torch.autograd.grad(out, q, grad)
    ref = attnlab.attention(q, k, v, causal=True, backend="eager")
    torch.testing.assert_close(dq, torch.autograd.grad(ref, q, grad.contiguous())[0],
                               atol=1e-5, rtol=1e-5)
