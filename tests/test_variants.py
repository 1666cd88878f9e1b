"""Every attention variant and their combinations against the NumPy float64 oracle, on
every backend that claims them: values, the weights' rows and gradients (against
float64 eager), with causal/window rules, masks, GQA and tiles small enough that the
shapes cross many tile and block-mask boundaries. A backend that does not declare a
variant must refuse it in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_functional import BACKENDS, FLASH, tiny_tiles  # the backends and tiles of every test

import attnlab
from attnlab import _native, backends
from attnlab import reference as ref
from attnlab.blockmask import block_mask
from attnlab.functional import attention_with_lse

# What each variant is called in the backend table.
CAPABILITY = {"softcap": "softcap", "alibi_slopes": "alibi", "sinks": "sinks",
              "document_ids": "documents", "mask_mod": "mask_mod", "score_mod": "score_mod"}


# Written with operators only, so that the oracle can call them one pair at a time
# with Python ints (FlexAttention's semantics) and attnlab with broadcast tensors.
def prefix_lm(b, h, q, kv):
    return (kv <= q) | (kv < 3)


def head_band(b, h, q, kv):
    return (q - kv <= h + 1) & (kv - q <= 2)


def per_batch(b, h, q, kv):
    return (kv + b) % 3 != 0


def nothing(b, h, q, kv):
    return kv < 0


def halve_and_tilt(s, b, h, q, kv):
    return s * 0.5 + 0.25 * (q - kv)


def per_head(s, b, h, q, kv):
    return s + 0.5 * h - 0.125 * b * kv


MASK_MODS = [prefix_lm, head_band, per_batch, nothing]
SCORE_MODS = [halve_and_tilt, per_head]


def _ids(draw, length):
    """Non-decreasing document ids: a few documents, some of them absent."""
    steps = draw(st.lists(st.sampled_from([0, 0, 0, 1, 2]), min_size=length, max_size=length))
    return np.cumsum(steps) + draw(st.integers(0, 2))


@st.composite
def problems(draw):
    kv_heads = draw(st.integers(1, 2))
    shape = dict(batch=draw(st.integers(1, 2)), kv_heads=kv_heads,
                 q_heads=kv_heads * draw(st.sampled_from([1, 2])),
                 q_len=draw(st.sampled_from([1, 4, 7, 9])),
                 head_dim=draw(st.sampled_from([4, 8])))
    shape["k_len"] = draw(st.sampled_from([shape["q_len"], shape["q_len"], 3, 11]))
    which = draw(st.lists(st.sampled_from(list(CAPABILITY)), min_size=1, max_size=4,
                          unique=True))
    v = {}
    b, hq, lq, lk = shape["batch"], shape["q_heads"], shape["q_len"], shape["k_len"]
    if "softcap" in which:
        v["softcap"] = draw(st.sampled_from([0.3, 1.0, 5.0, 50.0]))
    if "alibi_slopes" in which:
        per_batch_slopes = draw(st.booleans())
        v["alibi_slopes"] = np.array(draw(st.lists(
            st.sampled_from([0.0, 0.0625, 0.25, 0.5, 2.0]),
            min_size=hq * (b if per_batch_slopes else 1),
            max_size=hq * (b if per_batch_slopes else 1)))).reshape(
            (b, hq) if per_batch_slopes else (hq,))
    if "sinks" in which:
        v["sinks"] = np.array(draw(st.lists(st.sampled_from([-3.0, -0.5, 0.0, 1.0, 4.0]),
                                            min_size=hq, max_size=hq)))
    if "document_ids" in which:
        per_sequence = [(_ids(draw, lq), _ids(draw, lk)) for _ in range(b)]
        if lq == lk and draw(st.booleans()):
            v["document_ids"] = np.stack([q for q, _ in per_sequence])
        else:
            v["document_ids"] = (np.stack([q for q, _ in per_sequence]),
                                 np.stack([k for _, k in per_sequence]))
    if "mask_mod" in which:
        v["mask_mod"] = draw(st.sampled_from(MASK_MODS))
        v["blocks"] = draw(st.sampled_from([None, (2, 3), (1, 1), (4, 2)]))
    if "score_mod" in which:
        v["score_mod"] = draw(st.sampled_from(SCORE_MODS))
    rule = draw(st.sampled_from(["none", "causal", "window", "both"]))
    return dict(shape=shape, variants=v, causal=rule in ("causal", "both"),
                window=draw(st.integers(1, 5)) if rule in ("window", "both") else None,
                mask=draw(st.sampled_from([None, None, "bool", "float"])),
                seed=draw(st.integers(0, 2**16)))


def _inputs(p, dtype, grad=False):
    s = p["shape"]
    g = torch.Generator().manual_seed(p["seed"])
    q = torch.randn(s["batch"], s["q_heads"], s["q_len"], s["head_dim"], generator=g,
                    dtype=torch.float64)
    k = torch.randn(s["batch"], s["kv_heads"], s["k_len"], s["head_dim"], generator=g,
                    dtype=torch.float64)
    v = torch.randn(s["batch"], s["kv_heads"], s["k_len"], s["head_dim"], generator=g,
                    dtype=torch.float64)
    mask = None
    if p["mask"] == "bool":
        mask = torch.rand(s["batch"], 1, s["q_len"], s["k_len"], generator=g) > 0.25
    elif p["mask"] == "float":
        mask = torch.randn(1, s["q_heads"], s["q_len"], s["k_len"], generator=g,
                           dtype=torch.float64)
    return [t.to(dtype).requires_grad_(grad) for t in (q, k, v)], mask


def _torch_variants(p, dtype, grad=False):
    """The call's variant arguments for attnlab (tensors; a small-block BlockMask)."""
    s, out = p["shape"], {}
    for name, value in p["variants"].items():
        if name == "blocks":
            continue
        if name == "mask_mod" and p["variants"]["blocks"] is not None:
            bq, bk = p["variants"]["blocks"]
            value = block_mask(value, s["batch"], s["q_heads"], s["q_len"], s["k_len"],
                               block_q=bq, block_k=bk)
        elif name == "document_ids":
            value = (torch.from_numpy(value) if not isinstance(value, tuple)
                     else tuple(torch.from_numpy(x) for x in value))
        elif name in ("alibi_slopes", "sinks"):
            value = torch.from_numpy(value).to(dtype)
            if name == "sinks":
                value.requires_grad_(grad)
        out[name] = value
    return out


