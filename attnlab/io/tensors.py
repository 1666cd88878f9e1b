"""Tensors in safetensors files (never pickle)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from .files import CheckpointError, PathLike, atomic_write_bytes

if TYPE_CHECKING:
    import torch


def _prepare_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detach, make contiguous, and un-share storage so safetensors accepts the dict."""
    import torch

    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors: expected a dict of str -> Tensor, got {type(tensors).__name__}")
    out: dict[str, torch.Tensor] = {}
    seen_storages: set[tuple[str, int]] = set()
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensors: keys must be str, got {type(name).__name__} ({name!r})")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{name!r}]: expected a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise ValueError(f"tensors[{name!r}]: expected a dense tensor, got layout {t.layout}")
        t = t.detach()
        key = (str(t.device), t.untyped_storage().data_ptr())
        # Tied weights, views and transposes share storage; safetensors refuses that.
        if key in seen_storages or not t.is_contiguous() or t.numel() == 0:
            t = t.clone(memory_format=torch.contiguous_format)
        else:
            seen_storages.add(key)
        out[name] = t
    return out


def save_tensors(
    path: PathLike,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Save a dict of tensors to a safetensors file, atomically.

    Tensors that share storage (tied weights), views and non-contiguous tensors
    are copied first, so each name gets its own data in the file. ``metadata``
    must map str to str; read it back with :func:`load_metadata`.
    """
    from safetensors.torch import save

    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise TypeError(
                f"metadata: expected a dict of str -> str, got {type(metadata).__name__}"
            )
        bad = {k: v for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))}
        if bad:
            raise TypeError(f"metadata: keys and values must be str, got {bad!r}")
        metadata = dict(metadata)
    data = save(_prepare_tensors(tensors), metadata=metadata)
    atomic_write_bytes(path, data)


def check_file(path: Path) -> None:
    """CheckpointError naming ``path`` unless it is an existing regular file that
    safetensors can open (it takes UTF-8 paths only)."""
    if not path.exists():
        raise CheckpointError(f"{str(path)!r}: file not found")
    if not path.is_file():
        raise CheckpointError(f"{str(path)!r}: not a regular file")
    try:
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{str(path)!r}: safetensors opens only UTF-8 paths, and this "
                              "one is not; rename it, or link it under a UTF-8 name") from None


def load_tensors(path: PathLike, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Load all tensors of a safetensors file (never unpickles anything).

    Raises :class:`CheckpointError` naming the path if the file is missing,
    truncated or otherwise not a valid safetensors file.
    """
    from safetensors.torch import load_file

    path = Path(path)
    check_file(path)
    try:
        return load_file(path, device=device)
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(
            f"{str(path)!r}: not a valid safetensors file (truncated or corrupt?): {exc}"
        ) from exc


def load_metadata(path: PathLike) -> dict[str, str]:
    """The string metadata stored in a safetensors file's header ({} if none)."""
    from safetensors import safe_open

    path = Path(path)
    check_file(path)
    try:
        with safe_open(path, framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as exc:
        raise CheckpointError(f"{str(path)!r}: not a valid safetensors file: {exc}") from exc
