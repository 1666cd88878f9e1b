"""Hugging Face's Llama layout and its relatives that only add to it: Llama (SmolLM,
TinyLlama), Mistral (a sliding window on every layer), Qwen2 (q/k/v biases, a window on
some layers), Qwen3 (Qwen2's windows, a norm over each head's queries and keys). Plain
data, as :mod:`.hf`; Gemma 2 reuses the state map with its own names."""

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
    rope_scaling,
    rope_theta,
    window_field,
)

__all__ = ["llama_config", "llama_shapes", "llama_state", "mistral_config", "qwen2_config",
           "qwen3_config", "QWEN3_NAMES",
           "window_layers", "LLAMA_NAMES"]


# ------------------------------------------------------------------------- Llama


def llama_config(cfg: Mapping[str, Any]) -> Config:
    """``GPTConfig`` values of a Llama config dict (also Mistral's and Qwen2's, whose
    differences :func:`mistral_config` and :func:`qwen2_config` add)."""
    _require(cfg, "hidden_act", ("silu",), "silu")
    hidden, heads = _size(cfg, "hidden_size"), _size(cfg, "num_attention_heads")
    # transformers reads head_dim 0 (or null) as hidden_size // num_attention_heads.
    raw = cfg.get("head_dim")
    head_dim = (hidden // heads if raw == 0 and not isinstance(raw, bool) else
                _size(cfg, "head_dim", hidden // heads))
    if head_dim % 2:
        raise ValueError(f"config head_dim={head_dim} is not valid (RoPE needs an even "
                         "head_dim)")
    kv_heads = _size(cfg, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ValueError(f"config num_key_value_heads={kv_heads} is not valid with "
                         f"num_attention_heads={heads} (expected a divisor of it)")
    return dict(
        vocab_size=_size(cfg, "vocab_size"),
        context_length=_size(cfg, "max_position_embeddings"),
        d_model=hidden, num_layers=_size(cfg, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=kv_heads, d_ff=_size(cfg, "intermediate_size"),
        positions="rope", rope_base=rope_theta(cfg), rope_scaling=rope_scaling(cfg),
        norm="rmsnorm",
        norm_eps=_positive(cfg, "rms_norm_eps", 1e-6), mlp="swiglu",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        out_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        # Heads wider or narrower than hidden_size / heads (Mistral NeMo: 32 x 128 over
        # 5120): the attention is heads * head_dim wide and o_proj maps it back.
        **({} if head_dim * heads == hidden else {"head_dim": head_dim}),
    )


# Llama's names of a layer's tensors -> attnlab's (Gemma 2 names its norms otherwise).
LLAMA_NAMES = {"self_attn.q_proj": "attn.W_query", "self_attn.k_proj": "attn.W_key",
               "self_attn.v_proj": "attn.W_value", "self_attn.o_proj": "attn.out_proj",
               "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.fc", "mlp.down_proj": "mlp.proj",
               "input_layernorm": "norm1", "post_attention_layernorm": "norm2"}


def llama_shapes(cfg: Config, norms: tuple[str, ...] = ("input_layernorm",
                                                         "post_attention_layernorm")
                 ) -> dict[str, tuple[int, ...]]:
    """The shape of each Llama (Mistral, Qwen2, Gemma 2) tensor (names without ``model.``)
    that ``cfg`` (the ``GPTConfig`` values of :func:`llama_config`) makes, with the layers'
    ``norms``; biases where the file has them (``llama_state`` takes those it finds)."""
    d, ff = cfg["d_model"], cfg["d_ff"]
    head_dim = cfg.get("head_dim") or d // cfg["num_heads"]
    q, kv = cfg["num_heads"] * head_dim, cfg["num_kv_heads"] * head_dim
    want = {"embed_tokens.weight": (cfg["vocab_size"], d), "norm.weight": (d,)}
    rows = {"self_attn.q_proj": (q, d), "self_attn.k_proj": (kv, d),
            "self_attn.v_proj": (kv, d), "self_attn.o_proj": (d, q),
            "mlp.gate_proj": (ff, d), "mlp.up_proj": (ff, d), "mlp.down_proj": (d, ff)}
    for i in range(cfg["num_layers"]):
        for name, shape in rows.items():
            want[f"layers.{i}.{name}.weight"] = shape
            want[f"layers.{i}.{name}.bias"] = shape[:1]
        for norm in norms:  # (a head's own: Qwen3's q_norm and k_norm)
            want[f"layers.{i}.{norm}.weight"] = (head_dim,) if "attn." in norm else (d,)
    return want


def llama_state(state: Tensors, cfg: Config,
                names: Mapping[str, str] = LLAMA_NAMES) -> dict[str, torch.Tensor]:
    """attnlab's state dict of a Llama-layout state dict (Mistral, Qwen2; Gemma 2 with its
    own ``names`` of the layers' tensors), every shape checked first."""
    s = _strip(state, "model.")
    check_layer_count(s, "layers.", cfg["num_layers"], "num_hidden_layers")
    norms = tuple(src for src, dst in names.items() if "norm" in dst)
    check_shapes(s, llama_shapes(cfg, norms))
    if not cfg["tie_embeddings"]:
        check_shapes(_Named(state), {"lm_head.weight": (cfg["vocab_size"], cfg["d_model"])})
    check_tied_head(state, cfg, s["embed_tokens.weight"])
    out = {"tok_emb.weight": s["embed_tokens.weight"], "norm.weight": s["norm.weight"]}
    if not cfg["tie_embeddings"]:
        out["lm_head.weight"] = _Named(state)["lm_head.weight"]
    for i in range(cfg["num_layers"]):
        for src, dst in names.items():
            for kind in ("weight", "bias"):
                key = f"layers.{i}.{src}.{kind}"
                if key in s:
                    out[f"blocks.{i}.{dst}.{kind}"] = s[key]
    return _detached(out)


# ------------------------------------------------------------------------- Mistral, Qwen2


def mistral_config(cfg: Mapping[str, Any]) -> Config:
    """Llama's layout with a sliding window on every layer: ``sliding_window`` W (4096
    where absent, as transformers' MistralConfig; null = full causal attention) becomes
    ``GPTConfig.window``; a query at position p sees keys ``p - W < j <= p``, as
    transformers' sliding-window mask."""
    out = llama_config(cfg)
    out["window"] = window_field(cfg, "sliding_window", 4096)
    return out


def qwen2_config(cfg: Mapping[str, Any]) -> Config:
    """Llama's layout with biases on q/k/v (none on o_proj). Qwen2 may slide a window on
    some layers: with ``use_sliding_window``, those from ``max_window_layers`` on, or the
    ``sliding_attention`` entries of ``layer_types`` where the config lists them (as
    transformers reads it, with its defaults where a field is absent: a window of 4096
    from layer 28 on); they become ``GPTConfig.window`` and ``window_layers``."""
    out = llama_config(cfg)
    out.update(qkv_bias=True, out_bias=False, mlp_bias=False)
    n = out["num_layers"]
    window = (window_field(cfg, "sliding_window", 4096) if cfg.get("use_sliding_window")
              else None)
    types = cfg.get("layer_types")
    if types is None:
        start = cfg.get("max_window_layers", 28)
        if isinstance(start, bool) or not isinstance(start, int):
            raise ValueError(f"config max_window_layers={start!r} is not valid (expected an "
                             "int)")
        types = ["sliding_attention" if window is not None and i >= start else
                 "full_attention" for i in range(n)]
    out.update(window_layers(types, n, window))
    return out


def qwen3_config(cfg: Mapping[str, Any]) -> Config:
    """Qwen2's layout (its windows) with biases on q/k/v and o_proj only where
    ``attention_bias`` says, and an RMSNorm over each head's queries and keys before RoPE
    (``q_norm``, ``k_norm``: ``GPTConfig.qk_norm``). Without ``head_dim`` the heads are
    128 wide, as transformers' Qwen3Config has them."""
    out = qwen2_config(cfg if "head_dim" in cfg else {**cfg, "head_dim": 128})
    bias = bool(cfg.get("attention_bias", False))
    out.update(qkv_bias=bias, out_bias=bias, qk_norm=True)
    return out


# Qwen3's names: Llama's and the heads' norms.
QWEN3_NAMES = {**LLAMA_NAMES, "self_attn.q_norm": "attn.q_norm",
               "self_attn.k_norm": "attn.k_norm"}


def window_layers(types: Any, n: int, window: int | None) -> dict[str, Any]:
    """``{"window", "window_layers"}`` of ``GPTConfig`` for transformers' ``layer_types``
    (one ``"full_attention"`` or ``"sliding_attention"`` per layer, ``n`` layers) and the
    config's window: None, or the window on the sliding layers (listed only where some
    layers do not slide). Without a window no layer slides, as in transformers."""
    if not isinstance(types, list) or len(types) != n or not set(types) <= {
            "sliding_attention", "full_attention"}:
        raise ValueError(f"config layer_types={types!r} is not supported (expected one of "
                         f"'full_attention'/'sliding_attention' per layer, {n} layers)")
    sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    if window is None or not sliding:
        return {"window": None, "window_layers": None}
    return {"window": window, "window_layers": None if len(sliding) == n else sliding}
