"""Small GGUF files written in the tests with `gguf`'s GGUFWriter, as llama.cpp's
convert_hf_to_gguf.py writes them: a transformers model's config as llama.cpp's keys, its
tensors under llama.cpp's names (the Llama q/k rows permuted to llama.cpp's rotary
layout), in a chosen tensor type, and a tokenizer as metadata (byte-level BPE or
SentencePiece-style)."""

from __future__ import annotations

import functools
import json
import math

import gguf
import numpy as np
import torch
from hf_tokenizers import CORPUS, byte_level_bpe

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny model<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# transformers' names -> llama.cpp's
_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
# Gemma's, where they are not Llama's (its norm before the MLP is "pre")
_GEMMA_NAMES = {**_NAMES, "pre_feedforward_layernorm": "ffn_norm",
                "post_attention_layernorm": "post_attention_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def llama3_rope_factors(scaling: dict, head_dim: int) -> np.ndarray:
    """The divisor of each RoPE frequency that llama.cpp's convert_hf_to_gguf.py writes as
    ``rope_freqs.weight`` for a Llama 3.1 config (its own loop, in float32)."""
    base = scaling["rope_theta"]
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            factors.append(1.0)
        elif wavelen > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotate_half rows
    [x_0 .. x_{d/2-1}, y_0 ..] interleaved to [x_0, y_0, x_1, y_1, ...]."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_name(hf: str, gemma: bool = False) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{(_GEMMA_NAMES if gemma else _NAMES)[module]}.{kind}"


def _tensor(w: np.ndarray, kind: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    if w.ndim == 1 or kind == "F32":  # llama.cpp keeps norms and biases in F32
        return w.astype(np.float32), None
    if kind == "F16":
        return w.astype(np.float16), None
    qtype = gguf.GGMLQuantizationType[kind]
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def byte_level_metadata(pre: str = "default", add_bos: bool | None = False) -> dict:
    """tokenizer.ggml.* of the tests' byte-level BPE, with the chat tokens as control tokens."""
    tok = byte_level_bpe()
    tok = tok.from_str(tok.to_str())
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    spec = json.loads(tok.to_str())
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {t["content"] for t in spec["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "merges": merges,
            "types": [3 if t in specials else 1 for t in tokens], "add_bos": add_bos,
            "bos": vocab["<|im_start|>"], "eos": vocab["<|im_end|>"],
            "chat_template": CHAT_TEMPLATE}


# A byte-level vocabulary made to tell the pre-tokenizers apart: each merge below joins
# characters that some split puts in one piece and another split keeps apart (digits in
# runs of one, three or more; "/t" and "'m" across a split; CamelCase runs; punctuation
# runs; spaces).
SPLIT_PROBE_MERGES = ("1 2", "12 3", "4 5", "45 6", "2 0", "20 2", "/ t", "' m", "' M", "t p",
                      "tp R", "tpR e", "H t", "Ht tp", "$ 5", "! !", "< =", "Ġ Ġ", "ĠĠ Ġ",
                      "Ġ x", "D O", "DO N", "M L", "X ML", "Ġ 1", "Ġ1 2", "Ġ $", "Å ¿",
                      "Å¿ t", "' Å¿")  # (the last three: the long s, ſ, with the letter after
                                      # it or the apostrophe before)
SPLIT_PROBE_TEXTS = ("In 2024 we sold 1234567 units", "I'M i'm DON'T don't",
                     "path/to/file $5+3<=4 x!!", "HelloWorld XMLHttpRequest   x 12")


def split_probe_metadata(pre: str) -> dict:
    """tokenizer.ggml.* of :data:`SPLIT_PROBE_MERGES` over the 256 byte tokens."""
    from attnlab.text.gguf_tokenizer import _byte_spelling

    tokens = ["<|endoftext|>", *sorted(set(_byte_spelling().values()))]
    tokens += [m.replace(" ", "") for m in SPLIT_PROBE_MERGES]
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "merges": list(SPLIT_PROBE_MERGES),
            "types": [3, *[1] * (len(tokens) - 1)], "add_bos": False, "bos": 0, "eos": 0,
            "chat_template": CHAT_TEMPLATE}


@functools.cache
def _sentencepiece_pieces() -> tuple[tuple[str, ...], tuple[float, ...]]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                 split=True)
    # No emoji and few CJK characters in the training text: those take the byte fallback.
    text = [t for t in CORPUS if "😀" not in t]
    tok.train_from_iterator(text * 20, trainers.BpeTrainer(vocab_size=300, limit_alphabet=60))
    pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    return tuple(pieces), tuple(-float(i) for i in range(len(pieces)))


def sentencepiece_metadata() -> dict:
    """tokenizer.ggml.* of a SentencePiece-style vocabulary (``llama``): <unk>, <s>, </s>,
    the 256 byte tokens, then pieces scored by merge rank; no merges listed."""
    pieces, scores = _sentencepiece_pieces()
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = ["<unk>", "<s>", "</s>", *byte_tokens, *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    return {"model": "llama", "tokens": tokens, "scores": [0.0, 0.0, 0.0, *[0.0] * 256,
                                                          *scores],
            "types": types, "bos": 1, "eos": 2, "unk": 0, "add_bos": None,
            "chat_template": CHAT_TEMPLATE.replace("<|im_start|>", "<s>")
            .replace("<|im_end|>", "</s>")}


def write_gguf(path, hf_model, *, arch: str = "llama", name: str = "tiny", kind: str = "F32",
               tokenizer: dict | None = None, extra: tuple = (),
               feed_forward_length: int | None = None, skip: tuple = ()) -> None:
    """Write ``hf_model`` (a Llama/Mistral/Qwen2/Qwen3/Gemma 2/Gemma 3 transformers model)
    to ``path`` as GGUF, as llama.cpp's convert_hf_to_gguf.py writes it (Gemma: its norms
    stored as 1 + weight, its window and softcaps in keys of their own); ``extra``: more
    keys, as ``(GGUFWriter method, key, value)``; ``feed_forward_length``: a width that
    does not fit the tensors; ``skip``: tensors (llama.cpp names) left out."""
    cfg = hf_model.config
    gemma = arch.startswith("gemma")
    tokenizer = tokenizer or byte_level_metadata()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(feed_forward_length or cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads or gemma:  # as llama.cpp does
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # (Gemma 3: global)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if gemma:
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model(tokenizer["model"])
    if "pre" in tokenizer:
        w.add_tokenizer_pre(tokenizer["pre"])
    w.add_token_list(tokenizer["tokens"])
    w.add_token_types(tokenizer["types"])
    if "merges" in tokenizer:
        w.add_token_merges(tokenizer["merges"])
    if "scores" in tokenizer:
        w.add_token_scores(tokenizer["scores"])
    w.add_bos_token_id(tokenizer["bos"])
    w.add_eos_token_id(tokenizer["eos"])
    if "unk" in tokenizer:
        w.add_unk_token_id(tokenizer["unk"])
    if tokenizer["add_bos"] is not None:
        w.add_add_bos_token(tokenizer["add_bos"])
    w.add_chat_template(tokenizer["chat_template"])
    for method, key, value in extra:
        getattr(w, method)(key, value)
    scaling = getattr(cfg, "rope_parameters", None) or {}
    if scaling.get("rope_type") == "llama3":  # as llama.cpp's converter writes Llama 3.1
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(scaling, head_dim))
    permute = arch == "llama"
    for hf_name, t in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().to(torch.float32).numpy()
        if gemma and hf_name.endswith("norm.weight"):
            a = a + 1  # (llama.cpp runs them as plain RMSNorms)
        if permute and ".q_proj." in hf_name:
            a = llamacpp_permute(a, cfg.num_attention_heads)
        elif permute and ".k_proj." in hf_name:
            a = llamacpp_permute(a, cfg.num_key_value_heads)
        if gguf_name(hf_name, gemma) in skip:
            continue
        data, qtype = _tensor(a, kind)
        w.add_tensor(gguf_name(hf_name, gemma), data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
