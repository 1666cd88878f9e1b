"""The messages of the split attentions, over ``torch.distributed`` and nothing else:
the group's ranks, point-to-point sends and receives (``batch_isend_irecv``), and every
wait turned into one clear error when a peer dies or stops answering."""

from __future__ import annotations

import datetime
import time
import weakref
from collections.abc import Sequence

import torch


class RingError(RuntimeError):
    """A split attention lost a peer: another process of the group died, raised, or did
    not answer within the timeout. Raised once on every rank that notices, instead of
    a hang or a cascade of transport errors."""


def _dist():
    import torch.distributed as dist

    return dist


_DRAIN = 5.0  # seconds, in all, to drain a raising call's messages
# Groups on which a split attention raised with receives left open -> why (held weakly:
# a destroyed group's mark goes with it, and a new group is never taken for it).
_SPOILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Group:
    """A process group as the split attentions use it: this process's rank, the world
    size, the global rank of each group rank, and waits with a timeout."""

    def __init__(self, group=None, timeout: float | None = None, what: str = "ring_attention"):
        dist = _dist()
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(f"{what} needs torch.distributed initialised "
                             "(dist.init_process_group, or torchrun) and a group; got none")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError(f"{what}: this process is not a member of the group it was given")
        self.ranks = (list(range(self.size)) if group is None
                      else dist.get_process_group_ranks(group))
        self.timeout = (None if timeout is None
                        else datetime.timedelta(seconds=float(timeout)))
        self.what = what

    def _key(self):
        return self.group if self.group is not None else _dist().group.WORLD

    @property
    def spoilt(self) -> str | None:
        """Why this rank's earlier split call left receives open on the group (then it
        carries no more split calls: ``agree.agreed_lengths`` refuses them), or None."""
        return _SPOILT.get(self._key())

    def spoil(self, why: str) -> None:
        """Mark the group as unfit for more split calls (see :attr:`spoilt`)."""
        _SPOILT[self._key()] = why

    def glob(self, rank: int) -> int:
        return self.ranks[rank % self.size]

    def post(self, ops: Sequence[tuple[str, torch.Tensor, int, int]]) -> list:
        """Post ``("send" | "recv", tensor, group rank, tag)`` operations together
        (``dist.batch_isend_irecv``); returns one work per operation."""
        if not ops:
            return []
        dist = _dist()
        p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, self.glob(peer),
                          self.group, tag) for kind, t, peer, tag in ops]
        try:
            return dist.batch_isend_irecv(p2p)
        except Exception as exc:  # a peer already gone
            raise self.error("posting messages to its neighbours", ops[0][2], exc) from exc

    def wait(self, work, what: str, peer: int) -> None:
        try:
            done = work.wait() if self.timeout is None else work.wait(self.timeout)
        except Exception as exc:
            raise self.error(what, peer, exc) from exc
        if done is False:
            raise self.error(what, peer, TimeoutError("no answer within the timeout"))

    def drain(self, works: Sequence) -> None:
        """Wait, quietly, for messages posted by a call that is raising (a local step that
        failed on every rank alike): their peers posted the matching ones before the
        same failure, so they complete, and the group stays usable for the caller who
        catches the error. The waits end after a few seconds in all (a peer that is
        gone), and nothing they raise hides the error being raised."""
        deadline = time.monotonic() + min(_DRAIN, (self.timeout.total_seconds()
                                                   if self.timeout is not None else _DRAIN))
        for work in works:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                work.wait(datetime.timedelta(seconds=left))
            except Exception:  # noqa: S112  (the caller's error is the one to raise)
                continue

    def error(self, what: str, peer: int, exc: BaseException) -> RingError:
        cause = " ".join(str(exc).split())[:300]
        limit = (f"{self.timeout.total_seconds():g} s" if self.timeout is not None
                 else "the group's timeout")
        return RingError(
            f"{self.what}: rank {self.rank} of {self.size} stopped while {what} rank "
            f"{peer % self.size}: another process of the group died, raised or did not answer "
            f"within {limit} ({type(exc).__name__}: {cause})")

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (the same count on each), as lists of ints."""
        dist = _dist()
        mine = torch.tensor(list(values), dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        try:
            work = dist.all_gather(parts, mine, group=self.group, async_op=True)
        except Exception as exc:
            raise self.error("gathering the shapes of", (self.rank + 1), exc) from exc
        self.wait(work, "gathering the shapes of", self.rank + 1)
        return [p.tolist() for p in parts]

    def all_gather(self, x: torch.Tensor, lengths: Sequence[int], what: str) -> list:
        """Every rank's ``x`` ``(B, lengths[r])`` (the same ``B`` and dtype on each), as a
        list by rank: one ``all_gather`` of the shards padded to the longest."""
        dist = _dist()
        padded = x.new_zeros(x.shape[0], max(lengths))
        padded[:, :x.shape[1]] = x
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        try:
            work = dist.all_gather(parts, padded, group=self.group, async_op=True)
        except Exception as exc:
            raise self.error(what, self.rank + 1, exc) from exc
        self.wait(work, what, self.rank + 1)
        return [p[:, :n] for p, n in zip(parts, lengths)]
