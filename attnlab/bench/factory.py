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


def attention_step(fwd: Callable[[], object], backward: bool, inputs) -> Callable[[], object]:
    """The step of one attention call ``fwd``: the forward without autograd, or forward and
    backward (a gradient of ones) with ``inputs``' gradients cleared after each."""
    import torch

    if not backward:
        def step():
            with torch.no_grad():
                return fwd()
        return step

    def step_fb():
        out = fwd()
        out.backward(torch.ones_like(out))
        for t in inputs:
            t.grad = None
    return step_fb