def _oracle(p, q, k, v, mask, rows=False):
    kw = {n: x for n, x in p["variants"].items() if n != "blocks"}
    m = None if mask is None else mask.numpy() if mask.dtype == torch.bool else (
        mask.double().numpy())
    return ref.attention(q.detach().double().numpy(), k.detach().double().numpy(),
                         v.detach().double().numpy(), m, causal=p["causal"],
                         window=p["window"], return_weights=rows, **kw)


def _claims(backend: str, p) -> bool:
    if backend == "auto":
        return True
    return all(getattr(backends.TABLE[backend], CAPABILITY[n])
               for n in p["variants"] if n != "blocks")


TOL = {torch.float64: 1e-9, torch.float32: 3e-5}


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(p=problems(), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_values_match_the_oracle(backend, p, dtype):
    (q, k, v), mask = _inputs(p, dtype)
    kw = dict(mask=mask, causal=p["causal"], window=p["window"], backend=backend,
              **_torch_variants(p, dtype))
    if not _claims(backend, p):
        with pytest.raises(ValueError, match=f"backend='{backend}'.* does not take") as info:
            attnlab.attention(q, k, v, **kw)
        assert "\n" not in str(info.value)
        return
    with tiny_tiles():
        out = attnlab.attention(q, k, v, **kw)
    want = _oracle(p, q, k, v, mask)
    tol = TOL[dtype] * (1 + 4 * ("softcap" in p["variants"] and dtype == torch.float32))
    np.testing.assert_allclose(out.double().numpy(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", ["eager", "tiled", "auto"])
@settings(max_examples=40, deadline=None)
@given(p=problems(), rows=st.sampled_from([True, [0], [-1, 0]]))
def test_weights_rows_match_the_oracle(backend, p, rows):
    (q, k, v), mask = _inputs(p, torch.float64)
    with tiny_tiles():
        out, weights = attnlab.attention(q, k, v, mask=mask, causal=p["causal"],
                                         window=p["window"], return_weights=rows,
                                         backend=backend, **_torch_variants(p, torch.float64))
    want, want_w = _oracle(p, q, k, v, mask, rows=True)
    picked = slice(None) if rows is True else rows
    np.testing.assert_allclose(out.numpy(), want, atol=1e-9)
    np.testing.assert_allclose(weights.numpy(), want_w[..., picked, :], atol=1e-9)
    total = weights.sum(-1).numpy()  # sinks take their share: rows sum to at most 1
    assert (total <= 1 + 1e-9).all()
    if "sinks" in p["variants"]:
        assert (total < 1).all()


@pytest.mark.parametrize("backend", ["sdpa", "tiled", FLASH])
@settings(max_examples=40, deadline=None)
@given(p=problems())
def test_gradients_match_float64_eager(backend, p):
    if not _claims(backend, p):
        return  # refusals: test_values_match_the_oracle
    grads = []
    for name in ("eager", backend):
        (q, k, v), mask = _inputs(p, torch.float64, grad=True)
        kw = _torch_variants(p, torch.float64, grad=True)
        with tiny_tiles():
            out = attnlab.attention(q, k, v, mask=mask, causal=p["causal"],
                                    window=p["window"], backend=name, **kw)
        g_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(p["seed"] + 7),
                            dtype=torch.float64)
        leaves = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
        grads.append(torch.autograd.grad(out, leaves, g_out, allow_unused=True))
    for want, got in zip(*grads):
        assert got is not None
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)


def _lse_gradients(p, q, k, mask, g):
    """The oracle's gradient of ``sum(g * lse)`` in q, k and the sinks, by its closed form:
    ``d lse_i / d s_ij = P_ij`` (the oracle's weights), through the softcap's tanh and the
    scale to q and k; a sink's ``d lse_i / d sink = 1 - sum_j P_ij`` (1 on a row with no
    allowed key, whose lse is the sink's logit)."""
    _, weights = _oracle(p, q, k, q.new_zeros(k.shape), mask, rows=True)
    qn, kn = q.detach().numpy(), k.detach().numpy()
    group = qn.shape[1] // kn.shape[1]
    kg = np.repeat(kn, group, axis=1)  # (B, Hq, Lk, D)
    scale = 1 / np.sqrt(qn.shape[-1])
    ds = g[..., None] * weights  # (B, Hq, Lq, Lk)
    if "softcap" in p["variants"]:
        c = p["variants"]["softcap"]
        ds = ds * (1 - np.tanh(scale * qn @ kg.swapaxes(-1, -2) / c) ** 2)
    dq = scale * ds @ kg
    dk = (scale * ds.swapaxes(-1, -2) @ qn).reshape(*kn.shape[:2], group, *kn.shape[2:]).sum(2)
    dsinks = (g * (1 - weights.sum(-1))).sum(axis=(0, 2))
    return dq, dk, dsinks


@pytest.mark.parametrize("backend", [n for n, b in backends.TABLE.items() if b.lse is not None])
@settings(max_examples=40, deadline=None)
@given(p=problems())
def test_lse_gradients_match_the_oracle(backend, p):
    # torch's flex_attention differentiates its lse; attnlab's does too, on every backend
    # that forms it, so a loss on it (a z-loss, a merge of pieces) trains with its term.
    if backend == "flash" and not _native.available() or not _claims(backend, p):
        return  # refusals: test_values_match_the_oracle
    (q, k, v), mask = _inputs(p, torch.float64, grad=True)
    kw = _torch_variants(p, torch.float64, grad=True)
    with tiny_tiles():
        out, lse = attention_with_lse(q, k, v, mask=mask, causal=p["causal"],
                                      window=p["window"], backend=backend, **kw)
    g = torch.randn(lse.shape, generator=torch.Generator().manual_seed(p["seed"] + 7),
                    dtype=torch.float64)
    if "score_mod" in p["variants"]:  # its tensors' share cannot be seen: refused
        with pytest.raises(RuntimeError, match="with a score_mod .* carries no gradient"):
            torch.autograd.grad(lse, [q], g)
        return
    leaves = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    with tiny_tiles():
        got = torch.autograd.grad(lse, leaves, g, allow_unused=True)
    dq, dk, dsinks = _lse_gradients(p, q, k, mask, g.numpy())
    np.testing.assert_allclose(got[0].numpy(), dq, atol=1e-9, rtol=1e-9)
    np.testing.assert_allclose(got[1].numpy(), dk, atol=1e-9, rtol=1e-9)
    assert got[2] is None or not got[2].any()  # the lse does not read v
    if "sinks" in kw:
        np.testing.assert_allclose(got[3].numpy(), dsinks, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("backend", [n for n, b in backends.TABLE.items() if b.lse is not None])
def test_the_lse_of_an_additive_mask_as_given_differentiated_once(backend):
    if backend == "flash" and not _native.available():
        return
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(5, 5, generator=g, dtype=torch.float64) * 3
    q.requires_grad_()
    _, lse = attention_with_lse(q, k, v, mask=bias, causal=True, backend=backend)
    scores = (q @ k.mT / 2 + bias).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1),
                                               float("-inf"))
    want = torch.logsumexp(scores, -1)  # the rows were shifted inside: added back
    torch.testing.assert_close(lse, want, rtol=1e-12, atol=1e-12)
    z_loss = (lse ** 2).sum()  # not linear in the lse: its level matters
    torch.testing.assert_close(torch.autograd.grad(z_loss, q, create_graph=True)[0],
                               torch.autograd.grad((want ** 2).sum(), q)[0])
    # a second backward through it raises (it is differentiated once), not a wrong one
    grad, = torch.autograd.grad((lse ** 2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        grad.sum().backward()
    # a vmap of a grad that takes only the output is unaffected by the lse's gradient
    if backend in ("eager", "sdpa", "flash"):
        f = lambda x: attention_with_lse(x, k, v, backend=backend)[0].sum()  # noqa: E731
        per_row = torch.func.vmap(torch.func.grad(f))(q.detach().unsqueeze(0).expand(2, -1, -1,
                                                                                  -1, -1))
        torch.testing.assert_close(per_row[1], torch.func.grad(f)(q.detach()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_shape", ["rows", "keys"])
def test_a_mask_mod_leaves_an_additive_mask_as_exact_as_the_rule_does(backend, mask_shape):
    # Helper-found: each row's shift was the mask's maximum over the keys the causal
    # rule allows, counting keys only mask_mod forbids; -1e9 on every key a query may
    # see and 0 on the rest then swallowed the scores (off by 0.7).
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8) for _ in range(3))
    i = torch.arange(6)
    if mask_shape == "rows":  # (q_len, k_len): 0 exactly where the mask_mod forbids
        bias = torch.where(i[None] > i[:, None], 0.0, -1e9)
    else:  # a key-padding row for every query; the head's band forbids its 0s
        bias = torch.where(i < 2, 0.0, -1e9)[None]

    def band(b, h, qi, ki):  # causal, and (keys) head h sees no key before h
        return (ki <= qi) & (ki >= h) if mask_shape == "keys" else ki <= qi

    allowed = torch.stack([band(0, h, i[:, None], i[None]) for h in range(3)])[None]
    want = ref.attention(*(t.double().numpy() for t in (q, k, v)),
                         np.where(allowed.numpy(), bias.double().numpy(), -np.inf))
    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        got = attnlab.attention(q.to(dtype), k.to(dtype), v.to(dtype), mask=bias.to(dtype),
                                mask_mod=band, backend=backend)
        np.testing.assert_allclose(got.double().numpy(), want, atol=tol)
