"""The attention variants' cases of ``attnlab bench --suite attention`` (issue 22's
targets): softcap, ALiBi, sinks, document ids and a prefix-LM ``mask_mod``, B=1, 12
heads, head_dim 64, fp32, causal, T=4096 (documents: 8 in T=8192), forward and
forward+backward.

The peers, each as its users write it:

- ``torch-flex``: FlexAttention compiled by inductor with the same ``score_mod`` /
  ``mask_mod`` (sinks: one extra key of zeros whose score the ``score_mod`` sets to the
  head's sink logit, exact; its compiled CPU path has no ``return_lse`` for the other
  way, ``out * sigmoid(lse - sink)``); its compile time is reported apart
  (``compile_s``), its steps timed warm; forward only (it has no CPU backward);
- ``torch-sdpa``: ``F.scaled_dot_product_attention`` with the equivalent materialised
  float bias (ALiBi) or bool mask (documents, prefix-LM), where it can express the
  variant (not softcap or sinks);
- ``attnlab-per-document`` (documents only): one ``attention`` call per document, the
  time a document mask should stay near (issue 22: within 1.3x on the native kernel);
- ``torch-eager``: the textbook path in torch ops (transformers' ``eager`` attention:
  scores, softcap, mask, softmax in float32, sinks as an extra column as gpt-oss does),
  the PyTorch path that trains for softcap and sinks.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from ..functional import attention
from .factory import attention_step

VARIANTS = ("softcap", "alibi", "sinks", "documents", "prefix-lm")
SOFTCAP = 50.0  # Gemma 2's attention softcap
DOCUMENTS = 8
# FlexAttention's compile time per case name, read by attention.annotate().
COMPILE_S: dict[str, float] = {}


def peers(variant: str, backward: bool) -> list[str]:
    """The peers a variant's case runs against (SDPA where a dense mask states it; for
    documents also attnlab's own call per document, the time a document mask aims at)."""
    out = ["torch-sdpa"] if variant in ("alibi", "documents", "prefix-lm") else []
    if variant == "documents":
        out.insert(0, "attnlab-per-document")
    if variant in ("softcap", "sinks"):
        out.append("torch-eager")
    if not backward:
        out.append("torch-flex")
    return out


def pairs(variant: str, seq: int) -> int:
    """The (query, key) pairs the variant's case lets through: causal, within each
    document, or causal plus the prefix's keys."""
    causal = seq * (seq + 1) // 2
    if variant == "documents":
        size = seq // DOCUMENTS
        return DOCUMENTS * size * (size + 1) // 2
    if variant == "prefix-lm":
        prefix = seq // 4
        return causal + prefix * (prefix - 1) // 2
    return causal


