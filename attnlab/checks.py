"""Argument checks shared by the whole package: one rule and one wording each.

Every public function validates its plain arguments through these helpers, so
an error always reads ``"<name> must be <what was expected>, got <what came>"``
and names the argument. ``bool`` is refused where an ``int`` is expected
(``True`` is an ``int`` to Python, but ``window=True`` is a typo, not a choice).
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

__all__ = ["positive_int", "non_negative_int", "optional_positive_int", "bounded_int",
           "probability",
           "boolean", "finite_float", "one_of", "is_int", "machine_memory",
           "fits_in_memory"]


def is_int(value: object) -> bool:
    """True for a Python (or NumPy) integer that is not a bool."""
    # A plain int first: the ABC's instance check costs more, and a decoded token asks
    # this of every layer's cache.
    return type(value) is int or (isinstance(value, numbers.Integral)
                                  and not isinstance(value, bool))


def positive_int(name: str, value: object) -> int:
    """``value`` as an int ``>= 1``, else ValueError naming ``name``."""
    if not is_int(value) or int(value) < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def non_negative_int(name: str, value: object) -> int:
    """``value`` as an int ``>= 0``, else ValueError naming ``name``."""
    if not is_int(value) or int(value) < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def bounded_int(name: str, value: object, low: int, high: int) -> int:
    """``value`` as an int in ``[low, high]``, else ValueError naming ``name``: for sizes
    whose cost is time, not memory (steps, new tokens), so no memory check catches a typo
    such as ``--steps 100000000000000000000000``."""
    if not is_int(value) or not low <= int(value) <= high:
        what = f"a positive int <= {high:,}" if low == 1 else f"an int in [{low}, {high:,}]"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return int(value)


def optional_positive_int(name: str, value: object) -> int | None:
    """None, or ``value`` as an int ``>= 1``."""
    if value is None:
        return None
    if not is_int(value) or int(value) < 1:
        raise ValueError(f"{name} must be a positive int >= 1 or None, got {value!r}")
    return int(value)


def probability(name: str, value: object) -> float:
    """``value`` as a float in ``[0, 1]``, else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def boolean(name: str, value: object) -> bool:
    """``value`` as a bool (NumPy's bool too), else TypeError: ``"no"`` or ``1`` is not
    silently true."""
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def finite_float(name: str, value: object, *, positive: bool = False,
                 least: float | None = None) -> float:
    """``value`` as a finite float (``> 0`` with ``positive``, ``>= least`` with
    ``least``); NaN and inf are refused."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0) or (
            least is not None and value < least):
        what = ("a positive finite number" if positive else "a finite number"
                + ("" if least is None else f" >= {least:g}"))
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value


def one_of(name: str, value: T, options: Sequence[T]) -> T:
    """``value`` if it is one of ``options``, else ValueError listing them."""
    try:
        ok = value in options
    except TypeError:  # an unhashable value against a set or dict
        ok = False
    if not ok:
        raise ValueError(f"{name} must be one of {tuple(options)}, got {value!r}")
    return value


def machine_memory() -> int | None:
    """Bytes of physical memory of this machine (None where the system cannot say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return None


def fits_in_memory(what: str, nbytes: int | float) -> None:
    """Refuse, before any allocation, ``what`` needing ``nbytes`` when the machine has
    less: a config asking for 10**6 layers must be one line, not an allocator traceback
    after the memory has filled."""
    total = machine_memory()
    if total is not None and nbytes > total:
        raise ValueError(f"{what} needs about {nbytes / 2**30:,.1f} GiB of memory, but this "
                         f"machine has {total / 2**30:,.1f} GiB; expected a smaller size")
