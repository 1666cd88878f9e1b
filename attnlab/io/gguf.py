"""Reading a GGUF file (llama.cpp's format): its metadata and its tensors, dequantised.

The ``gguf`` package parses the file; this module decides what is read and how a bad
file is reported. The file is checked to be a regular file before anything maps it (a
FIFO would hang the mapping), and every read the parser makes is checked to lie inside
the file, so a damaged header (a count of 2**60 entries, a truncated tensor) is one
ValueError naming the file, never a hang or an IndexError. Pure I/O: what the names and
numbers mean for a model is :mod:`attnlab.layouts.gguf`.
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .files import CheckpointError, PathLike

__all__ = ["GGUFFile", "GGUFError", "dequantize", "SUPPORTED_TYPES", "is_gguf"]

MAGIC = b"GGUF"

# The tensor types attnlab reads (gguf's dequantisers; llama.cpp's usual model files).
# Others (the IQ and ternary types) are refused by name before anything is allocated.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K",
                   "Q3_K", "Q4_K", "Q5_K", "Q6_K")


class GGUFError(CheckpointError):
    """A GGUF file that cannot be read: damaged, truncated, or of a kind attnlab refuses."""


def is_gguf(path: PathLike) -> bool:
    """Whether ``path`` is a regular file that starts with the GGUF magic (never blocks)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


@functools.cache
def _reader_class():
    """gguf's reader over a plain array instead of a ``np.memmap``, every read bounds-checked.

    The reader slices its ``data`` once per value it parses (about 250,000 times for a
    49,152-token vocabulary); slicing a ``np.memmap`` costs ten times a plain array's,
    which made the header alone take 4 s. And a slice past the end of the data would be
    an empty array the parser then loops over (a damaged count), so a read that does not
    fit is refused here.
    """
    from gguf import GGUFReader

    class _Reader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count, size = int(count), np.dtype(dtype).itemsize
            if offset < 0 or count < 0 or offset + size * count > plain.shape[0]:
                raise GGUFError(f"ends early: {size * count} bytes wanted at byte {offset} "
                                f"of {plain.shape[0]} (truncated?)")
            arr = plain[offset:offset + size * count].view(dtype=dtype)
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    return _Reader


class GGUFFile:
    """The metadata and tensors of one GGUF file.

    ``metadata`` maps each key (``general.architecture``, ``llama.block_count``,
    ``tokenizer.ggml.tokens``...) to a Python value (str, int, float, bool, or a list);
    ``tensors`` maps each tensor name to gguf's record of it. Tensors are read (and
    dequantised) one at a time by :meth:`tensor`; the file stays mapped while this
    object lives.
    """

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path)
        self.name = repr(str(path))
        with self._open() as f:
            if f.read(4) != MAGIC:
                f.seek(0)
                raise GGUFError(f"{self.name} is not a GGUF file (it starts with "
                                f"{f.read(4)!r}, expected {MAGIC!r})")
            if os.fstat(f.fileno()).st_size < 24:
                raise GGUFError(f"{self.name} ends early: no room for a GGUF header "
                                "(truncated?)")
            f.seek(0)
            try:
                # The open file, not the path: what is mapped is the file checked above.
                self._reader = _reader_class()(f)
            except Exception as exc:  # the parser's IndexError, KeyError, ValueError...
                detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise GGUFError(f"{self.name} is not a valid GGUF file: {detail}") from None
        if self._reader.byte_order != "I":
            raise GGUFError(f"{self.name} is a big-endian GGUF file; attnlab reads "
                            "little-endian ones (what llama.cpp writes on x86 and ARM)")
        self.tensors = {t.name: t for t in self._reader.tensors}
        self.metadata = self._metadata()

    def _open(self):
        try:  # non-blocking: opening a FIFO without a writer returns at once
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise GGUFError(f"{self.name}: file not found") from None
        except OSError as exc:
            raise GGUFError(f"{self.name} cannot be read: {exc.strerror or exc}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise GGUFError(f"{self.name} is not a regular file; expected a GGUF file")
        return os.fdopen(fd, "rb")

    def _metadata(self) -> dict[str, Any]:
        out = {}
        for key, field in self._reader.fields.items():
            try:
                out[key] = field.contents()
            except (UnicodeDecodeError, IndexError, ValueError) as exc:
                raise GGUFError(f"{self.name}: metadata {key!r} cannot be read: "
                                f"{exc}") from None
        return out

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape in PyTorch's order (rows first; GGUF lists the columns first)."""
        return tuple(int(n) for n in reversed(self.tensors[name].shape.tolist()))

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def check_types(self, names: Iterable[str]) -> None:
        """A GGUFError naming the first tensor of ``names`` whose type attnlab does not read."""
        for name in names:
            kind = self.type_name(name)
            if kind not in SUPPORTED_TYPES:
                raise GGUFError(f"{self.name}: tensor {name!r} is of type {kind}, which "
                                f"attnlab does not read (expected one of "
                                f"{', '.join(SUPPORTED_TYPES)})")

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a float32 tensor of its own (see :func:`dequantize`)."""
        return dequantize(self.tensors[name], self.name)

    def raw(self, name: str) -> torch.Tensor:
        """Tensor ``name``'s bytes as stored, ``(rows, bytes a row)`` uint8 of its own (a
        Q8_0 row: per block of 32 a float16 scale, then 32 int8)."""
        return self.raw_rows(name)

    def raw_rows(self, name: str, a: int = 0, b: int | None = None) -> torch.Tensor:
        """Rows ``[a, b)`` of :meth:`raw` (to the end without ``b``), only those copied out
        of the file's mapping."""
        t = self.tensors[name]
        rows = self.shape(name)[0] if len(self.shape(name)) > 1 else 1
        data = np.asarray(t.data).view(np.uint8).reshape(rows, -1)[a:b]
        return torch.from_numpy(np.array(data, copy=True))

    def bf16(self, name: str) -> torch.Tensor:
        """Tensor ``name`` in bf16, its own memory: BF16 as stored, F16 rounded to bf16
        (three fewer mantissa bits, a wider range), other types dequantised first."""
        kind, shape = self.type_name(name), self.shape(name)
        if kind == "BF16":
            return self.raw(name).view(torch.bfloat16).reshape(shape)
        if kind == "F16":
            return self.raw(name).view(torch.float16).reshape(shape).to(torch.bfloat16)
        return self.tensor(name).to(torch.bfloat16)