def _slopes(heads: int) -> torch.Tensor:
    """BLOOM's / ALiBi's paper's slopes for a power-of-two-ish head count."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])


def _setting(variant: str, heads: int, seq: int) -> dict:
    """attnlab's arguments for the variant (causal for all but prefix-LM; ``"causal"``
    alone: the plain call the others are read against)."""
    if variant == "causal":
        return dict(causal=True)
    if variant == "softcap":
        return dict(causal=True, softcap=SOFTCAP)
    if variant == "alibi":
        return dict(causal=True, alibi_slopes=_slopes(heads))
    if variant == "sinks":
        return dict(causal=True, sinks=torch.linspace(-1.0, 2.0, heads))
    if variant == "documents":
        return dict(causal=True, document_ids=torch.arange(seq) * DOCUMENTS // seq)
    if variant == "prefix-lm":
        prefix = seq // 4

        def prefix_lm(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) | (kv_idx < prefix)
        return dict(mask_mod=prefix_lm)
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def _dense(variant: str, setting: dict, seq: int, device="cpu") -> torch.Tensor | None:
    """The materialised mask SDPA (and the eager path) is given: float bias or bool."""
    i = torch.arange(seq, device=device)
    causal = i[None, :] <= i[:, None]
    if variant == "alibi":
        bias = -setting["alibi_slopes"][:, None, None] * (i[:, None] - i[None, :]).abs()
        return bias.masked_fill(~causal, float("-inf"))  # (H, T, T)
    if variant == "documents":
        ids = setting["document_ids"]
        return causal & (ids[:, None] == ids[None, :])
    if variant == "prefix-lm":
        return causal | (i[None, :] < seq // 4)
    return causal


def compiled_flex():
    """``torch.compile(flex_attention)`` for one case, from a fresh dynamo cache: each
    case's mask and score functions recompile the same frame, and past dynamo's
    recompile_limit (8) FlexAttention runs its unfused path instead, 10-20x slower (a
    full run's later cases measured that: 2.8-3.0 s for a T=4096 variant compiled in 0.2
    s alone)."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, variant, setting, seq, case, device="cpu"):
    from torch.nn.attention.flex_attention import create_block_mask

    ids = setting.get("document_ids")
    slopes = setting.get("alibi_slopes")

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def documents(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (ids[q_idx] == ids[kv_idx])

    def softcap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    sinks = setting.get("sinks")

    def with_sink(b, h, q_idx, kv_idx):  # every query sees the sink key
        return (q_idx >= kv_idx) | (kv_idx == seq)

    def sink(score, b, h, q_idx, kv_idx):  # the sink key's score is the head's sink logit
        return torch.where(kv_idx == seq, sinks[h], score)

    mask_mod = {"documents": documents, "prefix-lm": setting.get("mask_mod"),
                "sinks": with_sink}.get(variant, causal)
    score_mod = {"softcap": softcap, "alibi": alibi, "sinks": sink}.get(variant)
    keys = seq + (sinks is not None)
    if sinks is not None:  # one more key of zeros, weighing a zero value
        k, v = (torch.cat([t, t.new_zeros(*t.shape[:2], 1, t.shape[3])], dim=2) for t in (k, v))
    block_mask = create_block_mask(mask_mod, None, None, seq, keys, device=device)
    compiled = compiled_flex()

    def run():
        return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)

    start = time.perf_counter()
    with torch.no_grad():  # the first call compiles
        run()
    COMPILE_S[case] = time.perf_counter() - start
    return run


def _torch_eager(q, k, v, variant, setting, dense):
    """transformers' eager attention, in torch ops."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    sinks = setting.get("sinks")

    def run():
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if variant == "softcap":
            scores = SOFTCAP * torch.tanh(scores / SOFTCAP)
        if dense.dtype == torch.bool:
            scores = scores.masked_fill(~dense, float("-inf"))
        else:
            scores = scores + dense
        if sinks is not None:
            column = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            weights = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
        else:
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
        return torch.matmul(weights, v)
    return run


def make_step(impl: str, variant: str, batch: int = 1, heads: int = 12, seq: int = 4096,
              dim: int = 64, backward: bool = False, case: str = "", device: str = "cpu",
              dtype: str = "float32"):
    """Inputs built once (on ``device``, in ``dtype``); a zero-argument step running
    ``impl`` on the variant's case."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, dim, generator=g)
               .to(device, getattr(torch, dtype)).requires_grad_(backward) for _ in range(3))
    setting = {name: value.to(device) if isinstance(value, torch.Tensor) else value
               for name, value in _setting(variant, heads, seq).items()}
    if impl == "attnlab-per-document":  # the yardstick of document masks: one call each
        cuts = torch.nonzero(torch.diff(setting["document_ids"])).flatten().add(1).tolist()
        bounds = list(zip([0, *cuts], [*cuts, seq]))

        def fwd():
            return torch.cat([attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True)
                              for a, b in bounds], dim=2)
    elif impl.startswith("attnlab-"):
        backend = impl.removeprefix("attnlab-")

        def fwd():
            return attention(q, k, v, backend=backend, **setting)
    elif impl == "torch-sdpa":
        mask = None if variant == "causal" else _dense(variant, setting, seq, device)
        if mask is not None and mask.is_floating_point():
            mask = mask.to(q.dtype)

        def fwd():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                  is_causal=mask is None)
    elif impl == "torch-eager":
        fwd = _torch_eager(q, k, v, variant, setting, _dense(variant, setting, seq, device))
    elif impl == "torch-flex":
        fwd = _flex(q, k, v, variant, setting, seq, case, device)
    else:
        raise ValueError(f"unknown impl {impl!r}")

    return attention_step(fwd, backward, (q, k, v))
