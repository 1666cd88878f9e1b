"""Building, combining and checking attention masks.

One convention everywhere: a boolean mask is **True where a query may attend**
to a key, and broadcasts to ``(batch, heads, q_len, k_len)``. Float masks are
additive (0 where allowed, ``-inf`` where not). :func:`from_attention_mask`
converts what tokenizers return (1 = real token, 0 = padding).

Causal masks with ``q_len != k_len`` are aligned to the end (bottom-right):
query ``i`` sits at position ``p = i + (k_len - q_len)`` and sees keys
``j <= p``. That is what decoding with a KV cache needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .checks import positive_int

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
]


def structural(q_len: int, k_len: int, *, causal: bool = False, window: int | None = None,
               device=None) -> torch.Tensor | None:
    """The ``(q_len, k_len)`` bool mask of the causal and window rules, or None if neither."""
    if not causal and window is None:
        return None
    return KeyRule(q_len, k_len, causal=causal, window=window).allowed(device=device)


def key_bounds(positions, k_len: int, *, causal: bool, window: int | None):
    """THE key rule: the keys ``[lo, hi)`` a query at ``positions`` may see.

    The one place it is written in Python (its C++ twin is ``csrc/mask.h``, and a test
    holds the two equal): a query at position ``p`` (in key coordinates) may see key
    ``j`` when ``j <= p`` (``causal``) and ``p - window < j`` (``window``; also
    ``j < p + window`` when not causal), ``0 <= j < k_len``. Every query's keys form
    one interval, and both ends are non-decreasing in ``p``: a block of queries sees
    the keys from its first query's ``lo`` to its last one's ``hi``, and a tile is
    fully allowed when its last query's ``lo`` and its first query's ``hi`` cover it.
    Everything else here (mask builders, tile ranges, the fully-allowed test) derives
    from this function.

    ``positions`` is an int or an integer tensor; ``(lo, hi)`` come back alike, with
    ``0 <= lo <= hi <= k_len`` (``hi == lo``: no key).
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
        hi = torch.maximum(torch.as_tensor(hi, device=positions.device).clamp(max=k_len), lo)
        return lo.expand_as(positions), hi.expand_as(positions)
    lo = min(max(lo, 0), k_len)
    return lo, max(min(hi, k_len), lo)


@dataclass(frozen=True)
class KeyRule:
    """The key rule of one attention call: query row ``i`` sits at position
    ``i + offset`` and sees the keys :func:`key_bounds` gives it.

    ``offset`` defaults to ``k_len - q_len``: causal and window rules aligned to the
    end, what decoding with a KV cache needs (query ``i`` sees ``j <= i + k_len -
    q_len``). A piece of a longer sequence (a query or key block of ring attention)
    passes its own. Tiled kernels ask :meth:`block` which keys a block of queries
    visits and :meth:`full` whether a tile needs masking at all.
    """

    q_len: int
    k_len: int
    causal: bool = False
    window: int | None = None
    offset: int | None = None

    def __post_init__(self) -> None:
        if self.offset is None:
            object.__setattr__(self, "offset", self.k_len - self.q_len)

    @property
    def structural(self) -> bool:
        """Whether the rule rules anything out beyond the keys' range."""
        return self.causal or self.window is not None

    def bounds(self, rows):
        """``(lo, hi)`` of query ``rows`` (an int or an integer tensor of row indices)."""
        return key_bounds(rows + self.offset, self.k_len, causal=self.causal,
                          window=self.window)

    def block(self, q_start: int, q_end: int) -> tuple[int, int]:
        """The keys ``[lo, hi)`` any query of ``[q_start, q_end)`` may see; ``hi == lo``
        when none. Tiled kernels visit only these."""
        lo, _ = self.bounds(q_start)
        _, hi = self.bounds(q_end - 1)
        return lo, max(lo, hi)

    def full(self, q_start: int, q_end: int, k_start: int, k_end: int) -> bool:
        """Whether every query of ``[q_start, q_end)`` may see every key of
        ``[k_start, k_end)``, so that the tile needs no mask."""
        last_lo, _ = self.bounds(q_end - 1)
        _, first_hi = self.bounds(q_start)
        return last_lo <= k_start and first_hi >= k_end

    def allowed(self, q_start: int = 0, q_len: int | None = None, k_start: int = 0,
                k_len: int | None = None, *, rows: torch.Tensor | None = None,
                device=None) -> torch.Tensor:
        """The bool tile ``(q_len, k_len)`` (True = may attend) of queries
        ``q_start..`` (or of the query indices ``rows``) and keys ``k_start..``;
        the whole ``(q_len, k_len)`` matrix by default."""
        if rows is None:
            q_len = self.q_len - q_start if q_len is None else q_len
            rows = torch.arange(q_start, q_start + q_len, device=device)
        k_len = self.k_len - k_start if k_len is None else k_len
        lo, hi = self.bounds(rows)
        j = torch.arange(k_start, k_start + k_len, device=rows.device)
        return (j >= lo.unsqueeze(-1)) & (j < hi.unsqueeze(-1))

    def pairs(self) -> int:
        """How many (query, key) pairs the rule lets through."""
        lo, hi = self.bounds(torch.arange(self.q_len))
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


