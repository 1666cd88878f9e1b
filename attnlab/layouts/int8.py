"""attnlab's int8 weights as plain data: llama.cpp's Q8_0 scheme, in the layout of the
native int8 products (``csrc/int8_product.h``).

The scheme (Q8_0): along each output's row of a weight ``W (out, in)``, every block of 32
weights shares one float16 scale ``d = max|w| / 127`` and holds ``q = round(w / d)`` in
``[-127, 127]``: symmetric, no zero point, ``w ~ d * q``. :func:`q8_0` computes it exactly
as the ``gguf`` package's reference (itself bit-exact with ``ggml-quants.c``): a float
weight quantised here equals the same weight in a Q8_0 GGUF file written by llama.cpp's
tools.

The layout (:func:`to_bands`): rows padded to whole blocks (zeros), outputs to whole
bands of 16, and each band stored as ``data (bands, blocks * 512)`` uint8, where band
``b``, block ``j``, group ``k`` (inputs ``4k .. 4k+3`` of the block), output ``o`` of the
band and input ``t`` of the group sit at ``[b, j * 512 + k * 64 + o * 4 + t]`` holding
``q + 128``, and ``scales (bands, blocks * 16)``, the float16 scales' bits as int16 at
``[b, j * 16 + o]`` (int16, so that ``model.to(dtype)`` leaves them alone). A Q8_0 tensor
of a GGUF file (blocks of a float16 scale then 32 int8) maps to it by moving bytes
(:func:`from_gguf_q8_0`): no float is computed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["BLOCK", "BAND", "q8_0", "to_bands", "from_bands", "dequantize", "quantize",
           "from_gguf_q8_0", "Q8Rows", "shapes", "nbytes"]

BLOCK = 32  # weights per scale, along a row (Q8_0's QK8_0)
BAND = 16  # outputs stored together for the vector products


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def shapes(out_features: int, in_features: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The shapes of ``(data, scales)`` of an ``(out, in)`` weight."""
    bands, blocks = _ceil(out_features, BAND), _ceil(in_features, BLOCK)
    return (bands, blocks * BLOCK * BAND), (bands, blocks * BAND)


def nbytes(out_features: int, in_features: int) -> int:
    """Bytes an ``(out, in)`` weight takes in this layout (padding included)."""
    (a, b), (c, d) = shapes(out_features, in_features)
    return a * b + 2 * c * d


def q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 of ``w (rows, in)`` (any float dtype): ``q (rows, in_padded)`` int8 and ``d
    (rows, blocks)`` float16, as the ``gguf`` package's ``Q8_0.quantize_blocks`` computes
    them (float32 maths, round half away from zero, ``1 / d`` before ``d`` is rounded to
    float16). ``in`` is padded with zeros to whole blocks."""
    rows, n = w.shape
    blocks = _ceil(n, BLOCK)
    x = torch.zeros(rows, blocks * BLOCK, dtype=torch.float32)
    x[:, :n] = w
    x = x.view(rows, blocks, BLOCK)
    d = x.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = x * inv
    a = v.abs()
    floor = a.floor()
    q = torch.sign(v) * (floor + (2 * (a - floor)).floor())
    return q.to(torch.int8).view(rows, blocks * BLOCK), d.squeeze(-1).to(torch.float16)


def to_bands(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scales)`` in the products' layout from ``q (out, blocks * 32)`` int8 and
    ``d (out, blocks)`` float16; outputs padded to whole bands (zero weights, zero
    scales)."""
    out, blocks = d.shape
    bands = _ceil(out, BAND)
    pad = bands * BAND - out
    if pad:
        q = torch.cat([q, q.new_zeros(pad, q.shape[1])])
        d = torch.cat([d, d.new_zeros(pad, blocks)])
    data = (q.view(torch.uint8) ^ 0x80).view(bands, BAND, blocks, 8, 4)
    data = data.permute(0, 2, 3, 1, 4).reshape(bands, blocks * BLOCK * BAND)
    scales = d.view(torch.int16).view(bands, BAND, blocks).transpose(1, 2)
    return data.contiguous(), scales.reshape(bands, blocks * BAND).contiguous()


