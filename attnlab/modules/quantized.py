"""Weight-only int8: :class:`Int8Linear` in place of ``nn.Linear``, and :func:`quantize`.

The scheme is llama.cpp's Q8_0 (:mod:`attnlab.layouts.int8`): symmetric, one float16
scale per block of 32 weights along each output's row, no zero point. Weights are held
once, in the layout of the native int8 products (``csrc/int8_product.h``): about 1.06
bytes a weight. The products multiply on the CPU's int8 dot product (``vpdpbusd``)
where it has one, with each row of ``x`` quantised on the fly per block of 32 the same
way (as llama.cpp's Q8_0 products do), and accumulate exactly in int32 within a block,
in float32 across blocks; elsewhere a portable loop computes the same integers and the
same bits. Off the CPU (or with gradients for ``x``), the weight is expanded to ``x``'s
dtype for the product.

As :mod:`.fused` does for float weights, the layers that multiply one input (q|k|v,
SwiGLU's gate|up) are quantised into one tensor, each layer's buffers a view of its
bands, so that one product serves them all (:func:`joint`). An embedding tied to a
quantised output layer becomes :class:`Int8Embedding`, reading its rows from that layer:
the table is stored once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import _native, _pages
from ..layouts import int8 as layout

__all__ = ["Int8Linear", "Int8Embedding", "quantize", "groups", "joint", "is_packed",
           "SCHEMES"]

SCHEMES = ("int8",)

Rows = Callable[[int, int], torch.Tensor]  # rows [a, b) of a float weight (out, in)
Source = Rows | tuple | layout.Q8Rows  # or a ready (data, scales) pair, or Q8_0 bytes


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with ``W (out_features, in_features)`` held as Q8_0 int8.

    Buffers ``data`` and ``scales`` hold the weight in the layout of
    :mod:`attnlab.layouts.int8`; ``bias`` is a float parameter (or None). The input may
    be float32 or bf16 (any leading shape); the output has its dtype. :meth:`dequantize`
    gives the float weight the int8 one stands for.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 device=None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        (dshape, sshape) = layout.shapes(out_features, in_features)
        self.register_buffer("data", torch.zeros(dshape, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.zeros(sshape, dtype=torch.int16, device=device))
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
                     if bias else None)

    @classmethod
    def of(cls, data: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
           in_features: int, out_features: int) -> Int8Linear:
        """A layer over existing tensors (views of a group's, a GGUF file's), not copied."""
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.out_features = in_features, out_features
        m.register_buffer("data", data)
        m.register_buffer("scales", scales)
        m.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        return m

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, scheme=Q8_0")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``(out_features, in_features)`` (a new tensor)."""
        return layout.dequantize(self.data, self.scales, self.out_features,
                                 self.in_features, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = joint(x, (self,))
        if out is not None:
            return out
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype).to(x.device), bias)


class Int8Embedding(nn.Module):
    """Token embeddings read from the rows of an :class:`Int8Linear` output layer ``(vocab,
    d_model)``: a tied model keeps one int8 table. The table is that layer's (not a
    submodule here: it is saved and moved with the output layer); rows come out in
    ``dtype``."""

    def __init__(self, table: Int8Linear, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        object.__setattr__(self, "table", table)
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.dtype = dtype

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tied to an Int8Linear"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.table
        if ids.dtype not in (torch.int64, torch.int32):  # as nn.Embedding takes them
            raise TypeError(f"ids must be an int64 or int32 tensor, got {ids.dtype}")
        ops = _native.load() if t.data.device.type == ids.device.type == "cpu" else None
        if ops is not None:  # one native call: a decoded token's row, ten ATen ops fewer
            rows = ops.int8_rows(t.data, t.scales, ids.long(), t.out_features, t.in_features)
            return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)
        bands, width = t.data.shape
        blocks = width // (layout.BLOCK * layout.BAND)
        flat = ids.reshape(-1)
        band, lane = flat // layout.BAND, flat % layout.BAND
        q = t.data.view(bands, blocks, 8, layout.BAND, 4)[band, :, :, lane, :]
        q = (q ^ 0x80).view(torch.int8).reshape(flat.numel(), blocks, layout.BLOCK)
        d = t.scales.view(bands, blocks, layout.BAND)[band, :, lane].view(torch.float16)
        rows = (q.to(torch.float32) * d.to(torch.float32)[..., None]).reshape(flat.numel(), -1)
        return rows[:, :self.embedding_dim].to(self.dtype).view(*ids.shape, self.embedding_dim)


