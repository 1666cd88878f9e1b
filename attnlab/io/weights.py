"""Reading weights from safetensors files: lazily, memory-mapped, in bounded chunks.

:class:`SafetensorsState` is the tensors of one or more files (a sharded checkpoint)
read on look-up; :func:`read_into` copies a mapped tensor into a model's parameter
through a small bounce buffer, so the file's pages never become part of the process.
Pure file reading: fitting the tensors to a model (names, shapes, dtypes, building on
the meta device) is :mod:`attnlab.models.loading`.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from .files import CheckpointError
from .tensors import check_file

__all__ = ["read_into", "SafetensorsState"]


CHUNK = 1 << 20


def read_into(dst: torch.Tensor, src: torch.Tensor, bounce: torch.Tensor | None = None) -> None:
    """``dst.copy_(src)``; a tensor :class:`SafetensorsState` memory-mapped, or a view
    of one whose rows each lie in one piece (a transpose, a slice of columns: how
    GPT-2's Conv1D weights become ``nn.Linear``'s), is read from its file in chunks of
    rows through ``bounce`` (bytes) instead, so its pages never become part of the
    process. Only while the mapping holds what the file holds: a tensor edited in
    memory (its copy-on-write pages written) is copied as it is, edits included."""
    if src.ndim == 2 and dst.ndim == 2 and src.stride(0) == 1 and src.stride(1) != 1:
        dst, src = dst.t(), src.t()  # read the transpose's rows
    origin = _ORIGINS.get(src.untyped_storage().data_ptr())
    row_shape = src.shape[1:]
    if (origin is None or src.ndim == 0 or src.numel() == 0 or not src[0].is_contiguous()
            or src.stride(0) < max(1, src[0].numel())):
        _copy(dst, src)
        return
    file, offset = origin
    es = src.element_size()
    row = src[0].numel() * es  # the bytes of one row; rows start `pitch` bytes apart
    pitch = src.stride(0) * es
    span = (src.shape[0] - 1) * pitch + row
    if _written(src.data_ptr(), span):
        _copy(dst, src)
        return
    offset += src.storage_offset() * es
    if bounce is None or bounce.numel() < row:
        bounce = torch.empty(max(CHUNK, row), dtype=torch.uint8)
    step = (bounce.numel() - row) // pitch + 1  # rows a chunk holds
    raw = bounce.numpy()
    for a in range(0, src.shape[0], step):
        b = min(a + step, src.shape[0])
        n = (b - a - 1) * pitch + row
        # The file the mapping was made of (its descriptor), even if its path now names
        # another one.
        if os.preadv(file.fileno(), [memoryview(raw)[:n]], offset + a * pitch) != n:
            raise CheckpointError(f"{file.name!r} ended early (truncated?)")
        rows = bounce[:n].view(src.dtype)
        dst[a:b].copy_(rows.as_strided((b - a, *row_shape), (src.stride(0), *src[0].stride())))


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, walking ``dst`` in its memory order where it is a transposed
    matrix (a weight packed ``(in, out)`` for decoding): torch's copy is about five times
    faster writing in order than reading in order (a 1536 x 576 matrix: 3 ms, not 16)."""
    if dst.ndim == 2 and dst.stride(0) == 1 and dst.stride(1) != 1:
        dst.t().copy_(src.t())
    else:
        dst.copy_(src)


_PAGE = mmap.PAGESIZE


def _written(address: int, nbytes: int) -> bool:
    """Whether this process wrote to any page of ``[address, address + nbytes)`` of a
    private file mapping (a written copy-on-write page is anonymous memory, no longer
    the file's; Linux's ``/proc/self/pagemap`` tells them apart). True where it cannot
    be told, so the caller copies what the memory holds."""
    import numpy as np

    first, last = address // _PAGE, (address + nbytes - 1) // _PAGE
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
    except OSError:
        return True
    if entries.size != last - first + 1:
        return True
    present, swapped, file = (entries >> np.uint64(bit) & np.uint64(1) for bit in (63, 62, 61))
    return bool(((present | swapped) & (file ^ np.uint64(1))).any())


