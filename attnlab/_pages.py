"""Room for the weights that decoding streams, on 2 MiB pages where Linux gives them.

Decoding one token reads every weight matrix once: 270 MB a token for SmolLM-135M in
bf16. On 4 KiB pages that is a TLB miss every 64 cache lines, and the hardware
prefetchers stop at the end of each page. On transparent huge pages (THP, asked for with
``madvise`` as Linux distributions ship it) a plain ``torch.sum`` over such a buffer read
5-7% more GB/s (one Zen 5 core, interleaved runs). torch's own allocator asks for huge
pages only where ``THP_MEM_ALLOC_ENABLE`` is set before it starts, and then for every
tensor; this asks for them for the weights alone.

A model's matrices are mostly 1-4 MiB each: a mapping of their own would hold few whole
2 MiB pages. So a model is loaded inside :func:`arena`, and its weights are cut one after
another, in the order they are made (the order decoding reads them), from mappings of
64 MiB or more. Each tensor is a storage of its own (``torch.frombuffer``) that keeps its
mapping alive; a mapping is freed with the last tensor cut from it.

Elsewhere (another OS, a GPU, the meta device, or a kernel that refuses) :func:`empty`
is ``torch.empty``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import mmap
from collections.abc import Iterator

import torch

HUGE_PAGE = 2 << 20  # bytes: outside an arena, a tensor under one huge page gains nothing
MAPPING = 64 << 20  # bytes: an arena's mappings (a larger tensor gets one of its size)
ALIGN = 64  # bytes: each tensor starts on a cache line


def _mapping(nbytes: int) -> mmap.mmap | None:
    """A private anonymous mapping of ``nbytes``, huge pages asked for; None where the OS
    has no such advice (not Linux) or no mapping."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        room = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None
    with contextlib.suppress(OSError):  # THP compiled out: small pages serve
        room.madvise(mmap.MADV_HUGEPAGE)
    return room


class _Arena:
    """Mappings of at least :data:`MAPPING` bytes, cut into tensors front to back."""

    def __init__(self) -> None:
        self.room: mmap.mmap | None = None
        self.used = 0

    def take(self, nbytes: int) -> tuple[mmap.mmap, int] | None:
        at = -(-self.used // ALIGN) * ALIGN
        if self.room is None or at + nbytes > len(self.room):
            # A whole number of huge pages: Linux then starts the mapping on one.
            room = _mapping(-(-max(nbytes, MAPPING) // HUGE_PAGE) * HUGE_PAGE)
            if room is None:
                return None
            self.room, at = room, 0
        self.used = at + nbytes
        return self.room, at


_ARENA: contextvars.ContextVar[_Arena | None] = contextvars.ContextVar(
    "attnlab_pages_arena", default=None)


@contextlib.contextmanager
def arena() -> Iterator[None]:
    """Within, :func:`empty` cuts CPU tensors of any size from shared huge-page mappings
    in the order asked (a model's weights: the loader and the quantiser use it). Within
    another, the outer one goes on."""
    if _ARENA.get() is not None:
        yield
        return
    token = _ARENA.set(_Arena())
    try:
        yield
    finally:
        _ARENA.reset(token)


def empty(shape: tuple[int, ...], dtype: torch.dtype,
          device: torch.device | str | None = None) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, on huge pages where it may: on
    the CPU, where the OS has ``MADV_HUGEPAGE`` (Linux), inside :func:`arena` or for a
    tensor of at least 2 MiB. Contiguous, uninitialised, an ordinary tensor (one that
    resizes only by being replaced)."""
    device = torch.get_default_device() if device is None else torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    cut = _ARENA.get()
    if (device.type != "cpu" or nbytes == 0 or dtype.is_complex or dtype == torch.bool
            or (cut is None and nbytes < HUGE_PAGE)):
        return torch.empty(shape, dtype=dtype, device=device)
    place = cut.take(nbytes) if cut is not None else (_mapping(nbytes), 0)
    if place is None or place[0] is None:
        return torch.empty(shape, dtype=dtype, device=device)
    room, at = place
    return torch.frombuffer(room, dtype=dtype, count=math.prod(shape), offset=at).view(shape)
