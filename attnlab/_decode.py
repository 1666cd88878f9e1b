"""Decoding one token in as few native calls as possible (``csrc/decode*.cpp``).

Decoding a single sequence reads every weight once per token; what is left is the
count of small operations per layer, each a few microseconds of dispatch for a
handful of numbers. Two fused steps, each standing aside (returning None, nothing
changed) where it cannot take the inputs, so that the modules run instead:

- :func:`step`, the attention of one layer: RoPE, cache append and attention over the
  cache in one call, between :class:`~attnlab.modules.MultiHeadAttention`'s q|k|v
  product and its output projection (about fifteen PyTorch ops otherwise);
- :func:`layers`, a run of whole pre-norm decoder layers for one row: norms,
  streamed products (the residuals folded into them), the step above and the MLP,
  layer after layer, in one call (about forty Python-level calls a layer through
  the modules).

The math is that of ``rope.RotaryEmbedding.rotate``, ``KVCache.update``,
:func:`attnlab.attention` (causal, end-aligned, sliding window) and the modules,
which stay the statement of it and the path for everything else (gradients, masks,
hooks, weights, other dtypes and devices).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from . import _native
from .cache import KVCache
from .rope import RotaryEmbedding

NORMS = ("rmsnorm", "layernorm")
MLPS = ("gelu", "gelu_tanh", "relu", "swiglu")


class Layer(NamedTuple):
    """One pre-norm decoder layer as :func:`layers` takes it.

    ``params``: the layer's 18 tensors in the order of ``decode_layers`` in
    ``csrc/decode_layers.cpp``, weight then bias of: norm1, norm2, W_query, W_key, W_value,
    out_proj, the MLP's gate (SwiGLU only), fc and proj; None where the layer has
    none. Q/K/V and gate/fc must be packed groups (``modules.fused.pack``): the kernel
    checks that they still lie side by side and multiplies each group at once.
    ``norm`` is one of :data:`NORMS`, ``mlp`` one of :data:`MLPS`.
    """

    params: Sequence[torch.Tensor | None]
    rotary: RotaryEmbedding | None
    window: int | None
    num_heads: int
    num_kv_heads: int
    norm: str
    eps: float
    mlp: str


def _reserved(caches: Sequence[KVCache], call):
    """Count one new position in each cache and run ``call(positions)``; every cache
    gets its position back when the call raises or declines with None."""
    positions = [cache.reserve(1) for cache in caches]
    try:
        out = call(positions)
    except BaseException:
        for cache, pos in zip(caches, positions):
            cache.crop(pos)
        raise
    if out is None:
        for cache, pos in zip(caches, positions):
            cache.crop(pos)
    return out


def _tables(rotary: RotaryEmbedding | None, cache: KVCache, device):
    """(cos, sin) for the new token's position, (None, None) without RoPE, or None
    beyond the tables RoPE keeps."""
    if rotary is None:
        return None, None
    return rotary.tables(cache.seq_len + 1, device)


def step(qkv: torch.Tensor, cache: KVCache, rotary: RotaryEmbedding | None,
         window: int | None, num_heads: int, num_kv_heads: int) -> torch.Tensor | None:
    """Attend from one new token, appending its key and value to ``cache``.

    Args:
        qkv: ``(B, 1, (num_heads + 2 * num_kv_heads) * head_dim)`` the new token's
            packed projection, float32 on the CPU.
        cache: the layer's cache; the token takes position ``cache.seq_len``.
        rotary: the layer's RoPE, or None.
        window: sliding window W (the token sees its last W positions), or None.

    Returns:
        ``(B, 1, num_heads * head_dim)`` (heads merged, ready for the output
        projection), or None where the native kernel is unavailable or the inputs
        are not what it takes; the cache is then unchanged and the caller runs the
        PyTorch path.
    """
    ops = _native.for_inference(qkv, cache.k)
    if ops is None or cache.remaining < 1:
        return None
    tables = _tables(rotary, cache, qkv.device)
    if tables is None:
        return None
    cos, sin = tables
    return _reserved([cache], lambda positions: ops.decode_step(
        qkv, cos, sin, cache.k, cache.v, positions[0], _window(window, positions[0]),
        num_heads, num_kv_heads, 1.0 / math.sqrt(cache.head_dim)))


class Run:
    """A run of consecutive layers as :func:`layers` passes them to the kernel: their
    parameters in one flat list and each setting in one list, built once for as long
    as the layers stay what they were (``models.decoding`` holds one for a whole
    ``generate`` call where nothing can change them), and each layer's RoPE tables,
    fetched again only when a position goes past them."""

    __slots__ = ("layers", "params", "heads", "kv_heads", "norms", "eps", "mlps", "tables")

    def __init__(self, layers: Sequence[Layer]) -> None:
        self.layers = tuple(layers)
        self.params = [p for layer in self.layers for p in layer.params]
        self.heads = [layer.num_heads for layer in self.layers]
        self.kv_heads = [layer.num_kv_heads for layer in self.layers]
        self.norms = [NORMS.index(layer.norm) for layer in self.layers]
        self.eps = [layer.eps for layer in self.layers]
        self.mlps = [MLPS.index(layer.mlp) for layer in self.layers]
        self.tables: list[tuple | None] = [None] * len(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def rope_tables(self, caches: Sequence[KVCache], device) -> tuple[list, list] | None:
        """Per layer (cos, sin) covering each cache's next position ((None, None) without
        RoPE), or None where a position is beyond what RoPE keeps."""
        cos, sin = [], []
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            held = self.tables[i]
            if held is None or (held[0] is not None and held[0].shape[0] <= cache.seq_len):
                held = self.tables[i] = _tables(layer.rotary, cache, device)
                if held is None:
                    return None
            cos.append(held[0])
            sin.append(held[1])
        return cos, sin


def layers(x: torch.Tensor, run: Run | Sequence[Layer],
           caches: Sequence[KVCache]) -> torch.Tensor | None:
    """One new token through a run of pre-norm decoder layers,
    ``y = x + attn(norm1(x))``, then ``y + mlp(norm2(y))``, layer after layer, each
    appending to its cache.

    Args:
        x: ``(1, 1, d_model)`` the token's hidden state, float32 on the CPU.
        run: the layers, in order (a :class:`Run` of them is reused as it is);
            caches: one per layer (batch size 1).

    Returns:
        ``(1, 1, d_model)``, or None (every cache unchanged) where the kernel cannot
        take these inputs; the caller then runs the modules.
    """
    ops = _native.for_inference(x)
    if ops is None:
        return None
    run = run if isinstance(run, Run) else Run(run)
    if any(cache.remaining < 1 for cache in caches):
        return None
    tables = run.rope_tables(caches, x.device)
    if tables is None:
        return None
    return _reserved(caches, lambda positions: ops.decode_layers(
        x, run.params, tables[0], tables[1], [c.k for c in caches], [c.v for c in caches],
        positions, [_window(layer.window, pos) for layer, pos in zip(run.layers, positions)],
        run.heads, run.kv_heads, [1.0 / math.sqrt(c.head_dim) for c in caches], run.norms,
        run.eps, run.mlps))


def _window(window: int | None, pos: int) -> int:
    """The kernels' window for a token at ``pos``: 0 for none; one wider than the cache
    rules nothing out, so it is capped and stays a C long."""
    return 0 if window is None else min(window, pos + 1)
