"""Building, combining and checking attention masks.

One convention everywhere: a boolean mask is **True where a query may attend**
to a key, and broadcasts to ``(batch, heads, q_len, k_len)``. Float masks are
additive (0 where allowed, ``-inf`` where not). :func:`from_attention_mask`
converts what tokenizers return (1 = real token, 0 = padding).

Causal masks with ``q_len != k_len`` are aligned to the end (bottom-right): query ``i``
sits at position ``p = i + (k_len - q_len)`` and sees keys ``j <= p``, as decoding with
a KV cache needs. With document ids (packed sequences, :class:`Documents`) a query sees
only its document's keys, and the rules are aligned to each document's end.

The key rule is written once, in :func:`key_bounds` and :class:`KeyRule`; the
builders here derive from it. The conversions of other conventions live in
``mask_forms`` and are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .checks import positive_int
from .mask_forms import as_attention_mask, describe, from_attention_mask, padding

__all__ = [
    "causal",
    "padding",
    "sliding_window",
    "combine",
    "from_attention_mask",
    "describe",
    "structural",
    "as_attention_mask",
    "key_bounds",
    "KeyRule",
    "Documents",
]


def structural(q_len: int, k_len: int, *, causal: bool = False, window: int | None = None,
               device=None, documents: Documents | None = None) -> torch.Tensor | None:
    """The bool mask of the causal, window and document rules, or None if none:
    ``(q_len, k_len)``, or ``(B, 1, q_len, k_len)`` with ``documents``."""
    if not causal and window is None and documents is None:
        return None
    return KeyRule(q_len, k_len, causal=causal, window=window,
                   documents=documents).allowed(device=device)


def key_bounds(positions, k_len: int, *, causal: bool, window: int | None,
               starts=None, ends=None):
    """THE key rule: the keys ``[lo, hi)`` a query at ``positions`` may see.

    The one place it is written in Python (its C++ twin is ``csrc/mask.h``, and a test
    holds the two equal): a query at position ``p`` (in key coordinates) may see key
    ``j`` when ``j <= p`` (``causal``) and ``p - window < j`` (``window``; also
    ``j < p + window`` when not causal), ``0 <= j < k_len``, and, with documents,
    ``starts <= j < ends`` (the keys of the query's own document, see
    :class:`Documents`). Every query's keys form one interval, and both ends are
    non-decreasing in the query's row: a block of queries sees the keys from its first
    query's ``lo`` to its last one's ``hi``, and a tile is fully allowed when its last
    query's ``lo`` and its first query's ``hi`` cover it. Everything else here (mask
    builders, tile ranges, the fully-allowed test) derives from this function.

    ``positions`` is an int or an integer tensor (``starts``/``ends`` alike, or None);
    ``(lo, hi)`` come back alike, with ``0 <= lo <= hi <= k_len`` (``hi == lo``: no key).
    """
    lo, hi = 0, k_len
    if causal:
        hi = positions + 1
    if window is not None:
        lo = positions - window + 1
        if not causal:
            hi = positions + window
    if isinstance(positions, torch.Tensor):
        lo = torch.as_tensor(lo, device=positions.device).clamp(0, k_len)
        hi = torch.as_tensor(hi, device=positions.device).clamp(max=k_len)
        if starts is not None:  # the query's document: its keys only
            lo = torch.minimum(torch.maximum(lo, starts), ends)
            hi = torch.minimum(hi, ends)
        hi = torch.maximum(hi, lo)
        return lo.expand_as(positions), hi.expand_as(positions)
    lo = min(max(lo, 0), k_len)
    hi = min(hi, k_len)
    if starts is not None:
        lo = min(max(lo, starts), ends)
        hi = min(hi, ends)
    return lo, max(hi, lo)


@dataclass(frozen=True, eq=False)
class Documents:
    """The documents of one call (packed sequences): ``q_ids (B, q_len)`` and
    ``k_ids (B, k_len)`` integer tensors, non-decreasing along each row (``B`` the batch,
    or 1 for every batch element), as :func:`attnlab.attention` checks them.

    A query sees only the keys of its own document (the keys whose id equals its id),
    and within the document the causal/window rule (and ALiBi's distances) are aligned
    to the document's end, as FlashAttention's varlen kernels align each sequence: the
    ``r``-th of the ``n_q`` queries of a document whose ``n_k`` keys start at key ``s``
    sits at position ``s + r + n_k - n_q``. When every document has as many queries as
    keys, that is the global rule with no offset. Derived per query row (``(B, q_len)``
    long): ``starts``/``ends``, its document's keys ``[starts, ends)``, and
    ``offsets``, its position minus its row.
    """

    q_ids: torch.Tensor
    k_ids: torch.Tensor

    def __post_init__(self) -> None:
        q_ids, k_ids = self.q_ids, self.k_ids
        batch = max(q_ids.shape[0], k_ids.shape[0])
        q_ids = q_ids.expand(batch, -1).contiguous()
        k_ids = k_ids.expand(batch, -1).contiguous()
        starts = torch.searchsorted(k_ids, q_ids)
        ends = torch.searchsorted(k_ids, q_ids, right=True)
        q_ends = torch.searchsorted(q_ids, q_ids, right=True)
        for name, value in (("starts", starts), ("ends", ends), ("offsets", ends - q_ends)):
            object.__setattr__(self, name, value)

    @property
    def batch(self) -> int:
        return self.starts.shape[0]

    @classmethod
    def piece(cls, q_ids: torch.Tensor, k_ids: torch.Tensor, offset: int) -> Documents:
        """The documents of a block of a longer self-attention (split attention's pieces):
        queries with ids ``q_ids`` against keys with ids ``k_ids``, query row ``i`` at
        position ``i + offset`` among the keys. In the whole sequence every document has
        as many queries as keys, so its document-aligned positions are the sequence's:
        the block keeps them (``offsets`` all ``offset``) instead of aligning each
        document to the block's end."""
        docs = cls(q_ids, k_ids)
        object.__setattr__(docs, "offsets", torch.full_like(docs.offsets, int(offset)))
        return docs


@dataclass(frozen=True)
class KeyRule:
    """The key rule of one attention call: query row ``i`` sits at position
    ``i + offset`` and sees the keys :func:`key_bounds` gives it.

    ``offset`` defaults to ``k_len - q_len``: causal and window rules aligned to the
    end, what decoding with a KV cache needs (query ``i`` sees ``j <= i + k_len -
    q_len``). A piece of a longer sequence (a query or key block of ring attention)
    passes its own. With ``documents`` (:class:`Documents`) each query row sees only
    its document's keys and sits at its document-aligned position instead, so the
    bounds are per batch element: ``(B, n)`` tensors. Tiled kernels ask :meth:`block`
    which keys a block of queries visits and :meth:`full` whether a tile needs masking
    at all (both over every batch element).
    """

    q_len: int
    k_len: int
    causal: bool = False
    window: int | None = None
    offset: int | None = None
    documents: Documents | None = None

    def __post_init__(self) -> None:
        if self.documents is not None and self.offset is not None:
            raise ValueError("KeyRule takes an offset or documents (which place every "
                             "query at its document's end), not both")
        if self.offset is None:
            object.__setattr__(self, "offset", self.k_len - self.q_len)

    @property
    def structural(self) -> bool:
        """Whether the rule rules anything out beyond the keys' range."""
        return self.causal or self.window is not None or self.documents is not None

    @property
    def every_row_sees_a_key(self) -> bool:
        """Whether every query row surely sees a key, told without building the mask:
        the rule always lets a query see the key at its own position, so it holds where
        every row's position is a key's (``0 <= offset``, ``offset + q_len <= k_len``;
        end-aligned rules whenever ``q_len <= k_len``), and without a rule where there
        are keys. With documents it is not told (False)."""
        if self.documents is not None:
            return False
        if self.q_len == 0 or (not self.structural and self.k_len > 0):
            return True
        return self.offset >= 0 and self.offset + self.q_len <= self.k_len

    def positions(self, rows):
        """The positions (in key coordinates) of query ``rows`` (an int or an integer
        tensor): ``rows + offset``, or ``(B, n)`` document-aligned ones with documents."""
        if self.documents is None:
            return rows + self.offset
        return torch.as_tensor(rows) + self.documents.offsets[:, rows]

    def bounds(self, rows):
        """``(lo, hi)`` of query ``rows`` (an int or an integer tensor of row indices);
        ``(B,)``/``(B, n)`` tensors with documents."""
        if self.documents is None:
            return key_bounds(rows + self.offset, self.k_len, causal=self.causal,
                              window=self.window)
        docs = self.documents
        return key_bounds(self.positions(rows), self.k_len, causal=self.causal,
                          window=self.window, starts=docs.starts[:, rows],
                          ends=docs.ends[:, rows])

    @cached_property
    def _row_bounds(self) -> tuple[list[list[int]], list[list[int]]]:
        """Every row's ``(lo, hi)`` per batch element, as lists (documents only): the
        tile loops ask for a few of them per tile."""
        lo, hi = self.bounds(torch.arange(self.q_len, device=self.documents.starts.device))
        return lo.tolist(), hi.tolist()

    def block(self, q_start: int, q_end: int) -> tuple[int, int]:
        """The keys ``[lo, hi)`` any query of ``[q_start, q_end)`` may see (in any batch
        element); ``hi == lo`` when none. Tiled kernels visit only these."""
        if self.documents is None:
            lo, _ = self.bounds(q_start)
            _, hi = self.bounds(q_end - 1)
        elif q_end <= q_start:
            return 0, 0
        else:
            los, his = self._row_bounds
            lo = min(row[q_start] for row in los)
            hi = max(row[q_end - 1] for row in his)
        return lo, max(lo, hi)

    def full(self, q_start: int, q_end: int, k_start: int, k_end: int) -> bool:
        """Whether every query of ``[q_start, q_end)`` may see every key of
        ``[k_start, k_end)`` (in every batch element), so that the tile needs no mask."""
        if self.documents is None:
            last_lo, _ = self.bounds(q_end - 1)
            _, first_hi = self.bounds(q_start)
            return last_lo <= k_start and first_hi >= k_end
        if q_end <= q_start:
            return True
        los, his = self._row_bounds
        return all(lo[q_end - 1] <= k_start and hi[q_start] >= k_end
                   for lo, hi in zip(los, his))

    def allowed(self, q_start: int = 0, q_len: int | None = None, k_start: int = 0,
                k_len: int | None = None, *, rows: torch.Tensor | None = None,
                device=None) -> torch.Tensor:
        """The bool tile (True = may attend) of queries ``q_start..`` (or of the query
        indices ``rows``) and keys ``k_start..``; the whole matrix by default.
        ``(q_len, k_len)``, or ``(B, 1, q_len, k_len)`` with documents (broadcastable to
        ``(batch, heads, q_len, k_len)`` either way)."""
        if rows is None:
            q_len = self.q_len - q_start if q_len is None else q_len
            if self.documents is not None:
                device = self.documents.starts.device
            rows = torch.arange(q_start, q_start + q_len, device=device)
        k_len = self.k_len - k_start if k_len is None else k_len
        lo, hi = self.bounds(rows)
        j = torch.arange(k_start, k_start + k_len, device=rows.device)
        allowed = (j >= lo.unsqueeze(-1)) & (j < hi.unsqueeze(-1))
        return allowed if self.documents is None else allowed.unsqueeze(1)

    def pairs(self) -> int:
        """How many (query, key) pairs the rule lets through (over every batch element
        with documents)."""
        device = None if self.documents is None else self.documents.starts.device
        lo, hi = self.bounds(torch.arange(self.q_len, device=device))
        return int((hi - lo).sum())


def group_view(m: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """View a mask broadcastable to ``(B, Hq, Lq, Lk)`` as ``(B, Hkv, G, Lq, Lk)``-broadcastable.

    Grouped-query attention folds the G query heads that share a kv head into
    their own axis, so K and V are never repeated.
    """
    while m.ndim < 4:
        m = m.unsqueeze(0)
    if m.shape[1] == 1:
        return m.unsqueeze(2)
    return m.reshape(m.shape[0], kv_heads, m.shape[1] // kv_heads, *m.shape[2:])


def causal(q_len: int, k_len: int | None = None, *, device=None) -> torch.Tensor:
    """Causal mask ``(q_len, k_len)``, True where query i may see key j.

    With ``k_len > q_len`` (decoding after a prefix) the queries are the last
    ``q_len`` positions: ``j <= i + (k_len - q_len)``.

    >>> causal(3).int().tolist()
    [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    q_len = positive_int("q_len", q_len)
    k_len = q_len if k_len is None else positive_int("k_len", k_len)
    return KeyRule(q_len, k_len, causal=True).allowed(device=device)


def sliding_window(q_len: int, k_len: int, window: int, *, device=None) -> torch.Tensor:
    """Symmetric band ``(q_len, k_len)``: query at position p sees ``p - window < j < p + window``.

    Combine with :func:`causal` for the usual causal sliding window
    (``p - window < j <= p``). Positions are end-aligned like :func:`causal`.
    """
    q_len = positive_int("q_len", q_len)
    k_len = positive_int("k_len", k_len)
    window = positive_int("window", window)
    return KeyRule(q_len, k_len, window=window).allowed(device=device)


def combine(*masks: torch.Tensor | None) -> torch.Tensor | None:
    """Combine masks so a key is allowed only where every mask allows it.

    Bool masks are AND-ed; float (additive) masks are summed, and a bool mask
    meeting a float one becomes ``-inf`` where it forbids. ``None`` is skipped.
    """
    present = [m for m in masks if m is not None]
    if not present:
        return None
    floats = [m for m in present if m.dtype.is_floating_point]
    bools = [m for m in present if m.dtype == torch.bool]
    others = [m for m in present if m.dtype != torch.bool and not m.dtype.is_floating_point]
    if others:
        raise TypeError(
            f"masks must be bool or float, got {others[0].dtype}; "
            "convert 1/0 masks with masks.from_attention_mask"
        )
    allowed = None
    for m in bools:
        allowed = m if allowed is None else allowed & m
    if not floats:
        return allowed
    total = floats[0]
    for m in floats[1:]:
        total = total + m
    if allowed is not None:
        total = total.masked_fill(~allowed, float("-inf"))
    return total
