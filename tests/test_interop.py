"""Hugging Face layouts run through attnlab's modules give transformers' numbers."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers as T  # noqa: E402

from attnlab.layouts.hf_llama import llama_config  # noqa: E402
from attnlab.models import GPT, Encoder  # noqa: E402


def gpt2(**kw):
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=120, n_positions=64, n_embd=48, n_layer=2, n_head=4,
                       bos_token_id=0, eos_token_id=0, **kw)
    return T.GPT2LMHeadModel(cfg).eval()


def llama(tied: bool, kv_heads: int = 2, **kw):
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=120, hidden_size=48, intermediate_size=96,
                        num_hidden_layers=2, num_attention_heads=6,
                        num_key_value_heads=kv_heads, max_position_embeddings=64,
                        tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0,
                        pad_token_id=0, **kw)
    return T.LlamaForCausalLM(cfg).eval()


def left_padded():
    ids = torch.randint(1, 120, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :7] = 0
    ids = ids.masked_fill(mask == 0, 0)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return ids, mask, positions


def assert_same_logits(hf) -> GPT:
    """GPT.from_hf(hf) gives hf's logits on every real token of a left-padded batch."""
    ours = GPT.from_hf(hf)
    ids, mask, positions = left_padded()
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=positions).logits
        got = ours(ids, attention_mask=mask, positions=positions)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)
    return ours


HF_MODELS = {"gpt2": gpt2, "llama-untied": lambda: llama(False),
             "llama-tied": lambda: llama(True), "llama-mqa": lambda: llama(False, 1),
             # heads of their own width: 6 x 16 over 48 (Mistral NeMo: 32 x 128 over 5120)
             "llama-wide-heads": lambda: llama(False, head_dim=16)}


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_logits_equal_with_left_padding(name):
    hf = HF_MODELS[name]()
    ours = assert_same_logits(hf)
    if name == "llama-tied":
        assert ours.lm_head.weight is ours.tok_emb.weight


# Config options attnlab implements exactly (GPT-2's score scalings are folded into
# W_query); with the default scaling, a model without 1/sqrt(d) is ~6e-3 off.
OPTION_MODELS = {
    "gpt2-unscaled": lambda: gpt2(scale_attn_weights=False),
    "gpt2-inverse-layer-idx": lambda: gpt2(scale_attn_by_inverse_layer_idx=True),
    "gpt2-unscaled-inverse-layer-idx": lambda: gpt2(scale_attn_weights=False,
                                                    scale_attn_by_inverse_layer_idx=True),
    "gpt2-reorder-and-upcast": lambda: gpt2(reorder_and_upcast_attn=True),
    "llama-biases": lambda: llama(False, attention_bias=True, mlp_bias=True),
    # Llama 3.1's RoPE scaling (a context of 8 originally: every band of its frequencies
    # counts on these short sequences) and the linear one
    "llama-rope-llama3": lambda: llama(False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}),
    "llama-rope-linear": lambda: llama(False, rope_scaling={"rope_type": "linear",
                                                            "factor": 4.0}),
}


@pytest.mark.parametrize("name", sorted(OPTION_MODELS))
def test_supported_config_options_give_equal_logits(name):
    hf = OPTION_MODELS[name]()
    if name == "llama-biases":  # random init leaves biases at zero: make them count
        with torch.no_grad():
            for p in hf.parameters():
                if p.ndim == 1 and not p.any():
                    p.normal_(0, 0.5)
    assert_same_logits(hf)


@pytest.mark.parametrize("batch", [1, 2])  # 1: the one-row decoding path (fused copies)
@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_cached_greedy_generation_follows_transformers_logits(name, batch):
    hf = HF_MODELS[name]()
    ours = GPT.from_hf(hf)
    with torch.no_grad():  # sharpen, so that most steps are not near-ties
        ours.lm_head.weight.mul_(8)
        hf.lm_head.weight.copy_(ours.lm_head.weight)
    prompt = torch.randint(1, 120, (batch, 5), generator=torch.Generator().manual_seed(2))
    seq = ours.generate(prompt, 20, temperature=0)
    with torch.no_grad():
        hf_logits = hf(seq).logits
        caches = ours.new_cache(batch, seq.shape[1])
        steps = [ours(seq[:, :5], caches=caches)[:, -1]]
        steps += [ours(seq[:, t:t + 1], caches=caches)[:, -1] for t in range(5, seq.shape[1] - 1)]
    ours_logits = torch.stack(steps, 1)  # the logits that chose tokens 5..
    ref = hf_logits[:, 4:-1]
    torch.testing.assert_close(ours_logits, ref, atol=1e-4, rtol=1e-4)
    top2 = ref.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > 1e-3
    assert decided.float().mean() > 0.8
    assert torch.equal(ref.argmax(-1)[decided], seq[:, 5:][decided])


def test_bert_hidden_states_with_padding():
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=120, hidden_size=48, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=96, max_position_embeddings=64)
    hf = T.BertModel(cfg, add_pooling_layer=False).eval()
    ours = Encoder.from_hf(hf)
    ids = torch.randint(1, 120, (3, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 2:] = 0
    types = torch.zeros_like(ids)
    types[:, 5:] = 1
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        got, attentions = ours(ids, attention_mask=mask, token_type_ids=types,
                               output_attentions=True)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)
    assert len(attentions) == 2 and attentions[0].shape == (3, 4, 11, 11)
    assert float(attentions[0][2, :, :, 2:].abs().max()) == 0.0  # padding gets no weight


@pytest.mark.parametrize("make, words", [
    (lambda: GPT.from_hf(llama(False).__class__(T.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, rope_scaling={"rope_type": "yarn", "factor": 2.0}))),
     ["rope_type", "yarn"]),
    (lambda: GPT.from_hf(T.BertModel(T.BertConfig(vocab_size=50, hidden_size=32,
                                                  num_hidden_layers=1, num_attention_heads=4,
                                                  intermediate_size=64))),
     ["model_type", "bert"]),
    (lambda: llama_config({**llama(False).config.to_dict(), "head_dim": 7}),
     ["head_dim=7", "even"]),
    (lambda: GPT.from_hf(llama(False, hidden_act="gelu")), ["hidden_act", "gelu"]),
    (lambda: GPT.from_hf(gpt2(activation_function="relu")), ["activation_function", "relu"]),
])
def test_unsupported_layouts_are_named(make, words):
    with pytest.raises(ValueError) as info:
        make()
    for w in words:
        assert w in str(info.value)
