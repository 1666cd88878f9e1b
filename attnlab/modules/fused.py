"""Fused projections for inference: several ``nn.Linear`` applied as one matmul.

Decoding one token at a time on a CPU is dominated by per-call overhead and by
reading the weights, so the Q/K/V projections (and SwiGLU's gate/up) run as one
``x @ W`` over their concatenated weights, stored transposed and contiguous, when
no gradient is needed and the input is small. The ``(in, out)`` layout matters on
its own for wide layers: a one-row product then streams the weights in order, and
MKL's kernel for it is 1.3x-1.8x faster than ``F.linear``'s ``(out, in)`` rows
when ``out >= in`` (measured on this 2-core EPYC: SmolLM's 576 -> 49152 output
layer 6.3 ms against 11.2 ms), which is why the models also read their output
layer this way. The price is memory: the copies hold those weights a second time.
The modules keep their separate ``nn.Linear`` layers
(checkpoints, initialisation order and hooks are untouched); the fused copy is
cached and rebuilt whenever a weight changes (its storage, dtype, device or
version counter), and skipped while any of them has hooks.
"""

from __future__ import annotations

import torch
from torch import nn

# Above this many input rows the matmuls dominate and three calls cost what one does,
# so the concatenated weight copy would only add memory.
MAX_ROWS = 512


class FusedLinears:
    """``[m(x) for m in linears]`` (same input size), as one matmul when allowed."""

    def __init__(self) -> None:
        self._key: list | None = None
        self._weight: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._sizes: list[int] = []  # out_features of each linear, to split the result

    def __call__(self, x: torch.Tensor, linears: tuple[nn.Linear, ...]) -> list[torch.Tensor]:
        out = self.joint(x, linears)
        if out is None:
            return [m(x) for m in linears]
        return out.split_with_sizes(self._sizes, dim=-1)

    def joint(self, x: torch.Tensor, linears: tuple[nn.Linear, ...]) -> torch.Tensor | None:
        """All outputs side by side ``(..., sum of out_features)``, from one matmul; or
        None where fusing is not allowed: with gradients, hooks, or a large input."""
        if torch.is_grad_enabled() or x.numel() > MAX_ROWS * x.shape[-1]:
            return None
        key = _weights_key(linears)
        if key is None:
            return None
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
        return out


def _weights_key(linears: tuple[nn.Linear, ...]) -> list | None:
    """What identifies the current weights and biases: storage, dtype, device, version;
    None while a layer has forward hooks, which must see that layer run.

    Read from ``_parameters`` directly: ``nn.Module.__getattr__`` costs about half a
    microsecond a name, and this runs for every decoded token. Inference tensors have
    no version counter (and cannot be changed in place outside inference mode); their
    storage identifies them.
    """
    key = []
    for m in linears:
        if m._forward_hooks or m._forward_pre_hooks:
            return None
        for t in m._parameters.values():  # weight, bias (None without one)
            if t is not None:
                key += (t.data_ptr(), t.dtype, t.device,
                        -1 if t.is_inference() else t._version)
    return key
