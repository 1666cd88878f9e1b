"""Hugging Face's Gemma 2 (``Gemma2ForCausalLM``) -> attnlab's GPT, as plain data.

Gemma 2 is Llama's layout with: heads wider than ``hidden_size / num_attention_heads``
(``head_dim``), scores scaled by ``query_pre_attn_scalar ** -0.5`` and softcapped
(``attn_logit_softcapping``), a sliding window on every other layer (``layer_types``),
four norms a layer (each branch normed before and after), RMSNorm with ``1 + weight``,
a GeGLU MLP, embeddings times ``sqrt(hidden_size)`` and softcapped output logits
(``final_logit_softcapping``). Each maps onto a ``GPTConfig`` option of the same meaning.

Gemma 3's text decoder (``Gemma3ForCausalLM``) adds a norm over each head's queries and
keys, five sliding layers to one global, and RoPE of its own on the sliding layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .common import (
    Config,
    Tensors,
    _positive,
    _require,
    _size,
    rope_scaling,
    rope_theta,
    window_field,
)
from .hf_llama import LLAMA_NAMES, llama_state, window_layers

__all__ = ["gemma2_config", "gemma2_state", "GEMMA2_NAMES", "gemma3_config", "gemma3_state"]

# Gemma 2's names of a layer's norms -> attnlab's (Block's norm1, post_attn_norm, norm2,
# post_mlp_norm); its projections are named as Llama's.
GEMMA2_NAMES = {**{k: v for k, v in LLAMA_NAMES.items() if "norm" not in v},
                "input_layernorm": "norm1", "post_attention_layernorm": "post_attn_norm",
                "pre_feedforward_layernorm": "norm2",
                "post_feedforward_layernorm": "post_mlp_norm"}


def _softcap(cfg: Mapping[str, Any], key: str, default: float) -> float | None:
    """A softcapping field: a positive number, or None where the config sets it null."""
    if key in cfg and cfg[key] is None:
        return None
    return _positive(cfg, key, default)


def gemma2_config(cfg: Mapping[str, Any]) -> Config:
    """``GPTConfig`` values of a Gemma 2 config dict (transformers' defaults where a field
    is absent)."""
    _require(cfg, "hidden_activation", ("gelu_pytorch_tanh", "gelu_new"), "gelu_pytorch_tanh")
    _require(cfg, "use_bidirectional_attention", (None, False), None)
    hidden, heads = _size(cfg, "hidden_size"), _size(cfg, "num_attention_heads")
    kv_heads = _size(cfg, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ValueError(f"config num_key_value_heads={kv_heads} is not valid with "
                         f"num_attention_heads={heads} (expected a divisor of it)")
    head_dim = _size(cfg, "head_dim", 256)
    if head_dim % 2:
        raise ValueError(f"config head_dim={head_dim} is not valid (RoPE needs an even "
                         "head_dim)")
    layers = _size(cfg, "num_hidden_layers")
    types = cfg.get("layer_types")
    if types is None:  # transformers' default: the even layers slide
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                 for i in range(layers)]
    bias = _require(cfg, "attention_bias", (True, False), False)
    return dict(
        vocab_size=_size(cfg, "vocab_size"),
        context_length=_size(cfg, "max_position_embeddings", 8192),
        d_model=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, d_ff=_size(cfg, "intermediate_size"), positions="rope",
        rope_base=rope_theta(cfg), rope_scaling=rope_scaling(cfg), norm="rmsnorm_plus_one",
        norm_eps=_positive(cfg, "rms_norm_eps", 1e-6), mlp="geglu",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bias, out_bias=bias, mlp_bias=False,
        attn_scale=_positive(cfg, "query_pre_attn_scalar", 256) ** -0.5,
        attn_softcap=_softcap(cfg, "attn_logit_softcapping", 50.0),
        logit_softcap=_softcap(cfg, "final_logit_softcapping", 30.0),
        **window_layers(types, layers, window_field(cfg, "sliding_window", 4096)),
        post_norms=True, scale_embeddings=True,
    )


def gemma2_state(state: Tensors, cfg: Config) -> dict[str, torch.Tensor]:
    """attnlab's state dict of a Gemma 2 state dict, every shape checked first."""
    return llama_state(state, cfg, GEMMA2_NAMES)


GEMMA3_NAMES = {**GEMMA2_NAMES, "self_attn.q_norm": "attn.q_norm",
                "self_attn.k_norm": "attn.k_norm"}


def gemma3_config(cfg: Mapping[str, Any]) -> Config:
    """``GPTConfig`` values of a Gemma 3 text config dict (``gemma3_text``): Gemma 2's with
    ``q_norm``/``k_norm`` (``qk_norm``), no softcapped scores (the logits' only where the
    config sets it), the sliding layers of ``layer_types`` (or every layer but each
    ``sliding_window_pattern``-th, 6), and their RoPE
    (``rope_parameters["sliding_attention"]``, or the older ``rope_local_base_freq``) as
    ``window_rope_base`` / ``window_rope_scaling``; the global layers'
    (``rope_parameters["full_attention"]``, or ``rope_theta`` and ``rope_scaling``) as
    ``rope_base`` / ``rope_scaling``, as transformers reads them."""
    layers = _size(cfg, "num_hidden_layers")
    pattern = _size(cfg, "sliding_window_pattern", 6)
    params = cfg.get("rope_parameters") or {}
    if not isinstance(params, Mapping) or not {"full_attention", "sliding_attention"} & set(
            params):
        params = {}  # the older fields: rope_theta, rope_scaling, rope_local_base_freq
    # As transformers' Gemma3TextConfig: each kind's own parameters, its base else the
    # older field's else the default, a rope_scaling on the global layers.
    context = cfg.get("max_position_embeddings", 131072)
    full = {"max_position_embeddings": context, "rope_parameters": {
        "rope_theta": cfg.get("rope_theta", 1e6), **(params.get("full_attention") or {}),
        **(cfg.get("rope_scaling") or {})}}
    local = {"max_position_embeddings": context, "rope_parameters": {
        "rope_theta": cfg.get("rope_local_base_freq", 1e4),
        **(params.get("sliding_attention") or {})}}
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else
                                       "full_attention" for i in range(layers)]
    if "sliding_attention" in types and cfg.get("sliding_window", 4096) is None:
        raise ValueError("config sliding_window=None with sliding layers is not valid (its "
                         "layer_types slide; transformers cannot run it either)")
    out = gemma2_config({
        **{k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling")},
        **full,
        "sliding_window": cfg.get("sliding_window", 4096),
        # (transformers' Gemma 3 keeps the field but never caps its scores)
        "attn_logit_softcapping": None,
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
        "layer_types": types})
    out.update(qk_norm=True, window_rope_base=rope_theta(local),
               window_rope_scaling=rope_scaling(local))
    return out


def gemma3_state(state: Tensors, cfg: Config) -> dict[str, torch.Tensor]:
    """attnlab's state dict of a Gemma 3 text state dict, every shape checked first."""
    return llama_state(state, cfg, GEMMA3_NAMES)
