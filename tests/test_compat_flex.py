"""``attnlab.compat.flex_attention`` / ``create_block_mask`` against torch's own
``torch.nn.attention.flex_attention`` on the CPU: its forward (the unfused reference
path torch runs without ``torch.compile``, and, marked slow, the compiled kernel), with
FlexAttention's own masks and score modifications, torch's block masks and ours; and
gradients, which torch's CPU path does not have, against attnlab's float64 eager path.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import attnlab
from attnlab.blockmask import BlockMask
from attnlab.compat import create_block_mask, flex_attention

g = torch.Generator().manual_seed(5)
B, H, L, S, E = 2, 4, 40, 40, 16
Q = torch.randn(B, H, L, E, generator=g)
K = torch.randn(B, H, S, E, generator=g)
V = torch.randn(B, H, S, E, generator=g)
DOCS = torch.tensor([0] * 7 + [1] * 20 + [2] * 13)
BIAS = torch.randn(H, 2 * S, generator=g)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 9)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx < 10)


def documents(b, h, q_idx, kv_idx):
    return (DOCS[q_idx] == DOCS[kv_idx]) & (q_idx >= kv_idx)


def per_batch(b, h, q_idx, kv_idx):  # batch element 1 sees only the first 5 keys
    return (kv_idx < 5) | (b == 0)


def first_row_empty(b, h, q_idx, kv_idx):
    return (q_idx > 0) & (kv_idx <= q_idx)


def softcap(score, b, h, q_idx, kv_idx):  # Gemma 2's, as FlexAttention users write it
    return 20 * torch.tanh(score / 20)


def alibi(score, b, h, q_idx, kv_idx):
    return score - (0.5 ** (h + 1)) * (q_idx - kv_idx).abs()


def rel_bias(score, b, h, q_idx, kv_idx):  # a lookup of a bias table
    return score + BIAS[h, q_idx - kv_idx + S]


MASKS = [None, causal, sliding, prefix_lm, documents, per_batch, first_row_empty]
MODS = [None, softcap, alibi, rel_bias]


def _torch_flex(q, k, v, score_mod, mask_mod, batch=None, **kw):
    block = None if mask_mod is None else torch_flex.create_block_mask(
        mask_mod, batch, None, q.shape[2], k.shape[2], device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "unfused implementation": what is compared here
        return torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block, **kw)


def _name(fn):
    return getattr(fn, "__name__", "none")


@pytest.mark.parametrize("mask_mod", MASKS, ids=_name)
@pytest.mark.parametrize("score_mod", MODS, ids=_name)
def test_flex_attention_equals_torchs_forward(mask_mod, score_mod):
    batch = B if mask_mod is per_batch else None
    want, want_lse = _torch_flex(Q, K, V, score_mod, mask_mod, batch, return_lse=True)
    block = None if mask_mod is None else create_block_mask(mask_mod, batch, None, L, S,
                                                            BLOCK_SIZE=16)
    out, lse = flex_attention(Q, K, V, score_mod=score_mod, block_mask=block, return_lse=True)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5)  # -inf where empty


def test_torchs_block_mask_and_gqa_are_taken_as_they_are():
    q = torch.randn(1, 8, L, E, generator=g)
    k, v = K[:1, :2], V[:1, :2]
    block = torch_flex.create_block_mask(documents, None, None, L, S, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = torch_flex.flex_attention(q, k, v, score_mod=alibi, block_mask=block,
                                         enable_gqa=True)
    got = flex_attention(q, k, v, score_mod=alibi, block_mask=block, enable_gqa=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flex_attention(q, k, v)


def test_create_block_mask_takes_flexattentions_arguments():
    bm = create_block_mask(causal, None, None, 256, 256, device="cpu", BLOCK_SIZE=(64, 128),
                           _compile=True)
    assert isinstance(bm, BlockMask) and bm.shape == (1, 1, 256, 256)
    assert (bm.block_q, bm.block_k) == (64, 128)
    assert create_block_mask(causal, None, None, 256, 256, BLOCK_SIZE=(64, 128)) is bm
    with pytest.raises(ValueError, match="B must be a positive int"):
        create_block_mask(causal, 0, None, 4, 4)
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        create_block_mask("causal", None, None, 4, 4)


@pytest.mark.parametrize("learned", [False, True], ids=["softcap", "learned-bias"])
def test_flex_attention_trains_on_the_cpu(learned):
    """FlexAttention has no CPU backward (pytorch issue 148752); here the gradients
    equal float64 eager's, a learned bias table's included."""
    grads = {}
    for name, dtype in (("compat", torch.float32), ("eager", torch.float64)):
        table = BIAS.to(dtype).clone().requires_grad_()

        def mod(score, b, h, q_idx, kv_idx, table=table):
            score = 20 * torch.tanh(score / 20)
            return score + table[h, q_idx - kv_idx + S] if learned else score

        q, k, v = (t.to(dtype).clone().requires_grad_() for t in (Q, K, V))
        if name == "compat":
            out = flex_attention(q, k, v, score_mod=mod,
                                 block_mask=create_block_mask(prefix_lm, None, None, L, S))
        else:
            out = attnlab.attention(q, k, v, score_mod=mod, mask_mod=prefix_lm, backend="eager")
        out.square().sum().backward()
        grads[name] = [t.grad for t in (q, k, v)] + ([table.grad] if learned else [])
    for got, want in zip(grads["compat"], grads["eager"]):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_flex_attention_equals_torchs_compiled_kernel():
    compiled = torch.compile(torch_flex.flex_attention, dynamic=False)
    q, k, v = (torch.randn(1, 2, 128, 16, generator=g) for _ in range(3))
    ids = torch.arange(128) // 40

    def docs(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    block = torch_flex.create_block_mask(docs, None, None, 128, 128, device="cpu")
    with torch.no_grad():
        want = compiled(q, k, v, score_mod=softcap, block_mask=block)
    got = flex_attention(q, k, v, score_mod=softcap, block_mask=block)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_return_aux_gives_torchs_aux_output():
    """FlexAttention's newer spelling: ``return_aux=AuxRequest(lse=True)`` gives ``(out,
    AuxOutput)`` with torch's lse; max_scores (not computed here) and both spellings at
    once are refused by name."""
    want, want_lse = _torch_flex(Q, K, V, softcap, causal, None,
                                 return_aux=torch_flex.AuxRequest(lse=True))
    want_lse = want_lse.lse
    block = create_block_mask(causal, None, None, L, S, BLOCK_SIZE=16)
    out, aux = flex_attention(Q, K, V, score_mod=softcap, block_mask=block,
                              return_aux=torch_flex.AuxRequest(lse=True))
    assert isinstance(aux, torch_flex.AuxOutput) and aux.max_scores is None
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(aux.lse, want_lse, atol=2e-5, rtol=2e-5)
    out, aux = flex_attention(Q, K, V, block_mask=block, return_aux=torch_flex.AuxRequest())
    assert aux.lse is None and out.shape == want.shape
    with pytest.raises(ValueError, match="max_scores"):
        flex_attention(Q, K, V, return_aux=torch_flex.AuxRequest(lse=True, max_scores=True))
    with pytest.raises(ValueError, match="return_lse or return_aux"):
        flex_attention(Q, K, V, return_lse=True, return_aux=torch_flex.AuxRequest(lse=True))


def test_the_lse_has_torchs_gradient():
    # torch's flex_attention differentiates its lse (its backward does not run on a CPU:
    # the reference is torch's logsumexp of the scores); a loss that takes it trains with
    # its term. A score_mod's tensors' share cannot be seen: a backward raises instead.
    q, k, v = (t.double().requires_grad_() for t in (Q, K, V))
    g_out, g_lse = torch.randn(B, H, L, E, dtype=torch.float64), torch.randn(B, H, L,
                                                                             dtype=torch.float64)
    causal = create_block_mask(lambda b, h, i, j: j <= i, None, None, L, S)
    out, lse = flex_attention(q, k, v, block_mask=causal, return_lse=True)
    got = torch.autograd.grad((out * g_out).sum() + (lse * g_lse).sum(), (q, k, v))
    scores = (q @ k.transpose(-1, -2) / E ** 0.5).masked_fill(
        torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
    want_lse = torch.logsumexp(scores, -1)
    want_out = torch.softmax(scores, -1) @ v
    want = torch.autograd.grad((want_out * g_out).sum() + (want_lse * g_lse).sum(), (q, k, v))
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    _, lse = flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 0.5, return_lse=True)
    with pytest.raises(RuntimeError, match="with a score_mod .* carries no gradient"):
        lse.sum().backward()
    # and a compiled call that returns the lse still traces whole (the lse then carries
    # no gradient)
    want, want_lse = flex_attention(Q, K, V, return_lse=True)
    compiled = torch.compile(lambda q, k, v: flex_attention(q, k, v, return_lse=True),
                             backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(*(t.clone().requires_grad_() for t in (Q, K, V)))[1],
                               want_lse)
    torch._dynamo.reset()


def test_masks_combinators_and_a_float64_lse_are_torchs():
    from attnlab.compat import and_masks, noop_mask, or_masks

    assert (and_masks, or_masks, noop_mask) == (torch_flex.and_masks, torch_flex.or_masks,
                                                torch_flex.noop_mask)
    q, k, v = (t.double() for t in (Q, K, V))
    _, lse = flex_attention(q, k, v, return_lse=True)
    _, want = _torch_flex(q, k, v, None, None, None, return_lse=True)
    assert lse.dtype == want.dtype == torch.float64
    torch.testing.assert_close(lse, want)


def test_a_torch_block_mask_is_read_as_its_blocks_say():
    # BlockMask.from_kv_blocks carries noop_mask: only its blocks say what is allowed, as
    # torch's compiled kernel (the one GPU code runs) reads them. attnlab attended
    # everywhere; here query block 0 lists key block 0 only: block-causal.
    num = torch.tensor([1, 2], dtype=torch.int32).view(1, 1, 2).expand(1, 2, 2).contiguous()
    idx = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32).view(1, 1, 2, 2).expand(
        1, 2, 2, 2).contiguous()
    blocks = torch_flex.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 32, 8, generator=g) for _ in range(3))
    allowed = torch.ones(32, 32, dtype=torch.bool)
    allowed[:16, 16:] = False
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=blocks), want)
    # a full block is whole: its mask_mod is not asked there
    full = torch_flex.BlockMask.from_kv_blocks(
        torch.zeros(1, 1, 2, dtype=torch.int32), torch.zeros(1, 1, 2, 2, dtype=torch.int32),
        num[:, :1], idx[:, :1], BLOCK_SIZE=16, mask_mod=lambda b, h, qi, ki: ki < 0)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=full),
                               want)
