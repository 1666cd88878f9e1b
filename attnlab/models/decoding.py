"""One decoded token through GPT blocks in native calls, and the check that a call may
stand in for a block's modules.

The check runs for every layer of every decoded token, between products that stream
megabytes of weights through the caches, so the Python doing it runs cold: a first
version that gathered a block's pieces through ``nn.Module`` attributes and checked
its packed layouts cost about 45 us a layer inside ``generate`` (SmolLM-135M: 1.4 of
15 ms a token). So it reads the pieces straight from ``_modules`` and
``_parameters``, checks only what Python must (types, hooks, flags), leaves the
tensors' checks to the kernel (dtypes, devices, shapes, that packed groups still sit
side by side in one block), and hands runs of consecutive blocks to the kernel in
one call (``_decode.layers``). Nothing is cached between tokens, so a piece replaced,
a hook added or a parameter moved is seen at the next token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .. import _decode
from ..cache import KVCache
from ..modules import MultiHeadAttention
from ..modules.layers import MLP, RMSNorm

_NORMS = {RMSNorm: "rmsnorm", nn.LayerNorm: "layernorm"}
# The linears of a block in the order of _decode.Layer.params (gate only for SwiGLU).
_ATTN_LINEARS = ("W_query", "W_key", "W_value", "out_proj")
_MLP_LINEARS = ("gate", "fc", "proj")


def run(blocks: Sequence[nn.Module], x: torch.Tensor, caches: Sequence[KVCache]) -> torch.Tensor:
    """``x (1, 1, d_model)`` through ``blocks`` for one new token: runs of blocks the
    kernel can take in one native call each, the others through their modules."""
    i = 0
    while i < len(blocks):
        ready = []
        while i + len(ready) < len(blocks):
            layer = _layer(blocks[i + len(ready)])
            if layer is None:
                break
            ready.append(layer)
        y = _decode.layers(x, ready, caches[i:i + len(ready)]) if ready else None
        if y is None:  # this block through its modules
            x, _ = blocks[i](x, None, caches[i], None, False)
            i += 1
        else:
            x = y
            i += len(ready)
    return x


def step(block: nn.Module, x: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
    """``block``'s output for one new token ``x (1, 1, d_model)`` with its cache, from
    one native call; None (nothing changed) where the modules must run instead."""
    layer = _layer(block)
    return None if layer is None else _decode.layers(x, [layer], [cache])


def _layer(block: nn.Module) -> _decode.Layer | None:
    """What ``_decode.layers`` needs of ``block`` now, or None where its modules must run:
    a piece the kernel does not know, a hook or ``qkv_hook`` that must see it run, a
    chosen backend, dropout in training."""
    mods = block._modules
    attn, mlp, norm1, norm2 = mods["attn"], mods["mlp"], mods["norm1"], mods["norm2"]
    if (type(attn) is not MultiHeadAttention or type(mlp) is not MLP
            or attn.qkv_hook is not None or attn.backend not in ("auto", "flash")
            or (block.training and (block.dropout or attn.dropout or attn.resid_dropout))):
        return None
    norm = _NORMS.get(type(norm1))
    if (norm is None or type(norm2) is not type(norm1) or norm1.eps != norm2.eps
            or len(norm1.normalized_shape) != 1):
        return None
    linears = [attn._modules[name] for name in _ATTN_LINEARS]
    linears += [mlp._modules.get(name) for name in _MLP_LINEARS]
    for m in linears:
        if m is not None and type(m) is not nn.Linear:
            return None
    for m in (block, attn, mlp, norm1, norm2, *linears):
        if m is not None and (m._forward_hooks or m._forward_pre_hooks):
            return None
    n1, n2 = norm1._parameters, norm2._parameters
    params = [n1["weight"], n1.get("bias"), n2["weight"], n2.get("bias")]
    for m in linears:
        if m is None:
            params += (None, None)
        else:
            p = m._parameters
            params += (p["weight"], p["bias"])
    eps = torch.finfo(torch.float32).eps if norm1.eps is None else norm1.eps
    return _decode.Layer(params, attn.rotary, attn.window, attn.num_heads, attn.num_kv_heads,
                         norm, eps, mlp.kind)
