"""``attnlab bench --suite modules``: the classic comparison of multi-head attention modules.

The workload of the book's bonus notebook (``ch03/02_bonus_efficient-multihead-attention``):
fp32, causal self-attention, d_model=768, 12 heads, B=8, T=1024 (``--quick``: B=2,
T=256), forward and forward+backward, through

- ``attnlab``: ``MultiHeadAttention(768, 768, 12, causal=True, context_length=T)``;
- ``book MHA``: ``llms_from_scratch.ch03.MultiHeadAttention``;
- ``book MHAWrapper``: ``ch03.MultiHeadAttentionWrapper``, 12 ``CausalAttention`` heads
  of 64 features;
- ``book PyTorchMHA``: ``ch03.PyTorchMultiHeadAttention``, fused qkv + SDPA;
- ``torch nn.MHA`` / ``torch nn.MHA weights``: ``nn.MultiheadAttention(768, 12,
  batch_first=True)`` with a causal ``attn_mask`` (and ``is_causal=True``),
  ``need_weights=False`` / ``need_weights=True``.

Each implementation is a factory ``("attnlab.bench.modules", "make_step", kwargs)``;
``make_step(**kwargs)`` builds the module and its inputs once and returns a
zero-argument ``step``, so a runner can rebuild it in a fresh subprocess.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from .runner import Case, Impl

MOD = __name__
# The peer whose time the Markdown table divides by.
BASELINE = "book PyTorchMHA"  # the fastest peer: fused qkv + SDPA
D_MODEL = 768
HEADS = 12

IMPLS = (
    "attnlab",
    "book MHA",
    "book MHAWrapper",
    "book PyTorchMHA",
    "torch nn.MHA",
    "torch nn.MHA weights",
)
# impl name -> what it runs (the names are short so that the runner's table stays aligned)
DESCRIPTIONS = {
    "attnlab": "attnlab MultiHeadAttention(768, 768, 12, causal=True, context_length=T)",
    "book MHA": "llms_from_scratch.ch03.MultiHeadAttention(768, 768, T, 0.0, 12)",
    "book MHAWrapper": "llms_from_scratch.ch03.MultiHeadAttentionWrapper(768, 64, T, 0.0, 12)",
    "book PyTorchMHA": "llms_from_scratch.ch03.PyTorchMultiHeadAttention(768, 768, 12)",
    "torch nn.MHA": "torch.nn.MultiheadAttention(768, 12, batch_first=True), causal attn_mask, "
                    "is_causal=True, need_weights=False",
    "torch nn.MHA weights": "the same with need_weights=True",
}


class _TorchMHA(nn.Module):
    """``nn.MultiheadAttention`` used for causal self-attention, as a user would call it."""

    def __init__(self, d: int, heads: int, seq: int, need_weights: bool) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(d, heads, batch_first=True)
        self.need_weights = need_weights
        # torch's convention: True = may NOT attend.
        self.register_buffer("mask", torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.mha(x, x, x, attn_mask=self.mask, need_weights=self.need_weights,
                          is_causal=True)
        return out


def build_module(impl: str, seq: int, d: int = D_MODEL, heads: int = HEADS) -> nn.Module:
    """The module of implementation ``impl`` for causal self-attention over ``seq`` tokens."""
    if impl == "attnlab":
        from ..modules import MultiHeadAttention

        return MultiHeadAttention(d, d, heads, causal=True, context_length=seq)
    if impl.startswith("book "):
        from llms_from_scratch import ch03

        if impl == "book MHA":
            return ch03.MultiHeadAttention(d, d, seq, 0.0, heads)
        if impl == "book MHAWrapper":
            return ch03.MultiHeadAttentionWrapper(d, d // heads, seq, 0.0, heads)
        if impl == "book PyTorchMHA":
            return ch03.PyTorchMultiHeadAttention(d, d, heads)
    if impl in ("torch nn.MHA", "torch nn.MHA weights"):
        return _TorchMHA(d, heads, seq, need_weights=impl == "torch nn.MHA weights")
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def make_step(impl: str, batch: int, seq: int, backward: bool = False, d: int = D_MODEL,
              heads: int = HEADS, seed: int = 0):
    """Build ``impl`` and its ``(batch, seq, d)`` fp32 input once; return a zero-arg step.

    Forward steps run in eval mode under ``torch.no_grad()``; forward+backward steps
    run in train mode (dropout 0) and back-propagate a fixed output gradient into
    the parameters, then drop the gradients.
    """
    torch.manual_seed(seed)
    module = build_module(impl, seq, d, heads)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, d, generator=g)  # (B, T, d)
    if not backward:
        module.eval()

        def step():
            with torch.no_grad():
                return module(x)
        return step

    module.train()
    grad_out = torch.randn(batch, seq, d, generator=g)

    def step_fb():
        out = module(x)
        out.backward(grad_out)
        module.zero_grad(set_to_none=True)
    return step_fb


def _factory(impl: str, **kw) -> tuple[str, str, dict]:
    return (MOD, "make_step", {"impl": impl, **kw})


def _skip(impl: str) -> str | None:
    if impl.startswith("book ") and importlib.util.find_spec("llms_from_scratch") is None:
        return "llms-from-scratch is not installed (pip install --no-deps llms-from-scratch)"
    return None


def _workloads(quick: bool) -> list[tuple[str, dict, int]]:
    batch, seq = (2, 256) if quick else (8, 1024)
    out = []
    for backward in (False, True):
        name = f"{'fwd+bwd' if backward else 'fwd'} B={batch} T={seq}"
        out.append((name, {"batch": batch, "seq": seq, "backward": backward}, 3 if quick else 5))
    return out


def cases(quick: bool = False) -> list[Case]:
    """The suite's cases for :func:`attnlab.bench.runner.run_cases`."""
    return [Case("modules", name, [Impl(i, _factory(i, **kw), skip=_skip(i)) for i in IMPLS],
                 repeats=repeats)
            for name, kw, repeats in _workloads(quick)]
