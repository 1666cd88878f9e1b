"""The pieces that travel around the ring: packing a piece's keys, values and key mask
into one flat message and viewing them back, and the exact merge of two blocks' partial
outputs by their log-sum-exp."""

from __future__ import annotations

import torch

_INF = float("inf")


def work_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class Pieces:
    """Packing a piece's tensors into one flat message and viewing them back.

    The messages' buffers come from a pool kept for one call: a buffer given back with
    :meth:`release` (once its send has completed, or its piece is done with) serves the
    next piece. Every buffer holds a whole piece of ``capacity`` keys, so a rank's
    memory for messages is the most pieces it ever holds at once, not what the heap
    keeps of thousands of freed ones.
    """

    def __init__(self, k, v, mask, dtype, capacity: int):
        self.batch, self.heads = k.shape[0], k.shape[1]
        self.dk, self.dv = k.shape[-1], v.shape[-1]
        self.k, self.v, self.mask = k, v, mask
        self.dtype = dtype
        self.capacity = capacity
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self.allocated = 0  # buffers made: the most this call ever held at once

    def sizes(self, n: int, grads: bool = False) -> list[int]:
        rows = self.batch * self.heads * n
        out = [rows * self.dk, rows * self.dv]
        return out if grads or self.mask is None else out + [self.batch * n]

    def pack(self, piece) -> torch.Tensor:
        a, b = piece.local, piece.local + piece.size
        parts = [self.k[:, :, a:b].reshape(-1), self.v[:, :, a:b].reshape(-1)]
        if self.mask is not None:
            parts.append(self.mask[:, a:b].reshape(-1).to(self.dtype))
        return torch.cat(parts, out=self.empty(piece.size))

    def empty(self, n: int, grads: bool = False, dtype=None) -> torch.Tensor:
        """A buffer for a message of ``n`` keys (uninitialised), from the pool."""
        dtype = dtype or self.dtype
        whole = sum(self.sizes(self.capacity, grads))
        free = self._free.get((dtype, whole))
        if free:
            buffer = free.pop()
        else:
            buffer = torch.empty(whole, dtype=dtype, device=self.k.device)
            self.allocated += 1
        return buffer[:sum(self.sizes(n, grads))]

    def release(self, flat: torch.Tensor | None) -> None:
        """Give a buffer from :meth:`empty` back to the pool (None: nothing)."""
        if flat is not None:
            whole = flat if flat._base is None else flat._base
            self._free.setdefault((whole.dtype, whole.numel()), []).append(whole)

    def views(self, flat: torch.Tensor | None, piece, grads: bool = False):
        """``(k, v, mask)`` of ``piece`` (``(dk, dv)`` with ``grads``): views of ``flat``, or
        of the local shard where ``flat`` is None."""
        n = piece.size
        if flat is None:
            a, b = piece.local, piece.local + n
            m = None if self.mask is None else self.mask[:, a:b]
            return self.k[:, :, a:b], self.v[:, :, a:b], _as4d(m)
        parts = flat.split(self.sizes(n, grads))
        k = parts[0].view(self.batch, self.heads, n, self.dk)
        v = parts[1].view(self.batch, self.heads, n, self.dv)
        if grads:
            return k, v
        m = None if self.mask is None else parts[2].view(self.batch, n) != 0
        return k, v, _as4d(m)


def _as4d(m):
    return None if m is None else m[:, None, None, :]


def merge(out, lse, part, part_lse) -> None:
    """Fold one block's ``(part, part_lse)`` into the running ``(out, lse)`` in place: the
    exact softmax over the union of their keys (``lse`` ``-inf``: no key yet; a block's
    ``+inf``: no key in it). ``part`` is scaled in place: the caller is done with it."""
    part_lse = part_lse.masked_fill(part_lse == _INF, -_INF)
    new = torch.logaddexp(lse, part_lse)
    keep, take = torch.exp(lse - new), torch.exp(part_lse - new)
    empty = new == -_INF  # neither has a key: -inf - -inf is NaN, and the row stays 0
    keep.masked_fill_(empty, 0.0)
    take.masked_fill_(empty, 0.0)
    take = take.unsqueeze(-1)
    # In place where ``part`` is already the work dtype: one block's output less at a time.
    out.mul_(keep.unsqueeze(-1)).add_(part.mul_(take) if part.dtype == out.dtype else
                                      part * take)
    lse.copy_(new)
