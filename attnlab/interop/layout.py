"""What every Hugging Face layout converter shares: a state-dict view whose missing key
names itself, and config fields that are required or limited to what attnlab does."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

Tensors = Mapping[str, torch.Tensor]
Config = dict[str, Any]


class _Named(Mapping):
    """A read-only view of a state dict under ``prefix`` whose missing key is a
    ValueError naming it (not a KeyError). Tensors are looked up, never copied, so
    a lazily read file is read once, name by name."""

    def __init__(self, state: Tensors, prefix: str = "") -> None:
        self._state, self._prefix = state, prefix

    def __getitem__(self, key: str) -> torch.Tensor:
        if self._prefix + key not in self._state:
            raise ValueError(f"weights have no {self._prefix + key!r}, which this layout needs")
        return self._state[self._prefix + key]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._prefix + key in self._state

    def __iter__(self):
        n = len(self._prefix)
        return (k[n:] for k in self._state if k.startswith(self._prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _strip(state: Tensors, prefix: str) -> _Named:
    """Keys without ``prefix`` where every key that matters has it (``bert.``, ``model.``)."""
    return _Named(state, prefix if any(k.startswith(prefix) for k in state) else "")


def _detached(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors detached, views (a transpose, a slice) left as views: building the
    model copies each one into its parameter (``io.weights.build_loaded``), a file's
    straight from disk, so the weights are never held twice, not even one layer's."""
    return {k: v.detach() for k, v in state.items()}


def _require(cfg: Mapping[str, Any], key: str, allowed, default=None):
    value = cfg.get(key, default)
    try:
        ok = value in allowed
    except TypeError:  # an unhashable value
        ok = False
    if not ok:
        raise ValueError(f"config {key}={value!r} is not supported (expected one of {allowed})")
    return value


def _field(cfg: Mapping[str, Any], key: str) -> Any:
    """A field the layout cannot do without: a ValueError naming it when absent."""
    if key not in cfg or cfg[key] is None:
        kind = cfg.get("model_type", "this")
        raise ValueError(f"config has no {key!r}, which a {kind} config needs")
    return cfg[key]
