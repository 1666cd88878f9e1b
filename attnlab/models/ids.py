"""Token ids entering a model: one check, so a bad id is named instead of an IndexError;
the positions of packed rows (``document_ids``)."""

from __future__ import annotations

import torch

from .._tracing import reads_values


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
    if ids.numel() == 0 or not reads_values():
        return
    if ids.numel() == 1 and ids.device.type == "cpu":  # a decoded token: no torch op
        low = high = int(ids.item())
    else:
        low, high = (int(v) for v in torch.aminmax(ids))  # one pass over a prompt
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{name} holds token id {bad}; expected ids in [0, {vocab_size}) "
                         f"(the model's vocab_size is {vocab_size})")


def document_positions(document_ids: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Each token's place in its document, ``(batch, seq)``: 0 where ``document_ids``
    changes (a document starts), counting up to its end. ``document_ids`` must be an
    integer tensor of ``shape`` (the ids')."""
    if not isinstance(document_ids, torch.Tensor) or document_ids.dtype.is_floating_point \
            or document_ids.dtype.is_complex or document_ids.dtype == torch.bool:
        raise TypeError(f"document_ids must be an integer tensor, got "
                        f"{getattr(document_ids, 'dtype', type(document_ids).__name__)}")
    if tuple(document_ids.shape) != tuple(shape):
        raise ValueError(f"document_ids must have the ids' shape {tuple(shape)} (batch, seq), "
                         f"got {tuple(document_ids.shape)}")
    index = torch.arange(shape[1], device=document_ids.device).expand(shape)
    starts = torch.ones(shape, dtype=torch.bool, device=document_ids.device)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def packed_positions(document_ids, shape: tuple[int, ...], caches: object,
                     positions: torch.Tensor | None) -> torch.Tensor | None:
    """The positions a model's forward uses for ``ids`` of ``shape`` packed with
    ``document_ids`` (each document from 0, :func:`document_positions`) unless
    ``positions`` are given; ``positions`` as they are without ``document_ids``. Packed
    rows are scored whole: ``caches`` must be None."""
    if document_ids is None:
        return positions
    if caches is not None:
        raise ValueError("document_ids is for packed rows scored whole; got caches too "
                         "(decode each document with a cache of its own)")
    return document_positions(document_ids, shape) if positions is None else positions
