"""Which heads matter: knock out one head (or one layer's heads) and measure the damage.

The classic measurement of Michel, Levy and Neubig (2019), "Are sixteen heads
really better than one?": the increase of the loss when a single head is
removed, every other head left intact. A head is knocked out in one of two ways:

- ``zero``: its context vector (``weights @ V`` of that head, the head's slice of
  ``out_proj``'s input) is set to zero, so it contributes nothing (Michel et al.'s
  mask ``xi_h = 0``);
- ``uniform``: its query is set to zero (and, where the layer has them, its ALiBi slope
  to 0 and its sink to none), so every score is 0 and its weights are exactly uniform
  over the keys it may see: it still passes on the average value, but can no longer
  choose where to look.

What is measured depends on the model:

- a decoder (``ToyAttnLM``, ``GPT``): next-token cross-entropy on the real tokens
  of a batch (``measure = "loss"``; the table shows the increase);
- an encoder (``Encoder``: BERT, MiniLM), which has no next-token loss: how far
  the sentence embedding moves, ``1 - cos`` between the mean-pooled final hidden
  states of the knocked-out and the intact model, averaged over the sentences
  (``measure = "embedding_change"``; 0 = unchanged, the baseline is 0).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import one_of
from .layers import attention_layers, is_decoder, layer_head, scores_from_qk_alone, token_batch

KNOCKOUTS = ("zero", "uniform")

MEANING = {
    "loss": "next-token cross-entropy on the real tokens (knocked out minus intact: "
            "how much worse the model predicts)",
    "embedding_change": "1 - cos(mean-pooled final hidden states, knocked out vs intact), "
                        "averaged over the sentences: how far the sentence embedding moves "
                        "(an encoder has no next-token loss)",
}


@contextlib.contextmanager
def knocked_out(model: nn.Module, heads: Iterable[tuple[int, int]], how: str = "zero"
                ) -> Iterator[None]:
    """Inside the block, the ``(layer, head)`` pairs in ``heads`` are knocked out
    (``how``: ``"zero"`` or ``"uniform"``, see the module docstring); every other
    head is untouched. Hooks are removed on exit, also on an error.

    With grouped-query attention a query head is knocked out alone: ``zero`` edits
    its own slice of the context, ``uniform`` its own query; the shared key/value
    head keeps serving the others.
    """
    one_of("how", how, KNOCKOUTS)
    layers = attention_layers(model)
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        layer, head = layer_head(layers, layer, head)
        by_layer.setdefault(layer, []).append(head)
    handles, previous = [], {}
    stack = contextlib.ExitStack()
    try:
        for layer, chosen in by_layer.items():
            mha = layers[layer]
            d = mha.head_dim
            if how == "zero":
                def zero(_m, inputs, chosen=chosen, d=d):
                    x = inputs[0].clone()  # (B, T, H * head_dim): heads side by side
                    for h in chosen:
                        x[..., h * d:(h + 1) * d] = 0
                    return (x, *inputs[1:])
                handles.append(mha.out_proj.register_forward_pre_hook(zero))
            else:
                previous[layer] = mha.qkv_hook
                inner = mha.qkv_hook

                def uniform(q, k, v, chosen=chosen, inner=inner):
                    if inner is not None:
                        q, k, v = inner(q, k, v)
                    q = q.clone()  # (B, H, T, head_dim)
                    q[:, chosen] = 0
                    return q, k, v
                mha.qkv_hook = uniform
                stack.enter_context(scores_from_qk_alone(mha, chosen))
        yield
    finally:
        stack.close()
        for h in handles:
            h.remove()
        for layer, hook in previous.items():
            layers[layer].qkv_hook = hook


@torch.no_grad()
def measure(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor,
            intact: torch.Tensor | None = None) -> float:
    """The damage measure of the module docstring on a right-padded batch.

    Args:
        ids: ``(batch, seq)`` token ids; mask: ``(batch, seq)`` 1 = real token.
        intact: for an encoder, the intact model's pooled embeddings ``(batch, d)``
            (from :func:`pooled`); None measures the model as it is against itself.

    Returns:
        a decoder's loss, or an encoder's mean ``1 - cos`` to ``intact``.
    """
    if is_decoder(model):
        logits = model(ids[:, :-1], attention_mask=mask[:, :-1])
        real = (mask[:, 1:] * mask[:, :-1]).bool()
        return float(F.cross_entropy(logits[real], ids[:, 1:][real]))
    now = pooled(model, ids, mask)
    intact = now if intact is None else intact
    # float64: in float32, 1 - cos(x, x) comes out near +-1e-7, not the baseline's 0.
    return float(1 - F.cosine_similarity(now.double(), intact.double(), dim=-1).mean())


@torch.no_grad()
def pooled(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """An encoder's sentence embeddings ``(batch, d_model)``: the final hidden states
    mean-pooled over the real tokens and L2-normalised (as sentence-transformers)."""
    hidden = model(ids, attention_mask=mask)  # (B, T, d)
    w = mask.unsqueeze(-1).to(hidden.dtype)
    return F.normalize((hidden * w).sum(1) / w.sum(1).clamp(min=1e-9), dim=-1)


def _batch(model: nn.Module, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` checked: a decoder's rows of two tokens or more (an encoder's of
    one), integer ids as int64, a mask of their shape."""
    ids = token_batch(model, ids, least=2 if is_decoder(model) else 1)
    mask = torch.as_tensor(mask)
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(f"mask must have the shape of ids {tuple(ids.shape)}, got "
                         f"{tuple(mask.shape)}")
    return ids, mask