def padding(lengths: Sequence[int] | torch.Tensor, seq_len: int, *, device=None) -> torch.Tensor:
    """Key padding mask ``(batch, 1, 1, seq_len)``: True for the first ``lengths[b]`` keys.

    Broadcasts against ``(batch, heads, q_len, k_len)``.
    """
    seq_len = positive_int("seq_len", seq_len)
    lengths = torch.as_tensor(lengths, device=device)
    if lengths.ndim != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise ValueError(
            f"lengths must be a 1-D sequence of ints, got shape {tuple(lengths.shape)} "
            f"dtype {lengths.dtype}"
        )
    if len(lengths) and (int(lengths.min()) < 0 or int(lengths.max()) > seq_len):
        raise ValueError(
            f"lengths must lie in [0, seq_len={seq_len}], got {lengths.tolist()}"
        )
    keep = torch.arange(seq_len, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)
    return keep[:, None, None, :]


def from_attention_mask(attention_mask: torch.Tensor, *, masked_is_true: bool = False
                        ) -> torch.Tensor:
    """Convert a mask of another convention to attnlab's.

    - a tokenizer-style ``(batch, seq)`` 1/0 integer mask (1 = real token)
      becomes a bool key mask ``(batch, 1, 1, seq)``;
    - a bool mask with ``masked_is_true=True`` (PyTorch ``key_padding_mask``
      style: True = ignore) is inverted; a 2-D one is treated as
      ``(batch, seq)`` key padding;
    - higher-rank masks keep their shape.
    """
    if not isinstance(attention_mask, torch.Tensor):
        attention_mask = torch.as_tensor(attention_mask)
    m = attention_mask
    if m.dtype.is_floating_point:
        raise TypeError(
            "attention_mask must be an integer 1/0 or bool tensor, got "
            f"{m.dtype}; float masks are additive and used as they are"
        )
    if m.dtype != torch.bool:
        values = torch.unique(m)
        if not bool(((values == 0) | (values == 1)).all()):
            raise ValueError(
                f"attention_mask must hold only 0 and 1, got values {values.tolist()[:8]}"
            )
        m = m == 1
    if masked_is_true:
        m = ~m
    if m.ndim == 2:
        m = m[:, None, None, :]
    return m


