"""The weights of chosen query rows of one recorded attention call, for long inputs.

The pictures of a long text (:mod:`attnlab.viz.long`) never hold a ``q_len x k_len``
matrix per head: they record the queries, keys and values each module gave attention
(its ``qkv_hook``) and ask the module for a few rows at a time. The module knows its
rule (causal, window), so the rows are those the model computed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..functional import attention

__all__ = ["AttentionRows"]


class AttentionRows:
    """Mixed into :class:`~attnlab.modules.MultiHeadAttention` (which has ``causal``,
    ``window`` and ``score_options``: its scale, softcap, ALiBi and sinks)."""

    causal: bool
    window: int | None
    score_options: Callable[..., dict]  # modules.scores.ScoreOptions

    def attention_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       rows: list[int]) -> torch.Tensor:
        """The weights ``(batch, heads, len(rows), k_len)`` of the query ``rows`` for the
        ``q, k, v`` this module gave attention in one self-attention call without a cache
        (as its ``qkv_hook`` sees them: ``(batch, heads, len, head_dim)``, after RoPE),
        under this module's rule and score options, from :func:`attnlab.attention` with
        ``return_weights=rows``: no ``q_len x k_len`` matrix is formed.

        Causal: the keys after the last row asked are masked for every row asked, so the
        call is made on the prefix up to it and the weights are padded back to ``k_len``
        with zeros. A block of consecutive rows is asked as the queries of that block
        alone (end-aligned, a causal block's queries keep their positions), so a block of
        ``R`` rows costs ``R`` rows of scores, not the whole call.
        """
        k_len = k.shape[-2]
        rows = [int(r) for r in rows]
        if not rows:
            raise ValueError("rows must name at least one query row, got none")
        whole = q.shape[-2] == k_len  # self-attention over one sequence
        lo, hi = min(rows), max(rows) + 1
        if self.causal and whole:
            k, v = k[..., :hi, :], v[..., :hi, :]
            q = q[..., :hi, :]
        options = self.score_options(q.device)
        # A block alone keeps its queries' positions when causal; otherwise only where
        # positions do not matter (no window, no ALiBi distance).
        if whole and rows == list(range(lo, hi)) and (
                self.causal or (self.window is None and "alibi_slopes" not in options)):
            q, rows = q[..., lo:hi, :], list(range(hi - lo))
        # auto: a backend that returns weights (a model may run on sdpa, which cannot)
        _, weights = attention(q, k, v, causal=self.causal, window=self.window,
                               return_weights=rows, **options)
        if weights.shape[-1] < k_len:
            weights = torch.nn.functional.pad(weights, (0, k_len - weights.shape[-1]))
        return weights
