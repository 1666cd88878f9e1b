"""GGUF files of the generate suite's models, written from the same safetensors folder the
other engines load, for llama.cpp (``llama-cpp-python``) to decode.

One file per (shape, precision), cached beside the folder's weights:

- ``f32``: every tensor float32;
- ``bf16`` / ``f16``: every matrix in that type, the rest float32;
- ``q8_0``: every matrix in llama.cpp's Q8_0 (blocks of 32 weights along a row, one
  float16 scale each: 34 bytes per 32 weights), the rest float32. A matrix whose rows
  do not split into blocks of 32 (tiny-llama's ``ffn_down``, rows of 688) is written in
  F16, as llama.cpp's own converter falls back.

What stays float32 whatever the precision, as llama.cpp's converter writes it: 1-D
tensors (norms, biases) and GPT-2's position embedding. Names come from the ``gguf``
package's own Hugging Face map; a Llama's q/k rows are permuted to llama.cpp's rotary
layout (its converter's ``permute``) and GPT-2's ``Conv1D`` weights, stored ``(in, out)``,
are transposed. The files hold no tokenizer (``tokenizer.ggml.model = "none"``, the
vocabulary size alone): the bench feeds token ids. A tied output layer is written once,
as the token embedding (llama.cpp reads it for both where ``output`` is absent).

Only writes. Reading GGUF into attnlab is the models' business, not the bench's.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

PRECISIONS = ("f32", "bf16", "f16", "q8_0")
# Bumped whenever what is written changes: the cached files carry it in their names.
FORMAT = 1
Q8_BLOCK = 32


def _types():
    import gguf

    T = gguf.GGMLQuantizationType
    return {"f32": T.F32, "bf16": T.BF16, "f16": T.F16, "q8_0": T.Q8_0}


def tensor_type(precision: str, gguf_name: str, shape: tuple[int, ...]):
    """The GGML type a tensor of ``shape`` (numpy order, ``(out, in)``) is stored in."""
    import gguf

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    T = gguf.GGMLQuantizationType
    if len(shape) < 2 or gguf_name.startswith("position_embd"):
        return T.F32
    if precision == "q8_0" and shape[-1] % Q8_BLOCK:
        return T.F16
    return _types()[precision]


def bytes_per_weight(precision: str, row_length: int) -> float:
    """Bytes a matrix weight takes at ``precision`` in these files (Q8_0's scales
    included), for rows of ``row_length`` weights: the one rule :func:`tensor_type` and
    the bandwidth bound share."""
    import gguf

    qtype = tensor_type(precision, "matrix", (1, row_length))
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return size / block


def path(folder: Path, precision: str) -> Path:
    """Where the ``precision`` GGUF of the model in ``folder`` is cached."""
    return Path(folder) / "peers" / f"model-{precision}-v{FORMAT}.gguf"


def ensure(folder: Path, precision: str) -> Path:
    """The ``precision`` GGUF of ``folder``'s model, written on first use (atomically: a
    unique temporary name in the same folder, then a rename)."""
    target = path(folder, precision)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, part = tempfile.mkstemp(prefix=target.name + "-", suffix=".part", dir=target.parent)
    os.close(fd)
    try:
        write(folder, part, precision)
        os.replace(part, target)
    finally:
        if os.path.exists(part):
            os.unlink(part)
    return target


def write(folder: Path, out: str | Path, precision: str) -> None:
    """Write the model of a ``save_pretrained`` folder (Llama or GPT-2) as GGUF."""
    import gguf
    from safetensors import safe_open

    config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    kind = config["model_type"]
    if kind not in ("llama", "gpt2"):
        raise ValueError(f"model_type must be 'llama' or 'gpt2', got {kind!r}")
    arch = gguf.MODEL_ARCH.LLAMA if kind == "llama" else gguf.MODEL_ARCH.GPT2
    layers = config["num_hidden_layers" if kind == "llama" else "n_layer"]
    names = gguf.get_tensor_name_map(arch, layers)
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    _metadata(writer, config, kind, precision)
    with safe_open(str(Path(folder) / "model.safetensors"), "np") as f:
        keys = f.keys()  # a list, not a dict view
        tensors = {k: f.get_tensor(k) for k in keys}
    for hf_name, data in tensors.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:  # buffers transformers saves that no engine reads
            continue
        data = _to_llama_cpp(hf_name, data.astype(np.float32), config, kind)
        _add(writer, name, data, precision)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with open(out, "rb+") as fh:
        os.fsync(fh.fileno())


def _add(writer, name: str, data: np.ndarray, precision: str) -> None:
    import gguf

    qtype = tensor_type(precision, name, data.shape)
    writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def _to_llama_cpp(hf_name: str, w: np.ndarray, config: dict, kind: str) -> np.ndarray:
    """The tensor as llama.cpp's converter hands it over (see the module docstring)."""
    if kind == "gpt2":
        if w.ndim == 2 and hf_name.endswith((".c_attn.weight", ".c_proj.weight",
                                             ".c_fc.weight")):
            return np.ascontiguousarray(w.T)
        return w
    heads = config["num_attention_heads"]
    if hf_name.endswith("q_proj.weight"):
        return _permute(w, heads)
    if hf_name.endswith("k_proj.weight"):
        return _permute(w, config.get("num_key_value_heads") or heads)
    return w


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Each head's rows from the half-split rotary order to llama.cpp's interleaved one."""
    return np.ascontiguousarray(
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)
        .reshape(w.shape))


def _metadata(writer, config: dict, kind: str, precision: str) -> None:
    import gguf

    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                 "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[precision]
    writer.add_name(f"attnlab bench {kind} ({precision})")
    writer.add_file_type(int(file_type))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_tokenizer_model("none")
    if kind == "gpt2":
        d = config["n_embd"]
        writer.add_context_length(config["n_positions"])
        writer.add_embedding_length(d)
        writer.add_feed_forward_length(config.get("n_inner") or 4 * d)
        writer.add_block_count(config["n_layer"])
        writer.add_head_count(config["n_head"])
        writer.add_layer_norm_eps(config["layer_norm_epsilon"])
        return
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