# --------------------------------------------------------------------- safetensors files


def _too_large(path: Path, exc: Exception) -> str:
    from ..checks import machine_memory

    total = machine_memory()
    memory = f"; this machine has {total / 2**30:,.1f} GiB of memory" if total else ""
    return (f"{str(path)!r} ({path.stat().st_size / 2**30:,.1f} GiB) cannot be mapped into "
            f"memory ({exc}){memory}: the model is too large for this machine")


class SafetensorsState(Mapping):
    """The tensors of one or more safetensors files (a sharded checkpoint), read lazily.

    Shapes and dtypes come from the headers without reading any data; a tensor is
    read (memory-mapped by safetensors) when it is looked up, and not kept here, so
    a converter that walks the names holds each tensor only as long as it needs it.
    """

    def __init__(self, files: list[str | os.PathLike], *, device: str = "cpu") -> None:
        from safetensors import safe_open

        self._handles = {}
        self._where: dict[str, object] = {}
        self._device = str(device)
        self._places: dict[str, tuple] = {}
        for path in files:
            path = Path(path)
            check_file(path)
            try:
                handle = safe_open(path, framework="pt", device=device)
            except Exception as exc:  # safetensors raises its own error types
                if "Cannot allocate memory" in str(exc):  # a whole file it cannot map
                    raise CheckpointError(_too_large(path, exc)) from exc
                raise CheckpointError(f"{str(path)!r}: not a valid safetensors file "
                                      f"(truncated or corrupt?): {exc}") from exc
            self._handles[path] = handle
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                self._where[name] = handle
            self._places.update(_places(_File(path)))

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._device != "cpu":
            return self._where[name].get_tensor(name)
        return _mapped(*self._places[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        out = {}
        for name, handle in self._where.items():
            part = handle.get_slice(name)
            out[name] = (tuple(part.get_shape()), _DTYPES.get(part.get_dtype(), torch.uint8))
        return out


# safetensors' dtype names -> torch's.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
           "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64}

# Where each tensor SafetensorsState mapped lies in its file: storage address -> (file,
# offset). An entry lives exactly as long as its mapping (weakref.finalize), so an
# address reused later never points at a stale file.
_ORIGINS: dict[int, tuple[_File, int]] = {}


class _File:
    """One open descriptor of a weights file: its header, its mappings and the reads of
    :func:`read_into` all see the same file, even if its path is given another one
    meanwhile. Closed once nothing uses it."""

    def __init__(self, path: Path) -> None:
        self.name = str(path)
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)

    def fileno(self) -> int:
        return self.fd


def _places(file: _File) -> dict[str, tuple]:
    """name -> (file, offset, shape, safetensors dtype) from the file's header."""
    (n,) = struct.unpack("<Q", os.pread(file.fd, 8, 0).ljust(8, b"\0"))
    header = json.loads(os.pread(file.fd, n, 8))
    start = 8 + n
    return {name: (file, start + int(info["data_offsets"][0]), tuple(info["shape"]),
                   info["dtype"]) for name, info in header.items() if name != "__metadata__"}


def _mapped(file: _File, offset: int, shape: tuple, dtype: str) -> torch.Tensor:
    """The tensor memory-mapped from the file (copy on write): nothing is read until
    it is used, and a page read stays shared with the page cache."""
    import numpy as np

    want = _DTYPES.get(dtype, torch.uint8)
    count = 1
    for d in shape:
        count *= d
    if count == 0:
        return torch.empty(shape, dtype=want)
    nbytes = count * torch.empty((), dtype=want).element_size()
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    view = mmap.mmap(file.fd, offset - start + nbytes, access=mmap.ACCESS_COPY, offset=start)
    raw = np.frombuffer(view, dtype=np.uint8, count=nbytes, offset=offset - start)
    t = torch.from_numpy(raw)
    ptr = t.untyped_storage().data_ptr()
    _ORIGINS[ptr] = (file, offset)
    weakref.finalize(raw, _ORIGINS.pop, ptr, None)
    return t.view(want).view(shape)
