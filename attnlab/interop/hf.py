"""Hugging Face layouts -> attnlab layouts: GPT-2, Llama (-> GPT) and BERT (-> Encoder).

Plain data in, plain data out: each converter maps a transformers config dict
to attnlab config values (a dict for ``GPTConfig``/``EncoderConfig``) and a
transformers state dict to an attnlab state dict. So it serves a live
``transformers`` model (``model.state_dict()``, ``model.config.to_dict()``) and
checkpoint files read without transformers (the bundled MiniLM) alike, and it
imports nothing from :mod:`attnlab.models`: the model classes build and load
(``GPT.from_hf``, ``Encoder.from_hf``). Unsupported options and missing fields
raise a ValueError naming the field.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..io import CONFIG_FILE, read_json
from ..io.weights import SafetensorsState

Tensors = Mapping[str, torch.Tensor]
Config = dict[str, Any]


class _Named(Mapping):
    """A read-only view of a state dict under ``prefix`` whose missing key is a
    ValueError naming it (not a KeyError). Tensors are looked up, never copied, so
    a lazily read file is read once, name by name."""

    def __init__(self, state: Tensors, prefix: str = "") -> None:
        self._state, self._prefix = state, prefix

    def __getitem__(self, key: str) -> torch.Tensor:
        if self._prefix + key not in self._state:
            raise ValueError(f"weights have no {self._prefix + key!r}, which this layout needs")
        return self._state[self._prefix + key]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._prefix + key in self._state

    def __iter__(self):
        n = len(self._prefix)
        return (k[n:] for k in self._state if k.startswith(self._prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _strip(state: Tensors, prefix: str) -> _Named:
    """Keys without ``prefix`` where every key that matters has it (``bert.``, ``model.``)."""
    return _Named(state, prefix if any(k.startswith(prefix) for k in state) else "")


def _own(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, copied only where the layout made a view (a transpose, a
    slice): the weights are not held twice while a model is built from them."""
    return {k: v.detach().contiguous() for k, v in state.items()}


def _require(cfg: Mapping[str, Any], key: str, allowed, default=None):
    value = cfg.get(key, default)
    try:
        ok = value in allowed
    except TypeError:  # an unhashable value
        ok = False
    if not ok:
        raise ValueError(f"config {key}={value!r} is not supported (expected one of {allowed})")
    return value


def _field(cfg: Mapping[str, Any], key: str) -> Any:
    """A field the layout cannot do without: a ValueError naming it when absent."""
    if key not in cfg or cfg[key] is None:
        kind = cfg.get("model_type", "this")
        raise ValueError(f"config has no {key!r}, which a {kind} config needs")
    return cfg[key]


# ------------------------------------------------------------------------- GPT-2