def is_packed(layers: Sequence[Int8Linear]) -> bool:
    """Whether the layers' buffers (and biases) lie side by side in one tensor each, as
    :func:`quantize` leaves a group, so that one product serves them all (every layer but
    the last a whole number of bands)."""
    # (the tensors read off the modules' dicts: through nn.Module.__getattr__ this check
    # took 1.5 ms of each decoding plan at SmolLM-135M's 121 products)
    d0, s0, b0 = _tensors_of(layers[0])
    at = 0
    for i, m in enumerate(layers):
        data, scales, bias = _tensors_of(m)
        if not (bias is None or isinstance(bias, torch.Tensor)):
            return False  # (a module as the bias: it runs as the layer's own forward says)
        if (data.shape[1] != d0.shape[1] or scales.shape[1] != s0.shape[1]
                or m.in_features != layers[0].in_features
                or (i + 1 < len(layers) and m.out_features % layout.BAND)
                or data.data_ptr() != d0.data_ptr() + at * d0.shape[1]
                or scales.data_ptr() != s0.data_ptr() + at * s0.shape[1] * 2
                or (bias is None) != (b0 is None)
                or (b0 is not None and (bias.dtype != b0.dtype or bias.data_ptr()
                                        != b0.data_ptr() + at * layout.BAND * b0.element_size()))):
            return False
        at += data.shape[0]
    return True


def _tensors_of(m: Int8Linear) -> tuple[torch.Tensor, torch.Tensor, object]:
    """``(m.data, m.scales, m.bias)``, read off the module's own dicts in the order in which
    ``m.bias`` finds them: the instance's (a plain tensor, or None), then its parameters,
    buffers and submodules (a bias registered as a buffer is one)."""
    bias = m.__dict__.get("bias")
    if "bias" not in m.__dict__:
        for store in (m._parameters, m._buffers, m._modules):
            if "bias" in store:
                bias = store["bias"]
                break
    return m._buffers["data"], m._buffers["scales"], bias


def _joint_tensors(layers: Sequence[Int8Linear]):
    """(data, scales, bias, out_features) of a packed group as whole tensors."""
    d0, s0, b0 = _tensors_of(layers[0])
    bands = sum(m._buffers["data"].shape[0] for m in layers)
    out = sum(m.out_features for m in layers)
    data = d0.as_strided((bands, d0.shape[1]), (d0.shape[1], 1))
    scales = s0.as_strided((bands, s0.shape[1]), (s0.shape[1], 1))
    bias = None if b0 is None else b0.as_strided((out,), (1,))
    return data, scales, bias, out


def joint(x: torch.Tensor, layers: Sequence[Int8Linear]) -> torch.Tensor | None:
    """All outputs side by side ``(..., sum of out_features)`` from one native product over
    a packed group, in ``x``'s dtype; None where it cannot run here (no kernel, another
    device or dtype, gradients wanted for ``x``, a group not packed)."""
    if x.requires_grad and torch.is_grad_enabled():
        return None
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        return None
    if not is_packed(layers):  # (one layer too: its bias must be a tensor or None)
        return None
    if layers[0].data.device.type != "cpu":
        return None
    ops = _native.load()
    if ops is None:
        return None
    data, scales, bias, out = _joint_tensors(layers)
    return ops.int8_linear(x.contiguous(), data, scales, out, bias, None)


def tensors(layers: Sequence[Int8Linear]):
    """``(data, scales, bias, out_features)`` of a group :func:`is_packed` accepts."""
    return _joint_tensors(layers)


# ---------------------------------------------------------------------- quantizing


def groups(model: nn.Module) -> list[list[tuple[str, nn.Linear]]]:
    """The model's ``nn.Linear`` layers in the groups that multiply one input (each
    module's ``product_groups``: q|k|v, gate|up), in module order, each with its name;
    every other layer a group of one."""
    names = {id(m): name for name, m in model.named_modules() if type(m) is nn.Linear}
    out, seen = [], set()
    for _, module in model.named_modules():
        for group in getattr(module, "product_groups", ()):
            group = [module._modules.get(n) for n in group]
            if all(id(m) in names and id(m) not in seen for m in group):
                out.append([(names[id(m)], m) for m in group])
                seen.update(id(m) for m in group)
    for name, m in model.named_modules():
        if type(m) is nn.Linear and id(m) not in seen:
            out.append([(name, m)])
    return out


def _whole(linears: Sequence[nn.Linear]) -> bool:
    """Whether a group's layers share one data tensor: all but the last fill whole bands."""
    return all(m.out_features % layout.BAND == 0 for m in linears[:-1])


def _bands(linears: Sequence[nn.Linear]) -> tuple[list[int], int, int]:
    """Each layer's bands, and the widths of a band's data (bytes) and scales (int16)
    rows, for a group sharing one data and one scales tensor."""
    n_in = linears[0].in_features
    (_, width), (_, swidth) = layout.shapes(layout.BAND, n_in)
    return [layout.shapes(m.out_features, n_in)[0][0] for m in linears], width, swidth


def _group_bytes(linears: Sequence[nn.Linear]) -> list[int]:
    """The bytes of the data and scales tensors :func:`quantize_group` makes for a group."""
    if len(linears) > 1 and not _whole(linears):
        return [n for m in linears for n in _group_bytes([m])]
    bands, width, swidth = _bands(linears)
    return [sum(bands) * width, sum(bands) * swidth * torch.int16.itemsize]


