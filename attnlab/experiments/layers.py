"""Finding the attention modules of a model: written once for every experiment."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from torch import nn

from ..modules import MultiHeadAttention

__all__ = ["attention_layers", "scores_from_qk_alone"]


def attention_layers(model: nn.Module) -> list[MultiHeadAttention]:
    """The model's attention modules in layer order (one per layer).

    Every experiment edits attention through these modules' ``qkv_hook`` or weights;
    a model without one is refused here, naming its class."""
    found = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    if not found:
        raise ValueError(f"model has no MultiHeadAttention modules: {type(model).__name__}")
    return found


@contextlib.contextmanager
def scores_from_qk_alone(mha: MultiHeadAttention, heads: Iterable[int] | None = None
                         ) -> Iterator[None]:
    """Inside the block the chosen ``heads`` of ``mha`` (all by default) score keys by
    ``q . k`` alone: no ALiBi distance penalty and no sink's share (``mha.plain_heads``;
    its parameters are not edited, so autograd and the weights are as they were), so
    that equal scores give equal weights, as an ablation that makes attention uniform
    needs (a zero query under ALiBi still prefers near keys, and a sink still takes its
    share). The heads already set so stay so; restored on exit, also on an error."""
    chosen = range(mha.num_heads) if heads is None else heads
    before = mha.plain_heads
    mha.plain_heads = tuple(sorted(set(before) | {int(h) for h in chosen}))
    try:
        yield
    finally:
        mha.plain_heads = before
