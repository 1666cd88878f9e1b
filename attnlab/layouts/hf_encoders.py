"""Hugging Face encoder layouts -> attnlab's ``Encoder``: BERT, RoBERTa and DistilBERT.

All three are BERT's post-norm block; they differ in names and in positions:

- BERT: positions ``0 .. seq-1``, token-type (segment) embeddings;
- RoBERTa: the same weights under ``roberta.``, but positions count the
  non-padding tokens and start at ``pad_token_id + 1`` (padding tokens sit at
  ``pad_token_id``); mapped exactly with ``EncoderConfig.positions="roberta"``;
- DistilBERT: other names (``q_lin``, ``sa_layer_norm``, ``ffn.lin1`` ...), no
  segment embeddings (a zero one-row table stands in), LayerNorm eps 1e-12.

Plain data as in :mod:`attnlab.layouts.hf`: config dict in, ``EncoderConfig``
values out; state dict in, attnlab state dict out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .common import Config, Tensors, _detached, _field, _require, _strip

_ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh",
                "gelu_pytorch_tanh": "gelu_tanh"}


def bert_config(cfg: Mapping[str, Any]) -> Config:
    """``EncoderConfig`` values of a BERT (or RoBERTa) config dict."""
    _require(cfg, "position_embedding_type", ("absolute",), "absolute")
    # BertLMHeadModel and RobertaForCausalLM save is_decoder: a causal stack, which the
    # bidirectional Encoder is not (and cross-attention has no weights here)
    _require(cfg, "is_decoder", (False,), False)
    _require(cfg, "add_cross_attention", (False,), False)
    act = _require(cfg, "hidden_act", tuple(_ACTIVATIONS))
    roberta = cfg.get("model_type") == "roberta"
    pad = cfg.get("pad_token_id")
    if roberta and pad is None:
        raise ValueError("config has no 'pad_token_id', which a roberta config needs "
                         "(positions start after it)")
    return dict(
        vocab_size=_field(cfg, "vocab_size"),
        context_length=_field(cfg, "max_position_embeddings"),
        d_model=_field(cfg, "hidden_size"), num_layers=_field(cfg, "num_hidden_layers"),
        num_heads=_field(cfg, "num_attention_heads"), d_ff=_field(cfg, "intermediate_size"),
        type_vocab_size=cfg.get("type_vocab_size", 2), norm_eps=cfg.get("layer_norm_eps", 1e-12),
        activation=_ACTIVATIONS[act], pad_id=pad or 0,
        positions="roberta" if roberta else "index",
    )


def bert_state(state: Tensors, cfg: Config) -> dict[str, torch.Tensor]:
    """attnlab ``Encoder`` names of a BERT/RoBERTa state dict (``bert.``/``roberta.``
    prefixes and heads such as ``cls.`` or ``lm_head.`` are ignored)."""
    s = _strip(state, "roberta." if cfg.get("positions") == "roberta" else "bert.")
    e = "embeddings."
    out = {"tok_emb.weight": s[e + "word_embeddings.weight"],
           "pos_emb.weight": s[e + "position_embeddings.weight"],
           "type_emb.weight": s[e + "token_type_embeddings.weight"],
           "emb_norm.weight": s[e + "LayerNorm.weight"], "emb_norm.bias": s[e + "LayerNorm.bias"]}
    names = {"attention.self.query": "attn.W_query", "attention.self.key": "attn.W_key",
             "attention.self.value": "attn.W_value", "attention.output.dense": "attn.out_proj",
             "attention.output.LayerNorm": "norm1", "intermediate.dense": "mlp.fc",
             "output.dense": "mlp.proj", "output.LayerNorm": "norm2"}
    for i in range(cfg["num_layers"]):
        for src, dst in names.items():
            for kind in ("weight", "bias"):
                out[f"blocks.{i}.{dst}.{kind}"] = s[f"encoder.layer.{i}.{src}.{kind}"]
    return _detached(out)


def distilbert_config(cfg: Mapping[str, Any]) -> Config:
    """``EncoderConfig`` values of a DistilBERT config dict."""
    act = _require(cfg, "activation", ("gelu", "relu"), "gelu")
    return dict(
        vocab_size=_field(cfg, "vocab_size"),
        context_length=_field(cfg, "max_position_embeddings"),
        d_model=_field(cfg, "dim"), num_layers=_field(cfg, "n_layers"),
        num_heads=_field(cfg, "n_heads"), d_ff=_field(cfg, "hidden_dim"),
        type_vocab_size=1, norm_eps=1e-12, activation=act, pad_id=cfg.get("pad_token_id") or 0,
        positions="index",
    )


def distilbert_state(state: Tensors, cfg: Config) -> dict[str, torch.Tensor]:
    """attnlab ``Encoder`` names of a DistilBERT state dict; the segment embedding that
    DistilBERT lacks is one row of zeros (adding it changes nothing)."""
    s = _strip(state, "distilbert.")
    e = "embeddings."
    tok = s[e + "word_embeddings.weight"]
    out = {"tok_emb.weight": tok, "pos_emb.weight": s[e + "position_embeddings.weight"],
           "type_emb.weight": torch.zeros(1, tok.shape[1], dtype=tok.dtype),
           "emb_norm.weight": s[e + "LayerNorm.weight"], "emb_norm.bias": s[e + "LayerNorm.bias"]}
    names = {"attention.q_lin": "attn.W_query", "attention.k_lin": "attn.W_key",
             "attention.v_lin": "attn.W_value", "attention.out_lin": "attn.out_proj",
             "sa_layer_norm": "norm1", "ffn.lin1": "mlp.fc", "ffn.lin2": "mlp.proj",
             "output_layer_norm": "norm2"}
    for i in range(cfg["num_layers"]):
        for src, dst in names.items():
            for kind in ("weight", "bias"):
                out[f"blocks.{i}.{dst}.{kind}"] = s[f"transformer.layer.{i}.{src}.{kind}"]
    return _detached(out)


ENCODER_LAYOUTS = {"bert": "BERT", "roberta": "RoBERTa", "distilbert": "DistilBERT"}


def convert_encoder(cfg: Mapping[str, Any], state: Tensors) -> tuple[Config, dict]:
    """(``EncoderConfig`` values, attnlab state dict) of a config dict whose
    ``model_type`` is one of :data:`ENCODER_LAYOUTS`."""
    kind = cfg.get("model_type")
    if kind == "distilbert":
        config = distilbert_config(cfg)
        return config, distilbert_state(state, config)
    if kind in ("bert", "roberta"):
        config = bert_config(cfg)
        return config, bert_state(state, config)
    raise ValueError(f"model.config.model_type={kind!r} is not supported by Encoder (expected "
                     f"one of {sorted(ENCODER_LAYOUTS)})")
