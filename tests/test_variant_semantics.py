"""What each variant means, checked against the formulation its source uses (BLOOM's
ALiBi, gpt-oss's sinks, one attention call per packed document) rather than against
attnlab's own oracle; and the properties the backends promise beyond values: dropout
composes, score_mod's captured tensors get gradients, O(seq) memory with a score_mod,
auto never sends a variant to a backend that does not declare it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import attnlab
from attnlab import _native, _tiled, backends
from attnlab.functional import _choose, _variants

BACKENDS = ["eager", "sdpa", "tiled", "auto"]
g = torch.Generator().manual_seed(3)
Q = torch.randn(2, 4, 12, 8, generator=g, dtype=torch.float64)
K = torch.randn(2, 2, 12, 8, generator=g, dtype=torch.float64)
V = torch.randn(2, 2, 12, 8, generator=g, dtype=torch.float64)
TOL = dict(atol=1e-10, rtol=1e-10)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(_tiled, "BLOCK_Q", 4)
    monkeypatch.setattr(_tiled, "BLOCK_K", 5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_alibi_under_causal_equals_bloom_slope_times_key(backend):
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    bloom = slopes[:, None, None] * torch.arange(12, dtype=torch.float64)  # BLOOM's bias
    want = attnlab.attention(Q, K, V, causal=True, mask=bloom, backend="eager")
    got = attnlab.attention(Q, K, V, causal=True, alibi_slopes=slopes, backend=backend)
    torch.testing.assert_close(got, want, **TOL)


def _gpt_oss(q, k, v, sinks, causal_mask):
    """gpt-oss's sdpa: the sink logit as an extra column of the scores, softmax, drop it."""
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~causal_mask, float("-inf"))
    sink = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return weights @ v, weights


@pytest.mark.parametrize("backend", ["eager", "tiled", "auto"])
def test_sinks_are_gpt_oss_sinks_with_their_gradient(backend):
    sinks = torch.tensor([-1.0, 0.0, 2.0, 5.0], dtype=torch.float64, requires_grad=True)
    mine = sinks.detach().clone().requires_grad_()
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    want, want_w = _gpt_oss(Q, K, V, sinks, causal)
    got, got_w = attnlab.attention(Q, K, V, causal=True, sinks=mine, return_weights=True,
                                   backend=backend)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_w, want_w, **TOL)
    g_out = torch.randn(got.shape, generator=g, dtype=torch.float64)
    (want * g_out).sum().backward()
    (got * g_out).sum().backward()
    torch.testing.assert_close(mine.grad, sinks.grad, **TOL)
    assert bool((got_w.sum(-1) < 1).all())


@pytest.mark.parametrize("backend", ["eager", "tiled"])
def test_a_row_with_no_key_and_a_sink_gives_zeros_and_no_nan(backend):
    sinks = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    q = Q.clone().requires_grad_()
    out, w = attnlab.attention(q, K[:, :, :3], V[:, :, :3], causal=True, sinks=sinks,
                               return_weights=True, backend=backend)  # 12 queries, 3 keys
    assert bool((out[:, :, :9] == 0).all()) and bool((w[:, :, :9] == 0).all())
    out.sum().backward()
    assert bool(torch.isfinite(q.grad).all()) and bool(torch.isfinite(sinks.grad).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_documents_equal_one_call_per_document(backend):
    """FlashAttention varlen's semantics: each packed sequence attends on its own, its
    rule aligned to its own end (here with more keys than queries in each)."""
    q_ids = torch.tensor([0, 0, 0, 1, 1, 1, 1, 3, 3, 3, 3, 3])
    k_ids = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 3, 3])
    q_cuts, k_cuts = [(0, 3), (3, 7), (7, 12)], [(0, 5), (5, 9), (10, 12)]
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    kw = dict(causal=True, window=3, alibi_slopes=slopes)
    got = attnlab.attention(Q, K, V, document_ids=(q_ids, k_ids), backend=backend, **kw)
    for (qa, qb), (ka, kb) in zip(q_cuts, k_cuts):
        want = attnlab.attention(Q[:, :, qa:qb], K[:, :, ka:kb], V[:, :, ka:kb],
                                 backend="eager", **kw)
        torch.testing.assert_close(got[:, :, qa:qb], want, **TOL)


