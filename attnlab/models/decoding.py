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
_GATE = len(_ATTN_LINEARS)  # its index among the linears


def run(blocks: Sequence[nn.Module], x: torch.Tensor, caches: Sequence[KVCache],
        kind: type) -> torch.Tensor:
    """``x (1, 1, d_model)`` through ``blocks`` (each to be of type ``kind``, GPT's
    ``Block``) for one new token: runs of blocks the kernel takes in one native call
    each, the others through their modules."""
    i = 0
    while i < len(blocks):
        ready = []
        while i + len(ready) < len(blocks):
            layer = _layer(blocks[i + len(ready)], kind)
            if layer is None:
                break
            ready.append(layer)
        y = _decode.layers(x, ready, caches[i:i + len(ready)]) if ready else None
        if y is not None:
            x, i = y, i + len(ready)
            continue
        # Declined (a tensor the kernel does not take): those blocks one at a time.
        for layer in ready or [None]:
            y = None if layer is None else _decode.layers(x, [layer], [caches[i]])
            x = blocks[i](x, None, caches[i], None, False)[0] if y is None else y
            i += 1
    return x


def _layer(block: nn.Module, kind: type) -> _decode.Layer | None:
    """What ``_decode.layers`` needs of ``block`` now, or None where its modules must run:
    a block or piece the kernel does not know (a subclass, a ``forward`` of its own), a
    hook or ``qkv_hook`` that must see it run, a chosen backend, dropout in training
    (each module's own flag: ``attn.train()`` alone turns on attention dropout)."""
    if type(block) is not kind or "forward" in block.__dict__:
        return None
    mods = block._modules
    attn, mlp, norm1, norm2 = (mods.get(n) for n in ("attn", "mlp", "norm1", "norm2"))
    if (type(attn) is not MultiHeadAttention or type(mlp) is not MLP
            or attn.qkv_hook is not None or attn.backend not in ("auto", "flash")
            or (block.training and block.dropout)
            or (attn.training and (attn.dropout or attn.resid_dropout))):
        return None
    norm = _NORMS.get(type(norm1))
    if (norm is None or type(norm2) is not type(norm1) or norm1.eps != norm2.eps
            or len(norm1.normalized_shape) != 1):
        return None
    linears = [attn._modules.get(name) for name in _ATTN_LINEARS]
    linears += [mlp._modules.get(name) for name in _MLP_LINEARS]
    for i, m in enumerate(linears):  # only the gate may be absent (SwiGLU has one)
        if (m is None and i != _GATE) or (m is not None and type(m) is not nn.Linear):
            return None
    for m in (block, attn, mlp, norm1, norm2, *linears):
        if m is not None and (m._forward_hooks or m._forward_pre_hooks
                              or "forward" in m.__dict__):
            return None
    n1, n2 = norm1._parameters, norm2._parameters
    params = [n1.get("weight"), n1.get("bias"), n2.get("weight"), n2.get("bias")]
    for m in linears:  # the kernel checks every tensor, absent ones included
        p = {} if m is None else m._parameters
        params += (p.get("weight"), p.get("bias"))
    eps = torch.finfo(torch.float32).eps if norm1.eps is None else norm1.eps
    return _decode.Layer(params, attn.rotary, attn.window, attn.num_heads, attn.num_kv_heads,
                         norm, eps, mlp.kind)
