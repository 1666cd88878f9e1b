"""The pieces the models share besides attention: the MLP, the norm, dropout.

One definition each, so GPT and Encoder name their parameters alike
(``blocks.i.mlp.fc``, ``blocks.i.mlp.proj``, ``blocks.i.norm1``) and drop out
the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import _native
from ..checks import finite_float
from . import fused

__all__ = ["MLP", "MLP_KINDS", "NORM_KINDS", "GATED_MLP_KINDS", "RMSNorm", "RMSNormPlusOne",
           "make_norm", "norm_kind", "dropout", "embedding", "residual"]

# The names of the kinds, used by the configs, the modules and the fused decoding step
# (csrc/decode_layers.cpp implements each under the same name).
# MLPs: gelu, gelu_tanh (GPT-2's tanh approximation), relu: ``proj(act(fc(x)))``;
# swiglu (Llama): ``proj(silu(gate(x)) * fc(x))``; geglu (Gemma): ``proj(gelu_tanh(gate(x))
# * fc(x))``.
MLP_KINDS = ("gelu", "gelu_tanh", "relu", "swiglu", "geglu")
GATED_MLP_KINDS = ("swiglu", "geglu")
# Norms: layernorm; rmsnorm (``x / rms(x) * weight``, Llama); rmsnorm_plus_one (``x / rms(x)
# * (1 + weight)`` computed in float32, weight initialised to zeros: Gemma's convention).
NORM_KINDS = ("layernorm", "rmsnorm", "rmsnorm_plus_one")


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``F.dropout`` in training with ``p > 0``; otherwise ``x`` itself, without a call
    (decoding runs every layer once per token, where even a no-op call costs)."""
    return F.dropout(x, p) if training and p > 0 else x


# Smaller sums allocate from malloc's free lists in about a microsecond, less than the
# checks of may_overwrite (about 5 us): a token being decoded keeps the plain sum.
IN_PLACE_FROM = 1 << 16  # elements


def residual(module: nn.Module, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """``x + branch`` for a block ``module`` whose own submodules computed ``branch``:
    summed into ``branch`` where :func:`~attnlab.modules.fused.may_overwrite` allows it
    (inference), that gives the same tensor and it is large (a prompt, an encoder's
    batch), so the block allocates one hidden-sized tensor fewer for each sum."""
    if (branch.numel() >= IN_PLACE_FROM and branch.shape == x.shape
            and branch.dtype == x.dtype and fused.may_overwrite(module, branch, x)):
        return branch.add_(x)
    return x + branch


def embedding(num: int, dim: int, padding_idx: int | None = None) -> nn.Embedding:
    """``nn.Embedding(num, dim, padding_idx)``; built on the meta device (weights to be
    loaded, see ``models.loading.build_loaded``) it skips the random initialisation, whose
    ``normal_`` on meta tensors imports torch's Python decompositions: about 70 MB that
    a process loading a model would otherwise carry for nothing."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(num, dim, padding_idx=padding_idx, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim, padding_idx=padding_idx)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` over the last dimension: the same parameter, state dict and
    result. Without gradients, on float32 CPU input, it is one native call (the
    kernel of ``csrc/decode.cpp``) instead of torch's six small operations, which
    decoding one token at a time pays twice per layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        ops = (_native.for_inference(x, weight) if len(self.normalized_shape) == 1
               and (weight is None or weight.is_contiguous()) else None)
        if ops is not None:
            eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
            return ops.rms_norm(x, weight, eps)
        return super().forward(x)


class RMSNormPlusOne(nn.Module):
    """Gemma's RMSNorm: ``x / sqrt(mean(x**2) + eps) * (1 + weight)`` over the last
    dimension, computed in float32 and cast back to ``x``'s dtype (Gemma multiplies before
    the cast, Llama after). ``weight`` ``(dim,)`` starts at zeros: the identity scale."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.normalized_shape = (dim,)
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


_NORMS = {"layernorm": nn.LayerNorm, "rmsnorm": RMSNorm, "rmsnorm_plus_one": RMSNormPlusOne}


def make_norm(kind: str, dim: int, eps: float, eps_name: str = "eps") -> nn.Module:
    """A norm of :data:`NORM_KINDS` (``"layernorm"``, ``"rmsnorm"``,
    ``"rmsnorm_plus_one"``) over the last ``dim`` features; a bad ``eps`` is named as
    ``eps_name``."""
    if kind not in NORM_KINDS:
        raise ValueError(f"kind must be one of {NORM_KINDS}, got {kind!r}")
    return _NORMS[kind](dim, eps=finite_float(eps_name, eps, positive=True))


def norm_kind(module: nn.Module) -> str | None:
    """The :data:`NORM_KINDS` name of a norm :func:`make_norm` builds (exactly its class),
    or None for any other module."""
    return next((name for name, cls in _NORMS.items() if type(module) is cls), None)


class MLP(nn.Module):
    """Position-wise feed-forward ``(B, T, d_model) -> (B, T, d_model)``.

    ``fc -> activation -> proj`` for ``kind`` gelu, gelu_tanh (GPT-2's tanh
    approximation) or relu; SwiGLU (``proj(silu(gate(x)) * fc(x))``, Llama's
    gate/up/down) for ``"swiglu"``; GeGLU (``proj(gelu_tanh(gate(x)) * fc(x))``, Gemma's)
    for ``"geglu"``.
    """

    def __init__(self, d_model: int, d_ff: int, kind: str = "gelu", bias: bool = True) -> None:
        super().__init__()
        if kind not in MLP_KINDS:
            raise ValueError(f"kind must be one of {MLP_KINDS}, got {kind!r}")
        self.kind = kind
        gated = kind in GATED_MLP_KINDS
        if gated:
            self.gate = nn.Linear(d_model, d_ff, bias=bias)
        self.fc = nn.Linear(d_model, d_ff, bias=bias)
        self.proj = nn.Linear(d_ff, d_model, bias=bias)
        # Each packed as the native products stream it fastest (modules.fused: (in, out),
        # by rows in bf16 or past 4096 outputs); a gated MLP's gate and up in one tensor.
        self.product_groups = (("gate", "fc") if gated else ("fc",), ("proj",))
        fused.pack_groups(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind in GATED_MLP_KINDS:
            gate_up = fused.joint(x, (self.gate, self.fc))  # one product in inference
            ops = (None if gate_up is None or self.kind != "swiglu"
                   else _native.for_inference(gate_up))
            if ops is not None:  # inference: silu(gate) * up in one pass
                return fused.apply(ops.silu_mul(gate_up), self.proj)
            gate, up = (gate_up.chunk(2, dim=-1) if gate_up is not None
                        else (fused.run(x, self.gate), fused.run(x, self.fc)))
            act = F.silu(gate) if self.kind == "swiglu" else F.gelu(gate, approximate="tanh")
            return fused.apply(act * up, self.proj)
        h = fused.apply(x, self.fc)
        inplace = h.numel() >= IN_PLACE_FROM and fused.may_overwrite(self, h, x)
        if self.kind == "relu":
            h = F.relu(h, inplace=inplace)
        else:
            approximate = "tanh" if self.kind == "gelu_tanh" else "none"
            h = (torch.ops.aten.gelu_(h, approximate=approximate) if inplace
                 else F.gelu(h, approximate=approximate))
        return fused.apply(h, self.proj)
