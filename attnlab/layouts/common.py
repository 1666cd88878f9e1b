"""What every Hugging Face layout converter shares: a state-dict view whose missing key
names itself, shapes checked against the config before a tensor is read, and config
fields that are required or limited to what attnlab does."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..checks import is_int
from ..io.files import CheckpointError
from ..rope import SCALINGS, check_scaling

Tensors = Mapping[str, torch.Tensor]
Config = dict[str, Any]


class _Named(Mapping):
    """A read-only view of a state dict under ``prefix`` whose missing key is a
    ValueError naming it (not a KeyError). Tensors are looked up, never copied, so
    a lazily read file is read once, name by name."""

    def __init__(self, state: Tensors, prefix: str = "") -> None:
        self._state, self._prefix = state, prefix
        self._shapes: dict | None = None

    def __getitem__(self, key: str) -> torch.Tensor:
        if self._prefix + key not in self._state:
            raise ValueError(f"weights have no {self._prefix + key!r}, which this layout needs")
        return self._state[self._prefix + key]

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of ``key`` without reading it (a file's from its header)."""
        full = self._prefix + key
        shapes = getattr(self._state, "shapes", None)  # a SafetensorsState's header
        if callable(shapes) and full in self._state:
            if self._shapes is None:
                self._shapes = shapes()
            return tuple(self._shapes[full][0])
        return tuple(self[key].shape)

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


class ShapeMismatch(CheckpointError):
    """A tensor's shape is not the one its layout's config makes."""


def check_shapes(s: _Named, want: Mapping[str, tuple[int, ...]]) -> None:
    """:class:`ShapeMismatch` naming each tensor of ``s`` whose shape is not ``want``'s,
    the shape found and the one expected, before any tensor is read or allocated:
    a layout that slices a tensor (GPT-2's joint q/k/v) would otherwise drop what
    does not fit. Names ``s`` lacks are left to the converter (which names them)."""
    problems = [f"{s._prefix + key!r} has shape {s.shape(key)}, expected {tuple(shape)}"
                for key, shape in want.items() if key in s and s.shape(key) != tuple(shape)]
    if problems:
        raise ShapeMismatch("; ".join(problems[:4]) + (" ..." if len(problems) > 4 else "")
                            + " (from the config)")


def check_layer_count(s: _Named, prefix: str, num_layers: int, key: str) -> None:
    """:class:`ShapeMismatch` unless ``s`` holds layers ``0 .. num_layers - 1`` under
    ``prefix`` (``h.``, ``layers.``): a config that asks for more layers than the file
    has is refused from the file's names alone, before the model (or a table of every
    layer's shapes) is built for it."""
    found = {name[len(prefix):].split(".", 1)[0] for name in s if name.startswith(prefix)}
    indices = {int(i) for i in found if i.isdigit()}
    if len(indices) != num_layers or indices != set(range(num_layers)):
        held = f"layers 0 .. {max(indices)}" if indices else "no layers"
        raise ShapeMismatch(f"config {key}={num_layers}, but the weights hold {held} "
                            f"({len(indices)} under {prefix!r})")


def check_tied_head(state: Tensors, cfg: Mapping[str, Any], embedding: torch.Tensor) -> None:
    """A config that ties the output layer to the token embedding (``tie_word_embeddings``
    true, or left out where it defaults to true), beside weights holding an
    ``lm_head.weight`` of their own: equal to the embedding (some writers save both) it
    is the tie; different, it is refused naming both, since reading either way (the tie,
    or the file's layer, as transformers 5 reads it) changes the logits silently."""
    if not cfg["tie_embeddings"] or "lm_head.weight" not in state:
        return
    head = state["lm_head.weight"]
    if head.shape != embedding.shape or not torch.equal(head, embedding):
        raise ValueError("config.json ties the output layer to the token embedding "
                         "(tie_word_embeddings true, or left out where it defaults to true), "
                         "but the weights hold an lm_head.weight of their own that differs: "
                         "set tie_word_embeddings to false in config.json to use it")


def _detached(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors detached, views (a transpose, a slice) left as views: building the
    model copies each one into its parameter (``models.loading.build_loaded``), a file's
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


def _size(cfg: Mapping[str, Any], key: str, default: Any = None) -> int:
    """A size (heads, layers, widths): a positive int, else a one-line ValueError naming
    the field (``n_head: 0`` would end in a ZeroDivisionError). Required unless a
    ``default`` is given, which stands in for an absent or null field."""
    value = _field(cfg, key) if default is None else cfg.get(key)
    if value is None:
        return default
    if not is_int(value) or value < 1:
        raise ValueError(f"config {key}={value!r} is not valid (expected a positive int)")
    return int(value)


def _positive(cfg: Mapping[str, Any], key: str, default: float) -> float:
    """A positive finite number (an epsilon, a rope base), ``default`` when absent or null."""
    value = cfg.get(key)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"config {key}={value!r} is not valid (expected a positive finite "
                         "number)")
    return float(value)


def rope_theta(cfg: Mapping[str, Any]) -> float:
    """RoPE's base of a Llama-family config (``rope_theta``, or inside
    ``rope_parameters``), checked with its scaling (:func:`rope_scaling`)."""
    rope_scaling(cfg)
    params = cfg.get("rope_parameters") or {}
    return _positive({"rope_theta": params.get("rope_theta", cfg.get("rope_theta"))},
                     "rope_theta", 10000.0)


def rope_scaling(cfg: Mapping[str, Any]) -> dict | None:
    """The RoPE scaling of a config (``rope_parameters``, or the older ``rope_scaling``)
    as ``GPTConfig.rope_scaling`` takes it: None for the default, ``linear`` and
    ``llama3`` (Llama 3.1-3.3) with their keys; any other kind is refused naming it."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(params, Mapping) or not isinstance(scaling, Mapping):
        bad = "rope_parameters" if not isinstance(params, Mapping) else "rope_scaling"
        raise ValueError(f"config {bad}={cfg[bad]!r} is not valid (expected an object)")
    # transformers reads rope_scaling first where a config has one (an older config, or
    # one edited to extend its context beside the rope_parameters it was saved with).
    merged = dict(scaling or params)
    kind = merged.get("rope_type") or merged.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise ValueError(f"config rope_type={kind!r} is not supported (expected 'default', "
                         "'linear' or 'llama3')")
    if kind == "llama3" and merged.get("original_max_position_embeddings") is None:
        # (transformers takes the model's own context then)
        merged["original_max_position_embeddings"] = cfg.get("max_position_embeddings")
    return check_scaling("config rope_parameters",
                         {"rope_type": kind, **{k: merged.get(k) for k in SCALINGS[kind]}})


def window_field(cfg: Mapping[str, Any], key: str, absent: int | None) -> int | None:
    """A sliding window field: a positive int, or None when null; ``absent`` (the model's
    default in transformers' config class) where the config has no such key."""
    value = cfg.get(key, absent)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise ValueError(f"config {key}={value!r} is not supported (expected a positive "
                         "int or null)")
    return value
