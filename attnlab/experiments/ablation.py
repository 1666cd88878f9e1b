"""Experiments on what attention does: knock out Q, K or V and measure.

Each ablation edits the queries, keys or values of every
:class:`~attnlab.modules.MultiHeadAttention` in the model through its ``qkv_hook``,
exactly as attention receives them (after rotary embeddings), so attention itself
still runs through ``attnlab.attention``. The interventions and what they must do:

- ``constant_q``: every query replaced by the first one. The scores of a key
  column are then the same for every query row (``max_row_spread`` = 0).
- ``zero_v``: values set to zero. The context vectors ``weights @ V`` (the input
  of ``out_proj``) are exactly zero (``max_abs_output`` = 0).
- ``constant_k``: every key replaced by the first one. All scores of a row are
  equal, so each query spreads its weight evenly over the keys it may see
  (``max_dev_from_uniform`` = 0).
- ``uniform_attention``: queries set to zero, which makes every score 0 and the
  weights exactly uniform over the allowed keys: attention as average pooling.

For the last two, whose point is equal weights, a layer's ALiBi slopes are set to 0 and
its sinks to none while they run (a zero query under ALiBi still prefers near keys); under
``constant_q`` ALiBi's distances still differ from row to row.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import one_of, probability
from ..modules import MultiHeadAttention
from ..recipe import train_demo_model
from .layers import attention_layers, is_decoder, scores_from_qk_alone, token_batch, whole

ABLATIONS = ("constant_q", "zero_v", "constant_k", "uniform_attention")
# The ablations whose point is equal weights: ALiBi's distances and sinks are set aside
# for them (layers.scores_from_qk_alone).
_UNIFORM = ("constant_k", "uniform_attention")


def _first_position(t: torch.Tensor) -> torch.Tensor:  # (B, H, T, D): position 0 everywhere
    return t[:, :, :1].expand_as(t).contiguous()


# Each ablation edits the (q, k, v) that attention receives, i.e. after rotary
# embeddings: editing the projections instead would let RoPE rotate a "constant"
# query differently at every position, and the scores would still depend on the row.
_EDITS: dict[str, Callable] = {
    "constant_q": lambda q, k, v: (_first_position(q), k, v),
    "zero_v": lambda q, k, v: (q, k, torch.zeros_like(v)),
    "constant_k": lambda q, k, v: (q, _first_position(k), v),
    "uniform_attention": lambda q, k, v: (torch.zeros_like(q), k, v),
}


def _qkv_hook(kind: str | None, record: dict | None) -> Callable:
    edit = _EDITS[kind] if kind is not None else (lambda q, k, v: (q, k, v))

    def hook(q, k, v):
        q, k, v = edit(q, k, v)
        if record is not None:
            record.setdefault("q", []).append(q.detach())
            record.setdefault("k", []).append(k.detach())
        return q, k, v

    return hook


@contextlib.contextmanager
def ablated(model: nn.Module, kind: str | None, record: dict | None = None) -> Iterator[None]:
    """Apply ablation ``kind`` (None = none) inside the block.

    If ``record`` is a dict, it collects per attention module the ``q``
    ``(batch, heads, q_len, head_dim)`` and ``k`` ``(batch, kv_heads, k_len, head_dim)``
    that attention received (rotated, ablated) and the context vectors fed to
    ``out_proj`` (lists, in call order).
    """
    one_of("ablation", kind, (*ABLATIONS, None))
    modules = attention_layers(model)
    previous = [mha.qkv_hook for mha in modules]  # restored on exit (the innermost block wins)
    handles = []
    stack = contextlib.ExitStack()
    try:
        for mha in modules:
            if kind in _UNIFORM:
                stack.enter_context(scores_from_qk_alone(mha))
            mha.qkv_hook = _qkv_hook(kind, record)
            if record is not None:
                handles.append(mha.out_proj.register_forward_pre_hook(
                    lambda m, i: record.setdefault("context", []).append(i[0].detach())))
                record.setdefault("modules", []).append(mha)
        yield
    finally:
        stack.close()
        for mha, hook in zip(modules, previous):
            mha.qkv_hook = hook
        for h in handles:
            h.remove()


@torch.no_grad()
def lm_loss(model: nn.Module, ids: torch.Tensor, **kw) -> float:
    """Next-token cross-entropy of a decoder model on ``ids`` ``(batch, seq)``, seq >= 2."""
    ids = token_batch(model, ids)
    logits = model(ids[:, :-1], **kw)
    if isinstance(logits, tuple):
        logits = logits[0]
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))


def _allowed(mha: MultiHeadAttention, q_len: int, k_len: int, device) -> torch.Tensor:
    from .. import masks

    rule = masks.structural(q_len, k_len, causal=mha.causal, window=mha.window, device=device)
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device) if rule is None else rule


def _row_spread(record: dict) -> float:
    """Largest spread across query rows of any key column's score, over allowed entries.

    The scores are rebuilt from the recorded q and k, which are what attention
    received (after RoPE), so this is the spread of the real pre-softmax scores.
    """
    worst = 0.0
    for mha, q, k in zip(record["modules"], record["q"], record["k"]):
        t, s = q.shape[2], k.shape[2]
        k = k.double().repeat_interleave(mha.num_heads // mha.num_kv_heads, dim=1)
        scores = q.double() @ k.transpose(-1, -2) / math.sqrt(mha.head_dim)  # (B, H, T, S)
        allowed = _allowed(mha, t, s, scores.device)
        hi = scores.masked_fill(~allowed, -math.inf).amax(dim=-2)
        lo = scores.masked_fill(~allowed, math.inf).amin(dim=-2)
        spread = (hi - lo)[allowed.any(dim=0).expand_as(hi)]
        if spread.numel():
            worst = max(worst, float(spread.max()))
    return worst


def _dev_from_uniform(attentions: list[torch.Tensor], record: dict) -> float:
    worst = 0.0
    for mha, w in zip(record["modules"], attentions):
        allowed = _allowed(mha, w.shape[-2], w.shape[-1], w.device)
        n = allowed.sum(dim=-1, keepdim=True).clamp(min=1)
        uniform = allowed / n
        worst = max(worst, float((w.double() - uniform).abs().max()))
    return worst


@torch.no_grad()
def qkv_ablation(model: nn.Module, ids: torch.Tensor) -> dict[str, dict[str, float]]:
    """Loss and the defining measure of each ablation on a held-out batch ``ids`` ``(B, T)``.

    Returns ``{"baseline": {"loss"}, "constant_q": {"loss", "max_row_spread"},
    "zero_v": {"loss", "max_abs_output"}, "constant_k": {"loss", "max_dev_from_uniform"}}``.
    """
    ids = token_batch(model, ids)
    was_training = model.training
    model.eval()
    try:
        out = {"baseline": {"loss": lm_loss(model, ids)}}
        for kind in ("constant_q", "zero_v", "constant_k"):
            record: dict = {}
            with ablated(model, kind, record):
                logits, attentions = model(ids[:, :-1], output_attentions=True)
            loss = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                         ids[:, 1:].reshape(-1)))
            entry = {"loss": loss}
            if kind == "constant_q":
                entry["max_row_spread"] = _row_spread(record)
            elif kind == "zero_v":
                entry["max_abs_output"] = max(float(c.abs().max()) for c in record["context"])
            else:
                entry["max_dev_from_uniform"] = _dev_from_uniform(attentions, record)
            out[kind] = entry
        return out
    finally:
        model.train(was_training)


@torch.no_grad()
def uniform_attention(model: nn.Module, ids: torch.Tensor) -> dict[str, float]:
    """Loss with every attention replaced by a uniform average over the allowed keys."""
    ids = token_batch(model, ids)
    was_training = model.training
    model.eval()
    try:
        record: dict = {}
        with ablated(model, "uniform_attention", record):
            logits, attentions = model(ids[:, :-1], output_attentions=True)
        loss = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                     ids[:, 1:].reshape(-1)))
        return {"loss": loss, "max_dev_from_uniform": _dev_from_uniform(attentions, record)}
    finally:
        model.train(was_training)


def saliency(model: nn.Module, ids: torch.Tensor, target: int | None = None) -> torch.Tensor:
    """Gradient x input for each token: how much each input token moves one prediction.

    Args:
        model: a decoder (``ToyAttnLM`` or ``GPT``) with a ``tok_emb`` embedding.
        ids: ``(seq,)`` or ``(1, seq)`` token ids.
        target: the token whose log-probability at the last position is explained
            (default: the model's own top prediction).

    Returns:
        ``(seq,)`` non-negative scores summing to 1: ``|sum_d grad_d * emb_d|`` per token.
        Set it beside the attention weights of the last row: weights show where a
        head looked, this shows what changed the output.
    """
    if isinstance(ids, torch.Tensor) and ids.ndim == 1:
        ids = ids[None]
    if not is_decoder(model):
        raise ValueError(f"saliency explains a next-token prediction, which needs a decoder; "
                         f"{type(model).__name__} is an encoder")
    ids = token_batch(model, ids, least=1)
    if ids.shape[0] != 1:
        raise ValueError(f"ids must be (seq,) or (1, seq): one text, got shape "
                         f"{tuple(ids.shape)}")
    was_training = model.training
    model.eval()
    captured = {}

    def keep(module, inputs, out):
        # The embeddings as a leaf of their own: their gradient needs none of the weights'
        # (frozen, int8), and the weights' .grad are left as the caller had them.
        captured["emb"] = out.detach().requires_grad_()
        return captured["emb"]

    handle = model.tok_emb.register_forward_hook(keep)
    try:
        with torch.enable_grad():
            last = model(ids)[0, -1].float().log_softmax(-1)
            vocab = last.shape[0]
            chosen = int(last.argmax()) if target is None else whole(target)
            if chosen is None or not 0 <= chosen < vocab:
                raise ValueError(f"target must be a token id in [0, {vocab}), got {target!r}")
            emb = captured["emb"]
            grad, = torch.autograd.grad(last[chosen], emb)
    finally:
        handle.remove()
        model.train(was_training)
    scores = (grad[0].float() * emb[0].detach().float()).sum(-1).abs()
    return scores / scores.sum().clamp(min=1e-12)


def explain(model: nn.Module, tokenizer, text: str) -> dict:
    """Three views of what a decoder's last prediction on ``text`` drew on, side by side.

    Returns ``{"tokens": [str] * seq, "attention": (layers, seq), "rollout": (seq,),
    "saliency": (seq,)}`` (NumPy): the last token's head-averaged attention weights
    in each layer (where each layer looked), its row of the attention rollout
    (:func:`attnlab.viz.rollout`: where the information came from through all
    layers with the residual path), and gradient x input saliency (:func:`saliency`:
    what changed the prediction). Each row sums to 1.
    """
    from ..viz import capture, rollout

    tokens, attentions = capture(model, tokenizer, text)  # per layer (heads, seq, seq)
    ids = torch.tensor(tokenizer.encode(text))
    return {"tokens": tokens,
            "attention": torch.stack([a[:, -1].float().mean(0) for a in attentions]).numpy(),
            "rollout": rollout(attentions)[-1],
            "saliency": saliency(model, ids).numpy()}


def dropout_placement(*, p: float = 0.2, steps: int = 200, seed: int = 0,
                      text: str | None = None) -> dict[str, dict[str, float]]:
    """Train the demo's ToyAttnLM three times: dropout on the weights, on the output, none.

    Each run is the demo's recipe (:func:`attnlab.recipe.train_demo_model`) with the
    same seed, so the three differ only in where dropout ``p`` is applied.

    Returns ``{"none" | "weights" | "output": {"loss", "train_loss", "eval_loss"}}``
    where ``loss`` is the final held-out loss (dropout is off when evaluating).
    """
    p = probability("p", p)
    out = {}
    for placement in ("none", "weights", "output"):
        _, _, summary = train_demo_model(
            steps=steps, seed=seed, text=text, eval_every=steps, progress=False,
            attn_dropout=p if placement == "weights" else None,
            resid_dropout=p if placement == "output" else None)
        out[placement] = {"loss": summary["eval_loss"], "train_loss": summary["final_loss"],
                          "eval_loss": summary["eval_loss"]}
    return out


def held_out_batch(tokenizer, *, batch: int = 16, length: int = 25, seed: int = 0
                   ) -> torch.Tensor:
    """``(batch, length)`` windows of a pattern corpus the demo model never saw."""
    from ..checks import bounded_int, positive_int
    from ..text.corpus import pattern_corpus
    from ..training import sample

    positive_int("batch", batch)
    stream = torch.tensor(tokenizer.encode(pattern_corpus(n_runs=400, seed=seed + 1000)))
    bounded_int("length", length, 2, len(stream) - 1)  # a token and the next, at least
    return sample(stream, batch, length - 1, torch.Generator().manual_seed(seed))


def run_all(model: nn.Module, ids: torch.Tensor, *, dropout_steps: int | None = 200,
            seed: int = 0) -> dict[str, dict]:
    """Every experiment: the JSON that ``attnlab ablate`` prints and writes.

    ``dropout_steps=None`` leaves out the dropout study (it trains the demo's toy
    model, which says nothing about a model loaded from elsewhere)."""
    results = qkv_ablation(model, ids)
    results["uniform_attention"] = uniform_attention(model, ids)
    if dropout_steps is not None:
        results["dropout_placement"] = dropout_placement(steps=dropout_steps, seed=seed)
    return results


_MEANING = {
    "baseline": "the trained model, untouched: the loss to beat.",
    "constant_q": "every query is the first one, so a key column scores the same for every "
                  "query (max_row_spread = {max_row_spread:.2g}); the model can no longer "
                  "choose where to look per token.",
    "zero_v": "values are zero, so the context vectors weights @ V are exactly zero "
              "(max_abs_output = {max_abs_output:.2g}); only the residual path is left.",
    "constant_k": "every key is the first one, so each query spreads its weight evenly over "
                  "what it may see (max_dev_from_uniform = {max_dev_from_uniform:.2g}).",
    "uniform_attention": "weights replaced by a plain average over the allowed keys "
                         "(average pooling): what attention adds beyond a bag of tokens.",
}


_DROPOUT_MEANING = {
    "none": "no dropout: the reference the two placements are compared with.",
    "weights": "dropout on the attention weights (each query randomly loses some of the keys "
               "it looks at, so it cannot rely on one key): held-out loss {vs_none:+.3f} "
               "against no dropout.",
    "output": "dropout on the attention output after out_proj (the attention result is "
              "thinned, the weights stay whole): held-out loss {vs_none:+.3f} against no "
              "dropout.",
}


def format_report(results: dict[str, dict]) -> str:
    """The terminal table of ``attnlab ablate``, one sentence per row."""
    base = results["baseline"]["loss"]
    lines = [f"{'experiment':<20s} {'loss':>8s} {'vs baseline':>12s}  what it means", "-" * 96]
    for key in ("baseline", "constant_q", "zero_v", "constant_k", "uniform_attention"):
        entry = results[key]
        delta = "" if key == "baseline" else f"{entry['loss'] - base:+.3f}"
        lines.append(f"{key:<20s} {entry['loss']:8.3f} {delta:>12s}  "
                     + _MEANING[key].format(**entry))
    if "dropout_placement" not in results:
        return "\n".join(lines)
    lines.append("")
    lines.append("dropout placement: the demo's toy model trained anew on the built-in "
                 "pattern text, not the model above (p=0.2, short training; final held-out "
                 "loss):")
    runs = results["dropout_placement"]
    for placement, entry in runs.items():
        meaning = _DROPOUT_MEANING[placement].format(
            vs_none=entry["eval_loss"] - runs["none"]["eval_loss"])
        lines.append(f"  {placement:<8s} eval {entry['eval_loss']:.3f}  "
                     f"train {entry['train_loss']:.3f}  {meaning}")
    return "\n".join(lines)
