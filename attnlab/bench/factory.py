"""How the bench names a step without building it: a *factory*, ``(module, function,
kwargs)``, plain data (it travels as JSON to the processes that build the same step: the
memory probe, a peer's worker). Calling ``module.function(**kwargs)`` returns a
zero-argument ``step`` that runs the workload once on inputs it has already built."""

from __future__ import annotations

import importlib
from collections.abc import Callable

Factory = tuple[str, str, dict]


def build(factory: Factory) -> Callable[[], object]:
    """The step a factory names, built in this process."""
    module, function, kwargs = factory
    return getattr(importlib.import_module(module), function)(**kwargs)
