"""A preallocated key/value cache for incremental decoding (one per attention layer).

Keys and values of the tokens seen so far are written once into fixed buffers
``(batch, num_kv_heads, max_seq_len, head_dim)``; each decoding step appends the
new token's keys/values and attends over a *view* of the filled part, so no step
copies the whole history. Causal masking stays right because
:func:`attnlab.attention` aligns causal masks to the end when ``q_len < k_len``.
"""

from __future__ import annotations

import torch

from .checks import is_int
from .checks import positive_int as _positive

__all__ = ["KVCache"]


class KVCache:
    """Fixed-size key/value buffers for one attention layer.

    Args:
        batch_size (int): number of sequences ``B`` decoded together.
        max_seq_len (int): most positions the cache can hold (prompt + generated).
        num_kv_heads (int): key/value heads ``Hkv`` of the layer (fewer than the
            query heads with grouped-query attention).
        head_dim (int): size ``D`` of each head's keys and values.
        dtype: dtype of the buffers (default: torch's default dtype).
        device: device of the buffers.

    Attributes:
        k, v: the buffers ``(B, Hkv, max_seq_len, D)``; only ``[:, :, :seq_len]`` is valid.

    Example:
        >>> cache = KVCache(1, 16, num_kv_heads=2, head_dim=8)
        >>> k_all, v_all = cache.update(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
        >>> k_all.shape, cache.seq_len
        (torch.Size([1, 2, 5, 8]), 5)
    """

    def __init__(
        self,
        batch_size: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.batch_size = _positive("batch_size", batch_size)
        self.max_seq_len = _positive("max_seq_len", max_seq_len)
        self.num_kv_heads = _positive("num_kv_heads", num_kv_heads)
        self.head_dim = _positive("head_dim", head_dim)
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda:0', "
                                 f"got {device!r}") from exc
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._len = 0

    def __repr__(self) -> str:
        return (
            f"KVCache(batch_size={self.batch_size}, max_seq_len={self.max_seq_len}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"seq_len={self._len}, dtype={self.k.dtype}, device={self.k.device})"
        )

    @property
    def seq_len(self) -> int:
        """Number of positions filled so far (the position of the next token)."""
        return self._len

    @property
    def remaining(self) -> int:
        """Number of positions still free."""
        return self.max_seq_len - self._len

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    def check_layout(self, batch_size: int, num_kv_heads: int, head_dim: int,
                     who: str = "input") -> None:
        """Raise ValueError unless the cache is laid out for this batch size and heads."""
        if batch_size != self.batch_size:
            raise ValueError(
                f"cache has batch_size {self.batch_size} but the {who} has batch size "
                f"{batch_size}; expected them equal"
            )
        if num_kv_heads != self.num_kv_heads or head_dim != self.head_dim:
            raise ValueError(
                f"cache holds num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim} "
                f"but the {who} has num_kv_heads={num_kv_heads}, head_dim={head_dim}; "
                "expected the same head layout"
            )

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new keys and values; return all keys and values so far.

        Args:
            k: ``(B, Hkv, T_new, D)`` keys of the new tokens.
            v: ``(B, Hkv, T_new, D)`` values of the new tokens.

        Returns:
            ``(k_all, v_all)``, each ``(B, Hkv, seq_len, D)``: views into the buffers
            (valid until the next ``update``/``reset``/``crop``).

        Raises:
            ValueError: wrong shapes, or more new positions than remain (nothing is
                written then).
        """
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.ndim != 4:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"{name} must be (batch, num_kv_heads, seq, head_dim), got {shape}"
                )
        if k.shape != v.shape:
            raise ValueError(
                f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; expected them equal"
            )
        b, h, t, d = k.shape
        self.check_layout(b, h, d, who="k/v")
        start = self._len
        self._check_room(t, "append")
        end = start + t
        # narrow() rather than [:, :, start:end]: the same views for less per-call work,
        # which counts when decoding one token at a time.
        self.k.narrow(2, start, t).copy_(k)
        self.v.narrow(2, start, t).copy_(v)
        self._len = end
        return self.k.narrow(2, 0, end), self.v.narrow(2, 0, end)

    def reserve(self, t: int) -> int:
        """Count ``t`` new positions as filled and return where they start; the caller
        writes ``k[:, :, start:start + t]`` and ``v[...]`` itself (a fused decoding
        step writes them in place). ValueError, changing nothing, if they do not fit."""
        start = self._len
        self._check_room(t, "reserve")
        self._len = start + t
        return start

    def _check_room(self, t: int, verb: str) -> None:
        """ValueError unless ``t`` more positions fit (the one overflow rule)."""
        if not is_int(t) or not 0 <= t <= self.max_seq_len - self._len:
            raise ValueError(
                f"KV cache overflow: asked to {verb} {t!r} positions but only "
                f"{self.max_seq_len - self._len} of max_seq_len={self.max_seq_len} remain "
                f"({self._len} filled); make the cache larger or reset() it"
            )

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(B, Hkv, seq_len, D)`` of the keys and values filled so far."""
        return self.k[:, :, : self._len], self.v[:, :, : self._len]

    def crop(self, n: int) -> None:
        """Keep only the first ``n`` positions (``0 <= n <= seq_len``), e.g. to roll
        back rejected speculative tokens or to reuse a shared prompt."""
        if not is_int(n) or not 0 <= n <= self._len:
            raise ValueError(f"crop length must be an int in [0, seq_len={self._len}], got {n!r}")
        self._len = n

    def reset(self) -> None:
        """Forget everything (seq_len = 0); the buffers are reused as they are."""
        self._len = 0

    def to(self, device=None, dtype: torch.dtype | None = None) -> KVCache:
        """Move the buffers (and their contents) to ``device``/``dtype`` in place."""
        self.k = self.k.to(device=device, dtype=dtype)
        self.v = self.v.to(device=device, dtype=dtype)
        return self
