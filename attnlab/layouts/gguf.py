"""GGUF layouts (llama.cpp's names and keys) -> the Hugging Face layouts of :mod:`.hf`.

A GGUF file's metadata is its config under llama.cpp's key names, and its tensors carry
llama.cpp's names. Both are mapped here, as plain data, to what transformers' config and
state dict would hold (the metadata in :mod:`.gguf_meta`); from there
:func:`~.hf.llama_config` (and its relatives) and :func:`~.hf.llama_state` do the rest,
with their checks: a GGUF model is read exactly as the same model saved by transformers.
Architectures: ``llama`` (Llama 2 and 3, SmolLM, TinyLlama, and Mistral, which llama.cpp
writes as ``llama``), ``qwen2``, ``qwen3``, ``gemma2`` and ``gemma3`` (whose norms
llama.cpp stores as ``1 + weight`` and runs as plain RMSNorms, as attnlab then does).

One difference is undone: llama.cpp's converter permutes the rows of a Llama query and
key projection, per head, from the half-split rotary layout (transformers', attnlab's)
to the interleaved pairs its kernels use; :func:`unpermute_rows` puts them back.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..io.files import PathLike
from ..io.gguf import GGUFFile
from . import int8
from .common import Config, ShapeMismatch
from .gguf_meta import ARCHITECTURES, gguf_config, rope_factors
from .hf_llama import QWEN3_NAMES, llama_state

__all__ = ["gguf_layout", "gguf_config", "GGUFState", "unpermute_rows", "required_tensors",
           "ARCHITECTURES", "PRECISIONS", "file_precision"]

# llama.cpp's tensor names -> transformers'
TENSOR_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",  # Qwen3's
}
QK_NORMS = ("attn_q_norm", "attn_k_norm")
POST_NORMS = ("post_attention_norm", "post_ffw_norm")  # Gemma's, after each branch
# Gemma's names where they are not Llama's (its norm before the MLP is "pre").
GEMMA_LAYER_NAMES = {**LAYER_TENSOR_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                     "post_attention_norm": "post_attention_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}


def hf_name(name: str, gemma: bool = False) -> str | None:
    """transformers' name of llama.cpp's tensor ``name`` (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``; ``gemma``: Gemma's names), None for a name
    this map lacks."""
    layer_names = GEMMA_LAYER_NAMES if gemma else LAYER_TENSOR_NAMES
    base, dot, kind = name.rpartition(".")
    if not dot or kind not in ("weight", "bias"):
        return None
    if base in TENSOR_NAMES:
        return f"{TENSOR_NAMES[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() \
            and parts[2] in layer_names:
        return f"model.layers.{int(parts[1])}.{layer_names[parts[2]]}.{kind}"
    return None


def llama_name(hf: str) -> str | None:
    """attnlab's name of transformers' Llama tensor ``hf`` (``model.layers.3.mlp.up_proj
    .weight`` -> ``blocks.3.mlp.fc.weight``), as :func:`llama_state` maps it; None for
    one it does not."""
    base = hf.removeprefix("model.")
    if base in ("embed_tokens.weight", "norm.weight"):
        return {"embed_tokens.weight": "tok_emb.weight", "norm.weight": "norm.weight"}[base]
    if base == "lm_head.weight":
        return base
    parts = base.split(".")
    if len(parts) >= 4 and parts[0] == "layers" and parts[1].isdigit():
        module = ".".join(parts[2:-1])
        if module in QWEN3_NAMES:  # (Llama's and Qwen3's head norms)
            return f"blocks.{parts[1]}.{QWEN3_NAMES[module]}.{parts[-1]}"
    return None


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of a query/key projection of ``heads`` heads.

    ``w``: ``(heads * head_dim, ...)`` (a weight ``(out, in)`` or a bias ``(out,)``).
    llama.cpp reorders each head's rows from ``[x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}]``
    (rotate_half pairs row i with row i + d/2) to ``[x_0, y_0, x_1, y_1, ...]``; this
    is the inverse: per head, ``(d/2, 2)`` rows read as ``(2, d/2)``.
    """
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def required_tensors(cfg: Config) -> list[str]:
    """llama.cpp's names of the tensors a GPT of ``cfg`` (``GPTConfig`` values) reads."""
    names = ["token_embd.weight", "output_norm.weight"]
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "factors":
        names.append("rope_freqs.weight")  # (Llama 3.1's: read into the config)
    names += [] if cfg["tie_embeddings"] else ["output.weight"]
    biased = {"attn_q": cfg["qkv_bias"], "attn_k": cfg["qkv_bias"], "attn_v": cfg["qkv_bias"],
              "attn_output": cfg["out_bias"], "ffn_gate": cfg["mlp_bias"],
              "ffn_up": cfg["mlp_bias"], "ffn_down": cfg["mlp_bias"]}
    for i in range(cfg["num_layers"]):
        for short in (*LAYER_TENSOR_NAMES, *POST_NORMS):
            if short in QK_NORMS and not cfg.get("qk_norm") or \
                    short in POST_NORMS and not cfg.get("post_norms"):
                continue
            names.append(f"blk.{i}.{short}.weight")
            if biased.get(short):
                names.append(f"blk.{i}.{short}.bias")
    return names


def check_tensor_names(names, cfg: Config, where: str) -> None:
    """A ValueError naming the first tensor the config needs and the file lacks, or the
    file holds and the config has no place for (a bias it does not have, a layer past
    its count), from the names alone."""
    want = required_tensors(cfg)
    missing = [n for n in want if n not in names]
    extra = sorted(set(names) - set(want))
    if missing:
        raise ValueError(f"{where}: tensor {missing[0]!r} is missing" + (
            f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + f"; the config ({cfg['num_layers']} layers) needs it")
    if extra:
        raise ValueError(f"{where}: tensor {extra[0]!r} has no place in the model its "
                         f"metadata describes ({cfg['num_layers']} layers)"
                         + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))


# What a GGUF model's weights are held in (``precision`` of :class:`GGUFState`).
PRECISIONS = ("float32", "bfloat16", "int8")


def file_precision(file: GGUFFile) -> str:
    """The precision that keeps what the file's matrices hold: ``"int8"`` where any is
    Q8_0 (attnlab's int8 is that scheme), ``"bfloat16"`` where they are BF16 or F16 (and
    F32), ``"float32"`` otherwise (F32, and the 4- to 6-bit types, which attnlab
    expands)."""
    kinds = {file.type_name(n) for n in file.tensors if len(file.shape(n)) == 2}
    if "Q8_0" in kinds:
        return "int8"
    if kinds & {"BF16", "F16"} and kinds <= {"BF16", "F16", "F32"}:
        return "bfloat16"
    return "float32"


class GGUFState(Mapping):
    """The tensors of a :class:`~attnlab.io.gguf.GGUFFile` under transformers' names, read
    when looked up (one at a time, never kept here) in ``precision``:

    - ``"float32"``: every tensor dequantised to float32;
    - ``"bfloat16"``: matrices in bf16 (BF16 as stored, F16 rounded), vectors float32;
    - ``"int8"``: vectors float32; a linear layer's weight (every matrix but an embedding
      that is not also the output layer) is a meta placeholder of its shape, its int8
      weight given by :meth:`int8` (a Q8_0 tensor's bytes moved into attnlab's layout,
      another type's rows to quantise).

    ``shapes()`` gives every shape from the file's header without reading a tensor, as
    :class:`~attnlab.io.weights.SafetensorsState` does, so shapes are checked against the
    config before anything is allocated. ``permuted``: undo llama.cpp's q/k row order.
    """

    def __init__(self, file: GGUFFile, *, permuted: bool = False, heads: int = 1,
                 kv_heads: int = 1, precision: str = "float32", gemma: bool = False) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self._file = file
        self._names = {hf_name(n, gemma): n for n in file.tensors}
        self._names.pop(None, None)
        self._heads = {"q_proj": heads, "k_proj": kv_heads} if permuted else {}
        self.precision = precision
        # An embedding stays float where the file has its own output layer.
        self._table = "lm_head.weight" not in self._names

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {hf: (self._file.shape(n), torch.float32) for hf, n in self._names.items()}

    def held_int8(self, key: str) -> bool:
        """Whether ``key`` is a weight an int8 model holds as int8."""
        return (len(self._file.shape(self._names[key])) == 2
                and (self._table or not key.endswith("embed_tokens.weight")))

    def _rows(self, key: str, w: torch.Tensor) -> torch.Tensor:
        proj = key.rsplit(".", 2)[-2]
        return unpermute_rows(w, self._heads[proj]) if proj in self._heads else w

    def __getitem__(self, key: str) -> torch.Tensor:
        name = self._names[key]
        shape = self._file.shape(name)
        if self.precision == "int8" and self.held_int8(key):
            return torch.empty(shape, device="meta")  # its weight comes from int8()
        if self.precision == "bfloat16" and len(shape) == 2:
            return self._rows(key, self._file.bf16(name))
        return self._rows(key, self._file.tensor(name))

    def int8(self, key: str):
        """The int8 weight of ``key`` (an ``"int8"`` state's linear weight): a Q8_0 tensor
        as a :class:`~attnlab.layouts.int8.Q8Rows` (its bytes only moved into that
        layout, a few bands at a time); another type as a function of rows ``[a, b)`` of
        its float weight."""
        name = self._names[key]
        out, n = self._file.shape(name)
        if self._file.type_name(name) == "Q8_0":
            # Whole heads a chunk (llama.cpp permuted each head's rows) and whole bands.
            heads = self._heads.get(key.rsplit(".", 2)[-2])
            head_rows = out // heads if heads else 1
            unit = math.lcm(int8.BAND, head_rows)
            step = unit * max(1, 256 // unit)

            def raw(a: int, b: int) -> torch.Tensor:
                rows = self._file.raw_rows(name, a, b)
                return unpermute_rows(rows, (b - a) // head_rows) if heads else rows
            return int8.Q8Rows(raw, out, n, step)
        w = self._rows(key, self._file.tensor(name))
        return lambda a, b: w[a:b]

    def __contains__(self, key: object) -> bool:  # Mapping's would read the tensor
        return key in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def gguf_layout(source: PathLike | GGUFFile, precision: str | None = "float32"
                ) -> tuple[Config, dict[str, torch.Tensor], str, dict[str, Any]]:
    """``(GPTConfig values, attnlab state dict, source name, int8 weights)`` of a GGUF
    file (a path or an open :class:`~attnlab.io.gguf.GGUFFile`), its tensors in
    ``precision`` (:data:`PRECISIONS`; None: :func:`file_precision`'s, the file's own).

    The int8 weights are empty unless the precision is ``"int8"``: then they map the
    state's name of each linear weight (a meta placeholder in the state) to a function
    giving its :meth:`GGUFState.int8`, to call when that layer is filled.

    Checked before any tensor is dequantised: the architecture and the options of its
    metadata, the tensors' names (each one the config needs, none it has no place for),
    every tensor's type (the quantisation types attnlab reads) and shape (from the config,
    as for a transformers folder). Every failure is one ValueError naming
    the file.
    """
    file = source if isinstance(source, GGUFFile) else GGUFFile(source)
    hf = gguf_config(file.metadata, file.tensors, file.name)
    arch = file.metadata["general.architecture"]
    try:
        config = ARCHITECTURES[arch][1](hf)
    except ValueError as exc:
        raise ValueError(f"{file.name}: {exc}") from None
    if "rope_freqs.weight" in file.tensors:  # a divisor per RoPE frequency (Llama 3.1's)
        config["rope_scaling"] = {"rope_type": "factors", "factors": rope_factors(file, hf)}
    gemma = arch.startswith("gemma")
    if gemma:  # its norms stored as 1 + weight: plain RMSNorms, as llama.cpp runs them
        config["norm"] = "rmsnorm"
    check_tensor_names(file.tensors, config, file.name)
    _, _, permuted, names = ARCHITECTURES[arch]  # (an odd head_dim: refused by the config)
    file.check_types(file.tensors)
    state = GGUFState(file, permuted=permuted, heads=config["num_heads"],
                      kv_heads=config["num_kv_heads"], gemma=gemma,
                      precision=file_precision(file) if precision is None else precision)
    weights = {}
    if state.precision == "int8":
        weights = {llama_name(key): (lambda k: lambda: state.int8(k))(key)
                   for key in state if state.held_int8(key)}
    try:
        return config, llama_state(state, config, names), file.name, weights
    except ShapeMismatch as exc:
        raise ShapeMismatch(f"{file.name} does not fit the GPT: {exc}") from None
    except ValueError as exc:  # a tensor the layout needs and the file lacks
        raise ValueError(f"{file.name}: {exc}") from None
