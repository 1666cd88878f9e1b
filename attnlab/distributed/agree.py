"""What the ranks of a split call must agree on, checked in one small all-gather: the
shards' lengths (which give the whole sequence's), the shapes, the options, and whether
a rank's group still carries split calls (``comm.Group.spoil``).

With ``seq_len`` given nothing is gathered: only this rank's own shard is checked."""

from __future__ import annotations

import math
import struct
import zlib
from numbers import Real

import torch

from ..checks import optional_positive_int
from .comm import RingError
from .shards import LAYOUTS, shard_lengths

_SHAPES = ["q_len", "k_len", "batch", "q_heads", "kv_heads", "head_dim", "v_dim", "mask",
           "causal", "window", "layout", "dtype"]


def agreed_lengths(comm, q, k, v, mask, seq_len, causal, window, layout, scale,
                   variants: dict) -> tuple[int, int]:
    """The whole sequence's ``(q_len, k_len)``, every rank's shard checked against it
    (and, without ``seq_len``, that the ranks agree on the shapes and ``scale`` and
    ``variants``: any disagreement is the same ValueError on every rank)."""
    if seq_len is not None:
        if comm.spoilt is not None:
            raise _spoilt_error(comm, comm.rank, comm.spoilt)
        return _given(comm, q, k, seq_len, layout)
    options = _option_facts(scale, **variants)
    dtype = str(q.dtype)
    facts = [q.shape[2], k.shape[2], q.shape[0], q.shape[1], k.shape[1], q.shape[3],
             v.shape[3], mask is not None, causal, window or 0, LAYOUTS.index(layout),
             sum(map(ord, dtype)), *options.values(), comm.spoilt is not None]
    every = comm.all_gather_ints(facts)
    spoilt = [r for r, row in enumerate(every) if row[-1]]
    if spoilt:  # every rank refuses: a marked one says why, the others which rank it was
        raise _spoilt_error(comm, comm.rank if comm.spoilt else spoilt[0], comm.spoilt)
    names = [*_SHAPES, *options]
    for i, name in enumerate(names[2:], start=2):
        column = [row[i] for row in every]
        if len(set(column)) > 1:  # an option's value is a digest: say which rank differs
            other = next(r for r, x in enumerate(column) if x != column[0])
            seen = (f"{column} (rank 0, 1, ...)" if name not in options
                    else f"rank {other}'s differs from rank 0's")
            raise ValueError(f"the ranks disagree on {name}: {seen}; every rank must call "
                             "with the same shapes and options")
    q_len, k_len = sum(row[0] for row in every), sum(row[1] for row in every)
    for name, total, col in (("queries", q_len, 0), ("keys", k_len, 1)):
        want = shard_lengths(total, comm.size, layout)
        got = [row[col] for row in every]
        if got != want:
            raise ValueError(f"the ranks hold {got} {name}; a {layout} split of {total} "
                             f"over {comm.size} ranks holds {want} (split with "
                             f"attnlab.distributed.shard(..., layout={layout!r}))")
    return q_len, k_len


def _given(comm, q, k, seq_len, layout) -> tuple[int, int]:
    if isinstance(seq_len, tuple | list) and len(seq_len) != 2:
        raise ValueError(f"seq_len must be the whole sequence's length, or (q_len, k_len) "
                         f"when they differ, got {seq_len!r}")
    q_len, k_len = (seq_len, seq_len) if not isinstance(seq_len, tuple | list) else seq_len
    for n in (q_len, k_len):
        optional_positive_int("seq_len", n)
    mine = [(shard_lengths(q_len, comm.size, layout)[comm.rank], q.shape[2]),
            (shard_lengths(k_len, comm.size, layout)[comm.rank], k.shape[2])]
    if any(want != got for want, got in mine):
        raise ValueError(f"rank {comm.rank}'s shards hold {q.shape[2]} queries and "
                         f"{k.shape[2]} keys; a {layout} split of seq_len={seq_len} over "
                         f"{comm.size} ranks gives it {mine[0][0]} and {mine[1][0]}")
    return q_len, k_len


def _spoilt_error(comm, rank: int, why: str | None) -> RingError:
    why = why if why is not None and rank == comm.rank else (
        f"rank {rank}'s earlier split call on this group raised between its messages")
    return RingError(f"{comm.what}: {why}; its peers' receives are still open and would take "
                     "this call's messages: make a new group (dist.new_group) for the split "
                     "attentions")


def _number(x) -> int:
    """A real number's float64 bits as an int64 (None: 0): equal only where equal. Anything
    else gets a digest of its type, alike on ranks that pass alike; the variants' own
    checks then name it."""
    if x is None:
        return 0
    if isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(float(x)):
        return struct.unpack("<q", struct.pack("<d", float(x)))[0]
    return zlib.crc32(type(x).__name__.encode()) + 1


def _tensor(t) -> int:
    """A digest of a replicated tensor's shape and values (None: 0); a tensor the checks
    will refuse (not floating point, on the meta device) by its shape and dtype alone."""
    if t is None:
        return 0
    if not isinstance(t, torch.Tensor):
        return _number(t)
    head = f"{tuple(t.shape)} {t.dtype}".encode()
    if not t.dtype.is_floating_point or t.device.type == "meta":
        return zlib.crc32(head) + 1
    values = t.detach().to("cpu", torch.float64).contiguous().numpy().tobytes()
    return zlib.crc32(values, zlib.crc32(head)) + 1


def _option_facts(scale, softcap=None, alibi_slopes=None, sinks=None, document_ids=None,
                  **_) -> dict[str, int]:
    """What every rank must pass alike beside the shapes, as ints to gather: the scale,
    the softcap, the slopes and sinks (replicated tensors: their values), and whether
    document ids came (each rank's are its own shard)."""
    return {"scale": _number(scale), "softcap": _number(softcap),
            "alibi_slopes": _tensor(alibi_slopes), "sinks": _tensor(sinks),
            "document_ids": int(document_ids is not None)}
