"""Room for the weights that decoding streams, on 2 MiB pages where Linux gives them.

Decoding one token reads every weight matrix once: 270 MB a token for SmolLM-135M in
bf16. On 4 KiB pages that is a TLB miss every 64 cache lines, and the hardware
prefetchers stop at the end of each page. On transparent huge pages (THP, asked for with
``madvise`` as Linux distributions ship it) a plain ``torch.sum`` over such a buffer read
5-7% more GB/s, and bf16 and int8 decoding ran 3-5% faster (one Zen 5 core, interleaved
runs). torch's own allocator asks for huge pages only where ``THP_MEM_ALLOC_ENABLE`` is
set before it starts, and then for every tensor; this asks for them for the weights alone.

A model's matrices are mostly 1-4 MiB each: a mapping of their own would hold few whole
2 MiB pages. So a loader sums the bytes of the matrices it is about to make and opens an
:func:`arena` of that size: one mapping, a whole number of huge pages, that
:func:`empty` then cuts the matrices from, front to back in the order decoding reads
them (``models.loading``: one region a token, 1.015-1.065x bf16 tokens/s on a Zen 4
core over two interleaved regions). Each tensor is a storage of its own
(``torch.frombuffer``) that keeps the mapping alive; the mapping goes with the last of
them. Only matrices go in (not norms or untied embeddings), so quantising or converting a
loaded model frees the mapping with the weights it replaces.

Outside an arena, under a dispatch mode (``FakeTensorMode``), for fewer than
:data:`MIN_ARENA` bytes or where the OS has no such mapping, :func:`empty` is
``torch.empty``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import mmap
from collections.abc import Iterable, Iterator

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

HUGE_PAGE = 2 << 20  # bytes
MIN_ARENA = 8 << 20  # bytes: below, the partly used last huge page costs more than it buys
ALIGN = 64  # bytes: each tensor starts on a cache line


def _mapping(nbytes: int) -> mmap.mmap | None:
    """A private anonymous mapping of ``nbytes`` with huge pages asked for (small pages
    where the kernel has no THP); None where the OS has neither the advice nor the room."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        room = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None
    with contextlib.suppress(OSError):  # THP compiled out: small pages serve
        room.madvise(mmap.MADV_HUGEPAGE)
    return room


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class _Arena:
    """One mapping, cut into tensors front to back."""

    def __init__(self, nbytes: int) -> None:
        # A whole number of huge pages: Linux (6.7 on) then starts the mapping on one.
        self.room = _mapping(-(-nbytes // HUGE_PAGE) * HUGE_PAGE)
        self.used = 0

    def take(self, nbytes: int) -> int | None:
        """The offset of ``nbytes`` more, or None where they do not fit."""
        if self.room is None or self.used + nbytes > len(self.room):
            return None
        at, self.used = self.used, _padded(self.used + nbytes)
        return at


_ARENA: contextvars.ContextVar[_Arena | None] = contextvars.ContextVar(
    "attnlab_pages_arena", default=None)


@contextlib.contextmanager
def arena(sizes: Iterable[int]) -> Iterator[None]:
    """Within, :func:`empty` cuts CPU tensors from one huge-page mapping that holds
    tensors of ``sizes`` (bytes each), in the order asked; a tensor that no longer fits
    gets ``torch.empty``. Under :data:`MIN_ARENA` bytes in all, no mapping is made."""
    total = sum(_padded(n) for n in sizes)
    token = _ARENA.set(_Arena(total) if total >= MIN_ARENA else None)
    try:
        yield
    finally:
        _ARENA.reset(token)


def empty(shape: tuple[int, ...], dtype: torch.dtype,
          device: torch.device | str | None = None) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, cut from the :func:`arena` in
    force where there is one (a CPU tensor, no dispatch mode). Contiguous,
    uninitialised, an ordinary tensor but for one thing: its storage does not resize."""
    device = torch.get_default_device() if device is None else torch.device(device)
    here = _ARENA.get()
    numel = math.prod(shape)
    if (here is None or device.type != "cpu" or numel <= 0 or min(shape, default=0) < 0
            or _get_current_dispatch_mode() is not None):
        return torch.empty(shape, dtype=dtype, device=device)
    at = here.take(numel * dtype.itemsize)
    if at is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.frombuffer(here.room, dtype=dtype, count=numel, offset=at).view(shape)
