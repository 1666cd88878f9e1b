"""Hugging Face layouts -> attnlab models: GPT-2, Llama (-> GPT) and BERT (-> Encoder).

Each converter maps a state dict and a config dict, so it serves a live
``transformers`` model (``model.state_dict()``, ``model.config.to_dict()``)
and checkpoint files read without transformers (the bundled MiniLM) alike.
Unsupported options raise a ValueError naming the field and its value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..models import GPT, Encoder, EncoderConfig, GPTConfig

Tensors = Mapping[str, torch.Tensor]


def _strip(state: Tensors, prefix: str) -> dict[str, torch.Tensor]:
    """Keys without ``prefix`` where every key that matters has it (``bert.``, ``model.``)."""
    if any(k.startswith(prefix) for k in state):
        return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    return dict(state)


def _require(cfg: Mapping[str, Any], key: str, allowed, default=None):
    value = cfg.get(key, default)
    if value not in allowed:
        raise ValueError(f"config {key}={value!r} is not supported (expected one of {allowed})")
    return value


def _load(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("lm_head.") or
               not getattr(model.config, "tie_embeddings", False)]
    if missing or unexpected:
        raise ValueError(f"weights do not fit the layout: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return model.eval()


# ------------------------------------------------------------------------- GPT-2


def gpt2_config(cfg: Mapping[str, Any]) -> GPTConfig:
    _require(cfg, "activation_function", ("gelu_new", "gelu_pytorch_tanh", "gelu"),
             "gelu_new")
    # scale_attn_weights and scale_attn_by_inverse_layer_idx are folded into
    # W_query by gpt2_state; reorder_and_upcast_attn only changes the order and
    # precision of the score matmul (the same numbers in float32), so it is accepted.
    _require(cfg, "scale_attn_weights", (True, False), True)
    _require(cfg, "scale_attn_by_inverse_layer_idx", (True, False), False)
    _require(cfg, "reorder_and_upcast_attn", (True, False), False)
    return GPTConfig(
        vocab_size=cfg["vocab_size"], context_length=cfg["n_positions"], d_model=cfg["n_embd"],
        num_layers=cfg["n_layer"], num_heads=cfg["n_head"],
        d_ff=cfg.get("n_inner") or 4 * cfg["n_embd"], positions="learned", norm="layernorm",
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        mlp="gelu" if cfg.get("activation_function") == "gelu" else "gelu_tanh",
        tie_embeddings=cfg.get("tie_word_embeddings", True), qkv_bias=True, out_bias=True,
        mlp_bias=True,
    )


def gpt2_query_factor(hf_cfg: Mapping[str, Any], layer: int, head_dim: int) -> float:
    """What W_query of ``layer`` is multiplied by so that attnlab's fixed 1/sqrt(head_dim)
    scaling gives the scores GPT-2 computes with its scaling options.

    GPT-2 scales q.k by ``1/sqrt(head_dim)`` only with ``scale_attn_weights`` and
    further by ``1/(layer + 1)`` with ``scale_attn_by_inverse_layer_idx``; attnlab's
    attention always applies ``1/sqrt(head_dim)``, and scores are linear in q.
    """
    factor = 1.0 if hf_cfg.get("scale_attn_weights", True) else math.sqrt(head_dim)
    if hf_cfg.get("scale_attn_by_inverse_layer_idx", False):
        factor /= layer + 1
    return factor


def gpt2_state(state: Tensors, cfg: GPTConfig,
               hf_cfg: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """GPT-2's Conv1D weights are ``[in, out]``: transpose to ``nn.Linear``'s ``[out, in]``.

    ``hf_cfg`` (the transformers config dict) carries the score-scaling options,
    which are folded into ``W_query`` (see :func:`gpt2_query_factor`).
    """
    s = _strip(state, "transformer.")
    d = cfg.d_model
    hf_cfg = hf_cfg or {}
    out = {"tok_emb.weight": s["wte.weight"], "pos_emb.weight": s["wpe.weight"],
           "norm.weight": s["ln_f.weight"], "norm.bias": s["ln_f.bias"]}
    if "lm_head.weight" in state and not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.num_layers):
        h, b = f"h.{i}.", f"blocks.{i}."
        w, bias = s[h + "attn.c_attn.weight"], s[h + "attn.c_attn.bias"]  # [d, 3d], [3d]
        for j, name in enumerate(("W_query", "W_key", "W_value")):
            out[b + f"attn.{name}.weight"] = w[:, j * d:(j + 1) * d].t()
            out[b + f"attn.{name}.bias"] = bias[j * d:(j + 1) * d]
        factor = gpt2_query_factor(hf_cfg, i, cfg.head_dim)
        if factor != 1.0:
            out[b + "attn.W_query.weight"] = out[b + "attn.W_query.weight"] * factor
            out[b + "attn.W_query.bias"] = out[b + "attn.W_query.bias"] * factor
        out[b + "attn.out_proj.weight"] = s[h + "attn.c_proj.weight"].t()
        out[b + "attn.out_proj.bias"] = s[h + "attn.c_proj.bias"]
        out[b + "mlp.fc.weight"] = s[h + "mlp.c_fc.weight"].t()
        out[b + "mlp.fc.bias"] = s[h + "mlp.c_fc.bias"]
        out[b + "mlp.proj.weight"] = s[h + "mlp.c_proj.weight"].t()
        out[b + "mlp.proj.bias"] = s[h + "mlp.c_proj.bias"]
        for src, dst in (("ln_1", "norm1"), ("ln_2", "norm2")):
            out[b + f"{dst}.weight"] = s[h + f"{src}.weight"]
            out[b + f"{dst}.bias"] = s[h + f"{src}.bias"]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


# ------------------------------------------------------------------------- Llama


def _rope_theta(cfg: Mapping[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ValueError(f"config rope_type={kind!r} is not supported (expected 'default')")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def llama_config(cfg: Mapping[str, Any]) -> GPTConfig:
    _require(cfg, "hidden_act", ("silu",), "silu")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise ValueError(f"config head_dim={head_dim} with {heads} heads does not make "
                         f"hidden_size={hidden}; not supported")
    return GPTConfig(
        vocab_size=cfg["vocab_size"], context_length=cfg["max_position_embeddings"],
        d_model=hidden, num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads, d_ff=cfg["intermediate_size"],
        positions="rope", rope_base=_rope_theta(cfg), norm="rmsnorm",
        norm_eps=cfg.get("rms_norm_eps", 1e-6), mlp="swiglu",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        out_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
    )


def llama_state(state: Tensors, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    s = _strip(state, "model.")
    out = {"tok_emb.weight": s["embed_tokens.weight"], "norm.weight": s["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    names = {"self_attn.q_proj": "attn.W_query", "self_attn.k_proj": "attn.W_key",
             "self_attn.v_proj": "attn.W_value", "self_attn.o_proj": "attn.out_proj",
             "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.fc", "mlp.down_proj": "mlp.proj",
             "input_layernorm": "norm1", "post_attention_layernorm": "norm2"}
    for i in range(cfg.num_layers):
        for src, dst in names.items():
            for kind in ("weight", "bias"):
                key = f"layers.{i}.{src}.{kind}"
                if key in s:
                    out[f"blocks.{i}.{dst}.{kind}"] = s[key]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


# ------------------------------------------------------------------------- BERT


def bert_config(cfg: Mapping[str, Any]) -> EncoderConfig:
    _require(cfg, "position_embedding_type", ("absolute",), "absolute")
    act = _require(cfg, "hidden_act", ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"))
    return EncoderConfig(
        vocab_size=cfg["vocab_size"], context_length=cfg["max_position_embeddings"],
        d_model=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"], d_ff=cfg["intermediate_size"],
        type_vocab_size=cfg.get("type_vocab_size", 2), norm_eps=cfg.get("layer_norm_eps", 1e-12),
        activation={"gelu": "gelu", "relu": "relu"}.get(act, "gelu_tanh"),
        pad_id=cfg.get("pad_token_id") or 0,
    )


def bert_state(state: Tensors, cfg: EncoderConfig) -> dict[str, torch.Tensor]:
    s = _strip(state, "bert.")
    e = "embeddings."
    out = {"tok_emb.weight": s[e + "word_embeddings.weight"],
           "pos_emb.weight": s[e + "position_embeddings.weight"],
           "type_emb.weight": s[e + "token_type_embeddings.weight"],
           "emb_norm.weight": s[e + "LayerNorm.weight"], "emb_norm.bias": s[e + "LayerNorm.bias"]}
    names = {"attention.self.query": "attn.W_query", "attention.self.key": "attn.W_key",
             "attention.self.value": "attn.W_value", "attention.output.dense": "attn.out_proj",
             "attention.output.LayerNorm": "norm1", "intermediate.dense": "fc",
             "output.dense": "proj", "output.LayerNorm": "norm2"}
    for i in range(cfg.num_layers):
        for src, dst in names.items():
            for kind in ("weight", "bias"):
                out[f"layers.{i}.{dst}.{kind}"] = s[f"encoder.layer.{i}.{src}.{kind}"]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


# ------------------------------------------------------------------------- entry points


def gpt_from_hf(model: Any) -> GPT:
    """An attnlab :class:`GPT` with the weights of a ``GPT2LMHeadModel`` or ``LlamaForCausalLM``."""
    cfg = model.config.to_dict()
    kind = cfg.get("model_type")
    if kind == "gpt2":
        gcfg = gpt2_config(cfg)
        state = gpt2_state(model.state_dict(), gcfg, cfg)
    elif kind == "llama":
        gcfg = llama_config(cfg)
        state = llama_state(model.state_dict(), gcfg)
    else:
        raise ValueError(f"model.config.model_type={kind!r} is not supported (expected 'gpt2' "
                         "or 'llama')")
    dtype = next(model.parameters()).dtype
    return _load(GPT(gcfg).to(dtype), state)


def encoder_from_hf(model: Any) -> Encoder:
    """An attnlab :class:`Encoder` with the weights of a ``BertModel`` (or one with ``.bert``)."""
    cfg = model.config.to_dict()
    if cfg.get("model_type") != "bert":
        raise ValueError(f"model.config.model_type={cfg.get('model_type')!r} is not supported "
                         "(expected 'bert')")
    ecfg = bert_config(cfg)
    dtype = next(model.parameters()).dtype
    return _load(Encoder(ecfg).to(dtype), bert_state(model.state_dict(), ecfg))
