"""Per-head knock-outs, the head-importance table, rollout and hidden states: each checked
against an independent computation (weights edited by hand, NumPy loops)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from attnlab.experiments import heads as Hd
from attnlab.models import GPT, Encoder, EncoderConfig, GPTConfig, ToyAttnLM
from attnlab.viz import rollout


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, context_length=32, d_model=32, num_layers=2,
                          num_heads=4, num_kv_heads=2, positions="rope")).eval()
    with torch.no_grad():  # sharpen the scores, which random init keeps near zero
        for mha in Hd.attention_layers(model):
            mha.W_query.weight.mul_(4)
    ids = torch.randint(0, 40, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[2, 8:] = 0
    return model, ids, mask


def _without_head(model, layer, head):
    """A copy whose out_proj ignores one head: the zeroed head, made by editing weights."""
    other = copy.deepcopy(model)
    mha = Hd.attention_layers(other)[layer]
    d = mha.head_dim
    with torch.no_grad():
        mha.out_proj.weight[:, head * d:(head + 1) * d] = 0
    return other


def test_zeroing_a_head_is_removing_its_columns_of_out_proj(gpt):
    model, ids, mask = gpt
    result = Hd.knockout(model, ids, mask, [(1, 2)])
    assert result["zero"] == pytest.approx(Hd.measure(_without_head(model, 1, 2), ids, mask),
                                           abs=1e-6)
    assert result["baseline"] == pytest.approx(Hd.measure(model, ids, mask), abs=1e-7)
    assert abs(result["zero"] - result["baseline"]) > 1e-4  # it did something


def _uniform_head(model, ids, layer=0, head=1):
    """Knock out (layer, head) as "uniform" and check it: its weights are the causal
    average, every other head of the layer as intact. Returns the weights."""
    with torch.no_grad():
        _, intact = model(ids, output_attentions=True)
        with Hd.knocked_out(model, [(layer, head)], "uniform"):
            _, weights = model(ids, output_attentions=True)
    batch, seq = ids.shape
    causal = torch.ones(seq, seq).tril()
    torch.testing.assert_close(weights[layer][:, head], (causal / causal.sum(-1, keepdim=True))
                               .expand(batch, seq, seq), atol=1e-6, rtol=0)
    others = [h for h in range(weights[layer].shape[1]) if h != head]
    torch.testing.assert_close(weights[layer][:, others], intact[layer][:, others])
    return weights


def test_uniform_knocks_out_one_query_head_only(gpt):
    model, ids, _ = gpt
    # (its GQA partner, head 0 on key/value head 0, stays as it was: _uniform_head checks)
    weights = _uniform_head(model, ids)
    torch.testing.assert_close(weights[1].sum(-1), torch.ones(3, 4, 12))
    assert model.blocks[0].attn.qkv_hook is None  # hooks gone


def test_uniform_is_uniform_with_alibi_and_sinks_and_leaves_them_as_they_were():
    # A zero query under ALiBi still prefers near keys and a sink still takes its share:
    # for the knocked-out head both are set aside, the other heads keep them, and the
    # model has its own back after the block.
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, context_length=32, d_model=32, num_layers=1,
                          num_heads=4, positions="alibi", sinks=True)).eval()
    mha = Hd.attention_layers(model)[0]
    with torch.no_grad():
        mha.sinks.copy_(torch.tensor([0.5, 2.0, -1.0, 1.0]))
    slopes, sinks = mha._alibi_slopes.clone(), mha.sinks.detach().clone()
    ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(1))
    _uniform_head(model, ids)
    assert torch.equal(mha._alibi_slopes, slopes) and torch.equal(mha.sinks.detach(), sinks)
    # the parameters are not edited: a graph built inside the block backpropagates after
    # it, the knocked-out head's sink gets no gradient, the others theirs
    with Hd.knocked_out(model, [(0, 1)], "uniform"):
        loss = model(ids).logsumexp(-1).mean()
    loss.backward()
    assert mha.sinks.grad[1] == 0 and bool((mha.sinks.grad[[0, 2, 3]] != 0).all())
    # a float16 model's sinks: "no share" stays finite in float16
    half = GPT(GPTConfig(vocab_size=40, context_length=32, d_model=32, num_layers=1,
                         num_heads=4, sinks=True)).half().eval()
    with Hd.knocked_out(half, [(0, 1)], "uniform"), torch.no_grad():
        assert torch.isfinite(half(ids)).all()


def test_the_table_is_each_head_alone(gpt):
    model, ids, mask = gpt
    table = Hd.head_importance(model, ids, mask)
    assert (table["layers"], table["heads"], table["measure"]) == (2, 4, "loss")
    for layer, head in [(0, 0), (1, 3)]:
        alone = Hd.measure(_without_head(model, layer, head), ids, mask) - table["baseline"]
        assert table["zero"][layer][head] == pytest.approx(alone, abs=1e-6)
    text = Hd.format_head_table(table)
    assert "head 3" in text and "most important: layer" in text
    assert f"{table['zero'][1][3]:+.4f}" in text


def test_bad_heads_are_named(gpt):
    model, ids, mask = gpt
    with pytest.raises(ValueError, match=r"head \(--head\) must be in \[0, 3\]"):
        Hd.knockout(model, ids, mask, [(0, 4)])
    with pytest.raises(ValueError, match=r"layer \(--layer\) must be in \[0, 1\]"):
        Hd.knockout(model, ids, mask, [(2, 0)])


def test_an_encoder_measures_how_far_the_sentence_embedding_moves():
    torch.manual_seed(0)
    model = Encoder(EncoderConfig(vocab_size=30, context_length=16, d_model=24, num_layers=2,
                                  num_heads=3, d_ff=48)).eval()
    ids = torch.randint(1, 30, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    result = Hd.knockout(model, ids, mask, [(0, 2)])
    assert result["measure"] == "embedding_change" and result["baseline"] == pytest.approx(0)
    other = _without_head(model, 0, 2)

    def pooled(m):  # by hand: mean over real tokens, then cosine
        h = m(ids, attention_mask=mask)
        w = mask[..., None].float()
        return (h * w).sum(1) / w.sum(1)

    with torch.no_grad():
        want = 1 - torch.nn.functional.cosine_similarity(pooled(other), pooled(model)).mean()
    assert result["zero"] == pytest.approx(float(want), abs=1e-6) and result["zero"] > 1e-6


def test_rollout_is_the_product_of_residual_mixed_head_means():
    rng = np.random.default_rng(0)
    layers = []
    for _ in range(3):
        a = rng.random((2, 4, 5, 5))  # (batch, heads, seq, seq)
        layers.append(a / a.sum(-1, keepdims=True))
    got = rollout([torch.tensor(a) for a in layers])
    for b in range(2):
        want = np.eye(5)
        for a in layers:  # by hand, one entry at a time
            mixed = np.zeros((5, 5))
            for i in range(5):
                for j in range(5):
                    mixed[i, j] = 0.5 * np.mean([a[b, h, i, j] for h in range(4)]) + 0.5 * (i == j)
                mixed[i] /= mixed[i].sum()
            want = mixed @ want
        np.testing.assert_allclose(got[b], want, rtol=1e-12)
    np.testing.assert_allclose(got.sum(-1), 1.0)
    steps = rollout([a[0] for a in layers], layers=True)
    assert steps.shape == (3, 5, 5)
    np.testing.assert_allclose(steps[-1], got[0])
    with pytest.raises(ValueError, match="self-attention"):
        rollout([np.ones((2, 3, 4)) / 4])


def test_toy_hidden_states_are_what_the_output_layer_reads():
    torch.manual_seed(0)
    model = ToyAttnLM(vocab_size=10, context_length=8, d_model=8).eval()
    ids = torch.randint(0, 10, (2, 6))
    with torch.no_grad():
        logits, attentions, hidden = model(ids, output_attentions=True,
                                           output_hidden_states=True)
        torch.testing.assert_close(hidden[0], model.embed(ids))
        torch.testing.assert_close(hidden[1], hidden[0] + model.attn(hidden[0]))
        torch.testing.assert_close(logits, model.out(hidden[1]))
        torch.testing.assert_close(model(ids), logits)
        assert len(attentions) == 1


def test_explain_sets_weights_rollout_and_saliency_side_by_side(gpt):
    from attnlab.experiments import explain
    from attnlab.text import CharTokenizer

    model, _, _ = gpt
    tok = CharTokenizer.from_text("abcdefghij")
    views = explain(model, tok, "abcabcj")
    assert views["tokens"] == list("abcabcj")
    assert views["attention"].shape == (2, 7) and views["saliency"].shape == (7,)
    with torch.no_grad():
        _, attentions = model(torch.tensor([tok.encode("abcabcj")]), output_attentions=True)
    np.testing.assert_allclose(views["rollout"], rollout(attentions)[0, -1], atol=1e-6)
    np.testing.assert_allclose(views["attention"][1], attentions[1][0, :, -1].mean(0), atol=1e-6)
    for key in ("attention", "rollout", "saliency"):
        np.testing.assert_allclose(views[key].sum(-1), 1.0, atol=1e-5)
