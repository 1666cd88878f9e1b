"""Weights held once, in the layout one-row products want.

Decoding one sequence, one token at a time, on a CPU is dominated by reading the
weights and by per-call overhead. Several projections of the same input (Q/K/V,
SwiGLU's gate/up) run as one product when their weights lie side by side, and the
layout decides how fast a product streams: MKL multiplies one row by a weight stored
``(in, out)`` (transposed, contiguous) 1.3x-1.9x faster than by ``nn.Linear``'s usual
``(out, in)`` rows (2-core EPYC, one thread), and the float32 tile kernel of prompts
reads ``(in, out)`` blocks in place.

So :func:`pack` stores a group of float32 ``nn.Linear`` weights as the column blocks
of one ``(in, sum of out)`` tensor, and each layer's ``weight`` stays an ordinary
``nn.Parameter`` of the usual shape ``(out, in)``: a transposed view of its block
(strides ``(1, sum of out)``), biases likewise slices of one vector. Two kinds are
packed by rows instead, as the row blocks of one ``(sum of out, in)`` tensor (each
weight a plain contiguous slice of it), :func:`by_rows`: bf16 weights, since the CPU's
bf16 dot product (``vdpbf16ps``) multiplies pairs of neighbouring inputs, which a row
holds side by side, and streams a row-packed weight 1.2x-1.5x faster than a
column-packed one (``csrc/dot_bf16.h``); and float32 groups of more than
:data:`COLUMNS_MAX_OUT` outputs (an output layer over a vocabulary) where the native
kernel runs, whose column product would pass over a partial sum too large for the core's
first cache once per input. Nothing is held twice. Names, shapes, ``state_dict``,
``load_state_dict`` (which copies into the views), optimizers, hooks and in-place edits
see plain ``nn.Linear`` layers; ``F.linear`` multiplies by a transposed view without
copying it. A layout that
was lost (``model.to(dtype)``, ``load_state_dict(assign=True)``, a replaced
parameter) is packed again by the next one-row call, which moves the weights
into a new block and frees the old tensors: again one copy.

:func:`joint` is the inference path: with gradients off it multiplies the rows by the
whole block at once: one row by the native kernel's streamed product
(``csrc/row_product.h``; else ``F.linear``), more (a batch being decoded, a prompt,
an encoder's batch) by its AVX-512 tile products where the CPU has them and the
weights are float32 (10-15% faster than MKL's ``addmm`` on the encoder's shapes,
one Zen 4 core; up to 16 rows times a float32 weight by rows by its rows loop, on any
CPU; bf16 weights on the bf16 dot product where the CPU has it); otherwise (bf16 weights
on many rows without it, or while a layer has forward hooks, which must see that layer
run) the layers run one by one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from .. import _native
from . import quantized

__all__ = ["pack", "pack_groups", "linears_to", "repack", "is_packed", "by_rows", "block",
           "joint", "apply", "split", "run", "takes", "dtype_device", "global_forward_hooks",
           "may_overwrite"]


def _offsets(linears: Sequence[nn.Linear]) -> list[int]:
    out, at = [], 0
    for m in linears:
        out.append(at)
        at += m._parameters["weight"].shape[0]
    return [*out, at]


# The most outputs a float32 group is packed by columns for. The one-row product over
# columns (csrc/row_product.h's axpys) adds each input's row into a partial sum of every
# output: up to here the sum (16 KB) stays in a Zen 4 core's 32 KB first-level cache, and
# that product ran as fast as over rows or up to 1.25x faster (576 and 4096 inputs);
# from 6144 outputs on, the sum passes through the second-level cache once per input and
# the product over rows ran 1.25x-1.5x faster (SmolLM-135M's output layer, 49152
# outputs: 5.7 against 7.9 ms, one thread). Smaller groups keep columns, which the
# float32 tile kernel of prompts reads in place (rows it first copies transposed).
# Where the native kernel is known not to run, columns at any width: MKL multiplies one row
# by that output layer in 5.9 ms by columns and 10.6 by rows (a float32 token 1.08-1.13x
# faster without the kernel, one Zen 4 core).
COLUMNS_MAX_OUT = 4096


def by_rows(dtype: torch.dtype, n_out: int) -> bool:
    """Whether :func:`pack` lays a group of ``n_out`` outputs (summed over its layers) of
    ``dtype`` out by rows, ``(sum of out, in)`` (bf16: what its dot product reads; float32
    past :data:`COLUMNS_MAX_OUT` outputs unless the native kernel is known not to run),
    rather than by columns, ``(in, sum of out)``. A group packed before the kernel was
    found missing (or switched off or on) is packed again by its next one-row product."""
    return dtype == torch.bfloat16 or (n_out > COLUMNS_MAX_OUT
                                        and not _native.known_unavailable())


def is_packed(linears: Sequence[nn.Linear]) -> bool:
    """Whether the weights (and biases) of ``linears`` are blocks of one tensor as
    :func:`pack` leaves them. Read from ``_parameters`` directly and with as few tensor
    calls as tell it: this runs for every decoded token, twice per layer."""
    w0 = linears[0]._parameters["weight"]
    b0 = linears[0]._parameters["bias"]
    n_in, es, dtype = w0.shape[1], w0.element_size(), w0.dtype
    total = sum(m._parameters["weight"].shape[0] for m in linears)
    rows = by_rows(dtype, total)
    ptr, bptr = w0.data_ptr(), None if b0 is None else b0.data_ptr()
    at = 0
    for m in linears:
        w, b = m._parameters["weight"], m._parameters["bias"]
        # Adjacent blocks of one (in, total) block, or of one (total, in) block by rows:
        # same dtype, those strides, each starting where the one before ended (a device
        # change moves them apart).
        if (w.dtype != dtype or w.shape[1] != n_in
                or w.stride() != ((n_in, 1) if rows else (1, total))
                or w.data_ptr() != ptr + at * (n_in if rows else 1) * es):
            return False
        if (b is None) != (b0 is None):
            return False
        if b is not None and (b.dtype != dtype or b.stride() != (1,)
                              or b.data_ptr() != bptr + at * es):
            return False
        at += w.shape[0]
    return True


def pack(linears: Sequence[nn.Linear]) -> None:
    """Move the weights of ``linears`` (same ``in_features``) into one ``(in, sum of out)``
    tensor (``(sum of out, in)`` where :func:`by_rows`) and make each layer's weight (and
    bias) a view of its block. The parameter objects stay the same (optimizers and ties
    keep them); the old tensors are freed unless something else holds them. Works on the
    meta device too."""
    if is_packed(linears):
        return
    ws = [m.weight for m in linears]
    offsets = _offsets(linears)
    total = offsets[-1]
    rows = by_rows(ws[0].dtype, total)
    # Normal tensors even under inference_mode (they are parameters from now on), unless
    # the parameters themselves were made there.
    with torch.inference_mode(ws[0].is_inference()), torch.no_grad():
        shape = (total, ws[0].shape[1]) if rows else (ws[0].shape[1], total)
        block = torch.empty(shape, dtype=ws[0].dtype, device=ws[0].device)
        for m, a, b in zip(linears, offsets, offsets[1:]):
            if rows:
                block[a:b].copy_(m.weight)
                m.weight.data = block[a:b]
            else:
                block[:, a:b].copy_(m.weight.t())
                m.weight.data = block[:, a:b].t()
        if all(m.bias is not None for m in linears):
            biases = torch.empty(total, dtype=ws[0].dtype, device=ws[0].device)
            for m, a, b in zip(linears, offsets, offsets[1:]):
                biases[a:b].copy_(m.bias)
                m.bias.data = biases[a:b]
        elif any(m.bias is not None for m in linears):  # not one vector: no joint bias
            for m in linears:
                if m.bias is not None:
                    m.bias.data = m.bias.detach().clone()


def dtype_device(linear: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype of a layer's weight and its device; float32 for int8 weights (their
    activations' dtype) on the device of their data."""
    w = linear._parameters.get("weight")
    if w is None and type(linear) is quantized.Int8Linear:
        return torch.float32, linear.data.device
    return w.dtype, w.device


