"""Loading a state dict into a model: the one place names, shapes and dtypes are checked.

Checkpoints, Hugging Face layouts, the bundled MiniLM and a training resume all
load weights through :func:`load_state`, so a mismatch always reads the same
way and names where the weights came from.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from .files import CheckpointError
from .tensors import check_file

__all__ = ["load_state", "state_mismatches", "build_loaded", "SafetensorsState"]


def _kind(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "float"
    return "complex" if dtype.is_complex else str(dtype)


def state_mismatches(expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                     given: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                     allow_missing: Collection[str] = ()) -> list[str]:
    """What keeps ``given`` (name -> (shape, dtype)) from loading where ``expected`` is wanted.

    Shapes must be equal; a floating-point tensor may load into a parameter of
    another floating-point dtype (it is cast, as ``load_state_dict`` does), any
    other dtype must match in kind. Works on shapes alone, so a safetensors
    header can be checked before a single weight is read.
    """
    problems = []
    missing = [n for n in expected if n not in given and n not in allow_missing]
    unexpected = [n for n in given if n not in expected]
    if missing:
        problems.append(f"missing {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
    if unexpected:
        problems.append(f"unexpected {unexpected[:5]}" + (" ..." if len(unexpected) > 5 else ""))
    for name, (shape, dtype) in given.items():
        if name not in expected:
            continue
        want_shape, want_dtype = expected[name]
        if tuple(shape) != tuple(want_shape):
            problems.append(f"{name!r} has shape {tuple(shape)}, expected {tuple(want_shape)}")
        elif _kind(dtype) != _kind(want_dtype):
            problems.append(f"{name!r} has dtype {dtype}, expected {want_dtype}")
    return problems


def _shapes(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    if isinstance(state, SafetensorsState):
        return state.shapes()  # from the file headers: nothing is read
    return {n: (tuple(t.shape), t.dtype) for n, t in state.items()}


def load_state(model: nn.Module, state: Mapping[str, torch.Tensor], *, source: str,
               allow_missing: Collection[str] = (), assign: bool = False) -> nn.Module:
    """Copy ``state`` into ``model`` after checking every name, shape and dtype.

    Args:
        model: the module to fill; its own ``state_dict()`` says what is expected.
        state: name -> tensor, in the model's naming.
        source: where the weights come from, for the message (a file path, "the
            transformers model", ...).
        allow_missing: names the model may keep as they are (an output layer tied
            to the embedding, which the source stores once).
        assign: make the given tensors the model's parameters instead of copying
            into them (no second copy; the model may be on the meta device).

    Raises:
        CheckpointError: ``"<source> does not fit the <Model>: <what differs>"``;
            the model is unchanged then.
    """
    own = model.state_dict()
    problems = state_mismatches({n: (tuple(t.shape), t.dtype) for n, t in own.items()},
                                _shapes(state), allow_missing)
    if problems:
        raise CheckpointError(f"{source} does not fit the {type(model).__name__}: "
                              + "; ".join(problems[:4]))
    model.load_state_dict(dict(state.items()), strict=False, assign=assign)
    return model


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one tensor (a tied output layer), primary first."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _set_param(model: nn.Module, name: str, value) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attr, value)


def build_loaded(make: Callable[[], nn.Module], state: Mapping[str, torch.Tensor], *,
                 source: str) -> nn.Module:
    """``make()`` a model without allocating or initialising its weights, then make the
    tensors of ``state`` its parameters: the weights exist once, never beside a
    throwaway random copy.

    The model is built on the meta device; names, shapes and dtypes are checked
    (:func:`load_state`) before anything is assigned. Tied parameters (an output
    layer sharing the embedding) stay tied to the first name of their group,
    whether the source stores them once or twice.
    """
    with torch.device("meta"):
        model = make()
    tied = _tied_groups(model)
    aliases = {name for names in tied for name in names[1:]}
    load_state(model, state, source=source, allow_missing=aliases, assign=True)
    for names in tied:
        primary = model.get_parameter(names[0])
        for name in names[1:]:
            _set_param(model, name, primary)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"{source} does not fit the {type(model).__name__}: "
                              f"missing {left[:5]}")
    return model


# --------------------------------------------------------------------- safetensors files


class SafetensorsState(Mapping):
    """The tensors of one or more safetensors files (a sharded checkpoint), read lazily.

    Shapes and dtypes come from the headers without reading any data; a tensor is
    read (memory-mapped by safetensors) when it is looked up, and not kept here, so
    a converter that walks the names holds each tensor only as long as it needs it.
    """

    def __init__(self, files: list[str | os.PathLike], *, device: str = "cpu") -> None:
        from safetensors import safe_open

        self._handles = {}
        self._where: dict[str, object] = {}
        for path in files:
            path = Path(path)
            check_file(path)
            try:
                handle = safe_open(path, framework="pt", device=device)
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{str(path)!r}: not a valid safetensors file "
                                      f"(truncated or corrupt?): {exc}") from exc
            self._handles[path] = handle
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                self._where[name] = handle

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        out = {}
        for name, handle in self._where.items():
            part = handle.get_slice(name)
            out[name] = (tuple(part.get_shape()), _DTYPES.get(part.get_dtype(), torch.uint8))
        return out


# safetensors' dtype names -> torch's.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
