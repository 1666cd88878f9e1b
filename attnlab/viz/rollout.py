"""Attention rollout (Abnar and Zuidema 2020, "Quantifying Attention Flow in Transformers").

Raw weights say where one layer looked; rollout follows the information through
all layers. Per layer, average the heads' weights ``A`` (``q_len x k_len``), add
the residual connection as the identity, ``0.5 * A + 0.5 * I``, re-normalise the
rows, and multiply the layers together, first layer on the right:
``R = Ã_L · … · Ã_2 · Ã_1``. Row ``i`` of ``R`` says how much each input token
flowed into position ``i`` after the last layer.

Pure array math (NumPy): it takes what a model returns with
``output_attentions=True`` and never needs the model itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .data import to_numpy

__all__ = ["rollout"]


def rollout(attentions: Any, *, residual: float = 0.5, layers: bool = False) -> np.ndarray:
    """Attention rollout of a stack of self-attention layers.

    Args:
        attentions: one array per layer (as models return them with
            ``output_attentions=True``), each ``(batch, heads, seq, seq)`` or
            ``(heads, seq, seq)``: torch tensors, NumPy arrays or nested lists.
            Self-attention only (``q_len == k_len``).
        residual: the weight of the identity, ``residual * I + (1 - residual) * A``
            (0.5 as in the paper; 0 = the plain product of head-averaged weights).
        layers: return the rollout after every layer, not only after the last.

    Returns:
        float64 ``(seq, seq)`` (``(batch, seq, seq)`` for batched input), rows summing
        to 1; with ``layers=True`` one more leading axis, one entry per layer.
    """
    if not 0.0 <= float(residual) <= 1.0:
        raise ValueError(f"residual must be in [0, 1], got {residual!r}")
    arrays = [to_numpy(_double(a), f"attentions[{i}]") for i, a in enumerate(list(attentions))]
    if not arrays:
        raise ValueError("attentions: expected at least one layer, got an empty sequence")
    shape = arrays[0].shape
    for i, a in enumerate(arrays):
        if a.ndim not in (3, 4) or a.shape[-1] != a.shape[-2] or a.shape != shape:
            raise ValueError(f"attentions[{i}]: expected (batch, heads, seq, seq) or (heads, "
                             f"seq, seq) self-attention, the same for every layer, got "
                             f"{a.shape} (layer 0: {shape})")
    seq = shape[-1]
    eye = np.eye(seq)
    out = np.broadcast_to(eye, shape[:-3] + (seq, seq)).copy()
    steps = []
    for a in arrays:
        mixed = (1.0 - residual) * a.mean(axis=-3) + residual * eye  # (..., seq, seq)
        mixed = mixed / np.clip(mixed.sum(axis=-1, keepdims=True), 1e-12, None)
        out = mixed @ out
        steps.append(out)
    return np.stack(steps) if layers else out


def _double(a: Any) -> Any:
    """A torch tensor in float64 before it becomes NumPy (the pictures' float32 would
    round off what a float64 model computed)."""
    if hasattr(a, "detach") and type(a).__module__.startswith("torch"):
        return a.detach().cpu().double().numpy()
    return a