def gpt2_config(cfg: Mapping[str, Any]) -> Config:
    _require(cfg, "activation_function", ("gelu_new", "gelu_pytorch_tanh", "gelu"),
             "gelu_new")
    # scale_attn_weights and scale_attn_by_inverse_layer_idx are folded into
    # W_query by gpt2_state; reorder_and_upcast_attn only changes the order and
    # precision of the score matmul (the same numbers in float32), so it is accepted.
    _require(cfg, "scale_attn_weights", (True, False), True)
    _require(cfg, "scale_attn_by_inverse_layer_idx", (True, False), False)
    _require(cfg, "reorder_and_upcast_attn", (True, False), False)
    d_model = _field(cfg, "n_embd")
    return dict(
        vocab_size=_field(cfg, "vocab_size"), context_length=_field(cfg, "n_positions"),
        d_model=d_model, num_layers=_field(cfg, "n_layer"), num_heads=_field(cfg, "n_head"),
        d_ff=cfg.get("n_inner") or 4 * d_model, positions="learned", norm="layernorm",
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


def gpt2_state(state: Tensors, cfg: Config,
               hf_cfg: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """GPT-2's Conv1D weights are ``[in, out]``: transpose to ``nn.Linear``'s ``[out, in]``.

    ``hf_cfg`` (the transformers config dict) carries the score-scaling options,
    which are folded into ``W_query`` (see :func:`gpt2_query_factor`).
    """
    s = _strip(state, "transformer.")
    d = cfg["d_model"]
    head_dim = d // cfg["num_heads"]
    hf_cfg = hf_cfg or {}
    out = {"tok_emb.weight": s["wte.weight"], "pos_emb.weight": s["wpe.weight"],
           "norm.weight": s["ln_f.weight"], "norm.bias": s["ln_f.bias"]}
    if "lm_head.weight" in state and not cfg["tie_embeddings"]:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg["num_layers"]):
        h, b = f"h.{i}.", f"blocks.{i}."
        w, bias = s[h + "attn.c_attn.weight"], s[h + "attn.c_attn.bias"]  # [d, 3d], [3d]
        for j, name in enumerate(("W_query", "W_key", "W_value")):
            out[b + f"attn.{name}.weight"] = w[:, j * d:(j + 1) * d].t()
            out[b + f"attn.{name}.bias"] = bias[j * d:(j + 1) * d]
        factor = gpt2_query_factor(hf_cfg, i, head_dim)
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
    return _own(out)


# ------------------------------------------------------------------------- Llama


def _rope_theta(cfg: Mapping[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ValueError(f"config rope_type={kind!r} is not supported (expected 'default')")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def llama_config(cfg: Mapping[str, Any]) -> Config:
    _require(cfg, "hidden_act", ("silu",), "silu")
    hidden, heads = _field(cfg, "hidden_size"), _field(cfg, "num_attention_heads")
    head_dim = cfg.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise ValueError(f"config head_dim={head_dim} with {heads} heads does not make "
                         f"hidden_size={hidden}; not supported")
    return dict(
        vocab_size=_field(cfg, "vocab_size"),
        context_length=_field(cfg, "max_position_embeddings"),
        d_model=hidden, num_layers=_field(cfg, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        d_ff=_field(cfg, "intermediate_size"),
        positions="rope", rope_base=_rope_theta(cfg), norm="rmsnorm",
        norm_eps=cfg.get("rms_norm_eps", 1e-6), mlp="swiglu",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        out_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
    )


def llama_state(state: Tensors, cfg: Config) -> dict[str, torch.Tensor]:
    s = _strip(state, "model.")
    out = {"tok_emb.weight": s["embed_tokens.weight"], "norm.weight": s["norm.weight"]}
    if not cfg["tie_embeddings"]:
        out["lm_head.weight"] = _Named(state)["lm_head.weight"]
    names = {"self_attn.q_proj": "attn.W_query", "self_attn.k_proj": "attn.W_key",
             "self_attn.v_proj": "attn.W_value", "self_attn.o_proj": "attn.out_proj",
             "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.fc", "mlp.down_proj": "mlp.proj",
             "input_layernorm": "norm1", "post_attention_layernorm": "norm2"}
    for i in range(cfg["num_layers"]):
        for src, dst in names.items():
            for kind in ("weight", "bias"):
                key = f"layers.{i}.{src}.{kind}"
                if key in s:
                    out[f"blocks.{i}.{dst}.{kind}"] = s[key]
    return _own(out)


# ------------------------------------------------------------------------- BERT


def bert_config(cfg: Mapping[str, Any]) -> Config:
    _require(cfg, "position_embedding_type", ("absolute",), "absolute")
    act = _require(cfg, "hidden_act", ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"))
    return dict(
        vocab_size=_field(cfg, "vocab_size"),
        context_length=_field(cfg, "max_position_embeddings"),
        d_model=_field(cfg, "hidden_size"), num_layers=_field(cfg, "num_hidden_layers"),
        num_heads=_field(cfg, "num_attention_heads"), d_ff=_field(cfg, "intermediate_size"),
        type_vocab_size=cfg.get("type_vocab_size", 2), norm_eps=cfg.get("layer_norm_eps", 1e-12),
        activation={"gelu": "gelu", "relu": "relu"}.get(act, "gelu_tanh"),
        pad_id=cfg.get("pad_token_id") or 0,
    )


def bert_state(state: Tensors, cfg: Config) -> dict[str, torch.Tensor]:
    s = _strip(state, "bert.")
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
    return _own(out)


# ------------------------------------------------------------------------- entry points


def _is_folder_arg(model: Any) -> bool:
    return isinstance(model, str | os.PathLike)


def read_folder(folder: str | os.PathLike) -> tuple[Config, SafetensorsState]:
    """The transformers config dict and the (lazily read) weights of a folder written by
    ``save_pretrained``: ``config.json`` and ``model.safetensors`` or shards listed in
    ``model.safetensors.index.json``. Never a pickle, never a download."""
    path = Path(folder)
    if not path.exists():
        hint = (" (it looks like a hub name: attnlab never downloads; save the model with "
                "save_pretrained and pass that folder)" if "/" in str(folder) and
                not str(folder).startswith((".", "/", "~")) else "")
        raise ValueError(f"model folder {str(folder)!r} does not exist{hint}")
    if not path.is_dir():
        raise ValueError(f"model folder {str(folder)!r} is a file, expected a folder written "
                         "by save_pretrained")
    cfg = read_json(path / CONFIG_FILE)
    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    elif index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{str(index)!r} has no weight_map")
        names = sorted(set(weight_map.values()))
        bad = [n for n in names if not isinstance(n, str) or Path(n).name != n]
        if bad:
            raise ValueError(f"{str(index)!r} names shards outside its folder: {bad[:3]}")
        files = [path / n for n in names]
    elif any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise ValueError(
            f"model folder {str(folder)!r} holds only PyTorch pickle weights (*.bin), which "
            "attnlab never loads (unpickling can run code); convert once with transformers: "
            "AutoModel.from_pretrained(folder).save_pretrained(folder, safe_serialization=True)")
    else:
        raise ValueError(f"model folder {str(folder)!r} has no model.safetensors")
    return cfg, SafetensorsState(files)


def _parts(model: Any) -> tuple[Config, Tensors]:
    """(config dict, state dict) of a live transformers model or a saved folder."""
    if _is_folder_arg(model):
        return read_folder(model)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict") or not hasattr(model, "state_dict"):
        raise TypeError(f"model must be a transformers model or a folder written by "
                        f"save_pretrained, got {type(model).__name__}")
    return config.to_dict(), model.state_dict()


GPT_LAYOUTS = {"gpt2": "GPT-2", "llama": "Llama"}
ENCODER_LAYOUTS = {"bert": "BERT"}


def gpt_layout(model: Any) -> tuple[Config, dict[str, torch.Tensor]]:
    """GPTConfig values and the attnlab state dict of a ``GPT2LMHeadModel``
    or ``LlamaForCausalLM``, live or as a folder written by ``save_pretrained``."""
    cfg, state = _parts(model)
    kind = cfg.get("model_type")
    if kind == "gpt2":
        config = gpt2_config(cfg)
        return config, gpt2_state(state, config, cfg)
    if kind == "llama":
        config = llama_config(cfg)
        return config, llama_state(state, config)
    raise ValueError(f"model.config.model_type={kind!r} is not supported (expected one of "
                     f"{sorted(GPT_LAYOUTS)})")


def encoder_layout(model: Any) -> tuple[Config, dict[str, torch.Tensor]]:
    """EncoderConfig values and the attnlab state dict of a ``BertModel``
    (or a model with ``.bert``), live or as a folder written by ``save_pretrained``."""
    cfg, state = _parts(model)
    if cfg.get("model_type") not in ENCODER_LAYOUTS:
        raise ValueError(f"model.config.model_type={cfg.get('model_type')!r} is not supported "
                         f"(expected one of {sorted(ENCODER_LAYOUTS)})")
    config = bert_config(cfg)
    return config, bert_state(state, config)