def dequantize(tensor: Any, where: str = "the GGUF file") -> torch.Tensor:
    """One GGUF tensor (gguf's ``ReaderTensor``) as a float32 ``torch.Tensor`` in PyTorch's
    shape order, holding its own memory (the file's mapping is not kept).

    The one place a GGUF tensor's type becomes a torch dtype: quantised blocks (Q8_0,
    Q4_1, K-quants...) and half precision are expanded to float32 here.
    """
    from gguf import dequantize as _dequantize

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise GGUFError(f"{where}: tensor {tensor.name!r} is of type {kind}, which attnlab "
                        f"does not read (expected one of {', '.join(SUPPORTED_TYPES)})")
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    try:
        if kind in _BLOCKS:
            size, expand = _BLOCKS[kind]
            blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8)).view(-1, size)
            return expand(blocks).reshape(shape)
        values = _dequantize(tensor.data, tensor.tensor_type)
    except Exception as exc:  # a block layout that does not fit its shape
        raise GGUFError(f"{where}: tensor {tensor.name!r} ({kind}) cannot be read: "
                        f"{exc}") from None
    values = np.ascontiguousarray(values, dtype=np.float32)
    if np.may_share_memory(values, tensor.data):
        values = values.copy()  # never a view of the file's mapping
    return torch.from_numpy(values.reshape(shape))


# The commonest block types expanded with torch: gguf's NumPy code makes ten temporary
# arrays a tensor (1.3 s for SmolLM2's Q4_1 and Q8_0 tensors; these take 0.2 s). The
# same operations in the same order as gguf's (tested equal to it bit for bit). A block
# is ``(n_blocks, bytes)``: a float16 scale d (Q4_1: and a float16 minimum m), then 32
# values: int8 for Q8_0, 4-bit for Q4_0/Q4_1 (the low nibbles of 16 bytes are values
# 0..15, the high nibbles 16..31).
def _scale(blocks: torch.Tensor, at: int) -> torch.Tensor:
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()  # (n_blocks, 1)


def _nibbles(blocks: torch.Tensor, at: int) -> torch.Tensor:
    qs = blocks[:, at:]
    return torch.cat([qs & 15, qs >> 4], dim=1)  # (n_blocks, 32) uint8


_BLOCKS = {
    "Q8_0": (34, lambda b: b[:, 2:].contiguous().view(torch.int8).float() * _scale(b, 0)),
    "Q4_0": (18, lambda b: _scale(b, 0) * (_nibbles(b, 2).to(torch.int8) - 8).float()),
    "Q4_1": (20, lambda b: _scale(b, 0) * _nibbles(b, 4).float() + _scale(b, 2)),
}
