"""Hugging Face layouts -> attnlab layouts: GPT-2, Llama, Mistral, Qwen2, Qwen3 (-> GPT;
Gemma 2 and 3 and BLOOM in :mod:`.hf_gemma2` and :mod:`.hf_bloom`) and BERT, RoBERTa, DistilBERT
(-> Encoder, in :mod:`.hf_encoders`).

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
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..io import CONFIG_FILE, read_json
from ..io.reading import CONFIG_LIMIT
from ..io.weights import SafetensorsState
from .common import (
    Config,
    ShapeMismatch,
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
from .hf_bloom import bloom_config, bloom_state
from .hf_encoders import ENCODER_LAYOUTS, bert_config, bert_state, convert_encoder
from .hf_gemma2 import gemma2_config, gemma2_state, gemma3_config, gemma3_state
from .hf_llama import (
    QWEN3_NAMES,
    llama_config,
    llama_state,
    mistral_config,
    qwen2_config,
    qwen3_config,
)

__all__ = ["gpt_layout", "encoder_layout", "read_folder", "GPT_LAYOUTS", "ENCODER_LAYOUTS",
           "gpt2_config", "gpt2_state", "llama_config", "llama_state", "mistral_config",
           "qwen2_config", "qwen3_config", "gemma2_config", "gemma2_state", "gemma3_config",
           "gemma3_state", "bloom_config", "bloom_state", "bert_config", "bert_state"]


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
    d_model, heads = _size(cfg, "n_embd"), _size(cfg, "n_head")
    if d_model % heads:
        raise ValueError(f"config n_embd={d_model} is not valid with n_head={heads} "
                         "(expected a multiple of it)")
    return dict(
        vocab_size=_size(cfg, "vocab_size"), context_length=_size(cfg, "n_positions"),
        d_model=d_model, num_layers=_size(cfg, "n_layer"), num_heads=heads,
        d_ff=_size(cfg, "n_inner", 4 * d_model), positions="learned", norm="layernorm",
        norm_eps=_positive(cfg, "layer_norm_epsilon", 1e-5),
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
    # Checked before the joint q/k/v is sliced: a slice would drop what does not fit.
    check_layer_count(s, "h.", cfg["num_layers"], "n_layer")
    check_shapes(s, gpt2_shapes(cfg))
    if "lm_head.weight" in state and not cfg["tie_embeddings"]:
        check_shapes(_Named(state), {"lm_head.weight": (cfg["vocab_size"], d)})
    check_tied_head(state, cfg, s["wte.weight"])
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
    return _detached(out)


def gpt2_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """The shape of each GPT-2 tensor (names without ``transformer.``) that ``cfg`` (the
    ``GPTConfig`` values of :func:`gpt2_config`) makes: Conv1D weights are ``[in, out]``."""
    d, ff = cfg["d_model"], cfg["d_ff"]
    want = {"wte.weight": (cfg["vocab_size"], d), "wpe.weight": (cfg["context_length"], d),
            "ln_f.weight": (d,), "ln_f.bias": (d,)}
    for i in range(cfg["num_layers"]):
        h = f"h.{i}."
        want.update({h + "attn.c_attn.weight": (d, 3 * d), h + "attn.c_attn.bias": (3 * d,),
                     h + "attn.c_proj.weight": (d, d), h + "attn.c_proj.bias": (d,),
                     h + "mlp.c_fc.weight": (d, ff), h + "mlp.c_fc.bias": (ff,),
                     h + "mlp.c_proj.weight": (ff, d), h + "mlp.c_proj.bias": (d,)})
        for norm in ("ln_1", "ln_2"):
            want.update({h + f"{norm}.weight": (d,), h + f"{norm}.bias": (d,)})
    return want


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
    cfg = read_json(path / CONFIG_FILE, CONFIG_LIMIT, "config")
    index = path / "model.safetensors.index.json"
    if os.path.lexists(path / "model.safetensors"):  # (not a regular file: said when read)
        files = [path / "model.safetensors"]
    elif os.path.lexists(index):
        weight_map = read_json(index, CONFIG_LIMIT, "index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{str(index)!r} has no weight_map")
        odd = [n for n in weight_map.values() if not isinstance(n, str)]
        if odd:
            raise ValueError(f"{str(index)!r}: each weight_map value must be a shard's file "
                             f"name (a string), got {odd[0]!r}")
        names = sorted(set(weight_map.values()))
        bad = [n for n in names if Path(n).name != n]
        if bad:
            raise ValueError(f"{str(index)!r} names shards outside its folder: {bad[:3]}")
        files = [path / n for n in names]
    elif any(path.glob("*.bin")) or any(path.glob("*.pt")):
        # The folder's own class keeps every weight (AutoModel would drop a decoder's
        # lm_head and write its headless class into config.json).
        archs = cfg.get("architectures") if isinstance(cfg, dict) else None
        arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) \
            and archs[0].isidentifier() else None
        loader = (f"transformers.{arch}" if arch else
                  "AutoModelForCausalLM (AutoModel for an encoder)")
        raise ValueError(
            f"model folder {str(folder)!r} holds only PyTorch pickle weights (*.bin), which "
            "attnlab never loads (unpickling can run code); convert once with transformers: "
            f"{loader}.from_pretrained(folder).save_pretrained(folder, "
            "safe_serialization=True)")
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


# model_type -> (name, config converter, state converter)
_GPT = {"gpt2": ("GPT-2", gpt2_config, lambda st, c, hf: gpt2_state(st, c, hf)),
        "llama": ("Llama", llama_config, lambda st, c, hf: llama_state(st, c)),
        "mistral": ("Mistral", mistral_config, lambda st, c, hf: llama_state(st, c)),
        "qwen2": ("Qwen2", qwen2_config, lambda st, c, hf: llama_state(st, c)),
        "qwen3": ("Qwen3", qwen3_config, lambda st, c, hf: llama_state(st, c, QWEN3_NAMES)),
        "gemma2": ("Gemma 2", gemma2_config, lambda st, c, hf: gemma2_state(st, c)),
        "gemma3_text": ("Gemma 3", gemma3_config, lambda st, c, hf: gemma3_state(st, c)),
        "bloom": ("BLOOM", bloom_config, lambda st, c, hf: bloom_state(st, c))}
GPT_LAYOUTS = {kind: name for kind, (name, _, _) in _GPT.items()}


def _unsupported(kind: Any, cls: str) -> ValueError:
    other = ("Encoder" if kind in ENCODER_LAYOUTS else "GPT" if kind in GPT_LAYOUTS else None)
    hint = f"; {kind!r} is a layout of {other}: use {other}.from_hf" if other else ""
    if kind == "gemma3":
        hint = ("; 'gemma3' is Gemma 3's image-and-text model: attnlab reads the text "
                "decoder's folders (Gemma3ForCausalLM, model_type 'gemma3_text')")
    return ValueError(f"model.config.model_type={kind!r} is not supported by {cls} (expected "
                      f"one of {sorted(GPT_LAYOUTS if cls == 'GPT' else ENCODER_LAYOUTS)})"
                      f"{hint}")


def gpt_layout(model: Any) -> tuple[Config, dict[str, torch.Tensor]]:
    """GPTConfig values and the attnlab state dict of a transformers causal LM of one of
    the :data:`GPT_LAYOUTS` (``GPT2LMHeadModel``, ``LlamaForCausalLM`` and its relatives
    SmolLM/TinyLlama, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
    ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``,
    ``BloomForCausalLM``), live or as a folder written by ``save_pretrained``.

    Nothing is copied: the tensors are the source's own (a folder's memory-mapped) or
    views of them where the layouts differ (GPT-2's transposed projections, its q/k/v
    slices), sharing their storage as a ``state_dict`` does (``GPT.from_hf`` copies
    them into a model of its own). Make them contiguous before writing them to a file
    of their own (``safetensors`` refuses views). Every tensor's shape is checked
    against the config first: :class:`~attnlab.layouts.common.ShapeMismatch` names the
    tensor, the shape found and the shape expected."""
    cfg, state = _parts(model)
    kind = cfg.get("model_type")
    if kind not in _GPT:
        raise _unsupported(kind, "GPT")
    _, make_config, make_state = _GPT[kind]
    for key in ("num_hidden_layers", "n_layer"):  # (GPT-2 and BLOOM: n_layer)
        layers = cfg.get(key)
        if isinstance(layers, int) and layers > len(state):
            # Before the converters make a list of the layers (Qwen2's and Gemma's layer
            # types): a count of 1e9 would fill memory before the layers are counted.
            found = {int(m.group(1)) for name in state
                     if (m := re.search(r"(?:^|\.)(\d+)\.", name))}
            held = f"layers 0 .. {max(found)}" if found else "no layers"
            raise ShapeMismatch(f"config {key}={layers}, but the weights hold {held} "
                                f"({len(state)} tensors; every layer needs some)")
    config = make_config(cfg)
    try:
        return config, make_state(state, config, cfg)
    except ShapeMismatch as exc:
        where = repr(str(model)) if _is_folder_arg(model) else f"the {type(model).__name__}"
        raise ShapeMismatch(f"{where} does not fit the GPT: {exc}") from None


def encoder_layout(model: Any) -> tuple[Config, dict[str, torch.Tensor]]:
    """EncoderConfig values and the attnlab state dict of a ``BertModel``, ``RobertaModel``
    or ``DistilBertModel`` (or a model holding one, such as ``BertForMaskedLM``), live or
    as a folder written by ``save_pretrained``. The tensors are the source's own, not
    copies (see :func:`gpt_layout`)."""
    cfg, state = _parts(model)
    if cfg.get("model_type") not in ENCODER_LAYOUTS:
        raise _unsupported(cfg.get("model_type"), "Encoder")
    return convert_encoder(cfg, state)
