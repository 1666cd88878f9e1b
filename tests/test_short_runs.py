"""The flash forward's path for query runs of at most 32 keys (packed sentences, short
sequences): the same numbers as its tiles and as the float64 oracle, NaN and empty rows
included. A mask of all True sends the same problem through the tiles."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from threads import threads

from attnlab import _native
from attnlab import reference as ref
from attnlab.functional import attention_with_lse

pytestmark = pytest.mark.skipif(not _native.available(),
                                reason=f"native kernel: {_native.unavailable_reason()}")


@st.composite
def short_problems(draw):
    """Lengths around the 16 rows of a vector and the 32 keys the path takes, head dims
    that fill 16-float vectors or leave a part, GQA, windows, causal, packed documents,
    rows packed side by side as a qkv projection leaves them, NaN inputs."""
    kv_heads = draw(st.integers(1, 2))
    k_len = draw(st.sampled_from([1, 5, 15, 16, 17, 31, 32, 33, 40]))
    same = draw(st.booleans())
    return dict(
        batch=draw(st.integers(1, 2)), kv_heads=kv_heads,
        q_heads=kv_heads * draw(st.sampled_from([1, 3])),
        q_len=k_len if same else draw(st.sampled_from([1, 7, 16, 17, 33])), k_len=k_len,
        head_dim=draw(st.sampled_from([1, 8, 16, 24, 32, 40, 64])),
        v_dim=draw(st.sampled_from([None, 5, 48])),
        causal=draw(st.booleans()), window=draw(st.sampled_from([None, 1, 4, 50])),
        documents=same and draw(st.booleans()), packed=draw(st.booleans()),
        nan=draw(st.sampled_from([None, "query", "key"])),
        seed=draw(st.integers(0, 2**16)), threads=draw(st.sampled_from([1, 2])),
    )


def _inputs(p):
    g = torch.Generator().manual_seed(p["seed"])
    b, hq, hk, lq, lk, d = (p[n] for n in ("batch", "q_heads", "kv_heads", "q_len", "k_len",
                                           "head_dim"))
    dv = p["v_dim"] or d
    if p["packed"]:  # (B, L, heads * d) projections, viewed per head: rows far apart
        q = torch.randn(b, lq, hq * d + 3, generator=g)[..., :hq * d]
        q = q.view(b, lq, hq, d).transpose(1, 2)
        kv = torch.randn(b, lk, hk * (d + dv), generator=g)
        k = kv[..., :hk * d].view(b, lk, hk, d).transpose(1, 2)
        v = kv[..., hk * d:].view(b, lk, hk, dv).transpose(1, 2)
    else:
        q = torch.randn(b, hq, lq, d, generator=g)
        k = torch.randn(b, hk, lk, d, generator=g)
        v = torch.randn(b, hk, lk, dv, generator=g)
    if p["nan"] == "query":
        q = q.clone()
        q[0, 0, lq // 2, 0] = float("nan")
    elif p["nan"] == "key":
        k = k.clone()
        k[-1, -1, lk - 1, d - 1] = float("nan")
    return q, k, v


@settings(max_examples=120, deadline=None)
@given(p=short_problems())
def test_short_runs_give_the_tiles_numbers_and_the_oracles(p):
    q, k, v = _inputs(p)
    options = dict(causal=p["causal"], window=p["window"])
    if p["documents"]:
        g = torch.Generator().manual_seed(p["seed"] + 1)
        options["document_ids"] = torch.randint(0, 4, (p["batch"], p["k_len"]),
                                                generator=g).sort(dim=1).values
    everywhere = torch.ones(p["q_len"], p["k_len"], dtype=torch.bool)
    with threads(p["threads"]):
        out, lse = attention_with_lse(q, k, v, backend="flash", **options)
        tiled, tiled_lse = attention_with_lse(q, k, v, mask=everywhere,
                                                      backend="flash", **options)
    # the same NaN, zeros and +inf (rows with no key) on both paths, the values close
    torch.testing.assert_close(out, tiled, rtol=2e-6, atol=2e-6, equal_nan=True)
    torch.testing.assert_close(lse, tiled_lse, rtol=2e-6, atol=2e-6, equal_nan=True)
    if p["nan"]:  # (NaN as the tiles give it: the oracle has its own convention)
        return
    want = ref.attention(*(t.double().numpy() for t in (q, k, v)), causal=p["causal"],
                         window=p["window"],
                         document_ids=None if not p["documents"]
                         else options["document_ids"].numpy())
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)


def test_a_row_of_nan_scores_and_a_row_with_no_key():
    """Row 0 of a causal problem of more queries than keys sees nothing (zeros, lse +inf);
    a NaN query's row is NaN, its lse NaN; the other rows are finite."""
    q, k, v = (torch.randn(1, 2, n, 8) for n in (6, 4, 4))
    q[0, 1, 4, 3] = float("nan")
    out, lse = attention_with_lse(q, k, v, causal=True, backend="flash")
    assert torch.equal(out[0, :, :2], torch.zeros(2, 2, 8))
    assert torch.isposinf(lse[0, :, :2]).all()
    assert out[0, 1, 4].isnan().all() and lse[0, 1, 4].isnan()
    finite = torch.ones(2, 6, dtype=torch.bool)
    finite[:, :2] = False
    finite[1, 4] = False
    assert torch.isfinite(lse[0][finite]).all() and torch.isfinite(out[0][finite]).all()
