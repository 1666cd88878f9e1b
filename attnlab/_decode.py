"""Decoding one token in as few native calls as possible (``csrc/decode*.cpp``).

Decoding a single sequence reads every weight once per token; what is left is the
count of small operations per layer, each a few microseconds of dispatch for a
handful of numbers. Two fused steps, each standing aside (returning None, nothing
changed) where it cannot take the inputs, so that the modules run instead:

- :func:`step`, the attention of one layer: RoPE, cache append and attention over the
  cache in one call, between :class:`~attnlab.modules.MultiHeadAttention`'s q|k|v
  product and its output projection (about fifteen PyTorch ops otherwise);
- :class:`Run`, a run of whole pre-norm decoder layers (each a named
  :class:`DecoderLayer`, checked once when added) for one row: norms, streamed products
  (the residuals folded into them), the step above and the MLP, layer after layer, in
  one call (about forty Python-level calls a layer through the modules); with the
  model's head and token table, :meth:`Run.greedy` loops that call over a row's greedy
  tokens natively.

The math is that of ``rope.RotaryEmbedding.rotate``, ``KVCache.update``,
:func:`attnlab.attention` (causal, end-aligned, sliding window) and the modules,
which stay the statement of it and the path for everything else (gradients, masks,
hooks, weights, other dtypes and devices).

Precision: weights float32, bf16 or int8 (``modules.quantized``), caches float32 or
bf16; the attention and the row between layers are float32 whatever they are
(``csrc/decode_layers.cpp`` says why).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import _native
from .cache import KVCache
from .rope import RotaryEmbedding


@dataclass(frozen=True)
class DecoderLayer:
    """One pre-norm decoder layer, ``y = x + out(attend(qkv(norm1(x))))`` then
    ``y + down(act(up(norm2(y))))``, by name, as :class:`Run` hands it to the kernel.

    Weights are ``(out, in)`` float32 or bf16 and biases ``(out,)`` (None where a layer
    has none): ``qkv_weight`` the queries', keys' and values' products side by side
    (``(num_heads + 2 * num_kv_heads) * head_dim`` rows), ``up_weight`` the MLP's first
    product (SwiGLU/GeGLU: gate and up side by side, ``up_out`` outputs), ``down_weight``
    its second. An int8 product gives its data as the weight and its ``*_scales``
    (``layouts.int8``). ``norm`` and ``mlp`` are the names ``modules.layers`` gives the
    kinds ("rmsnorm", "rmsnorm_plus_one", "layernorm"; "gelu", "gelu_tanh", "relu",
    "swiglu", "geglu"); ``rotary`` the layer's RoPE or None; ``window`` its sliding window
    or None; ``scale``, ``softcap``, ``alibi_slopes`` and ``sinks`` as
    :func:`attnlab.attention` takes them; the post-norms (Gemma 2) norm each branch again
    before it is added, both or neither; the q/k norms (Qwen3, ``(head_dim,)``) norm each
    head's query and key before RoPE, both or neither, of the layer's norm kind and eps.
    """

    norm: str
    eps: float
    norm1_weight: torch.Tensor | None
    norm1_bias: torch.Tensor | None
    norm2_weight: torch.Tensor | None
    norm2_bias: torch.Tensor | None
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    out_weight: torch.Tensor
    out_bias: torch.Tensor | None
    mlp: str
    up_weight: torch.Tensor
    up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None
    rotary: RotaryEmbedding | None
    d_model: int
    up_out: int
    qkv_scales: torch.Tensor | None = None
    out_scales: torch.Tensor | None = None
    up_scales: torch.Tensor | None = None
    down_scales: torch.Tensor | None = None
    scale: float | None = None  # of the scores; None: 1 / sqrt(head_dim)
    softcap: float | None = None
    alibi_slopes: torch.Tensor | None = None  # (num_heads,)
    sinks: torch.Tensor | None = None  # (num_heads,)
    post_attn_norm_weight: torch.Tensor | None = None
    post_attn_norm_bias: torch.Tensor | None = None
    post_mlp_norm_weight: torch.Tensor | None = None
    post_mlp_norm_bias: torch.Tensor | None = None
    q_norm_weight: torch.Tensor | None = None
    q_norm_bias: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    k_norm_bias: torch.Tensor | None = None


def _reserved(caches: Sequence[KVCache], call, count: int = 1, filled=None):
    """Count ``count`` new positions in each cache (from ``starts``, one per cache) and
    run ``call(starts)``; each cache keeps the first ``filled(out)`` of them (default
    all) and gets the rest back, all of them when the call raises or declines with None."""
    starts = [cache.reserve(count) for cache in caches]
    out = None
    try:
        out = call(starts)
    finally:
        kept = 0 if out is None else count if filled is None else filled(out)
        if kept < count:
            for cache, start in zip(caches, starts):
                cache.crop(start + kept)
    return out


def _tables(rotary: RotaryEmbedding | None, cache: KVCache, device, ahead: int = 1):
    """(cos, sin) covering the next ``ahead`` positions, (None, None) without RoPE, or
    None beyond the tables RoPE keeps."""
    if rotary is None:
        return None, None
    return rotary.tables(cache.seq_len + ahead, device)


def step(qkv: torch.Tensor, cache: KVCache, rotary: RotaryEmbedding | None,
         window: int | None, num_heads: int, num_kv_heads: int, *,
         scale: float | None = None, softcap: float | None = None,
         alibi_slopes: torch.Tensor | None = None,
         sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """Attend from one new token, appending its key and value to ``cache``.

    Args:
        qkv: ``(B, 1, (num_heads + 2 * num_kv_heads) * head_dim)`` the new token's
            packed projection, float32 or bf16 on the CPU.
        cache: the layer's cache (float32 or bf16); the token takes position
            ``cache.seq_len``.
        rotary: the layer's RoPE, or None.
        window: sliding window W (the token sees its last W positions), or None.
        scale, softcap, alibi_slopes ``(num_heads,)``, sinks ``(num_heads,)``: as
            :func:`attnlab.attention` takes them (scale None: ``1 / sqrt(head_dim)``).

    Returns:
        ``(B, 1, num_heads * head_dim)`` (heads merged, ready for the output
        projection, in ``qkv``'s dtype), or None where the native kernel is unavailable
        or the inputs are not what it takes; the cache is then unchanged and the caller
        runs the PyTorch path.
    """
    ops = _native.for_inference(qkv, cache.k, cache.v, dtypes=_native.PRODUCT_DTYPES)
    if ops is None or cache.remaining < 1 or cache.k.dtype != cache.v.dtype:
        return None
    tables = _tables(rotary, cache, qkv.device)
    if tables is None:
        return None
    cos, sin = tables
    alibi, sink = (None if t is None else t.detach().to(torch.float64).reshape(-1).contiguous()
                   for t in (alibi_slopes, sinks))
    scale = 1.0 / math.sqrt(cache.head_dim) if scale is None else float(scale)
    out = _reserved([cache], lambda positions: ops.decode_step(
        qkv.float(), cos, sin, cache.k, cache.v, positions[0], _window(window, positions[0]),
        num_heads, num_kv_heads, scale, 0.0 if softcap is None else float(softcap), alibi,
        sink))
    return None if out is None else out.to(qkv.dtype)


class Run:
    """A run of consecutive decoder layers that the native step takes one decoded row
    through in one call (``csrc/decode_layers.cpp``'s ``DecoderRun``).

    :meth:`add` checks a layer once and keeps it; :meth:`__call__` then runs a token
    through every layer kept, the kernel checking only what changes per token (caches,
    positions, RoPE tables). A run holds the layers' tensors as they were added: one is
    built for as long as they stay so (``models.decoding.Decoder``)."""

    def __init__(self) -> None:
        ops = _native.load()
        if ops is None:
            raise RuntimeError(f"the native kernel is not available: "
                               f"{_native.unavailable_reason()}")
        self._native = getattr(torch.classes, _native.LIBRARY).DecoderRun()
        self.rotaries: list[RotaryEmbedding | None] = []
        self._tables: list[tuple | None] = []
        self.has_head = False  # set_head took the final norm and output layer

    def __len__(self) -> int:
        return len(self.rotaries)

    def add(self, layer: DecoderLayer) -> str | None:
        """Keep ``layer`` at the end of the run; or say why the kernel cannot take it
        (its dtype, device, shapes), keeping nothing."""
        fields = {f.name: getattr(layer, f.name) for f in dataclasses.fields(layer)}
        rotary, window = fields.pop("rotary"), fields.pop("window")
        scale, softcap = fields.pop("scale"), fields.pop("softcap")
        fields["alibi"], fields["sinks"] = (
            None if t is None else t.detach().to(torch.float64).contiguous()
            for t in (fields.pop("alibi_slopes"), fields.pop("sinks")))
        # A window wider than every cache rules nothing out; 2**62 keeps it a C long.
        why = self._native.add(**fields, window=0 if window is None else min(window, 2**62),
                               rope=rotary is not None,
                               scale=1.0 / math.sqrt(layer.head_dim) if scale is None else scale,
                               softcap=0.0 if softcap is None else softcap)
        if why:
            return why
        self.rotaries.append(rotary)
        self._tables.append(None)
        return None

    def set_head(self, norm: str, eps: float, norm_weight: torch.Tensor | None,
                 norm_bias: torch.Tensor | None, weight: torch.Tensor,
                 bias: torch.Tensor | None, scales: torch.Tensor | None, vocab: int) -> str | None:
        """After the last layer, the model's final norm (a kind and eps as
        :class:`DecoderLayer`'s, ``(d_model,)`` parameters) and output layer (``weight``
        ``(vocab, d_model)`` float32 or bf16, or int8 data with its ``scales``): the run
        then returns the logits. Or say why the kernel cannot take them, keeping nothing."""
        why = self._native.set_head(norm, eps, norm_weight, norm_bias, weight, bias, scales,
                                    vocab)
        self.has_head = not why
        return why or None

    def set_embedding(self, table: torch.Tensor, scales: torch.Tensor | None, vocab: int,
                      bf16_rows: bool) -> str | None:
        """After :meth:`set_head`, the model's token table for :meth:`greedy`, where its
        embedding is a plain row lookup: ``(vocab, d_model)`` float32 or bf16, or int8
        data with its ``scales`` (a table tied to an int8 output layer); ``bf16_rows``:
        each row rounded to bf16 (the model's activations). Or say why the kernel cannot
        take it, keeping nothing."""
        return self._native.set_embedding(table, scales, vocab, bf16_rows) or None

    def greedy(self, first: int, count: int, caches: Sequence[KVCache],
               stops: Sequence[int] = ()) -> list[int] | None:
        """Up to ``count`` greedy tokens after ``first`` in one native call: each token is
        embedded, run through the layers and the head (appending to ``caches``, batch
        size 1), and the first index of the largest logit is the next (a NaN counted as
        -inf, as ``generation.sample_next``); it ends after a token in ``stops``. Each
        cache keeps the positions of the tokens fed. None, every cache unchanged, where
        the kernel cannot take these inputs (no head or embedding, no room)."""
        if (len(caches) != len(self) or count < 1
                or any(cache.remaining < count for cache in caches)):
            return None
        tables = self._rope_tables(caches, torch.device("cpu"), ahead=count)
        if tables is None:
            return None
        tokens = _reserved(caches, lambda starts: self._native.greedy(
            first, count, list(stops), [c.k for c in caches], [c.v for c in caches], starts,
            *tables), count, filled=len)
        return None if tokens is None else tokens.tolist()

    def _rope_tables(self, caches: Sequence[KVCache], device,
                     ahead: int = 1) -> tuple[list, list] | None:
        """Per layer (cos, sin) covering each cache's next ``ahead`` positions ((None,
        None) without RoPE), fetched again only when a position goes past them; None
        where a position is beyond what RoPE keeps."""
        cos, sin = [], []
        for i, (rotary, cache) in enumerate(zip(self.rotaries, caches)):
            held = self._tables[i]
            if held is None or (held[0] is not None
                                and held[0].shape[0] < cache.seq_len + ahead):
                held = self._tables[i] = _tables(rotary, cache, device, ahead)
                if held is None:
                    return None
            cos.append(held[0])
            sin.append(held[1])
        return cos, sin

    def __call__(self, x: torch.Tensor, caches: Sequence[KVCache]) -> torch.Tensor | None:
        """One new token ``x (1, 1, d_model)`` (float32 or bf16, CPU) through the run, each layer
        appending to its cache (batch size 1). Returns ``(1, 1, d_model)`` in ``x``'s dtype
        (with a head, :meth:`set_head`: the logits ``(1, 1, vocab)`` float32), or None
        (every cache unchanged) where the kernel cannot take these inputs; the caller then
        runs the modules."""
        if len(caches) != len(self) or any(cache.remaining < 1 for cache in caches):
            return None
        tables = self._rope_tables(caches, x.device)
        if tables is None:
            return None
        return _reserved(caches, lambda positions: self._native.step(
            x, [c.k for c in caches], [c.v for c in caches], positions, tables[0], tables[1]))


def _window(window: int | None, pos: int) -> int:
    """The kernels' window for a token at ``pos``: 0 for none; one wider than the keys
    rules nothing out (``csrc/mask.h``), so it is capped and stays a C long."""
    return 0 if window is None else min(window, pos + 1)
