"""GGUF metadata (llama.cpp's keys) -> a transformers config dict, as plain data: the
architectures attnlab reads, their keys, and what llama.cpp keeps in its code rather
than in the file (Gemma's query scale, window pattern and local RoPE). :mod:`.gguf`
maps the tensors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..io.gguf import GGUFFile
from .hf_gemma2 import GEMMA2_NAMES, GEMMA3_NAMES, gemma2_config, gemma3_config
from .hf_llama import LLAMA_NAMES, QWEN3_NAMES, llama_config, qwen2_config, qwen3_config

__all__ = ["ARCHITECTURES", "CONFIG_KEYS", "gguf_config", "rope_factors"]

# general.architecture -> (transformers' model_type, config converter, whether llama.cpp
# permuted the q/k rows, transformers' names of a layer's tensors -> attnlab's).
# llama.cpp writes Mistral (7B, Nemo...) as "llama", with no sliding window in its
# metadata (llama.cpp attends over the whole context), so a Mistral file is read as the
# Llama it is run as. Gemma's are read as llama.cpp computes them: its norms' weights are
# stored as 1 + the checkpoint's, so a plain RMSNorm takes them as they are (gguf_layout).
ARCHITECTURES = {"llama": ("llama", llama_config, True, LLAMA_NAMES),
                 "qwen2": ("qwen2", qwen2_config, False, LLAMA_NAMES),
                 "qwen3": ("qwen3", qwen3_config, False, QWEN3_NAMES),
                 "gemma2": ("gemma2", gemma2_config, False, GEMMA2_NAMES),
                 "gemma3": ("gemma3_text", gemma3_config, False, GEMMA3_NAMES)}

# "<arch>.<key>" -> transformers' config key
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}

def _scalar(meta: Mapping[str, Any], key: str, where: str) -> Any:
    value = meta.get(key)
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise ValueError(f"{where}: metadata {key}={value[:8]!r} differs from layer to "
                             "layer; not supported")
        value = value[0]
    return value


def gguf_config(meta: Mapping[str, Any], tensor_names: Mapping[str, Any] | set,
                where: str = "the GGUF file") -> dict[str, Any]:
    """The transformers config dict that GGUF metadata ``meta`` describes (``model_type``
    llama, qwen2, qwen3, gemma2 or gemma3_text), for :func:`~.hf.llama_config` and its
    relatives. What
    attnlab does not do (RoPE scaling, mixtures of experts, partial rotary) is refused
    here, naming the key."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{where}: architecture {arch!r} is not supported (expected one of "
                         f"{sorted(ARCHITECTURES)}: Llama, SmolLM, TinyLlama, Mistral, Qwen2, "
                         "Qwen3, Gemma 2, Gemma 3)")
    cfg: dict[str, Any] = {"model_type": ARCHITECTURES[arch][0]}
    for key, hf_key in CONFIG_KEYS.items():
        value = _scalar(meta, f"{arch}.{key}", where)
        if value is not None:
            cfg[hf_key] = value
    layers = cfg.get("num_hidden_layers")
    if isinstance(layers, int) and layers > len(tensor_names):
        # Before any list of the layers is made: a block_count of 4e9 would fill memory.
        raise ValueError(f"{where}: metadata {arch}.block_count={layers}, but the file holds "
                         f"{len(tensor_names)} tensors; every layer needs some")
    if "vocab_size" not in cfg and isinstance(meta.get("tokenizer.ggml.tokens"), list):
        cfg["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
    if cfg["model_type"] != "qwen2":  # (Qwen2's q/k/v biases are its layout's own)
        # llama.cpp reads a Llama layer's biases where the file has them (transformers:
        # attention_bias for q, k, v and the output, mlp_bias for the MLP).
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        cfg["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    _refuse_what_attnlab_does_not_do(meta, arch, tensor_names, where)
    # llama.cpp reads a factor without a type as linear, and the older key too.
    factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))
    if meta.get(f"{arch}.rope.scaling.type", "linear") == "linear" and factor not in (None, 1.0):
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}  # (Gemma 3: global)
    heads = cfg.get("num_attention_heads")
    hidden = cfg.get("hidden_size")
    if heads and hidden:
        # Heads of their own width (attention.key_length, as llama.cpp writes Mistral
        # NeMo's 128 over 5120 / 32); values and the rotation span the same width.
        head_dim = _scalar(meta, f"{arch}.attention.key_length", where) or hidden // heads
        for key in ("rope.dimension_count", "attention.value_length"):
            value = _scalar(meta, f"{arch}.{key}", where)
            if value is not None and value != head_dim:
                raise ValueError(f"{where}: metadata {arch}.{key}={value} is not the "
                                 f"heads' width {head_dim}; not supported (attnlab rotates "
                                 "and attends over whole heads)")
        # Always given: llama.cpp's width is key_length, else n_embd / n_head, where
        # transformers' converters would take their own defaults (Qwen3's 128, Gemma's 256).
        cfg["head_dim"] = head_dim
        if arch.startswith("gemma"):
            _gemma(meta, arch, cfg, where)
    return cfg


