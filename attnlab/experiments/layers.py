"""Finding the attention modules of a model: written once for every experiment."""

from __future__ import annotations

from torch import nn

from ..modules import MultiHeadAttention

__all__ = ["attention_layers"]


def attention_layers(model: nn.Module) -> list[MultiHeadAttention]:
    """The model's attention modules in layer order (one per layer).

    Every experiment edits attention through these modules' ``qkv_hook`` or weights;
    a model without one is refused here, naming its class."""
    found = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    if not found:
        raise ValueError(f"model has no MultiHeadAttention modules: {type(model).__name__}")
    return found