@pytest.mark.parametrize("backend", ["eager", "tiled"])
def test_dropout_composes_with_every_variant(backend, monkeypatch):
    monkeypatch.setattr(_tiled, "BLOCK_Q", 8)  # fewer tiles: 100 calls stay quick
    monkeypatch.setattr(_tiled, "BLOCK_K", 8)
    kw = dict(softcap=2.0, alibi_slopes=torch.full((4,), 0.1, dtype=torch.float64),
              sinks=torch.zeros(4, dtype=torch.float64, requires_grad=True),
              document_ids=torch.tensor([0] * 5 + [1] * 7), causal=True,
              mask_mod=lambda b, h, q, kv: kv != 2)
    q = Q.clone().requires_grad_()
    assert bool((attnlab.attention(q, K, V, dropout_p=1.0, backend=backend, **kw) == 0).all())
    # The mean over many draws approaches the call without dropout (1/(1-p) scaling).
    torch.manual_seed(0)
    with torch.no_grad():
        plain = attnlab.attention(Q, K, V, backend=backend, **kw)
        draws = torch.stack([attnlab.attention(Q, K, V, dropout_p=0.3, backend=backend, **kw)
                             for _ in range(100)])
    error = float((draws.mean(0) - plain).abs().mean())
    assert error < 0.06, error  # 0.02 here; a wrong scaling (no 1/(1-p)) gives 0.12
    attnlab.attention(q, K, V, dropout_p=0.3, backend=backend, **kw).sum().backward()
    assert bool(torch.isfinite(q.grad).all()) and bool(torch.isfinite(kw["sinks"].grad).all())


@pytest.mark.parametrize("backend", ["eager", "tiled"])
def test_a_score_mod_closing_over_a_learned_bias_trains_it(backend):
    """FlexAttention's learned relative-position bias: the gradient reaches the tensor
    the score_mod indexes."""
    grads = {}
    for name in ("eager", backend):
        bias = torch.linspace(-1, 1, 4 * 23, dtype=torch.float64).reshape(4, 23)
        bias.requires_grad_()
        q = Q.clone().requires_grad_()

        def rel_bias(score, b, h, q_idx, kv_idx, bias=bias):
            return score + bias[h, q_idx - kv_idx + 11]

        out = attnlab.attention(q, K, V, causal=True, score_mod=rel_bias, backend=name)
        out.pow(2).sum().backward()
        grads[name] = (q.grad, bias.grad)
    for want, got in zip(grads["eager"], grads[backend]):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("backend", [*BACKENDS, "flash"])
def test_slopes_changed_in_place_before_the_backward_leave_its_gradient_alone(backend):
    """The backward rebuilds ALiBi's bias from the slopes: it read the caller's tensor,
    so slopes changed in place after the forward (a reused buffer) gave another
    gradient, silently (tiled 0.9 off in float32, flash in float64)."""
    if backend == "flash" and not _native.available():
        pytest.skip("native kernel not built")
    grads = []
    for change in (False, True):
        slopes = torch.tensor([0.5, 1.0, 0.25, 2.0], dtype=torch.float64)
        q = Q.clone().requires_grad_()
        out = attnlab.attention(q, K, V, causal=True, alibi_slopes=slopes, backend=backend)
        if change:
            slopes.mul_(10)
        out.pow(2).sum().backward()
        grads.append(q.grad)
    torch.testing.assert_close(grads[1], grads[0], **TOL)


