"""Attention over a sequence split across processes, on ``torch.distributed``.

- :func:`ring_attention`: keys and values travel around the ring of ranks in pieces,
  overlapped with the local attention; exact, forward and backward.
- :func:`ulysses_attention`: all-to-all over heads (DeepSpeed-Ulysses); each rank
  attends a share of the heads over the whole sequence.
- The sharding helpers (:mod:`.shards`): split a sequence into contiguous or zig-zag
  shards and back, each shard's positions (RoPE), a padding mask's shard.
- :class:`ContextParallel`: the group and layout a module or model splits its sequence by.
"""

from .comm import RingError
from .context import ContextParallel
from .ring import ring_attention
from .shards import (
    LAYOUTS,
    gather,
    shard,
    shard_lengths,
    shard_mask,
    shard_positions,
    shard_ranges,
    unshard,
)
from .ulysses import ulysses_attention

__all__ = ["ring_attention", "ulysses_attention", "ContextParallel", "RingError", "LAYOUTS",
           "shard", "unshard", "gather", "shard_mask", "shard_positions", "shard_ranges",
           "shard_lengths"]