def knockout(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor,
             heads: Iterable[tuple[int, int]]) -> dict:
    """The measure with ``heads`` knocked out each way, against the intact model.

    Returns ``{"measure", "baseline", "heads": [[layer, head], ...], "zero",
    "uniform"}`` where ``zero``/``uniform`` are the measure knocked out that way.
    """
    layers = attention_layers(model)
    heads = [layer_head(layers, layer, head) for layer, head in heads]
    ids, mask = _batch(model, ids, mask)
    was_training = model.training
    model.eval()
    try:
        intact = None if is_decoder(model) else pooled(model, ids, mask)
        out = {"measure": "loss" if is_decoder(model) else "embedding_change",
               "baseline": measure(model, ids, mask, intact), "heads": [list(h) for h in heads]}
        for how in KNOCKOUTS:
            with knocked_out(model, heads, how):
                out[how] = measure(model, ids, mask, intact)
        return out
    finally:
        model.train(was_training)


def head_importance(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """Every head knocked out alone, both ways: the importance table.

    Args:
        ids, mask: ``(batch, seq)`` a right-padded batch and its 1/0 mask.

    Returns:
        ``{"measure", "meaning", "baseline", "layers", "heads", "zero", "uniform"}``
        where ``zero`` and ``uniform`` are ``layers x heads`` nested lists of the
        increase of the measure over ``baseline`` when that head alone is knocked out.
    """
    layers = attention_layers(model)
    n_heads = layers[0].num_heads
    ids, mask = _batch(model, ids, mask)
    was_training = model.training
    model.eval()
    try:
        intact = None if is_decoder(model) else pooled(model, ids, mask)
        kind = "loss" if is_decoder(model) else "embedding_change"
        base = measure(model, ids, mask, intact)
        table = {how: [[0.0] * layer.num_heads for layer in layers] for how in KNOCKOUTS}
        for i, layer in enumerate(layers):
            for h in range(layer.num_heads):
                for how in KNOCKOUTS:
                    with knocked_out(model, [(i, h)], how):
                        table[how][i][h] = measure(model, ids, mask, intact) - base
    finally:
        model.train(was_training)
    return {"measure": kind, "meaning": MEANING[kind], "baseline": base,
            "layers": len(layers), "heads": n_heads, **table}


def format_head_table(result: dict) -> str:
    """The terminal table of ``attnlab ablate --heads``: one row per layer, one column per
    head, for each way of knocking out, plus the heads that matter most."""
    lines = [f"head importance: the increase of {result['measure']} when one head alone is "
             f"knocked out (baseline {result['baseline']:.4f})",
             f"  {result['measure']} = {result['meaning']}"]
    for how, title in (("zero", "head output zeroed"),
                       ("uniform", "head's attention replaced by uniform weights")):
        rows = result[how]
        width = max(len(r) for r in rows)
        lines += ["", f"{title} ({how}):",
                  "layer " + "".join(f"{'head ' + str(h):>10s}" for h in range(width))]
        lines += [f"{i:>5d} " + "".join(f"{v:>+10.4f}" for v in row) for i, row in enumerate(rows)]
        ranked = sorted(((v, i, h) for i, row in enumerate(rows) for h, v in enumerate(row)),
                        reverse=True)[:3]
        lines.append("most important: " + ", ".join(f"layer {i} head {h} ({v:+.4f})"
                                                    for v, i, h in ranked))
    return "\n".join(lines)


def format_knockout(result: dict, what: str) -> str:
    """The report of ``attnlab ablate --layer L [--head H]``."""
    base = result["baseline"]
    lines = [f"{what} knocked out; {result['measure']} = {MEANING[result['measure']]}",
             f"  intact      {base:.4f}"]
    for how in KNOCKOUTS:
        lines.append(f"  {how:<11s} {result[how]:.4f}  ({result[how] - base:+.4f})")
    return "\n".join(lines)


# --------------------------------------------------------------------------- batches


def batch_from_ids(stream: list[int] | torch.Tensor, context_length: int, *,
                   max_rows: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder's evaluation batch from a token stream: consecutive windows of
    ``min(context_length, 128) + 1`` tokens (inputs plus the next token), the last one
    shorter and right-padded, at most ``max_rows`` rows. Returns ``(ids, mask)``,
    both ``(rows, width)``; mask 1 = real token."""
    stream = torch.as_tensor(stream, dtype=torch.long).flatten()
    if len(stream) < 2:
        raise ValueError(f"the evaluation text is {len(stream)} token(s); at least 2 are "
                         "needed to predict one")
    width = min(context_length, 128) + 1
    rows = [stream[i:i + width] for i in range(0, len(stream) - 1, width)][:max_rows]
    return _padded([r.tolist() for r in rows if len(r) >= 2] or [stream[:width].tolist()], 0)


def batch_from_text(model: nn.Module, tokenizer, text: str, *, max_rows: int = 32
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The evaluation batch of ``text`` for ``model``: for a decoder the token stream
    in windows (:func:`batch_from_ids`); for an encoder one row per non-empty line
    (a sentence), truncated to the model's context, right-padded. Returns
    ``(ids, mask)``, ``(rows, width)`` each."""
    limit = model.context_length
    if is_decoder(model):
        try:
            stream = tokenizer.encode(text)
        except ValueError as exc:
            raise ValueError(f"--text: {exc}") from None
        return batch_from_ids(stream, limit, max_rows=max_rows)
    lines = [line.strip() for line in text.splitlines() if line.strip()][:max_rows]
    if not lines:
        raise ValueError("the evaluation text has no non-empty line (one sentence a line)")
    if hasattr(tokenizer, "encode_batch"):  # a Hugging Face tokenizer: keeps [SEP] when cut
        rows = [tokenizer.encode(line, max_length=limit) for line in lines]
    else:
        rows = [tokenizer.encode(line)[:limit] for line in lines]
    return _padded(rows, getattr(tokenizer, "pad_id", 0))


def _padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids, mask