def test_a_score_mod_whose_tensor_changed_before_the_backward_is_refused():
    """The tiled path recomputes the scores in the backward: a tensor the score_mod
    reads, changed in place meanwhile (or its name bound again), gave a gradient of
    other scores, silently (eager autograd refuses or is unaffected)."""
    scales = torch.linspace(0.5, 2.0, 12, dtype=torch.float64)

    def scaled(score, b, h, q_idx, kv_idx):
        return score * scales[kv_idx]

    def bind_again():
        nonlocal scales
        scales = scales * 10

    for change in (lambda: scales.mul_(10), bind_again):
        q = Q.clone().requires_grad_()
        out = attnlab.attention(q, K, V, causal=True, score_mod=scaled, backend="tiled")
        change()
        with pytest.raises(RuntimeError, match="score_mod 'scaled' reads a tensor that was "
                                               "modified in place"):
            out.sum().backward()
    q = Q.clone().requires_grad_()  # unchanged: the gradient is eager's
    attnlab.attention(q, K, V, causal=True, score_mod=scaled, backend="tiled").sum().backward()
    want = Q.clone().requires_grad_()
    attnlab.attention(want, K, V, causal=True, score_mod=scaled,
                      backend="eager").sum().backward()
    torch.testing.assert_close(q.grad, want.grad, **TOL)


