"""What torch is doing around an attention call: tracing it (torch.compile, torch.export),
transforming it (torch.func), autocasting it. Asked on every call, so each answer costs a
few hundred nanoseconds at most; torch is imported here at the top (``checks`` keeps it out
for the command line's start)."""

from __future__ import annotations

import torch

__all__ = ["reads_values", "transforms_active", "func_gradients", "batched", "autocasting",
           "each_mapped_call", "first_derivatives_only", "without_gradient"]


def reads_values() -> bool:
    """Whether a check may read a tensor's values (finite slopes, ids in range): not while
    torch.compile or torch.export traces, where reading one is a data-dependent branch
    that stops a ``fullgraph`` trace, nor under a ``torch.func`` transform (``vmap``
    refuses it); such code runs unchecked, as torch's own does."""
    return not (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active())


def transforms_active() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, jacrev, ...) runs this call."""
    return not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active()


def func_gradients() -> bool:
    """Whether a ``torch.func`` gradient transform (``grad``, ``vjp``, ``jacrev``, ``jvp``)
    runs this call: its backward may then run on batched tensors (``jacrev`` maps the
    vector-Jacobian product, per-sample gradients map ``grad``)."""
    if not transforms_active():
        return False
    try:  # (the stack is not traced by dynamo: transforms_active is False there)
        kinds = [str(level.key()) for level in torch._C._functorch.get_interpreter_stack()]
    except (AttributeError, RuntimeError, TypeError):  # another torch: nothing refused
        return False
    return any(kind.endswith(("Grad", "Jvp")) for kind in kinds)


def batched(*tensors) -> bool:
    """Whether any of these (None skipped) is mapped by a ``torch.func.vmap`` here."""
    return transforms_active() and any(
        t is not None and torch._C._functorch.is_batchedtensor(t) for t in tensors)


def autocasting(*tensors) -> str | None:
    """The device type whose ``torch.autocast`` is on for these floating tensors (the
    first one's device), or None. ``attention`` then takes q, k and v in autocast's dtype
    (bf16 on a CPU), as torch's SDPA does, so that every backend returns it and a float32
    query from a layer meets a bf16 cache, and runs the maths as for such inputs."""
    if not torch._C._is_any_autocast_enabled():  # the common case, in 60 ns
        return None
    if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tensors):
        return None  # the caller's checks name what is wrong
    try:
        kind = tensors[0].device.type
        return kind if torch.is_autocast_enabled(kind) else None
    except RuntimeError:  # a device type autocast does not know (meta)
        return None


def each_mapped_call(function, info, in_dims, args):
    """An attention ``autograd.Function``'s ``vmap`` rule: ``function.apply`` on each mapped
    slice in turn (its own autograd node, so a ``grad`` around the ``vmap`` reaches every
    one), the ``(out, lse)`` results stacked along a new leading dimension."""
    outs = [function.apply(*(a.select(d, i) if isinstance(d, int) else a
                             for a, d in zip(args, in_dims)))
            for i in range(info.batch_size)]
    return (torch.stack([o for o, _ in outs]), torch.stack([lse for _, lse in outs])), (0, 0)


class _NoGradient(torch.autograd.Function):
    """``value`` in a graph whose backward refuses: see :func:`without_gradient`."""

    generate_vmap_rule = True

    @staticmethod
    def forward(value, message, *inputs):
        return value.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.message = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(ctx.message)


def without_gradient(value: torch.Tensor, what: str, *inputs,
                     message: str | None = None) -> torch.Tensor:
    """``value`` (computed from ``inputs`` without autograd), tied to them so that a
    backward through it raises naming ``what`` (or saying ``message``), rather than giving
    gradients that leave its part out; ``value`` itself where no input asks for a
    gradient, and while torch.compile traces (a backward that raises stops a fullgraph
    trace). ``inputs``: tensors or None."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    if (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
            and not torch.compiler.is_compiling()):
        if message is None:
            message = (f"attnlab: {what} carries no gradient (FlexAttention's lse does): use "
                       "lse.detach() where a loss takes it")
        return _NoGradient.apply(value, message, *tensors)
    return value


def first_derivatives_only(what: str, grads, *inputs,
                           advice: str = "use backend='eager' for higher-order gradients"
                           ) -> tuple:
    """A backward's ``grads`` (computed without autograd), each tied to the forward's
    ``inputs`` (pass its output too: saved copies of the inputs may carry no gradient) so
    that differentiating them again (``create_graph=True``: a gradient penalty, a
    Hessian-vector product, ``jacrev`` of ``grad``) raises, naming ``what`` and giving
    ``advice``, where they would otherwise pass for constants and give a second derivative
    of zero."""
    message = (f"attnlab: {what}'s gradients cannot be differentiated again (a second "
               f"derivative: a gradient penalty, a Hessian); {advice}")
    return tuple(None if g is None else without_gradient(g, "", *inputs, message=message)
                 for g in grads)
