"""The base of attnlab's dataclass configs (model and training): one way to and from a dict.

It sits at the bottom layer with :mod:`attnlab.checks` (the argument checks), so that
the models, the training loop and the plain-data layouts share one reading of a
``config.json`` without importing each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["Config"]


class Config:
    """Base of the dataclass configs (model and training): one way to and from a dict.

    ``from_dict`` refuses unknown keys, naming them: a typo in a ``config.json``
    must not silently fall back to a default.
    """

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        if not isinstance(data, Mapping):
            raise TypeError(f"{cls.__name__}: expected a dict of fields, got "
                            f"{type(data).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise ValueError(f"{cls.__name__} got unknown fields {unknown}; expected some of "
                             f"{known}")
        return cls(**data)