def test_a_score_mod_reading_a_module_or_a_dict_is_checked_too():
    """A score_mod method reading self.rel (an nn.Module's parameter) or a dict's tensor:
    the objects were compared by identity only, and the changed values gave another
    gradient silently."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rel = torch.nn.Parameter(torch.linspace(0.5, 2.0, 12, dtype=torch.float64))

        def mod(self, score, b, h, q_idx, kv_idx):
            return score * self.rel[kv_idx]

    table = {"s": torch.linspace(0.5, 2.0, 12, dtype=torch.float64)}

    def from_table(score, b, h, q_idx, kv_idx):
        return score * table["s"][kv_idx]

    module = Scaled()
    for fn, change in ((module.mod, lambda: module.rel.mul_(10)),
                       (from_table, lambda: table["s"].mul_(10))):
        q = Q.clone().requires_grad_()
        out = attnlab.attention(q, K, V, causal=True, score_mod=fn, backend="tiled")
        with torch.no_grad():
            change()
        with pytest.raises(RuntimeError, match="reads a tensor that was modified in place"):
            out.sum().backward()


def test_the_score_mod_path_keeps_memory_o_seq():
    """No q_len x k_len tensor anywhere, forward or backward: score_mod only ever sees
    tiles, and what autograd saves is O(seq x dim)."""
    seq, seen, saved = 64, [], []

    def watch(score, b, h, q_idx, kv_idx):
        seen.append(score.shape[-2] * score.shape[-1])
        return score * 0.5

    q, k, v = (torch.randn(1, 2, seq, 8, requires_grad=True) for _ in range(3))

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attnlab.attention(q, k, v, causal=True, score_mod=watch, backend="tiled")
    out.sum().backward()
    assert seen and max(seen) <= 4 * 5  # one tile of BLOCK_Q x BLOCK_K (the fixture's)
    assert max(saved) <= 2 * seq * 8  # q, k, v, the output: nothing seq x seq
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_tiles_that_documents_rule_out_are_never_formed(monkeypatch):
    visited = []
    real = _tiled._tile_scores

    def count(q_blk, k_blk, mask, ctx, qs, qe, ks, ke):
        visited.append((qs, ks))
        return real(q_blk, k_blk, mask, ctx, qs, qe, ks, ke)

    monkeypatch.setattr(_tiled, "_tile_scores", count)
    ids = torch.arange(40) // 10  # four documents of ten
    q, k, v = (torch.randn(1, 1, 40, 8) for _ in range(3))
    attnlab.attention(q, k, v, document_ids=ids, backend="tiled")
    # Query block [qs, qs+4) sees only its document's keys: two or three key tiles of 5.
    assert len(visited) <= 10 * 3 and all(abs(ks - qs) < 15 for qs, ks in visited)


VARIANT_CALLS = {
    "softcap": dict(softcap=30.0),
    "alibi": dict(alibi_slopes=torch.full((4,), 0.25)),
    "sinks": dict(sinks=torch.zeros(4)),
    "documents": dict(document_ids=torch.arange(256) // 64),
    "mask_mod": dict(mask_mod=lambda b, h, q, kv: kv <= q),
    "score_mod": dict(score_mod=lambda s, b, h, q, kv: s * 0.5),
}


@pytest.mark.parametrize("variant", list(VARIANT_CALLS))
@pytest.mark.parametrize("grad", [False, True])
def test_auto_takes_a_backend_that_declares_the_variant(variant, grad):
    q, k = torch.randn(1, 4, 256, 16), torch.randn(1, 4, 256, 16)
    q.requires_grad_(grad)
    variants = _variants.check(q, k, **{
        key: value for key, value in VARIANT_CALLS[variant].items()})
    chosen = _choose(q, k, None, None, None, causal=True, variants=variants)
    assert getattr(backends.TABLE[chosen], variant), chosen
    flash = backends.TABLE["flash"]
    why = flash.supports(backends.Request(q, k, None, True, None, 0.0, None, variants))
    if not getattr(flash, variant):
        assert why is not None and "does not take" in why
    out = attnlab.attention(q, k, k, causal=True, **VARIANT_CALLS[variant])
    want = attnlab.attention(q.double(), k.double(), k.double(), causal=True,
                             backend="eager", **{n: (x.double() if isinstance(x, torch.Tensor)
                                                     and x.is_floating_point() else x)
                                                 for n, x in VARIANT_CALLS[variant].items()})
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def test_softcap_is_gemma2s_tanh_on_the_scaled_score():
    cap = 0.7
    scores = Q @ K.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(8)
    weights = F.softmax(cap * torch.tanh(scores / cap), dim=-1)
    want = weights @ V.repeat_interleave(2, 1)
    for backend in ("eager", "tiled", "auto"):
        torch.testing.assert_close(attnlab.attention(Q, K, V, softcap=cap, backend=backend),
                                   want, **TOL)


@pytest.mark.parametrize("seq, variant, want", [
    (256, dict(softcap=30.0), "eager"),  # short rows: the textbook path
    (1024, dict(softcap=30.0), "tiled"),
    (1024, dict(sinks=torch.zeros(12)), "tiled"),
    (1024, dict(alibi_slopes=torch.full((12,), 0.1)), "sdpa"),  # a 50 MB dense bias
    (16384, dict(alibi_slopes=torch.full((12,), 0.1)), "tiled"),  # 12.9 GB of bias: no
    (4096, dict(document_ids=torch.arange(4096) // 512), "tiled"),  # 1/16 of the pairs
    (4096, dict(document_ids=torch.arange(4096) // 2048), "sdpa"),  # half of them
    (4096, dict(mask_mod=lambda b, h, q, kv: (kv <= q) & (q - kv < 256)), "tiled"),
])
def test_auto_takes_the_tiled_path_where_it_pays(seq, variant, want, monkeypatch):
    """backends.choose's one rule, fed by the tiled path's ``pays``: without the
    native kernel (switched off here), the tiled path where it is faster or the others
    need O(T^2) buffers (the shapes only: nothing runs)."""
    monkeypatch.setenv(_native.ENV_SWITCH, "0")
    q = torch.empty(1, 12, seq, 64)
    variants = _variants.check(q, q, **variant)
    assert _choose(q, q, None, None, None, causal=True, variants=variants) == want


@pytest.mark.skipif(not _native.available(), reason="the native kernel is not built")
@pytest.mark.parametrize("variant", [
    dict(softcap=30.0), dict(sinks=torch.zeros(12)), dict(alibi_slopes=torch.full((12,), 0.1)),
    dict(document_ids=torch.arange(1024) // 128),
    dict(mask_mod=lambda b, h, q, kv: (kv <= q) & (q - kv < 256)),
])
def test_auto_takes_the_kernel_for_every_variant_it_runs(variant):
    """With the kernel built, its variants go where plain attention goes: the kernel."""
    q = torch.empty(1, 12, 1024, 64)
    variants = _variants.check(q, q, **variant)
    assert _choose(q, q, None, None, None, causal=True, variants=variants) == "flash"
    score_mod = _variants.check(q, q, score_mod=lambda s, b, h, i, j: s)
    assert _choose(q, q, None, None, None, causal=True, variants=score_mod) != "flash"