def quantize_group(members: Sequence[tuple[str, nn.Linear]], model: nn.Module,
                   device=None) -> list[Int8Linear]:
    """Put an :class:`Int8Linear` in place of each ``(name, linear)`` of ``members``, its
    weight not yet filled (:func:`_fill`): one data and one scales tensor for the group
    (each layer's buffers views of its bands, every layer but the last a whole number of
    bands; else each gets its own), one bias vector where all have one."""
    linears = [m for _, m in members]
    n_in = linears[0].in_features
    if len(linears) > 1 and not _whole(linears):
        return [q for member in members for q in quantize_group([member], model, device)]
    bands, width, swidth = _bands(linears)
    data = _pages.empty((sum(bands), width), torch.uint8, device)  # streamed every token
    scales = _pages.empty((sum(bands), swidth), torch.int16, device)
    biases = [m._parameters.get("bias") for m in linears]
    joint_bias = all(b is not None for b in biases)
    bias_dtype = biases[0].dtype if biases[0] is not None else torch.float32
    bias = (torch.empty(sum(bands) * layout.BAND, dtype=bias_dtype, device=device)
            if joint_bias else None)
    out, at = [], 0
    for (name, m), nb in zip(members, bands):
        b = m._parameters.get("bias")
        view = None
        if b is not None:
            view = (bias[at * layout.BAND:at * layout.BAND + m.out_features] if joint_bias
                    else torch.empty(m.out_features, dtype=b.dtype, device=device))
            if not b.is_meta:  # (a model being loaded gets its biases by name after)
                with torch.no_grad():
                    view.copy_(b)
        q = Int8Linear.of(data[at:at + nb], scales[at:at + nb], view, n_in, m.out_features)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, q)
        out.append(q)
        at += nb
    return out


def _fill(q: Int8Linear, rows: Source, chunk: int = 256) -> None:
    """Quantise ``rows`` (the float weight, ``chunk`` rows at a time) into ``q``'s buffers,
    or copy a ready ``(data, scales)`` pair or a :class:`~attnlab.layouts.int8.Q8Rows`."""
    n = q.out_features
    if isinstance(rows, tuple):
        q.data.copy_(rows[0])
        q.scales.copy_(rows[1])
        return
    if isinstance(rows, layout.Q8Rows):  # bytes already Q8_0: moved a few bands at a time
        for a in range(0, n, rows.step):
            d, s = rows.bands(a, min(n, a + rows.step))
            q.data[a // layout.BAND:a // layout.BAND + d.shape[0]] = d
            q.scales[a // layout.BAND:a // layout.BAND + s.shape[0]] = s
        return
    ops = _native.load() if q.data.device.type == "cpu" else None
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        w = rows(a, b)
        if ops is not None and w.dtype in _native.PRODUCT_DTYPES:  # the same bits, faster
            ops.quantize_rows(w.contiguous(), q.data, q.scales, a, n)
            continue
        d, s = layout.to_bands(*layout.q8_0(w))
        q.data[a // layout.BAND:a // layout.BAND + d.shape[0]] = d
        q.scales[a // layout.BAND:a // layout.BAND + s.shape[0]] = s


def quantize(model: nn.Module, scheme: str = "int8",
             sources: Callable[[str], Source] | None = None,
             dtype: torch.dtype | None = None) -> nn.Module:
    """Quantise every ``nn.Linear`` of ``model`` in place to :class:`Int8Linear` (weight-only
    int8, llama.cpp's Q8_0 scheme), packed groups together; an ``nn.Embedding`` that shares
    a quantised layer's weight (a tied output layer) becomes an :class:`Int8Embedding` of
    it. Norms, biases and untied embeddings keep their dtype.

    ``sources`` (for loading): given a layer's name, the rows of its float weight (or a
    ready ``(data, scales)`` pair in the int8 layout, or a GGUF Q8_0 tensor's bytes as a
    :class:`~attnlab.layouts.int8.Q8Rows`); by default the layer's own weight.
    ``dtype``: the rows an :class:`Int8Embedding` gives (default: the embedding's).
    Returns ``model``.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"quantize must be one of {SCHEMES}, got {scheme!r}")
    tied: dict[int, Int8Linear] = {}
    filling = []
    # Every layer's buffers first, then their contents: the quantiser's temporaries, freed
    # last, leave no holes between the weights (an allocator keeps those).
    grouped = list(groups(model))
    sizes = [n for members in grouped for n in _group_bytes([m for _, m in members])]
    with _pages.arena(sizes):  # the int8 weights, streamed every token, on huge pages
        for members in grouped:
            weights = [m._parameters["weight"] for _, m in members]
            device = None if weights[0].is_meta else weights[0].device
            for (name, _), w, q in zip(members, weights,
                                       quantize_group(members, model, device)):
                tied[id(w)] = q
                filling.append((q, name, w))
    for q, name, w in filling:
        _fill(q, sources(name) if sources is not None
              else (lambda a, b, w=w: w.detach()[a:b]))
    for name, m in list(model.named_modules()):
        if type(m) is nn.Embedding and id(m._parameters["weight"]) in tied:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr,
                    Int8Embedding(tied[id(m.weight)], dtype or m.weight.dtype))
    return model
