"""The gradient of the log-sum-exp that :func:`attnlab.attention_with_lse` returns.

``d lse_i / d s_ij = P_ij``: a loss's gradient ``g_i`` on ``lse_i`` adds ``g_i * P_ij`` to
each score's gradient, ``dS = P * (dP - D + g)`` in FlashAttention-2's terms
(``D_i = rowsum(dO_i * O_i)``), which is what torch's ``flex_attention`` differentiates.
Every backend's block backward (``backends.LseStep.backward``) computes ``P * (dP - D)``
from the rows' output and lse. Called with one value column of zeros and an output
column of ``-g`` under an output gradient of ones, its ``dP`` is 0 and its ``D`` is
``-g``: it gives exactly the lse's share of ``dq`` and ``dk`` (``v``'s is 0), through the
same score pipeline as the forward (scale, softcap, ALiBi, documents, block masks). A
sink's share: ``d lse_i / d sink_h = exp(sink_h - lse_i)``.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ._tracing import without_gradient


class _LseGradient(torch.autograd.Function):
    """``lse`` itself, differentiable in ``q``, ``k`` and ``sinks`` (once: its backward
    is not differentiable again, and a second backward through it raises)."""

    generate_vmap_rule = True  # (a vmap of a grad that never reaches the lse)

    @staticmethod
    def forward(lse, q, k, sinks, step, settings):
        return lse.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        lse, q, k, sinks, step, settings = inputs
        ctx.step, ctx.settings = step, settings
        ctx.save_for_backward(lse, q, k, sinks)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        lse, q, k, sinks = ctx.saved_tensors
        mask, causal, window, scale, variants = ctx.settings
        grad = grad.to(lse.dtype)
        dq = dk = dsinks = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            # (B, Hq, Lq, 1) in the lse's dtype: a scaled loss's -g would overflow fp16
            minus_g = (-grad).unsqueeze(-1)
            try:
                dq, dk, _ = ctx.step.backward(q, k, k.new_zeros(*k.shape[:-1], 1), mask,
                                              minus_g, lse, torch.ones_like(minus_g), causal,
                                              window, scale, variants, None)
            except RuntimeError as exc:  # the textbook paths differentiate with autograd
                if not torch._C._are_functorch_transforms_active():
                    raise
                raise RuntimeError("attnlab: under torch.func's transforms the lse's gradient "
                                   "runs on the native kernel only: use backend='flash' (or "
                                   "'auto')") from exc
            dq, dk = dq.to(q.dtype), dk.to(k.dtype)
        if sinks is not None and ctx.needs_input_grad[3]:
            share = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)  # 0 on empty rows
            dsinks = (grad * share).sum(dim=(0, 2)).to(sinks.dtype)
        return None, dq, dk, dsinks, None, None


def with_gradient(lse, step, q, k, mask, causal, window, scale, variants) -> torch.Tensor:
    """``lse`` ``(B, Hq, Lq)`` of 4-D ``q``, ``k`` as ``step`` (a backend's ``LseStep``)
    formed it, differentiable in ``q``, ``k`` and the sinks; itself where none of them
    asks for a gradient, and while torch.compile traces (the callable ``step`` would
    break a fullgraph trace; the lse then carries no gradient). With a ``score_mod``
    (whose tensors' share it cannot see) or a mask that requires grad, a backward
    through it raises instead of leaving a share out."""
    sinks = None if variants is None else variants.sinks
    if mask is not None and mask.requires_grad or variants is not None and variants.score_mod:
        return without_gradient(lse, "with a score_mod or a mask that requires grad, the lse "
                                "(of attention_with_lse, compat.flex_attention)", q, k, sinks,
                                mask)
    wants = [t for t in (q, k, sinks) if t is not None and t.requires_grad]
    if not wants or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return lse
    return _LseGradient.apply(lse, q, k, sinks, step, (mask, causal, window, scale, variants))