def _gemma(meta: Mapping[str, Any], arch: str, cfg: dict[str, Any], where: str) -> None:
    """What Gemma 2 and 3 keep in keys of their own or in llama.cpp's code, as llama.cpp
    reads them: the sliding window (Gemma 2: 4096 where absent; Gemma 3 without one has
    no sliding layer), Gemma 2's softcaps (50 and 30 where absent), Gemma 3's local RoPE
    base (``rope.freq_base_swa``, else 10000) and global one (10000 where absent), and the
    query scale, 1/sqrt(head_dim) but 1/sqrt(hidden / heads) for the 27B models (a file
    has no query_pre_attn_scalar). A Gemma 2 output layer of its own is refused: llama.cpp
    ties it to the embedding."""
    for key, hf_key in (("attention.sliding_window", "sliding_window"),
                        ("attn_logit_softcapping", "attn_logit_softcapping"),
                        ("final_logit_softcapping", "final_logit_softcapping"),
                        ("rope.freq_base_swa", "rope_local_base_freq")):
        value = _scalar(meta, f"{arch}.{key}", where)
        if value is not None:
            cfg[hf_key] = value
    if arch == "gemma2":
        cfg.setdefault("sliding_window", 4096)
        if not cfg["tie_word_embeddings"]:
            raise ValueError(f"{where}: output.weight has no place in a gemma2 file "
                             "(llama.cpp ties Gemma 2's output layer to token_embd)")
    else:
        cfg.setdefault("rope_theta", 10000.0)
        if "sliding_window" not in cfg:
            cfg["layer_types"] = ["full_attention"] * cfg.get("num_hidden_layers", 0)
    big = cfg.get("num_hidden_layers") == {"gemma2": 46, "gemma3": 62}[arch]  # the 27Bs
    cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // cfg["num_attention_heads"] if big
                                    else cfg["head_dim"])


def rope_factors(file: GGUFFile, hf: dict[str, Any]) -> list[float]:
    """``rope_freqs.weight``'s factors, or a ValueError naming the file and what is wrong."""
    name, shape = "rope_freqs.weight", file.shape("rope_freqs.weight")
    heads, hidden = hf.get("num_attention_heads"), hf.get("hidden_size")
    half = (hf.get("head_dim") or (hidden // heads if heads and hidden else 0)) // 2
    why = None
    if hf["model_type"] != "llama":
        why = "is not read for this architecture (llama's only, as llama.cpp)"
    elif file.type_name(name) != "F32" or len(shape) != 1:
        why = "is not a 1-D F32 tensor"
    elif shape[0] != half:
        why = f"has {shape[0]} factors, expected one per RoPE frequency ({half})"
    elif "rope_scaling" in hf:
        why = "beside a linear scaling factor is not supported"
    if why is not None:
        raise ValueError(f"{file.name}: {name} {why}")
    return file.tensor(name).tolist()


def _refuse_what_attnlab_does_not_do(meta: Mapping[str, Any], arch: str,
                                     tensor_names, where: str) -> None:
    scaling = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if scaling not in (None, "none", "linear") and factor != 1.0:
        raise ValueError(f"{where}: {arch}.rope.scaling.type={scaling!r} is not supported "
                         "(attnlab scales RoPE linearly or by rope_freqs.weight)")
    if (_scalar(meta, f"{arch}.expert_count", where) or 0) > 0:
        raise ValueError(f"{where}: a mixture of experts ({arch}.expert_count="
                         f"{meta[f'{arch}.expert_count']}) is not supported")
