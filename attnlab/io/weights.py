"""Loading a state dict into a model: the one place names, shapes and dtypes are checked.

Checkpoints, Hugging Face layouts, the bundled MiniLM and a training resume all
load weights through :func:`load_state`, so a mismatch always reads the same
way and names where the weights came from.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from .files import CheckpointError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["load_state", "state_mismatches"]


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


def load_state(model: nn.Module, state: Mapping[str, torch.Tensor], *, source: str,
               allow_missing: Collection[str] = ()) -> nn.Module:
    """Copy ``state`` into ``model`` after checking every name, shape and dtype.

    Args:
        model: the module to fill; its own ``state_dict()`` says what is expected.
        state: name -> tensor, in the model's naming.
        source: where the weights come from, for the message (a file path, "the
            transformers model", ...).
        allow_missing: names the model may keep as they are (an output layer tied
            to the embedding, which the source stores once).

    Raises:
        CheckpointError: ``"<source> does not fit the <Model>: <what differs>"``;
            the model is unchanged then.
    """
    own = model.state_dict()
    problems = state_mismatches(
        {n: (tuple(t.shape), t.dtype) for n, t in own.items()},
        {n: (tuple(t.shape), t.dtype) for n, t in state.items()}, allow_missing)
    if problems:
        raise CheckpointError(f"{source} does not fit the {type(model).__name__}: "
                              + "; ".join(problems[:4]))
    model.load_state_dict(state, strict=False)
    return model
