"""What a :class:`~attnlab.modules.MultiHeadAttention` may add to the plain scores
``q . k / sqrt(head_dim)``: a scale of its own, softcapping, ALiBi's distance penalty and
learned sinks; the module hands them to :func:`attnlab.attention`, which defines each."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..checks import boolean, finite_float, positive_int

__all__ = ["ScoreOptions", "alibi_slopes"]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes ``(num_heads,)`` float32 (on the CPU), as BLOOM computes them
    (and the ALiBi paper's reference code): for ``n`` a power of two the geometric sequence
    ``2**(-8 / n), 2**(-16 / n), ...``; otherwise those of the largest power of two
    ``c < n`` followed by every other slope of ``2 * c`` (the odd ones) for the heads left.
    Computed with the same float32 operations as transformers' BLOOM, so the biases are
    bit for bit theirs."""
    positive_int("num_heads", num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    # An explicit device: a model built on the meta device (to be loaded) still gets values.
    base = torch.full((), 2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32,
                      device="cpu")
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32, device="cpu"))
    if closest != num_heads:
        extra = torch.full((), 2 ** (-(2 ** -(math.log2(2 * closest) - 3))),
                           dtype=torch.float32, device="cpu")
        left = min(closest, num_heads - closest)
        powers = torch.arange(1, 1 + 2 * left, 2, dtype=torch.int32, device="cpu")
        slopes = torch.cat([slopes, torch.pow(extra, powers)])
    return slopes


class ScoreOptions:
    """Mixed into :class:`~attnlab.modules.MultiHeadAttention`: the options of its scores,
    set once by :meth:`_init_scores` (``scale``, ``softcap``, ``alibi``, ``sinks``)."""

    scale: float | None
    softcap: float | None
    alibi: bool
    sinks: nn.Parameter | None
    #: Heads that score by ``q . k`` alone for a while (no ALiBi penalty, no sink's share),
    #: as the experiments' uniform knock-outs need; set and cleared by
    #: ``experiments.layers.scores_from_qk_alone``, the parameters left untouched.
    plain_heads: tuple[int, ...] = ()

    def _init_scores(self, num_heads: int, *, scale: float | None, softcap: float | None,
                     alibi: bool, sinks: bool) -> None:
        self.scale = None if scale is None else finite_float("scale", scale, positive=True)
        self.softcap = None if softcap is None else finite_float("softcap", softcap,
                                                                  positive=True)
        self.alibi = boolean("alibi", alibi)
        # Computed once, on the CPU (moved with the queries when they are elsewhere).
        self._alibi_slopes = alibi_slopes(num_heads) if alibi else None
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if boolean("sinks", sinks) else None

    def score_options(self, device: torch.device | None = None) -> dict:
        """What this module adds to :func:`attnlab.attention`'s plain rule (causal, window):
        ``scale``, ``softcap``, ``alibi_slopes``, ``sinks``, each only where set (an empty
        dict for plain attention); slopes on ``device``."""
        options: dict = {}
        if self.scale is not None:
            options["scale"] = self.scale
        if self.softcap is not None:
            options["softcap"] = self.softcap
        plain = torch.tensor(self.plain_heads, dtype=torch.long) if self.plain_heads else None
        if self._alibi_slopes is not None:
            slopes = self._alibi_slopes
            if plain is not None:
                slopes = slopes.index_fill(0, plain, 0.0)
            options["alibi_slopes"] = slopes if device is None else slopes.to(device)
        if self.sinks is not None:
            sinks = self.sinks
            if plain is not None:  # a logit no row gives a share to, finite in its dtype
                sinks = sinks.index_fill(0, plain.to(sinks.device),
                                         torch.finfo(sinks.dtype).min / 2)
            options["sinks"] = sinks
        return options

    def _scores_repr(self) -> list[str]:
        parts = [f"{name}={getattr(self, name)}" for name in ("scale", "softcap")
                 if getattr(self, name) is not None]
        if self.alibi:
            parts.append("alibi=True")
        if self.sinks is not None:
            parts.append("sinks=True")
        return parts
