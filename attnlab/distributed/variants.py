"""The variants of :func:`attnlab.attention` across shards: what each block's local step
takes, and the one term (the sinks) that joins the merged softmax instead.

- ``softcap`` and ``alibi_slopes`` go to every block as they are: a block's rows and keys
  carry their positions in the whole sequence (the plan's offsets), so ALiBi's
  distances are the whole sequence's.
- ``sinks`` join each row's normaliser once, after the blocks are merged:
  ``lse' = logaddexp(lse, sink)`` and ``out' = out * exp(lse - lse')``; the blocks'
  backward then reads ``lse'`` (a sink weighs no value), and the sink's own gradient is
  ``-sum_rows exp(sink - lse') * rowsum(dO * O')``, this rank's rows' share.
- ``document_ids``: each rank's shard of the ids, split like the sequence; gathered
  once into the whole row's ids, from which every block takes its queries' and keys'
  (``masks.Documents.piece``). Self-attention only (one length for queries and keys).
- ``mask_mod`` and ``score_mod`` see positions a shard cannot give them: refused.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import _variants
from .. import masks as _masks
from .shards import shard_lengths, unshard

__all__ = ["SplitVariants", "check"]

_INF = float("inf")


@dataclasses.dataclass(frozen=True)
class SplitVariants:
    """The checked variants of one split call: ``block`` (what every block's step takes,
    without sinks or documents), ``sinks`` ``(q_heads,)`` or None, ``ids`` the whole
    sequence's document ids ``(1 or B, T)`` or None."""

    block: _variants.Variants | None
    sinks: torch.Tensor | None
    ids: torch.Tensor | None

    def request(self, q_len: int, k_len: int) -> _variants.Variants | None:
        """The variants the backend must take on ``q_len`` queries and ``k_len`` keys of a
        shard (documents as a stand-in: one document)."""
        if self.ids is None:
            return self.block
        zeros = self.ids.new_zeros(self.ids.shape[0], max(q_len, k_len))
        return dataclasses.replace(self.block or _variants.Variants(), documents=_masks.Documents(
            zeros[:, :q_len], zeros[:, :k_len]))

    def for_call(self, position: int, n: int, start: int, size: int, offset: int):
        """``(variants, offset)`` for the step of queries ``[position, position + n)``
        against keys ``[start, start + size)`` (whole-sequence positions), query row 0 at
        ``offset`` among the keys: with documents the offset rides in them."""
        if self.ids is None:
            return self.block, offset
        docs = _masks.Documents.piece(self.ids[:, position:position + n],
                                      self.ids[:, start:start + size], offset)
        return dataclasses.replace(self.block or _variants.Variants(), documents=docs), None

    def add_sinks(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Fold the sinks into the merged ``out (B, H, L, Dv)`` and ``lse (B, H, L)``
        (``-inf``: no key) in place."""
        if self.sinks is None:
            return
        sink = self.sinks.detach().to(lse.dtype).view(1, -1, 1)
        new = torch.logaddexp(lse, sink)
        out.mul_(torch.exp(lse - new).unsqueeze(-1))
        lse.copy_(new)

    def sink_grad(self, out, lse, grad_out) -> torch.Tensor | None:
        """This rank's rows' share of the sinks' gradient."""
        if self.sinks is None:
            return None
        delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # (B, H, L)
        share = torch.exp(self.sinks.detach().to(lse.dtype).view(1, -1, 1) - lse)
        return -(share * delta).sum(dim=(0, 2)).to(self.sinks.dtype)


def check(comm, q, k, q_len: int, k_len: int, layout: str, *, softcap=None,
          alibi_slopes=None, sinks=None, document_ids=None, mask_mod=None,
          score_mod=None) -> SplitVariants:
    """The variants of a split call on this rank's shards ``q``/``k`` of a sequence of
    ``q_len`` queries and ``k_len`` keys, checked (one all-gather with document ids)."""
    for name, value in (("mask_mod", mask_mod), ("score_mod", score_mod)):
        if value is not None:
            raise ValueError(f"{name} is not supported by split attention (its function "
                             "sees positions and heads no shard can give it); pass "
                             f"{name}=None, or express the rule as causal, window, "
                             "document_ids or a key mask")
    block = _variants.check(q, k, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    if block is not None and block.sinks is not None:
        sinks = block.sinks
        block = dataclasses.replace(block, sinks=None)
        block = None if not block.present() else block
    ids = None if document_ids is None else _whole_ids(comm, document_ids, q, k, q_len,
                                                       k_len, layout)
    return SplitVariants(block, sinks, ids)


def _whole_ids(comm, ids, q, k, q_len, k_len, layout) -> torch.Tensor:
    if q_len != k_len:
        raise ValueError(f"document_ids needs self-attention (one sequence of queries and "
                         f"keys), got q_len {q_len} and k_len {k_len}")
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"document_ids must be this rank's shard of the ids, a torch.Tensor, "
                        f"got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"document_ids must be an integer tensor, got dtype {ids.dtype}")
    n, batch = k.shape[2], k.shape[0]
    if tuple(ids.shape) not in {(n,), (batch, n)}:
        raise ValueError(f"document_ids must be this rank's shard of the ids, ({n},) or "
                         f"({batch}, {n}) (split like the sequence), got {tuple(ids.shape)}")
    ids = ids.to(device=q.device, dtype=torch.int64)
    ids = (ids.unsqueeze(0) if ids.ndim == 1 else ids).expand(batch, n)
    lengths = shard_lengths(k_len, comm.size, layout)
    whole = unshard(comm.all_gather(ids, lengths, "gathering the document ids of"),
                    layout=layout, dim=1)
    down = whole[:, 1:] < whole[:, :-1]
    if bool(down.any()):
        row, at = (int(i) for i in down.nonzero()[0])
        raise ValueError(f"document_ids must be non-decreasing along the whole sequence "
                         f"(packed documents, in order), got {int(whole[row, at])} then "
                         f"{int(whole[row, at + 1])} at positions {at}, {at + 1} of "
                         f"sequence {row}")
    return whole
