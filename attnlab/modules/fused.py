"""Fused projections for inference: several ``nn.Linear`` applied as one matmul.

Decoding one token at a time on a CPU is dominated by per-call overhead and by
reading the weights, so the Q/K/V projections (and SwiGLU's gate/up) run as one
``x @ W`` over their concatenated weights, stored transposed and contiguous
(``(in, out)``: a one-row product then streams the weights in order, about 20%
faster than ``F.linear``'s ``(out, in)`` on this CPU), when no gradient is needed
and the input is small. The modules keep their separate ``nn.Linear`` layers
(checkpoints, initialisation order and hooks are untouched); the fused copy is
cached and rebuilt whenever a weight changes (its storage or version counter),
and skipped while any of them has hooks.
"""

from __future__ import annotations

import torch
from torch import nn

# Above this many input rows the matmuls dominate and three calls cost what one does,
# so the concatenated weight copy would only add memory.
MAX_ROWS = 512


class FusedLinears:
    """Apply ``linears`` (same input size) to one input with one matmul when allowed."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._weight: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._sizes: list[int] = []  # out_features of each linear, to split the result

    @staticmethod
    def usable(linears: tuple[nn.Linear, ...], x: torch.Tensor) -> bool:
        """Inference only (no gradients, no hooks) and a small input, as in decoding."""
        return (not torch.is_grad_enabled() and x.numel() <= MAX_ROWS * x.shape[-1]
                and not any(m._forward_hooks or m._forward_pre_hooks for m in linears))

    def __call__(self, x: torch.Tensor, linears: tuple[nn.Linear, ...]) -> list[torch.Tensor]:
        tensors = [t for m in linears for t in (m.weight, m.bias) if t is not None]
        # Inference tensors have no version counter (and cannot be changed in place
        # outside inference mode); their storage identifies them.
        key = tuple((t.data_ptr(), -1 if t.is_inference() else t._version, t.dtype, t.device)
                    for t in tensors)
        if key != self._key:
            # A normal tensor even under inference_mode: it is kept across calls.
            with torch.inference_mode(False), torch.no_grad():
                self._weight = torch.cat([m.weight for m in linears]).t().contiguous()
                biases = [m.bias if m.bias is not None else
                          torch.zeros(m.out_features, dtype=m.weight.dtype,
                                      device=m.weight.device) for m in linears]
                has_bias = any(m.bias is not None for m in linears)
                self._bias = torch.cat(biases) if has_bias else None
                self._sizes = [m.out_features for m in linears]
            self._key = key
        out = x @ self._weight  # (..., in) @ (in, sum of out)
        if self._bias is not None:
            out += self._bias
        return list(out.split(self._sizes, dim=-1))
