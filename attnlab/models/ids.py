"""Token ids entering a model: one check, so a bad id is named instead of an IndexError."""

from __future__ import annotations

import torch


def check_ids(ids: torch.Tensor, vocab_size: int, name: str = "ids") -> None:
    """Refuse ``(batch, seq)`` ids outside ``[0, vocab_size)``.

    An embedding lookup would raise a bare ``IndexError: index out of range in
    self`` (on a GPU, a device-side assert that poisons the whole process).
    """
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.dtype.is_floating_point \
            or ids.dtype == torch.bool or ids.is_complex():
        got = (f"shape {tuple(ids.shape)} dtype {ids.dtype}" if isinstance(ids, torch.Tensor)
               else type(ids).__name__)
        raise ValueError(f"{name} must be a (batch, seq) integer tensor, got {got}")
    if ids.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(ids))  # one pass: this runs every token
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{name} holds token id {bad}; expected ids in [0, {vocab_size}) "
                         f"(the model's vocab_size is {vocab_size})")
