"""``ContextParallel``: how a module or model splits its sequence across processes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from ..checks import one_of, optional_positive_int
from .comm import Group
from .ring import optional_timeout, ring_attention
from .shards import LAYOUTS, shard, shard_lengths, shard_positions
from .ulysses import ulysses_attention

STRATEGIES = ("ring", "ulysses")


@dataclass(frozen=True)
class ContextParallel:
    """A sequence split over the ranks of ``group`` (None: the default group).

    ``layout``: ``"zigzag"`` (the default: balances a causal model's work) or
    ``"contiguous"``; ``strategy``: ``"ring"`` (:func:`ring_attention`) or ``"ulysses"``
    (:func:`ulysses_attention`, heads divisible by the group size); ``seq_len``: the
    whole sequence's length when every call has the same one (training on a fixed
    context): positions and shard sizes are then known without asking the other ranks;
    None gathers it at each call. ``timeout``: seconds to wait for a neighbour.

    ``MultiHeadAttention(..., context_parallel=cp)`` and ``GPT(config,
    context_parallel=cp)`` then take this rank's shard of the sequence (``cp.shard(x)``)
    and return this rank's shard of their output.
    """

    group: object = None
    layout: str = "zigzag"
    strategy: str = "ring"
    seq_len: int | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        one_of("layout", self.layout, LAYOUTS)
        one_of("strategy", self.strategy, STRATEGIES)
        optional_positive_int("seq_len", self.seq_len)
        optional_timeout(self.timeout)

    def _comm(self) -> Group:
        return Group(self.group, self.timeout, "context parallelism")

    @property
    def world_size(self) -> int:
        return self._comm().size

    @property
    def rank(self) -> int:
        return self._comm().rank

    def total(self, local_len: int) -> int:
        """The whole sequence's length, given this rank's shard length (``seq_len`` when
        set, this rank's shard checked against it; else gathered from the ranks)."""
        known = _KNOWN.get()
        if known is not None and known[0] == id(self):
            return known[1]
        if self.seq_len is not None:
            comm = self._comm()
            want = shard_lengths(self.seq_len, comm.size, self.layout)[comm.rank]
            if local_len != want:
                raise ValueError(f"rank {comm.rank}'s shard holds {local_len} tokens; a "
                                 f"{self.layout} split of ContextParallel's seq_len="
                                 f"{self.seq_len} over {comm.size} ranks gives it {want}")
            return self.seq_len
        return sum(row[0] for row in self._comm().all_gather_ints([local_len]))

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's shard of the whole sequence ``x`` along ``dim``."""
        comm = self._comm()
        return shard(x, comm.size, comm.rank, layout=self.layout, dim=dim)

    def positions(self, local_len: int, *, seq_len: int | None = None,
                  device=None) -> torch.Tensor:
        """The positions of this rank's ``local_len`` tokens in the whole sequence (of
        ``seq_len`` tokens when given, else :meth:`total`)."""
        comm = self._comm()
        seq_len = self.total(local_len) if seq_len is None else seq_len
        return shard_positions(seq_len, comm.size, comm.rank, self.layout, device=device)

    def attention(self, q, k, v, *, causal=False, window=None, mask=None, scale=None,
                  backend="auto", **variants) -> torch.Tensor:
        """``q``, ``k``, ``v`` shards ``(B, H, L_rank, D)`` -> this rank's output shard;
        ``variants``: those :func:`ring_attention` takes (softcap, alibi_slopes, sinks,
        this rank's shard of document_ids)."""
        split = ring_attention if self.strategy == "ring" else ulysses_attention
        seq_len = None if self.seq_len is None else self.seq_len
        return split(q, k, v, group=self.group, causal=causal, window=window, mask=mask,
                     scale=scale, layout=self.layout, backend=backend, seq_len=seq_len,
                     timeout=self.timeout, **variants)


# (id of a ContextParallel, the whole length) inside whole_length().
_KNOWN: ContextVar[tuple[int, int] | None] = ContextVar("attnlab_whole_length", default=None)


@contextlib.contextmanager
def whole_length(split: ContextParallel | None, total: int) -> Iterator[None]:
    """Inside this block ``split.total`` is ``total`` without asking the ranks again: a
    model that gathered its sequence's length once, for all its layers (each layer's
    ``MultiHeadAttention`` checks its ``context_length`` against it)."""
    token = None if split is None else _KNOWN.set((id(split), total))
    try:
        yield
    finally:
        if token is not None:
            _KNOWN.reset(token)