def from_bands(data: torch.Tensor, scales: torch.Tensor,
               out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`to_bands`: ``q (out, blocks * 32)`` int8, ``d (out, blocks)``
    float16 (padding dropped)."""
    bands = data.shape[0]
    blocks = scales.shape[1] // BAND
    q = (data.view(bands, blocks, 8, BAND, 4) ^ 0x80).permute(0, 3, 1, 2, 4)
    q = q.reshape(bands * BAND, blocks * BLOCK)[:out_features].view(torch.int8)
    d = scales.view(bands, blocks, BAND).transpose(1, 2).reshape(bands * BAND, blocks)
    return q, d[:out_features].contiguous().view(torch.float16)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scales)`` of a float weight ``w (out, in)``: :func:`q8_0` then
    :func:`to_bands`, a few thousand rows at a time (never a float32 copy of all of
    ``w``)."""
    out, n = w.shape
    (bands, width), (_, swidth) = shapes(out, n)
    data = torch.empty(bands, width, dtype=torch.uint8)
    scales = torch.empty(bands, swidth, dtype=torch.int16)
    quantize_into(w, data, scales)
    return data, scales


def quantize_into(w: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
                  rows: int = 4096) -> None:
    """Fill ``data`` and ``scales`` (the shapes of :func:`shapes`) with the quantised
    ``w (out, in)``, ``rows`` rows (a multiple of 16) at a time."""
    out = w.shape[0]
    for a in range(0, out, rows):
        b = min(out, a + rows)
        d, s = to_bands(*q8_0(w[a:b]))
        data[a // BAND:a // BAND + d.shape[0]] = d
        scales[a // BAND:a // BAND + s.shape[0]] = s


def dequantize(data: torch.Tensor, scales: torch.Tensor, out_features: int,
               in_features: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``(out, in)`` that ``(data, scales)`` stand for: ``d * q``."""
    q, d = from_bands(data, scales, out_features)
    w = q.view(out_features, -1, BLOCK).to(torch.float32) * d.to(torch.float32)[..., None]
    return w.view(out_features, -1)[:, :in_features].to(dtype)


class Q8Rows:
    """A Q8_0 weight ``(out_features, in_features)`` taken a few bands at a time (a whole
    tensor's bytes converted at once cost four to five copies of it): ``raw(a, b)`` gives
    the GGUF bytes of rows ``[a, b)``, ``step`` (a multiple of :data:`BAND`) the rows of
    each call, :meth:`bands` their ``(data, scales)``."""

    def __init__(self, raw: Callable[[int, int], torch.Tensor], out_features: int,
                 in_features: int, step: int) -> None:
        if step <= 0 or step % BAND:
            raise ValueError(f"step must be a positive multiple of {BAND}, got {step}")
        self.raw, self.out_features, self.in_features, self.step = \
            raw, out_features, in_features, step

    def bands(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data, scales)`` of rows ``[a, b)`` (``a`` a multiple of :data:`BAND`), the
        last band padded."""
        return from_gguf_q8_0(self.raw(a, b), b - a, self.in_features)


def from_gguf_q8_0(raw: torch.Tensor, out_features: int,
                   in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scales)`` from a GGUF Q8_0 tensor's bytes ``raw`` (``out * blocks * 34``
    uint8: per block a float16 scale, then 32 int8), for an ``(out, in)`` weight with
    ``in`` a multiple of 32 (Q8_0 has no partial blocks): only bytes are moved."""
    if in_features % BLOCK:
        raise ValueError(f"in_features must be a multiple of {BLOCK} for Q8_0, got "
                         f"{in_features}")
    blocks = in_features // BLOCK
    raw = raw.reshape(out_features, blocks, 2 + BLOCK)
    d = raw[..., :2].contiguous().view(torch.float16).view(out_features, blocks)
    q = raw[..., 2:].contiguous().view(torch.int8).view(out_features, blocks * BLOCK)
    return to_bands(q, d)
