"""How every attnlab model returns what it was asked for, beside its main output."""

from __future__ import annotations

import torch


def with_extras(out: torch.Tensor, attentions: list | None, hidden_states: list | None):
    """``out`` alone when nothing extra was asked for, else the tuple ``(out, attentions?,
    hidden_states?)`` holding only what was asked for, in that order (``attentions``:
    one ``(batch, heads, q_len, k_len)`` tensor per layer; ``hidden_states``: the
    embeddings, then each layer's output, each ``(batch, seq, d_model)``)."""
    extras = tuple(x for x in (attentions, hidden_states) if x is not None)
    return (out, *extras) if extras else out
