"""The mask conventions people bring, turned into attnlab's, and a text picture of a mask.

attnlab's convention (``masks``): a bool mask is True where a query may attend and
broadcasts to ``(batch, heads, q_len, k_len)``; float masks are additive. Here:
key-padding masks from lengths, tokenizer-style 1/0 masks, PyTorch's True = masked,
the 2-D/3-D masks modules and models take, and :func:`describe`. Re-exported by
:mod:`attnlab.masks`, where users find them; nothing here depends on the key rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .checks import positive_int

__all__ = ["padding", "from_attention_mask", "as_attention_mask", "describe"]


def padding(lengths: Sequence[int] | torch.Tensor, seq_len: int, *, device=None) -> torch.Tensor:
    """Key padding mask ``(batch, 1, 1, seq_len)``: True for the first ``lengths[b]`` keys.

    Broadcasts against ``(batch, heads, q_len, k_len)``.
    """
    seq_len = positive_int("seq_len", seq_len)
    lengths = torch.as_tensor(lengths, device=device)
    if lengths.ndim != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise ValueError(
            f"lengths must be a 1-D sequence of ints, got shape {tuple(lengths.shape)} "
            f"dtype {lengths.dtype}"
        )
    if len(lengths) and (int(lengths.min()) < 0 or int(lengths.max()) > seq_len):
        raise ValueError(
            f"lengths must lie in [0, seq_len={seq_len}], got {lengths.tolist()}"
        )
    keep = torch.arange(seq_len, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)
    return keep[:, None, None, :]


def from_attention_mask(attention_mask: torch.Tensor, *, masked_is_true: bool = False
                        ) -> torch.Tensor:
    """Convert a mask of another convention to attnlab's.

    - a tokenizer-style ``(batch, seq)`` 1/0 integer mask (1 = real token)
      becomes a bool key mask ``(batch, 1, 1, seq)``;
    - a bool mask with ``masked_is_true=True`` (PyTorch ``key_padding_mask``
      style: True = ignore) is inverted; a 2-D one is treated as
      ``(batch, seq)`` key padding;
    - higher-rank masks keep their shape.
    """
    if not isinstance(attention_mask, torch.Tensor):
        attention_mask = torch.as_tensor(attention_mask)
    m = attention_mask
    if m.dtype.is_floating_point:
        raise TypeError(
            "attention_mask must be an integer 1/0 or bool tensor, got "
            f"{m.dtype}; float masks are additive and used as they are"
        )
    if m.dtype != torch.bool:
        values = torch.unique(m)
        if not bool(((values == 0) | (values == 1)).all()):
            raise ValueError(
                f"attention_mask must hold only 0 and 1, got values {values.tolist()[:8]}"
            )
        m = m == 1
    if masked_is_true:
        m = ~m
    if m.ndim == 2:
        m = m[:, None, None, :]
    return m


def as_attention_mask(mask: torch.Tensor | None, batch: int, k_len: int
                      ) -> torch.Tensor | None:
    """A mask as modules and models take it, in :func:`attnlab.attention`'s convention.

    The one conversion at the module/model boundary:

    - 2-D ``(batch, k_len)``: key padding, bool (True = real token) or 1/0
      integers as tokenizers return them -> ``(batch, 1, 1, k_len)``;
    - 3-D ``(batch, q_len, k_len)``: one mask per example shared by all heads ->
      ``(batch, 1, q_len, k_len)`` (never read as per-head: that would silently
      mix examples and heads whenever batch == heads);
    - 4-D: as it is. Integer 1/0 masks become bool; float masks stay additive.

    Bool and float 4-D masks pass through without any work, so a model converts
    once and its layers pay nothing for the mask they are handed.
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.ndim == 2:
        if mask.shape[1] != k_len or mask.shape[0] not in (1, batch):
            raise ValueError(
                f"a 2-D mask is a key-padding mask (batch={batch}, k_len={k_len}), got shape "
                f"{tuple(mask.shape)}; give a per-query (q_len, k_len) mask as mask[None, None]"
            )
        if mask.dtype == torch.bool or mask.dtype.is_floating_point:
            return mask[:, None, None, :]
    elif mask.ndim == 3:
        if mask.shape[0] not in (1, batch):
            raise ValueError(
                f"a 3-D mask is (batch={batch}, q_len, k_len), got shape {tuple(mask.shape)}; "
                "give a per-head mask as (batch, heads, q_len, k_len)"
            )
        mask = mask[:, None]
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        return from_attention_mask(mask)  # 1/0 ints -> bool
    return mask


def describe(mask: torch.Tensor, *, max_size: int = 32) -> str:
    """A small text picture of a 2-D mask (or the first matrix of a bigger one).

    ``#`` = may attend, ``.`` = masked. Float masks: allowed where > -inf.
    """
    m = torch.as_tensor(mask)
    if m.dtype.is_floating_point:
        m = m > float("-inf")
    m = m.bool()
    while m.ndim > 2:
        m = m[0]
    if m.ndim != 2:
        raise ValueError(f"mask must have at least 2 dimensions, got shape {tuple(m.shape)}")
    q_len, k_len = m.shape
    rows = [
        f"q{i:<3d}" + "".join("#" if bool(m[i, j]) else "." for j in range(min(k_len, max_size)))
        + (" ..." if k_len > max_size else "")
        for i in range(min(q_len, max_size))
    ]
    if q_len > max_size:
        rows.append("...")
    allowed = int(m.sum())
    header = f"mask {q_len}x{k_len}: {allowed}/{q_len * k_len} allowed (# = may attend)"
    return "\n".join([header, *rows])
