"""Finding the attention modules of a model: written once for every experiment."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
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


# A sink logit that takes no share of any row (exp(-1e30 - lse) is 0), finite as
# attention requires of sinks.
_NO_SINK = -1e30


@contextlib.contextmanager
def scores_from_qk_alone(mha: MultiHeadAttention, heads: Iterable[int] | None = None
                         ) -> Iterator[None]:
    """Inside the block the chosen ``heads`` of ``mha`` (all by default) score keys by
    ``q . k`` alone: no ALiBi distance penalty (slope 0) and no sink, so that equal scores
    give equal weights, as an ablation that makes attention uniform needs (a zero query
    under ALiBi still prefers near keys, and a sink still takes its share). Restored on
    exit, also on an error."""
    chosen = list(range(mha.num_heads)) if heads is None else list(heads)
    slopes = mha._alibi_slopes
    sinks = None if mha.sinks is None else mha.sinks.detach().clone()
    try:
        if slopes is not None:
            flat = slopes.clone()
            flat[chosen] = 0.0
            mha._alibi_slopes = flat
        if sinks is not None:
            with torch.no_grad():
                mha.sinks[chosen] = _NO_SINK
        yield
    finally:
        mha._alibi_slopes = slopes
        if sinks is not None:
            with torch.no_grad():
                mha.sinks.copy_(sinks)
