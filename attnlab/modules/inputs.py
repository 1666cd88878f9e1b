"""The input checks of :class:`~attnlab.modules.MultiHeadAttention`: ``x`` and a
cross-attention ``kv``, each named with what came and what was expected."""

from __future__ import annotations

import torch

from . import fused


def _shape(t: object) -> object:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


class InputChecks:
    """``_check_x`` and ``_check_kv`` for a module with ``d_in`` and ``W_query``."""

    def _check_x(self, x) -> tuple[int, int]:
        if not isinstance(x, torch.Tensor) or x.ndim != 3:
            raise ValueError(
                f"x must be (batch, seq, features={self.d_in}) (batch first) or one "
                f"(seq, features={self.d_in}) sequence, got {_shape(x)}"
            )
        if x.shape[-1] != self.d_in:
            raise ValueError(
                f"x has {x.shape[-1]} features (shape {tuple(x.shape)}) but d_in={self.d_in}"
            )
        weight = self.W_query._parameters.get("weight")  # read directly: once a token
        if not fused.takes(x.dtype, self.W_query):
            raise TypeError(f"x has dtype {x.dtype} but the module's weights are {weight.dtype}; "
                            f"expected a {weight.dtype} x (or convert the module with .to())")
        return x.shape[0], x.shape[1]

    def _check_kv(self, kv, b: int) -> None:
        if not isinstance(kv, torch.Tensor) or kv.ndim != 3:
            raise ValueError(
                f"kv must be (batch, k_seq, features={self.d_in}) (batch first), got {_shape(kv)}"
            )
        if kv.shape[0] != b or kv.shape[-1] != self.d_in:
            raise ValueError(
                f"kv has shape {tuple(kv.shape)} but expected (batch={b}, k_seq, "
                f"features={self.d_in})"
            )
