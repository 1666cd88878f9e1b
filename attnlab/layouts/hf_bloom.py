"""Hugging Face's BLOOM (``BloomForCausalLM``) -> attnlab's GPT, as plain data.

BLOOM has no position embedding: ALiBi biases each head's scores by its distance
(``GPTConfig.positions="alibi"``, the same slopes). Its word embeddings are normed
(``embed_norm``), its blocks are GPT-2's pre-norm blocks with LayerNorm, biases everywhere
and a tanh-GELU MLP, and its query, key and value weights lie in one
``query_key_value`` tensor interleaved per head: rows ``[q_0 k_0 v_0 q_1 k_1 v_1 ...]``,
``head_dim`` rows each.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .common import (
    Config,
    Tensors,
    _detached,
    _Named,
    _positive,
    _require,
    _size,
    _strip,
    check_layer_count,
    check_shapes,
    check_tied_head,
)

__all__ = ["bloom_config", "bloom_state", "bloom_shapes", "BLOOM_CONTEXT"]

# ALiBi has no table of positions, so nothing in a BLOOM config caps the sequence; the
# BLOOM models were trained on 2048 tokens (``seq_length`` where a config records it).
BLOOM_CONTEXT = 2048


def bloom_config(cfg: Mapping[str, Any]) -> Config:
    """``GPTConfig`` values of a BLOOM config dict."""
    _require(cfg, "apply_residual_connection_post_layernorm", (False,), False)
    # transformers' BloomConfig reads an old config's n_embed as hidden_size.
    hidden = _size(cfg, "n_embed" if cfg.get("hidden_size") is None and
                   cfg.get("n_embed") is not None else "hidden_size")
    heads = _size(cfg, "n_head")
    if hidden % heads:
        raise ValueError(f"config hidden_size={hidden} is not valid with n_head={heads} "
                         "(expected a multiple of it)")
    return dict(
        vocab_size=_size(cfg, "vocab_size"),
        context_length=_size(cfg, "seq_length", BLOOM_CONTEXT),
        d_model=hidden, num_layers=_size(cfg, "n_layer"), num_heads=heads,
        d_ff=4 * hidden, positions="alibi", norm="layernorm",
        norm_eps=_positive(cfg, "layer_norm_epsilon", 1e-5),
        # BLOOM's GELU is the tanh approximation (its constant 0.79788456 is sqrt(2/pi)
        # to 8 digits).
        mlp="gelu_tanh", tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=True, out_bias=True, mlp_bias=True, embed_norm=True,
    )


def bloom_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """The shape of each BLOOM tensor (names without ``transformer.``) that ``cfg`` (the
    ``GPTConfig`` values of :func:`bloom_config`) makes."""
    d, ff = cfg["d_model"], cfg["d_ff"]
    want = {"word_embeddings.weight": (cfg["vocab_size"], d)}
    for norm in ("word_embeddings_layernorm", "ln_f"):
        want.update({f"{norm}.weight": (d,), f"{norm}.bias": (d,)})
    for i in range(cfg["num_layers"]):
        h = f"h.{i}."
        want.update({h + "self_attention.query_key_value.weight": (3 * d, d),
                     h + "self_attention.query_key_value.bias": (3 * d,),
                     h + "self_attention.dense.weight": (d, d),
                     h + "self_attention.dense.bias": (d,),
                     h + "mlp.dense_h_to_4h.weight": (ff, d), h + "mlp.dense_h_to_4h.bias": (ff,),
                     h + "mlp.dense_4h_to_h.weight": (d, ff), h + "mlp.dense_4h_to_h.bias": (d,)})
        for norm in ("input_layernorm", "post_attention_layernorm"):
            want.update({h + f"{norm}.weight": (d,), h + f"{norm}.bias": (d,)})
    return want


def bloom_state(state: Tensors, cfg: Config) -> dict[str, torch.Tensor]:
    """attnlab's state dict of a BLOOM state dict, every shape checked first; the joint
    ``query_key_value`` is split per head into ``W_query``/``W_key``/``W_value`` (each a
    copy of its rows: one layer's at a time)."""
    s = _strip(state, "transformer.")
    d, heads = cfg["d_model"], cfg["num_heads"]
    head_dim = d // heads
    check_layer_count(s, "h.", cfg["num_layers"], "n_layer")
    check_shapes(s, bloom_shapes(cfg))
    if not cfg["tie_embeddings"]:
        check_shapes(_Named(state), {"lm_head.weight": (cfg["vocab_size"], d)})
    check_tied_head(state, cfg, s["word_embeddings.weight"])
    out = {"tok_emb.weight": s["word_embeddings.weight"]}
    for kind in ("weight", "bias"):
        out[f"embed_norm.{kind}"] = s[f"word_embeddings_layernorm.{kind}"]
        out[f"norm.{kind}"] = s[f"ln_f.{kind}"]
    if not cfg["tie_embeddings"]:
        out["lm_head.weight"] = _Named(state)["lm_head.weight"]
    names = {"self_attention.dense": "attn.out_proj", "mlp.dense_h_to_4h": "mlp.fc",
             "mlp.dense_4h_to_h": "mlp.proj", "input_layernorm": "norm1",
             "post_attention_layernorm": "norm2"}
    for i in range(cfg["num_layers"]):
        h, b = f"h.{i}.", f"blocks.{i}."
        # (3d, d) rows grouped by head: (heads, [q k v], head_dim, d).
        w = s[h + "self_attention.query_key_value.weight"].view(heads, 3, head_dim, d)
        bias = s[h + "self_attention.query_key_value.bias"].view(heads, 3, head_dim)
        for j, name in enumerate(("W_query", "W_key", "W_value")):
            out[b + f"attn.{name}.weight"] = w[:, j].reshape(d, d)
            out[b + f"attn.{name}.bias"] = bias[:, j].reshape(d)
        for src, dst in names.items():
            for kind in ("weight", "bias"):
                out[b + f"{dst}.{kind}"] = s[h + f"{src}.{kind}"]
    return _detached(out)
