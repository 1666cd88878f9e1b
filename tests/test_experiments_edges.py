"""The experiments on what learners and researchers bring: bf16, int8 and frozen models,
encoders, one-token rows, int32 ids, bad targets and head numbers, long texts of models
with sinks."""

from __future__ import annotations

import re

import pytest
import torch

import attnlab
from attnlab.experiments import ablation as E
from attnlab.experiments.heads import head_importance, knockout
from attnlab.models import GPT, Encoder, EncoderConfig, GPTConfig
from attnlab.text import CharTokenizer
from attnlab.text.corpus import pattern_corpus

TOK = CharTokenizer("abcdefgh ")
IDS = torch.tensor([1, 2, 3, 4, 5])


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=9, context_length=1024, d_model=32, num_layers=2,
                         num_heads=4, **kw)).eval()


def _by_hand(model, ids: torch.Tensor, target: int) -> torch.Tensor:
    """Gradient x input of the embedding output, written out with autograd."""
    emb = model.tok_emb(ids[None]).detach().float().requires_grad_()
    handle = model.tok_emb.register_forward_hook(lambda m, i, o: emb.to(o.dtype))
    try:
        with torch.enable_grad():
            grad, = torch.autograd.grad(model(ids[None])[0, -1].float().log_softmax(-1)[target],
                                        emb)
    finally:
        handle.remove()
    scores = (grad[0] * emb[0].detach()).sum(-1).abs()
    return scores / scores.sum()


def test_saliency_needs_no_gradient_of_the_weights_and_leaves_theirs_alone():
    """It retained the embedding's gradient through the weights: a frozen or int8 model,
    or a call under no_grad, failed; and it set every parameter's .grad to None."""
    model = _gpt()
    want = _by_hand(model, IDS, 3)
    torch.testing.assert_close(E.saliency(model, IDS, target=3), want)
    model(IDS[None]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    E.saliency(model, IDS, target=3)
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(E.saliency(model, IDS, target=3), want)
    frozen = _gpt().requires_grad_(False)
    torch.testing.assert_close(E.saliency(frozen, IDS, target=3), want)
    int8 = _gpt().quantize("int8")
    torch.testing.assert_close(E.saliency(int8, IDS, target=3), _by_hand(int8, IDS, 3))


def test_explain_takes_a_bf16_model():
    model = _gpt().to(torch.bfloat16)
    out = E.explain(model, TOK, "abc ab")
    assert out["attention"].shape == (2, 6) and out["saliency"].shape == (6,)
    assert abs(float(out["attention"].sum(-1).mean()) - 1) < 1e-2


@pytest.mark.parametrize("target", [9, -1, 1.5, True])
def test_a_target_outside_the_vocabulary_is_named(target):
    with pytest.raises(ValueError, match=r"target must be a token id in \[0, 9\)"):
        E.saliency(_gpt(), IDS, target=target)


@pytest.mark.parametrize("call", [E.lm_loss, E.qkv_ablation, E.uniform_attention,
                                  lambda m, ids: E.saliency(m, ids[0])])
def test_a_next_token_experiment_on_an_encoder_is_refused(call):
    """An encoder's hidden features were read as logits: a loss of 3.4, a saliency over
    hidden features, all meaningless."""
    torch.manual_seed(0)
    bert = Encoder(EncoderConfig(vocab_size=30, context_length=16, d_model=24, num_layers=1,
                                 num_heads=2, d_ff=48)).eval()
    with pytest.raises(ValueError, match="needs a decoder; Encoder is an encoder"):
        call(bert, torch.tensor([[2, 5, 6, 7, 3]]))


@pytest.mark.parametrize("ids, words", [
    (torch.tensor([[3]]), r"seq >= 2 \(a token and the next\), got shape \(1, 1\)"),
    (torch.tensor([3, 4, 5]), r"\(batch, seq\) .* got shape \(3,\)"),
    (torch.tensor([[0.5, 1.0]]), "ids must be an integer tensor"),
])
@pytest.mark.parametrize("call", [E.lm_loss, E.qkv_ablation, E.uniform_attention,
                                  lambda m, ids: head_importance(m, ids, torch.ones_like(ids))])
def test_rows_too_short_for_a_next_token_are_named(call, ids, words):
    """A one-token row gave NaN (lm_loss, the head table) or an internal IndexError."""
    with pytest.raises((ValueError, TypeError), match=words):
        call(_gpt(), ids)


def test_int32_ids_give_the_int64_loss():
    model = _gpt()
    ids = torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1]])
    assert E.lm_loss(model, ids.int()) == E.lm_loss(model, ids)
    assert E.qkv_ablation(model, ids.int()) == E.qkv_ablation(model, ids)
    mask = torch.ones_like(ids)
    assert head_importance(model, ids.int(), mask) == head_importance(model, ids, mask)


