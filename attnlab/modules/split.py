"""A sequence split across processes, as :class:`~attnlab.modules.MultiHeadAttention`
runs it: with ``context_parallel`` set (:class:`attnlab.distributed.ContextParallel`) the
module takes this rank's shard of the sequence, rotates it at its positions in the whole
sequence and attends over the whole sequence through ring (or all-to-all) attention."""

from __future__ import annotations

import torch

from ..distributed import ContextParallel

__all__ = ["SplitSequence"]


class SplitSequence:
    """Mixed into :class:`~attnlab.modules.MultiHeadAttention` (``causal``, ``window``,
    ``backend``, ``dropout``, ``training``)."""

    context_parallel: ContextParallel | None

    def _split_context(self, context_parallel: object) -> None:
        if context_parallel is not None and not isinstance(context_parallel, ContextParallel):
            raise TypeError("context_parallel must be an attnlab.distributed.ContextParallel or "
                            f"None, got {type(context_parallel).__name__}")
        self.context_parallel = context_parallel

    def _split_positions(self, x: torch.Tensor, kv, cache, positions, return_weights,
                         rope: bool):
        """The checks of a split call, and the RoPE positions of this rank's tokens."""
        for name, value in (("kv", kv), ("cache", cache)):
            if value is not None:
                raise ValueError(f"{name} is not supported with context_parallel: a split "
                                 "sequence attends to itself, without a cache")
        if return_weights:
            raise ValueError("return_weights is not supported with context_parallel (no rank "
                             "holds a whole row of weights)")
        if self.training and self.dropout:
            raise ValueError(f"dropout={self.dropout} on the attention weights is not supported "
                             "with context_parallel; train with dropout=0.0")
        whole = None  # the whole sequence's length: one small gather without a seq_len
        if self.context_length is not None or (rope and positions is None):
            whole = self.context_parallel.total(x.shape[1])
        if self.context_length is not None and whole > self.context_length:
            raise ValueError(f"sequence of {whole} tokens (split over the ranks) is longer "
                             f"than context_length={self.context_length}")
        if rope and positions is None:
            positions = self.context_parallel.positions(x.shape[1], seq_len=whole,
                                                        device=x.device)
        return positions

    def _split_attention(self, q, k, v, mask, **options) -> torch.Tensor:
        """``(B, H, L_rank, D)`` shards -> this rank's output shard ``(B, H, L_rank, Dv)``;
        ``options``: the scores' options (scale, softcap, ALiBi, sinks) and this rank's
        shard of ``document_ids``."""
        return self.context_parallel.attention(q, k, v, causal=self.causal, window=self.window,
                                               mask=mask, backend=self.backend, **options)
