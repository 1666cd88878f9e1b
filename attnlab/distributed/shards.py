"""Splitting one sequence across the ranks of a group, and putting it back together.

A sequence of ``seq_len`` tokens is split along its sequence dimension into one shard
per rank, by one of two layouts:

- ``"contiguous"``: rank ``r`` holds the ``r``-th of ``world_size`` consecutive
  pieces (``torch.tensor_split``'s sizes: the first ``seq_len % world_size`` ranks
  hold one token more).
- ``"zigzag"``: the sequence is cut into ``2 * world_size`` pieces (the same rule of
  sizes) and rank ``r`` holds pieces ``r`` and ``2 * world_size - 1 - r``, one from
  each end. Under a causal rule every rank then has about the same number of
  (query, key) pairs to compute, where the contiguous layout leaves rank 0 almost
  idle and the last rank with most of the work.

A shard is its chunks laid end to end, in the order of their positions. Every
function here is pure (no communication) except :func:`gather`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..checks import non_negative_int, one_of, positive_int

__all__ = ["LAYOUTS", "shard_ranges", "shard_lengths", "shard_positions", "shard", "unshard",
           "shard_mask", "gather"]

LAYOUTS = ("contiguous", "zigzag")


def _check(seq_len: int, world_size: int, rank: int | None, layout: str) -> None:
    non_negative_int("seq_len", seq_len)
    positive_int("world_size", world_size)
    one_of("layout", layout, LAYOUTS)
    if rank is not None:
        non_negative_int("rank", rank)
        if rank >= world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")


def _pieces(seq_len: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` of ``parts`` consecutive pieces, as ``torch.tensor_split`` cuts."""
    base, extra = divmod(seq_len, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        out.append((start, end))
        start = end
    return out


def shard_ranges(seq_len: int, world_size: int, rank: int,
                 layout: str = "contiguous") -> list[tuple[int, int]]:
    """The ``[start, end)`` positions of ``rank``'s chunks, in order: one chunk for
    ``"contiguous"``, two for ``"zigzag"`` (either may be empty when ``seq_len`` is
    smaller than the number of chunks).

    >>> shard_ranges(10, 2, 0, "zigzag")
    [(0, 3), (7, 10)]
    """
    _check(seq_len, world_size, rank, layout)
    if layout == "contiguous":
        return [_pieces(seq_len, world_size)[rank]]
    pieces = _pieces(seq_len, 2 * world_size)
    return [pieces[rank], pieces[2 * world_size - 1 - rank]]


def shard_lengths(seq_len: int, world_size: int, layout: str = "contiguous") -> list[int]:
    """How many tokens each rank holds, ``[len_0, ..., len_{N-1}]``."""
    return [sum(e - s for s, e in shard_ranges(seq_len, world_size, r, layout))
            for r in range(world_size)]


def shard_positions(seq_len: int, world_size: int, rank: int, layout: str = "contiguous",
                    *, device=None) -> torch.Tensor:
    """The positions in the whole sequence of ``rank``'s tokens, ``(len_rank,)`` int64:
    what RoPE and learned position embeddings need for a shard.

    >>> shard_positions(10, 2, 1, "zigzag").tolist()
    [3, 4, 5, 6]
    """
    ranges = shard_ranges(seq_len, world_size, rank, layout)
    return torch.cat([torch.arange(s, e, device=device) for s, e in ranges])


def _dim(x: torch.Tensor, dim: int, name: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim must index a dimension of {name} (shape {tuple(x.shape)}), "
                         f"got {dim}")
    return dim % x.ndim


def shard(x: torch.Tensor, world_size: int, rank: int, *, layout: str = "contiguous",
          dim: int = 1) -> torch.Tensor:
    """``rank``'s shard of the whole sequence ``x`` along ``dim`` (1: ``(batch, seq, ...)``
    as modules and token ids take it; use ``dim=-2`` for ``(batch, heads, seq, dim)``).

    A view for ``"contiguous"``, a new tensor (two chunks side by side) for ``"zigzag"``.
    """
    dim = _dim(x, dim, "x")
    ranges = shard_ranges(x.shape[dim], world_size, rank, layout)
    parts = [x.narrow(dim, s, e - s) for s, e in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def unshard(shards: Sequence[torch.Tensor], *, layout: str = "contiguous",
            dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard (``shards[r]`` is rank ``r``'s), the
    inverse of :func:`shard`: ``unshard([shard(x, N, r) for r in range(N)]) == x``."""
    if not isinstance(shards, Sequence) or not shards:
        raise ValueError("shards must be a non-empty sequence of tensors, one per rank")
    dims = {_dim(s, dim, f"shards[{i}]") for i, s in enumerate(shards)}
    dim = dims.pop()
    world = len(shards)
    seq_len = sum(s.shape[dim] for s in shards)
    want = shard_lengths(seq_len, world, layout)
    got = [s.shape[dim] for s in shards]
    if got != want:
        raise ValueError(f"shards have lengths {got} along dim {dim}; a {layout} split of "
                         f"{seq_len} tokens over {world} ranks has {want}")
    chunks: list[tuple[int, torch.Tensor]] = []
    for r, s in enumerate(shards):
        at = 0
        for start, end in shard_ranges(seq_len, world, r, layout):
            chunks.append((start, s.narrow(dim, at, end - start)))
            at += end - start
    return torch.cat([c for _, c in sorted(chunks, key=lambda item: item[0])], dim=dim)


def shard_mask(mask: torch.Tensor, world_size: int, rank: int, *,
               layout: str = "contiguous") -> torch.Tensor:
    """``rank``'s shard of a key-padding mask: ``(batch, seq)`` (as tokenizers return it,
    1/0 or bool) or ``(batch, 1, 1, seq)`` (attnlab's 4-D form); the sequence is the
    last dimension, and the shard keeps the form it came in."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.ndim not in (2, 4) or (mask.ndim == 4 and mask.shape[1:3] != (1, 1)):
        raise ValueError(f"mask must be a key-padding mask (batch, seq) or (batch, 1, 1, seq), "
                         f"got shape {tuple(mask.shape)}")
    return shard(mask, world_size, rank, layout=layout, dim=-1)


def gather(x: torch.Tensor, *, group=None, layout: str = "contiguous",
           dim: int = 1) -> torch.Tensor:
    """Every rank's shard of ``x`` put together into the whole sequence, on every rank
    (``torch.distributed.all_gather``; shards may differ in length). Not differentiable:
    a tool for checking and for outputs, not for a training graph."""
    import torch.distributed as dist

    dim = _dim(x, dim, "x")
    one_of("layout", layout, LAYOUTS)
    world = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([x.shape[dim]]), group=group)
    sizes = [int(n) for n in lengths]
    longest = max(sizes)
    pad = list(x.shape)
    pad[dim] = longest - x.shape[dim]
    padded = torch.cat([x.detach(), x.new_zeros(pad)], dim=dim).contiguous()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return unshard([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], layout=layout, dim=dim)