def test_saliency_takes_one_text():
    with pytest.raises(ValueError, match=r"one text, got shape \(2, 3\)"):
        E.saliency(_gpt(), torch.tensor([[1, 2, 3], [4, 5, 6]]))


@pytest.mark.parametrize("kw, words", [(dict(length=0), "length"), (dict(length=1), "length"),
                                       (dict(batch=0), "batch")])
def test_held_out_batch_names_a_bad_size(kw, words):
    tok = CharTokenizer.from_text(pattern_corpus())
    with pytest.raises(ValueError, match=words):
        E.held_out_batch(tok, **kw)


def test_whole_numbers_held_in_tensors_are_taken():
    """head=argmax(...) and target=logits.argmax() are 0-d integer tensors."""
    model = _gpt()
    ids = torch.tensor([[1, 2, 3, 4]])
    mask = torch.ones_like(ids)
    assert knockout(model, ids, mask, [(0, torch.tensor(3))]) == knockout(model, ids, mask,
                                                                            [(0, 3)])
    torch.testing.assert_close(E.saliency(model, IDS, target=torch.tensor(4)),
                               E.saliency(model, IDS, target=4))


@pytest.mark.parametrize("head", [2.7, 1.5, "1"])
def test_a_head_that_is_no_whole_number_is_refused(head):
    """knockout truncated 2.7 to head 2 and knocked that one out."""
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(TypeError, match="head .* must be an integer"):
        knockout(_gpt(), ids, torch.ones_like(ids), [(0, head)])


def test_the_comparison_figure_checks_its_layer_and_head():
    """layer=-1 drew the last layer titled "layer -1"; 5 and 7 gave NumPy's IndexError."""
    found = attnlab.viz.compare(_gpt(), TOK, "abc", "abd")
    for kw, words in ((dict(layer=-1), r"layer \(--layer\) must be in \[0, 1\]"),
                      (dict(layer=5), r"layer \(--layer\) must be in \[0, 1\]"),
                      (dict(head=7), r"head \(--head\) must be in \[0, 3\]")):
        with pytest.raises(ValueError, match=words):
            found.figure(**kw)


def test_a_long_text_of_a_model_with_sinks_is_shown_and_the_page_keeps_every_layer(
        tmp_path, monkeypatch):
    """The top keys were taken with gradients on: a learned sink made them need grad and
    .numpy() failed; and with --layer the page held that layer alone."""
    model = _gpt(sinks=True)
    text = "abcd " * 200  # past the whole-weights page
    attnlab.viz.show_attention(model, TOK, text, tmp_path / "all")
    attnlab.viz.show_attention(model, TOK, text, tmp_path / "one", layer=1)
    page = (tmp_path / "one" / "attention.html").read_text()
    assert re.findall(r'"layer_ids":\[[^\]]*\]', page) == ['"layer_ids":[1,0]']
    # the picture of that layer keeps the keys of a page of one layer, not a share
    from attnlab.viz import long as long_mod

    drawn = []
    real = long_mod.long_figure
    monkeypatch.setattr(long_mod, "long_figure", lambda top, *a, **k: drawn.append(top) or
                        real(top, *a, **k))
    monkeypatch.setattr(long_mod, "TOPK_BUDGET", 192_000)  # 8 keys for two layers, 16 for one
    attnlab.viz.show_attention(model, TOK, text, tmp_path / "two", layer=1)
    assert drawn[0].layer_ids == (1,) and drawn[0].k == 16
    assert long_mod.plan(4, 1000, [1, 0])[0] == 8  # what the page of both layers keeps
