"""Every supported Hugging Face architecture, saved with save_pretrained and loaded from
the folder, gives transformers' logits (or hidden states), layer by layer, padding
included, and the same greedy generation."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers as T  # noqa: E402
from test_interop import gpt2, left_padded, llama  # noqa: E402

from attnlab.models import GPT, Encoder  # noqa: E402

_SMALL = dict(vocab_size=120, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
              bos_token_id=0, eos_token_id=0, pad_token_id=0)


def mistral(window=3, **kw):
    torch.manual_seed(0)
    cfg = T.MistralConfig(**{**_SMALL, "sliding_window": window, **kw})
    return T.MistralForCausalLM(cfg).eval()


def qwen2(**kw):
    torch.manual_seed(0)
    cfg = T.Qwen2Config(**{**_SMALL, **kw})
    hf = T.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # random init leaves the q/k/v biases at zero: make them count
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return hf


DECODERS = {"gpt2": gpt2, "llama": lambda: llama(False), "mistral": mistral,
            "mistral-no-window": lambda: mistral(None), "qwen2": qwen2,
            "qwen2-all-layers-sliding": lambda: qwen2(use_sliding_window=True, sliding_window=4,
                                                      max_window_layers=0)}


def _diff(a, b) -> float:
    return float((a - b).abs().max())


@pytest.fixture(params=sorted(DECODERS))
def decoder(request, tmp_path):
    hf = DECODERS[request.param]()
    hf.save_pretrained(tmp_path / "m")
    return request.param, hf, GPT.from_hf(tmp_path / "m")


def test_logits_and_hidden_states_equal_with_left_padding(decoder):
    name, hf, ours = decoder
    if name.startswith("mistral") and ours.config.window is not None:
        assert ours.config.window == 3
    if name == "qwen2-all-layers-sliding":
        assert ours.config.window == 4
    ids, mask, positions = left_padded()
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
        got, hidden = ours(ids, attention_mask=mask, positions=positions,
                           output_hidden_states=True)
    real = mask.bool()
    assert _diff(got[real], want.logits[real]) < 1e-5, name
    assert len(hidden) == len(want.hidden_states) == ours.config.num_layers + 1
    for i, (h, w) in enumerate(zip(hidden, want.hidden_states)):
        assert _diff(h[real], w[real]) < 1e-5, (name, i)


def test_a_sliding_window_is_honoured_not_ignored():
    """Mistral's window changes the logits once the text is longer than it: the match
    above is not a coincidence of short sequences."""
    hf = mistral(3)
    ids = torch.randint(1, 120, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        windowed = GPT.from_hf(hf)(ids)
        hf.config.sliding_window = None
        full = GPT.from_hf(hf)(ids)
    assert _diff(windowed[:, 3:], full[:, 3:]) > 1e-3
    assert _diff(windowed[:, :3], full[:, :3]) < 1e-6


# attnlab's generate stops at nothing unless told (eos_id=None); transformers' would stop
# at eos, and with min_new_tokens it would forbid eos instead: neither is greedy decoding.
NO_EOS = dict(pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_generation_is_transformers(decoder, batch):
    name, hf, ours = decoder
    with torch.no_grad():  # sharpen, so that greedy steps are not near-ties
        ours.lm_head.weight.mul_(8)
        hf.lm_head.weight.copy_(ours.lm_head.weight)
    prompt = torch.randint(1, 120, (batch, 5), generator=torch.Generator().manual_seed(2))
    got = ours.generate(prompt, 12, temperature=0)
    want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                       do_sample=False, **NO_EOS)
    assert torch.equal(got, want), name


def test_unsupported_model_types_are_refused_naming_the_supported_ones(tmp_path):
    torch.manual_seed(0)
    T.GPTNeoXForCausalLM(T.GPTNeoXConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                         num_attention_heads=4, intermediate_size=64)
                         ).save_pretrained(tmp_path / "neox")
    with pytest.raises(ValueError, match=r"'gpt_neox' is not supported by GPT \(expected one of "
                                         r"\['bloom', 'gemma2', 'gemma3_text', 'gpt2', 'llama', "
                                         r"'mistral', "
                                         r"'qwen2', 'qwen3'\]\)"):
        GPT.from_hf(tmp_path / "neox")
    with pytest.raises(ValueError, match=r"not supported by Encoder .*'bert', 'distilbert', "
                                         r"'roberta'.*'llama' is a layout of GPT"):
        Encoder.from_hf(llama(False))


@pytest.mark.parametrize("setting", ["is_decoder", "add_cross_attention"])
@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_a_causal_bert_is_refused_not_read_as_bidirectional(tmp_path, kind, setting):
    # Helper-found: BertLMHeadModel / RobertaForCausalLM folders (is_decoder=True, causal
    # in transformers) loaded as the bidirectional Encoder, 0.04-1.9 off, without a word.
    torch.manual_seed(0)
    shape = dict(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                 intermediate_size=40, max_position_embeddings=24, is_decoder=True,
                 add_cross_attention=setting == "add_cross_attention")
    model = (T.BertLMHeadModel(T.BertConfig(**shape)) if kind == "bert"
             else T.RobertaForCausalLM(T.RobertaConfig(pad_token_id=1, **shape)))
    if setting == "add_cross_attention":  # the decoder flag alone is the other case
        model.config.is_decoder = False
    model.save_pretrained(tmp_path / kind)
    with pytest.raises(ValueError, match=rf"config {setting}=True is not supported"):
        Encoder.from_hf(tmp_path / kind)


# ------------------------------------------------------------------------ encoders


def bert():
    torch.manual_seed(0)
    return T.BertModel(T.BertConfig(vocab_size=120, hidden_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=96,
                                    max_position_embeddings=64), add_pooling_layer=False).eval()


def roberta():
    torch.manual_seed(0)
    return T.RobertaModel(T.RobertaConfig(vocab_size=120, hidden_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=96,
                                          max_position_embeddings=40, pad_token_id=1,
                                          type_vocab_size=1),
                          add_pooling_layer=False).eval()


def distilbert():
    torch.manual_seed(0)
    return T.DistilBertModel(T.DistilBertConfig(vocab_size=120, dim=48, n_layers=2, n_heads=4,
                                                hidden_dim=96, max_position_embeddings=64)
                             ).eval()


ENCODERS = {"bert": (bert, 0), "roberta": (roberta, 1), "distilbert": (distilbert, 0)}


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_encoder_hidden_states_equal_with_right_padding(name, tmp_path):
    make, pad = ENCODERS[name]
    hf = make()
    hf.save_pretrained(tmp_path / "e")
    ours = Encoder.from_hf(tmp_path / "e")
    ids = torch.randint(2, 120, (3, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 2:] = 0
    ids = ids.masked_fill(mask == 0, pad)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, output_hidden_states=True)
        got, hidden = ours(ids, attention_mask=mask, output_hidden_states=True)
    real = mask.bool()
    assert _diff(got[real], want.last_hidden_state[real]) < 1e-5, name
    assert len(hidden) == len(want.hidden_states) == 3
    for i, (h, w) in enumerate(zip(hidden, want.hidden_states)):
        assert _diff(h[real], w[real]) < 1e-5, (name, i)


def test_roberta_positions_start_after_the_padding_id():
    """RoBERTa's offset is what makes it match: with BERT's 0-based positions it is off."""
    hf = roberta()
    ours = Encoder.from_hf(hf)
    assert ours.context_length == 40 - 2
    ids = torch.randint(2, 120, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).last_hidden_state
        assert _diff(ours(ids), want) < 1e-5
        ours.config.positions = "index"
        assert _diff(ours(ids), want) > 1e-2


def test_greedy_generation_of_a_left_padded_batch_is_transformers(decoder):
    name, hf, ours = decoder
    with torch.no_grad():
        ours.lm_head.weight.mul_(8)
        hf.lm_head.weight.copy_(ours.lm_head.weight)
    prompts = [[5, 17, 9], [44, 3, 81, 29, 7, 60]]
    got = ours.generate(prompts, 10, temperature=0)[:, -10:]
    ids = torch.tensor([[0, 0, 0, 5, 17, 9], [44, 3, 81, 29, 7, 60]])
    mask = (torch.arange(6) >= torch.tensor([[3], [0]])).long()
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                       **NO_EOS)[:, -10:]
    assert torch.equal(got, want), name
