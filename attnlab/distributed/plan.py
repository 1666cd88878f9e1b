"""The schedule of one ring attention call: which key pieces travel how far, and what
each rank does at each tick. Pure arithmetic: every rank computes the same plan from
the same numbers, so the messages match without being announced.

Each rank's keys are cut into *pieces* of at most ``block`` keys (within a chunk of
its shard, never across). A piece travels the ring ``owner -> owner+1 -> ...``, one hop
per tick, and only as far as some rank still needs it (its *reach*): under a causal
rule a rank never receives keys that lie wholly after its queries, and under a window
a piece stops once it has passed the last rank whose queries it falls in.

Piece ``p`` of a rank's keys is at hop ``h`` at tick ``p + h`` (a diagonal schedule):
at each tick a rank holds about one piece of each of the ``N`` shards, receives the
next tick's pieces while it computes on these, and forwards each piece as soon as it
has it. So a rank keeps a few pieces in hand, never a whole remote shard, and every
send finds its receive already posted one tick earlier (gloo's sends complete only
once the receiver has posted): no rank waits on a later tick of another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import masks as _masks
from .shards import shard_ranges


@dataclass(frozen=True)
class Piece:
    """Keys ``[start, end)`` (positions in the whole sequence) of rank ``owner``, its
    ``index``-th piece, at ``local`` in the owner's shard; ``uid`` numbers every piece
    of the call (message tags)."""

    owner: int
    index: int
    start: int
    end: int
    local: int
    uid: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Call:
    """One kernel call: the rank's query rows ``[q_local, q_local + q_len)`` against a
    piece, query row 0 at position ``offset`` among the piece's keys."""

    q_local: int
    q_len: int
    offset: int


@dataclass(frozen=True)
class Item:
    """What a rank does with a piece at one tick: it got it from the previous rank
    (``hop >= 1``), forwards it (``send``) and computes ``calls`` on it."""

    piece: Piece
    hop: int
    send: bool
    calls: tuple[Call, ...]


@dataclass
class Plan:
    """The schedule of one call over ``world`` ranks (see the module's docstring).

    ``q_len``/``k_len``: the whole sequence's lengths (end-aligned rules: query ``i`` at
    position ``i + k_len - q_len``); ``block``: keys per piece and query rows per call.
    """

    q_len: int
    k_len: int
    world: int
    layout: str
    causal: bool
    window: int | None
    block: int
    pieces: list[list[Piece]] = field(init=False)
    reach: dict[int, int] = field(init=False)  # uid -> the last hop that needs it
    ticks: int = field(init=False)

    def __post_init__(self) -> None:
        self.pieces, uid = [], 0
        for r in range(self.world):
            own, local = [], 0
            for start, end in shard_ranges(self.k_len, self.world, r, self.layout):
                for s in range(start, end, self.block):
                    e = min(s + self.block, end)
                    own.append(Piece(r, len(own), s, e, local + s - start, uid))
                    uid += 1
                local += end - start
            self.pieces.append(own)
        self.reach = {}
        for own in self.pieces:
            for p in own:
                hops = [h for h in range(self.world)
                        if self._any_call((p.owner + h) % self.world, p)]
                self.reach[p.uid] = max(hops, default=0)
        self.ticks = max((p.index + self.reach[p.uid] + 1 for own in self.pieces for p in own),
                         default=0)

    def query_rows(self, rank: int) -> list[tuple[int, int, int]]:
        """``(position, local row, length)`` of each block of ``rank``'s queries."""
        out, local = [], 0
        for start, end in shard_ranges(self.q_len, self.world, rank, self.layout):
            for s in range(start, end, self.block):
                out.append((s, local + s - start, min(self.block, end - s)))
            local += end - start
        return out

    def calls(self, rank: int, piece: Piece) -> tuple[Call, ...]:
        """The kernel calls of ``rank``'s query blocks that see some key of ``piece``:
        worked out each time asked (a few per tick), never all kept, since a long
        sequence has tens of thousands of them."""
        return tuple(self._each_call(rank, piece))

    def _any_call(self, rank: int, piece: Piece) -> bool:
        return next(self._each_call(rank, piece), None) is not None

    def _each_call(self, rank: int, piece: Piece):
        for position, local, n in self.query_rows(rank):
            offset = position + self.k_len - self.q_len - piece.start
            rule = _masks.KeyRule(n, piece.size, causal=self.causal, window=self.window,
                                  offset=offset)
            lo, hi = rule.block(0, n)
            if hi > lo:
                yield Call(local, n, offset)

    def items(self, rank: int, tick: int) -> list[Item]:
        """What ``rank`` does at ``tick``: one item per piece it holds then."""
        out = []
        for piece, hop in self._within_reach(rank, tick):
            reach = self.reach[piece.uid]
            calls = self.calls(rank, piece)
            if calls or hop < reach:
                out.append(Item(piece, hop, hop < reach, calls))
        return out

    def arrivals(self, rank: int, tick: int) -> list[tuple[Piece, int]]:
        """``(piece, hop)`` of each piece ``rank`` receives for ``tick`` (the items of
        :meth:`items` with ``hop >= 1``, whose receives are posted a tick ahead), without
        working out their calls: a piece within its reach is always held there, since at
        the reach itself it has calls by the reach's definition."""
        return [(piece, hop) for piece, hop in self._within_reach(rank, tick) if hop]

    def _within_reach(self, rank: int, tick: int):
        for hop in range(self.world):
            own = self.pieces[(rank - hop) % self.world]
            index = tick - hop
            if 0 <= index < len(own) and hop <= self.reach[own[index].uid]:
                yield own[index], hop

    def finals(self, rank: int, tick: int) -> list[Piece]:
        """``rank``'s own pieces whose key gradients come home at ``tick`` (from the rank
        at their reach, which computed the last share at that tick)."""
        return [p for p in self.pieces[rank]
                if self.reach[p.uid] >= 1 and p.index + self.reach[p.uid] == tick]

    def tag(self, piece: Piece, hop: int, kind: int) -> int:
        """The message tag of ``piece`` arriving at ``hop``; ``kind``: 0 keys and values,
        1 their gradients on the way, 2 the gradients coming home."""
        return (piece.uid * (self.world + 1) + hop) * 3 + kind
