"""Finding the attention modules of a model: written once for every experiment."""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ..modules import MultiHeadAttention

__all__ = ["attention_layers", "scores_from_qk_alone", "is_decoder", "token_batch",
           "layer_head", "whole"]


def is_decoder(model: nn.Module) -> bool:
    return hasattr(model, "generate")


def token_batch(model: nn.Module, ids, *, least: int = 2, name: str = "ids") -> torch.Tensor:
    """``ids`` checked as a batch ``(batch, seq)`` of integer token ids, as int64; ``least``:
    the shortest row (2 for a next-token loss: a token and the next). A loss is asked of
    an encoder (``least`` 2) is refused: it has no next-token prediction."""
    if least >= 2 and not is_decoder(model):
        raise ValueError(f"a next-token loss needs a decoder; {type(model).__name__} is an "
                         "encoder (head_importance measures how its embeddings move)")
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or \
            ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of token ids, got "
                        f"{getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < least:
        raise ValueError(f"{name} must be (batch, seq) with batch >= 1 and seq >= {least}"
                         f"{' (a token and the next)' if least >= 2 else ''}, got shape "
                         f"{tuple(ids.shape)}")
    return ids.long()


def whole(value) -> int | None:
    """``value`` as an int where it is a whole number: a Python or NumPy integer, or a
    0-d integer tensor (``logits.argmax()``); None for anything else (a float, a bool)."""
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or value.dtype.is_floating_point or value.dtype.is_complex or \
                value.dtype == torch.bool:
            return None
        return int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def layer_head(model_layers: list, layer, head) -> tuple[int, int]:
    """``(layer, head)`` checked against the model's attention modules: whole numbers
    (:func:`whole`: a float head was truncated) in range (``show``'s rule,
    :func:`attnlab.viz.capture.pick`: a negative one counted from the end)."""
    from ..viz.capture import pick

    for name, value in (("layer", layer), ("head", head)):
        if whole(value) is None:
            raise TypeError(f"{name} (--{name}) must be an integer, got {value!r}")
    layer = pick(len(model_layers), whole(layer), "layer")[0]
    return layer, pick(model_layers[layer].num_heads, whole(head), "head")[0]


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
