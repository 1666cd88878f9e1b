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
one call (``_decode.layers``). Even so it is about 20 us a layer, cold (0.6 of
11 ms a token for SmolLM).

So the plan (which blocks the kernel takes, in which runs) is made for every token,
and a piece replaced, a hook added or a parameter moved is seen at the next one,
except inside :func:`held`: ``generate`` without a callback, on a model and a prompt
through which none of the user's Python can run until it returns (no hooks, no
forward of an instance's own, only attnlab's and torch's module classes, plain
tensors, no torch function or dispatch mode in force). There nothing in this thread
can change the blocks between the first token and the last, and the plan made at
the first token serves them all. The kernel still checks every tensor at every call.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from itertools import chain

import torch
from torch import nn

from .. import _decode
from ..cache import KVCache
from ..functional import may_decode
from ..modules import MultiHeadAttention, fused
from ..modules.layers import MLP, RMSNorm

_NORMS = {RMSNorm: "rmsnorm", nn.LayerNorm: "layernorm"}
# The linears of a block in the order of _decode.Layer.params (gate only for SwiGLU).
_ATTN_LINEARS = ("W_query", "W_key", "W_value", "out_proj")
_MLP_LINEARS = ("gate", "fc", "proj")
_GATE = len(_ATTN_LINEARS)  # its index among the linears
# Within held(): the plan of each sequence of blocks, made at its first token.
_HELD: ContextVar[dict | None] = ContextVar("attnlab_decoding_held", default=None)
_LIBRARY = ("attnlab.", "torch.nn.")

# A plan: (start, stop, run) for each stretch of blocks, run a _decode.Run where the
# kernel may take blocks[start:stop], None for one block that runs its modules.
Plan = list[tuple[int, int, "_decode.Run | None"]]


@contextmanager
def held(model: nn.Module, ids=None) -> Iterator[None]:
    """Within, each plan is made once and kept, where ``model`` and ``ids`` (the prompt
    given to ``generate``) run nothing of the user's (see the module's docstring);
    otherwise, and outside, one plan a token. (Another Python thread changing the
    model while ``generate`` runs is not seen: modules are not thread-safe anyway.)"""
    plain = ids is None or type(ids) in (torch.Tensor, list, tuple)
    token = _HELD.set({} if plain and not _modes_active() and _library_only(model) else None)
    try:
        yield
    finally:
        _HELD.reset(token)


def _modes_active() -> bool:
    """Whether a ``TorchFunctionMode`` or ``TorchDispatchMode`` (user code run on every
    op) is in force; True where torch no longer says."""
    try:
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    except ImportError:
        return True
    return bool(_get_current_function_mode_stack() or _get_current_dispatch_mode_stack())


def _library_only(model: nn.Module) -> bool:
    """Whether a forward of ``model`` runs only attnlab's and torch's code: no hooks
    (global, on any module, an attention's ``qkv_hook``), no instance's own ``forward``,
    every module of a class from attnlab or ``torch.nn``, every parameter and buffer a
    plain tensor."""
    if fused.global_forward_hooks():
        return False
    for m in model.modules():
        if (m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__
                or not type(m).__module__.startswith(_LIBRARY)
                or getattr(m, "qkv_hook", None) is not None):
            return False
    return all(type(t) in (torch.Tensor, nn.Parameter)
               for t in chain(model.parameters(), model.buffers()))


def run(blocks: nn.ModuleList, x: torch.Tensor, caches: Sequence[KVCache],
        kind: type) -> torch.Tensor:
    """``x (1, 1, d_model)`` through ``blocks`` (each to be of type ``kind``, GPT's
    ``Block``) for one new token: runs of blocks the kernel takes in one native call
    each, the others through their modules."""
    memo = _HELD.get()
    plan = None if memo is None else memo.get(blocks)
    if plan is None:
        plan = _plan(blocks, kind)
        if memo is not None:
            memo[blocks] = plan
    for start, stop, fused_run in plan:
        y = None if fused_run is None else _decode.layers(x, fused_run, caches[start:stop])
        if y is not None:
            x = y
            continue
        # Declined (a tensor the kernel does not take): those blocks one at a time.
        for i in range(start, stop):
            layer = None if fused_run is None else fused_run.layers[i - start]
            y = None if layer is None else _decode.layers(x, [layer], [caches[i]])
            x = blocks[i](x, None, caches[i], None, False)[0] if y is None else y
    return x


def _plan(blocks: Sequence[nn.Module], kind: type) -> Plan:
    """Which blocks the kernel may take now: runs of consecutive ones, one each."""
    plan: Plan = []
    ready: list[_decode.Layer] = []
    for i, block in enumerate(blocks):
        layer = _layer(block, kind)
        if layer is not None:
            ready.append(layer)
            continue
        if ready:
            plan.append((i - len(ready), i, _decode.Run(ready)))
            ready = []
        plan.append((i, i + 1, None))
    if ready:
        plan.append((len(blocks) - len(ready), len(blocks), _decode.Run(ready)))
    return plan


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
            or attn.qkv_hook is not None
            or not may_decode(attn.backend, dropout_p=attn.dropout if attn.training else 0.0)
            or (block.training and block.dropout)
            or (attn.training and attn.resid_dropout)):
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
