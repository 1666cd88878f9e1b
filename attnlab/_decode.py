"""One decoding step of one attention layer in one native call (``csrc/decode.cpp``).

Decoding a single sequence reads every weight once per token; what is left is the
count of small operations per layer. Between the q|k|v product and the output
projection, :class:`~attnlab.modules.MultiHeadAttention` does about fifteen (split
heads, RoPE, cache append, attention, merge heads), each a few microseconds of
dispatch for 64 numbers per head. :func:`step` does them as one: the same math as
``rope.RotaryEmbedding.rotate``, ``KVCache.update`` and :func:`attnlab.attention`
(causal, end-aligned, sliding window), which stay the statement of it and the path
for everything else (gradients, masks, hooks, weights, other dtypes and devices).
"""

from __future__ import annotations

import math

import torch

from . import _native
from .cache import KVCache
from .rope import RotaryEmbedding


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
    cos = sin = None
    if rotary is not None:
        tables = rotary.tables(cache.seq_len + 1, qkv.device)
        if tables is None:
            return None
        cos, sin = tables
    pos = cache.reserve(1)
    # A window wider than the cache rules nothing out; capped, it stays a C long.
    window = 0 if window is None else min(window, pos + 1)
    try:
        return ops.decode_step(qkv, cos, sin, cache.k, cache.v, pos, window, num_heads,
                               num_kv_heads, 1.0 / math.sqrt(cache.head_dim))
    except BaseException:
        cache.crop(pos)
        raise