def takes(dtype: torch.dtype, linear: nn.Module) -> bool:
    """Whether the layer multiplies rows of ``dtype``: its weight's dtype, or float32 and
    bf16 for float32, bf16 and int8 weights (each product converts the row)."""
    w = linear._parameters.get("weight")
    if w is None or w.dtype == dtype:
        return True
    return dtype in _native.PRODUCT_DTYPES and w.dtype in _native.PRODUCT_DTYPES


def pack_groups(module: nn.Module) -> None:
    """:func:`pack` each group of a module's ``product_groups`` (names of its layers that
    multiply one input, as one product: q|k|v, gate|up; or a layer alone)."""
    for names in module.product_groups:
        pack([module._modules[name] for name in names])


def linears_to(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Every ``nn.Linear`` of ``model`` (weight and bias) in ``dtype``, in place, each
    module's ``product_groups`` packed again; norms and embeddings, and so the
    activations, keep their dtype. Each product then reads its row in the weights' dtype
    (bf16: rounded as ``vdpbf16ps`` reads it), accumulates in float32 and gives the row's
    dtype (:func:`joint`, :func:`run`). Returns ``model``."""
    for m in model.modules():
        if type(m) is nn.Linear:
            m.to(dtype)
    for m in model.modules():
        if hasattr(m, "product_groups"):
            pack_groups(m)
    return model


def repack(model: nn.Module, dtype: torch.dtype) -> None:
    """Give ``model``'s floating parameters ``dtype`` and pack them as :func:`pack` packs
    that dtype: every module's ``product_groups``, and each other layer that was packed
    alone (the output layer). For a model built on the meta device, before its weights are
    allocated: they are then filled in the layout decoding reads, where a conversion after
    loading would move every group at the first decoded token (a transient copy of the
    largest, the tied output layer's 57 MB at SmolLM-135M's shape in bf16)."""
    grouped, groups = set(), []
    for m in model.modules():
        for names in getattr(m, "product_groups", ()):
            groups.append([m._modules[name] for name in names])
            grouped.update(id(layer) for layer in groups[-1])
    alone = [m for m in model.modules() if type(m) is nn.Linear and id(m) not in grouped
             and not m._parameters["weight"].is_contiguous()]
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = torch.empty(p.shape, dtype=dtype, device=p.device)
    for group in [*groups, *([m] for m in alone)]:
        pack(group)


def global_forward_hooks() -> bool:
    """Whether forward hooks registered for every module are in force: they must see
    each module run, so the fused inference paths stand aside."""
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks)


# Modules whose forward returns a new tensor, never one it keeps: attnlab's own and the
# plain torch layers its blocks are built from. (A module that returns a tensor it
# holds, as activation patching does, cannot be told from one that returns a new one.)
_FRESH_OUTPUT = (nn.Linear, nn.LayerNorm, nn.RMSNorm, nn.Embedding, nn.Dropout, nn.Identity,
                 nn.ModuleList)


def _as_built(m: nn.Module) -> bool:
    """``m`` runs attnlab's code as it stands: a type of :data:`_FRESH_OUTPUT` or of
    attnlab, no forward hook or pre-hook, no forward of its own put on the instance (as
    accelerate's hooks and capture wrappers do)."""
    return (not m._forward_hooks and not m._forward_pre_hooks and "forward" not in m.__dict__
            and (type(m) in _FRESH_OUTPUT or type(m).__module__.startswith("attnlab.")))


def may_overwrite(module: nn.Module, out: torch.Tensor, *inputs: torch.Tensor) -> bool:
    """Whether ``module`` may reuse the memory of ``out``, a result of its own
    submodules, for its next result (an activation in place, a residual sum into a
    branch). Only where nothing else can hold ``out``: autograd recorded none of the
    tensors, ``out`` shares no memory with ``inputs`` (a submodule that returned its
    input, such as ``nn.Identity``), no hook is registered for every module, and the
    module and each submodule run as attnlab built them (:func:`_as_built`: a hook, a
    wrapper or a user's own module might keep what it returned). Reusing ``out`` spares
    an allocation of its size: on the encoder, each was one more buffer to page-fault
    whenever malloc had handed the last one back to the system."""
    if (torch.is_grad_enabled() and any(t.requires_grad for t in (out, *inputs))) \
            or torch.compiler.is_compiling():  # storage pointers are not traced
        return False
    memory = out.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() == memory for t in inputs):
        return False
    return not global_forward_hooks() and all(_as_built(m) for m in module.modules())


def block(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The whole packed weight as an ``(sum of out, in)`` view, and the joint bias
    (None without biases); only for ``linears`` that :func:`is_packed` accepts. The
    layout is read from the first weight's strides, not asked of :func:`by_rows` again."""
    w0, b0 = linears[0]._parameters["weight"], linears[0]._parameters["bias"]
    total = sum(m._parameters["weight"].shape[0] for m in linears)
    if w0.stride() == (w0.shape[1], 1):  # by rows (or one column: the same memory)
        weight = w0.as_strided((total, w0.shape[1]), (w0.shape[1], 1))
    else:
        weight = w0.as_strided((total, w0.shape[1]), (1, total))
    bias = None if b0 is None else b0.as_strided((total,), (1,))
    return weight, bias


def joint(x: torch.Tensor, linears: Sequence[nn.Linear]) -> torch.Tensor | None:
    """All outputs side by side ``(..., sum of out_features)`` from one product over the
    packed block, for inference (one row, a batch being decoded, a prompt, an encoder's
    batch); or None where the layers should run one by one: with gradients, with hooks on a
    layer, for more than one row where the native products do not take them (a CPU
    without AVX-512, past 16 rows for float32 weights by rows and for any by columns, or
    bf16 weights on one without the bf16 dot product: BLAS multiplies a packed block
    slower than each layer's own weight).

    The weights may be float32 or bf16 (one row by the native streamed product either
    way), or int8 (:class:`~.quantized.Int8Linear` layers, by the native int8 product);
    ``x`` may have another float dtype than the weights: the result has ``x``'s."""
    if torch.is_grad_enabled() or global_forward_hooks() or torch.compiler.is_compiling():
        return None  # (compiling: the packed layout is told by data pointers, not traced)
    for m in linears:  # a wrapped or parametrised layer, or one hooked: it runs itself
        if (m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__
                or type(m) is not type(linears[0])):
            return None
    if type(linears[0]) is quantized.Int8Linear:
        return quantized.joint(x, linears)
    if type(linears[0]) is not nn.Linear or any("weight" not in m._parameters for m in linears):
        return None
    one_row = math.prod(x.shape[:-1]) == 1
    ops = _native.for_inference(x, dtypes=_native.PRODUCT_DTYPES)
    if not one_row and ops is None:
        return None
    if not is_packed(linears):
        if any(m._parameters["bias"] is not None for m in linears) and not all(
                m._parameters["bias"] is not None for m in linears):
            return None
        pack(linears)  # the layout was lost (a dtype change, an assigned parameter)
    weight, bias = block(linears)
    if ops is not None and weight.dtype in _native.PRODUCT_DTYPES:
        # One row streamed as fast as memory allows, more by the tile kernel.
        out = ops.linear(x.contiguous(), weight, bias, None)
        if out is not None:
            return out
    return _linear(x, weight, bias) if one_row else None


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` in the weight's dtype, the result in ``x``'s."""
    if x.dtype == weight.dtype:
        return F.linear(x, weight, bias)
    return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)


def run(x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """``linear(x)`` through the layer itself (its hooks see it), ``x`` given in the
    weight's dtype where they differ (a float32 row through bf16 weights) and the result
    returned in ``x``'s."""
    w = linear._parameters.get("weight") if type(linear) is nn.Linear else None
    if w is None or w.dtype == x.dtype or not x.is_floating_point():
        return linear(x)
    return linear(x.to(w.dtype)).to(x.dtype)


def apply(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``linear(x)``: by the packed inference product where :func:`joint` takes it,
    else by the layer itself (which its hooks then see)."""
    out = joint(x, (linear,))
    return run(x, linear) if out is None else out


def split(x: torch.Tensor, linears: Sequence[nn.Linear]) -> list[torch.Tensor]:
    """``[m(x) for m in linears]``, as one product for one row (see :func:`joint`)."""
    out = joint(x, linears)
    if out is None:
        return [run(x, m) for m in linears]
    return list(out.split_with_sizes([m.out_features for m in linears], dim=-1))