def as_attention_mask(mask: torch.Tensor | None, batch: int, k_len: int
                      ) -> torch.Tensor | None:
    """A mask as modules and models take it, in :func:`attnlab.attention`'s convention.

    The one conversion at the module/model boundary:

    - 2-D ``(batch, k_len)``: key padding, bool (True = real token) or 1/0
      integers as tokenizers return them -> ``(batch, 1, 1, k_len)``;
    - 3-D ``(batch, q_len, k_len)``: one mask per example shared by all heads ->
      ``(batch, 1, q_len, k_len)`` (never read as per-head: that would silently
      mix examples and heads whenever batch == heads);
    - 4-D: as it is. Integer 1/0 masks become bool; float masks stay additive.

    Bool and float 4-D masks pass through without any work, so a model converts
    once and its layers pay nothing for the mask they are handed.
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.ndim == 2:
        if mask.shape[1] != k_len or mask.shape[0] not in (1, batch):
            raise ValueError(
                f"a 2-D mask is a key-padding mask (batch={batch}, k_len={k_len}), got shape "
                f"{tuple(mask.shape)}; give a per-query (q_len, k_len) mask as mask[None, None]"
            )
        if mask.dtype == torch.bool or mask.dtype.is_floating_point:
            return mask[:, None, None, :]
    elif mask.ndim == 3:
        if mask.shape[0] not in (1, batch):
            raise ValueError(
                f"a 3-D mask is (batch={batch}, q_len, k_len), got shape {tuple(mask.shape)}; "
                "give a per-head mask as (batch, heads, q_len, k_len)"
            )
        mask = mask[:, None]
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        return from_attention_mask(mask)  # 1/0 ints -> bool
    return mask


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


def additive_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an additive mask is shifted and added in for inputs of ``dtype``:
    float64 for float64, else float32 (never bf16/fp16, which would round the bias)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# Scratch of the allowed-key maximum: about this many mask entries per step.
_SHIFT_SCRATCH = 1 << 22


def shift_rows(mask: torch.Tensor, q_len: int, k_len: int, *, causal: bool = False,
               window: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An additive mask with each row's largest *allowed* entry moved to 0.

    Softmax ignores a constant added to a row, so this changes no weight, but it
    keeps large finite values (HF's ``finfo.min``, ``-1e9``, a BLOOM-style
    ``slope * j``) from swallowing the scores when added in float32. The maximum is
    taken over the keys the causal/window rule allows (as ``reference.py`` does): a
    big value on a key the rule forbids would otherwise push the allowed entries so
    far down that their differences are lost. The arithmetic runs in at least
    ``dtype`` (float32; the kernels add the mask in their compute dtype), never in
    bf16/fp16, whose 8/11-bit mantissas cannot hold ``slope * j`` exactly.

    ``mask`` broadcasts to ``(..., q_len, k_len)``. Its shape is kept when one shift
    fits every query row (no rule, or a rule that leaves each row's maximum alone);
    otherwise the result is ``(..., q_len, k_len)``. Entries the rule forbids may
    come out positive; they are clamped to 0 so that no finite pair of values can
    overflow to ``+inf`` (they are masked to ``-inf`` anyway). Rows with no allowed
    key are left unshifted. The shift carries no gradient (softmax has none there).
    """
    while mask.ndim < 2:
        mask = mask.unsqueeze(0)
    mask = mask.to(torch.promote_types(mask.dtype, dtype))
    if k_len == 0 or mask.shape[-1] == 0:
        return mask  # no keys: nothing to shift
    top = mask.detach().amax(dim=-1, keepdim=True)  # (..., q_len or 1, 1)
    rule = KeyRule(q_len, k_len, causal=causal, window=window)
    if not rule.full(0, q_len, 0, k_len):
        row_top = _allowed_max(mask.detach(), rule)
        row_top = torch.where(torch.isfinite(row_top), row_top, top)  # empty rows: any shift
        if not torch.equal(row_top, top.expand_as(row_top)):
            top = row_top
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return (mask - top).clamp(max=0.0)


def _allowed_max(mask: torch.Tensor, rule: KeyRule) -> torch.Tensor:
    """Each query row's largest mask entry over the keys ``rule`` allows,
    ``(..., q_len, 1)`` (``-inf`` for a row with none), a block of rows at a time."""
    batch = mask.shape[:-2].numel()
    step = max(1, _SHIFT_SCRATCH // max(1, batch * rule.k_len))
    tops = []
    for start in range(0, rule.q_len, step):
        n = min(step, rule.q_len - start)
        allowed = rule.allowed(start, n, device=mask.device)
        part = mask[..., start:start + n, :] if mask.shape[-2] > 1 else mask
        tops.append(part.masked_fill(~allowed, float("-inf")).amax(dim=-1, keepdim=True))
    if not tops:  # no query rows
        return mask.new_empty((*mask.shape[:-2], 0, 1))
    return torch.cat(tops, dim=-2)


def describe(mask: torch.Tensor, *, max_size: int = 32) -> str:
    """A small text picture of a 2-D mask (or the first matrix of a bigger one).

    ``#`` = may attend, ``.`` = masked. Float masks: allowed where > -inf.
    """
    m = torch.as_tensor(mask)
    if m.dtype.is_floating_point:
        m = m > float("-inf")
    m = m.bool()
    while m.ndim > 2:
        m = m[0]
    if m.ndim != 2:
        raise ValueError(f"mask must have at least 2 dimensions, got shape {tuple(m.shape)}")
    q_len, k_len = m.shape
    rows = [
        f"q{i:<3d}" + "".join("#" if bool(m[i, j]) else "." for j in range(min(k_len, max_size)))
        + (" ..." if k_len > max_size else "")
        for i in range(min(q_len, max_size))
    ]
    if q_len > max_size:
        rows.append("...")
    allowed = int(m.sum())
    header = f"mask {q_len}x{k_len}: {allowed}/{q_len * k_len} allowed (# = may attend)"
    return "\n".join([header, *rows])
