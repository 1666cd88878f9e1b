"""What each head does: every ``(layer, head)`` scored on documented attention probes.

The model reads a probe input (random tokens, repeated) once, with
``output_attentions=True``; every score is computed from the weights it returns and
from the token ids, nothing else: no hook, no module, no parameter is read, so any model
whose forward returns ``(output, [one (batch, heads, seq, seq) tensor per layer])``
can be classified.

The probe input: ``batch`` sequences, each ``length`` distinct random token ids (special
tokens left out) followed by the same ``length`` ids again, as in the induction-head
studies. Each score is a mean attention weight in [0, 1], over the query rows the probe
defines (rows of all sequences pooled):

- ``previous-token``: the weight on position ``i - 1``, rows ``i >= 1``. Heads that move
  each token's identity one position on, the first half of an induction circuit
  (Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits"; Olsson et
  al. 2022).
- ``induction``: on the second copy, the weight on the token *after* the earlier
  occurrence of the current token (row ``i`` attends ``j + 1`` where ``ids[j] == ids[i]``,
  ``j < i - 1``): the head that completes ``[A][B] ... [A] -> [B]`` (Olsson et al. 2022,
  "In-context Learning and Induction Heads").
- ``sink`` (first token): the weight on position 0, rows ``i >= 1``: the attention sink
  that absorbs weight a head does not need elsewhere (Xiao et al. 2023, "Efficient
  Streaming Language Models with Attention Sinks").
- ``self``: the weight on the query's own position (the diagonal), rows ``i >= 1``
  (row 0 of a causal head can attend nowhere else).
- ``duplicate-token``: the weight on earlier occurrences of the current token (row ``i``
  attends ``j < i`` with ``ids[j] == ids[i]``; the rows of the second copy) (Wang et
  al. 2022, "Interpretability in the Wild", the IOI circuit's duplicate-token heads).

A head's ``kind`` is its strongest probe when that score reaches ``min_score``, else
``"other"`` (it does something these probes do not name). For reference, a causal head
that spreads its weight evenly scores the mean of ``1 / (i + 1)`` over rows ``i >= 1`` on
previous-token, sink and self: 0.16 over 16 positions, 0.035 over the default 128.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checks import positive_int

__all__ = ["KINDS", "ABOUT", "OTHER", "classify", "probe_ids", "probe_scores", "head_labels",
           "format_kinds", "save_kinds"]

KINDS = ("previous-token", "induction", "sink", "self", "duplicate-token")
OTHER = "other"
ABOUT = {
    "previous-token": "attention on position i-1 (Elhage et al. 2021; Olsson et al. 2022)",
    "induction": "on a repeated random sequence, attention from the second copy to the token "
                 "after the first occurrence (Olsson et al. 2022)",
    "sink": "attention on the first token, position 0 (Xiao et al. 2023)",
    "self": "attention on the query's own position (the diagonal)",
    "duplicate-token": "attention on earlier occurrences of the same token (Wang et al. 2022)",
}
DEFAULT_LENGTH = 64  # tokens per copy: 128 positions, well within every context here


def probe_ids(vocabulary: Sequence[int] | torch.Tensor, length: int, batch: int,
              seed: int = 0) -> torch.Tensor:
    """The probe input ``(batch, 2 * length)``: per row ``length`` distinct ids drawn from
    ``vocabulary`` (without replacement), then the same ids again."""
    pool = torch.as_tensor(vocabulary, dtype=torch.long).flatten()
    positive_int("length", length)
    positive_int("batch", batch)
    if length > len(pool):
        raise ValueError(f"length must be at most the {len(pool)} usable token ids (each "
                         f"copy holds distinct tokens), got {length}")
    gen = torch.Generator().manual_seed(int(seed))
    rows = [pool[torch.randperm(len(pool), generator=gen)[:length]] for _ in range(batch)]
    first = torch.stack(rows)
    return torch.cat([first, first], dim=1)


def probe_scores(weights: torch.Tensor, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every probe of the module docstring on one layer's weights.

    Args:
        weights: ``(batch, heads, T, T)`` attention weights (row = query).
        ids: ``(batch, T)`` the token ids the weights were computed on.

    Returns:
        ``{kind: (heads,) float64 mean score}`` for each kind in :data:`KINDS`; a probe
        with no row to score (no repeated token, ``T < 2``) scores 0.
    """
    return _means(_probe_sums(weights, ids))


def _means(sums: dict[str, tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    """Each kind's sum over its count (0 with no row scored)."""
    return {kind: total / count if count else torch.zeros_like(total)
            for kind, (total, count) in sums.items()}


def _probe_sums(weights: torch.Tensor, ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
    """Per kind, the ``(heads,)`` float64 sum of the rows' scores and the number of rows
    scored: what :func:`probe_scores` divides, and what adds up over sequences scored a
    few at a time (:func:`classify`)."""
    w = torch.as_tensor(weights).double()
    ids = torch.as_tensor(ids)
    if w.ndim != 4 or w.shape[-1] != w.shape[-2]:
        raise ValueError(f"weights must be (batch, heads, T, T), got {tuple(w.shape)}")
    if tuple(ids.shape) != (w.shape[0], w.shape[-1]):
        raise ValueError(f"ids must be (batch, T) = ({w.shape[0]}, {w.shape[-1]}), got "
                         f"{tuple(ids.shape)}")
    t = w.shape[-1]
    later = torch.arange(1, t)  # rows i >= 1
    same = ids[:, :, None] == ids[:, None, :]  # (B, T, T): ids[i] == ids[j]
    earlier = torch.ones(t, t, dtype=torch.bool).tril(-1)  # j < i
    duplicate = same & earlier
    # induction targets: j + 1 for every j < i - 1 with ids[j] == ids[i]
    induction = torch.zeros_like(same)
    induction[:, :, 1:] = (same & torch.ones(t, t, dtype=torch.bool).tril(-2))[:, :, :-1]
    return {
        "previous-token": _row_sums(w[..., later, later - 1]),
        "induction": _masked_row_sums(w, induction),
        "sink": _row_sums(w[..., later, 0]),
        "self": _row_sums(w[..., later, later]),
        "duplicate-token": _masked_row_sums(w, duplicate),
    }


def _row_sums(values: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(B, H, R)`` -> the ``(H,)`` sum over sequences and rows, and their number."""
    return values.sum(dim=(0, 2)), values.shape[0] * values.shape[2]


def _masked_row_sums(w: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each row's weight on its ``targets`` ``(B, T, T)``, summed over the rows that have a
    target at all ``(H,)``, and their number."""
    rows = targets.any(-1)  # (B, T)
    per_row = (w * targets[:, None].to(w.dtype)).sum(-1)  # (B, H, T)
    return per_row.permute(1, 0, 2)[:, rows].sum(-1), int(rows.sum())


def _ordinary_ids(tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """The ids a probe may draw: every id below ``vocab_size`` but padding, unknown and
    the tokenizer's special tokens (a BOS or chat marker would be a sink of its own)."""
    special: set[int] = set()
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "get_added_tokens_decoder"):
        special |= {int(i) for i, t in backend.get_added_tokens_decoder().items()
                    if getattr(t, "special", False)}
    for name in ("pad_id", "unk_id"):  # WordTokenizer's <pad> and <unk>, HF's padding
        found = getattr(tokenizer, name, None)
        if isinstance(found, int):
            special.add(found)
    keep = torch.ones(vocab_size, dtype=torch.bool)
    keep[[i for i in special if 0 <= i < vocab_size]] = False
    return torch.nonzero(keep).flatten()


# The attention weights one forward of the probe may hold (every layer's), in bytes.
PROBE_BYTES = 256 << 20


def _heads_guess(model: nn.Module) -> int:
    """Layers x heads of ``model`` where its config says (for the size of the probe's
    forwards), else a generous 1024."""
    config = getattr(model, "config", None)
    layers, heads = getattr(config, "num_layers", None), getattr(config, "num_heads", None)
    return layers * heads if isinstance(layers, int) and isinstance(heads, int) else 1024


def _vocab_size(model: nn.Module, tokenizer: Any) -> int:
    sizes = [int(tokenizer.vocab_size)]
    config = getattr(model, "config", None)
    if getattr(config, "vocab_size", None) is not None:
        sizes.append(int(config.vocab_size))
    return min(sizes)


@torch.no_grad()
def classify(model: nn.Module, tokenizer: Any, *, length: int | None = None, batch: int = 4,
             seed: int = 0, min_score: float = 0.3) -> dict:
    """Score every ``(layer, head)`` of ``model`` on the probes of the module docstring.

    Args:
        model: any attnlab model (``ToyAttnLM``, ``GPT``, ``Encoder``); only what its
            forward returns with ``output_attentions=True`` is read.
        tokenizer: its tokenizer (for the vocabulary the random tokens come from).
        length: tokens per copy of the probe sequence (default 64, capped by half the
            model's ``context_length`` and by the number of ordinary token ids).
        batch, seed: how many random sequences, and the seed that draws them.
        min_score: the score a probe must reach to name a head's ``kind``.

    Returns:
        ``{"layers", "heads", "kinds", "scores": {kind: [[score per head] per layer]},
        "kind": [[kind per head] per layer], "score": [[its score]], "min_score",
        "about": {kind: what it measures}, "probe": {"length", "batch", "seed"}}``,
        plain data (JSON as it is).
    """
    if isinstance(min_score, bool) or not isinstance(min_score, int | float) or \
            not 0 <= min_score <= 1:
        raise ValueError(f"min_score must be a number in [0, 1], got {min_score!r}")
    pool = _ordinary_ids(tokenizer, _vocab_size(model, tokenizer))
    context = getattr(model, "context_length", None)
    cap = min(len(pool), DEFAULT_LENGTH if context is None else int(context) // 2)
    if cap < 2:  # no length to ask for: say what is short, not an empty range
        short = (f"the model's context of {context} tokens" if context is not None
                 and int(context) // 2 < 2 else f"its {len(pool)} ordinary token ids")
        raise ValueError(f"the head probes repeat a random sequence of at least 2 tokens "
                         f"within the context: {short} leave no room for one")
    if length is None:
        length = min(DEFAULT_LENGTH, cap)
    positive_int("length", length)
    if length < 2 or length > cap:
        raise ValueError(f"length (--length) must be in [2, {cap}] (half the model's context "
                         f"of {context} tokens, and at most the {len(pool)} ordinary token "
                         f"ids), got {length}")
    ids = probe_ids(pool, length, batch, seed)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    # A few sequences a forward: their weights, every layer's (batch, heads, T, T), are
    # what the memory holds, and --batch 100000 asked for 29 GB at once.
    chunk = max(1, PROBE_BYTES // (4 * (2 * length) ** 2 * _heads_guess(model)))
    sums: list[dict] = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, batch, chunk):
            part = ids[start:start + chunk]
            out = model(part.to(device), output_attentions=True)
            attentions = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            if not isinstance(attentions, list | tuple) or not attentions:
                raise TypeError(f"model: expected forward(ids, output_attentions=True) to "
                                f"return (output, [weights per layer]), got "
                                f"{type(out).__name__}")
            got = [_probe_sums(w.detach().cpu(), part) for w in attentions]
            sums = got if not sums else [{k: (a[k][0] + b[k][0], a[k][1] + b[k][1])
                                          for k in KINDS} for a, b in zip(sums, got)]
    finally:
        model.train(was_training)
    per_layer = [_means(layer) for layer in sums]
    scores = {k: [[float(x) for x in layer[k]] for layer in per_layer] for k in KINDS}
    shape = [(i, range(len(row))) for i, row in enumerate(scores[KINDS[0]])]
    best = [[max(KINDS, key=lambda k: scores[k][i][h]) for h in hs] for i, hs in shape]
    score = [[scores[best[i][h]][i][h] for h in hs] for i, hs in shape]
    kind = [[best[i][h] if score[i][h] >= min_score else OTHER for h in hs] for i, hs in shape]
    return {"layers": len(per_layer), "heads": max(len(r) for r in kind), "kinds": list(KINDS),
            "scores": scores, "kind": kind, "score": score, "min_score": float(min_score),
            "about": dict(ABOUT), "probe": {"length": length, "batch": batch, "seed": seed}}


def head_labels(result: dict) -> list[list[str]]:
    """``"previous-token 0.81"`` per head (layers x heads), for pictures and the explorer.
    A head below ``min_score`` reads ``"other (sink 0.12)"``: its best probe, still named."""
    out = []
    for i, row in enumerate(result["kind"]):
        labels = []
        for h, kind in enumerate(row):
            value = result["score"][i][h]
            if kind == OTHER:
                best = max(result["kinds"], key=lambda k, h=h: result["scores"][k][i][h])
                labels.append(f"{OTHER} ({best} {value:.2f})")
            else:
                labels.append(f"{kind} {value:.2f}")
        out.append(labels)
    return out


def _cell(result: dict, layer: int, head: int) -> str:
    """``"sink 0.93"``, or ``"(sink 0.12)"`` for a head below ``min_score``."""
    best = max(result["kinds"], key=lambda k: result["scores"][k][layer][head])
    text = f"{best} {result['scores'][best][layer][head]:.2f}"
    return text if result["kind"][layer][head] != OTHER else f"({text})"


def format_kinds(result: dict) -> str:
    """The terminal table of ``attnlab heads``: one row per layer, one column per head,
    each cell the strongest probe and its score, then what each probe measures."""
    cells = [[_cell(result, i, h) for h in range(len(row))] for i, row in enumerate(result["kind"])]
    width = max(len(c) for row in cells for c in row) + 2
    lines = [f"what each head does: the strongest probe and its mean attention weight "
             f"(in brackets: no probe reaches {result['min_score']:.2f}, the head is "
             f"{OTHER!r})",
             ("layer " + "".join(f"{'head ' + str(h):<{width}s}"
                                 for h in range(result["heads"]))).rstrip()]
    lines += [f"{i:>5d} " + "".join(f"{c:<{width}s}" for c in row).rstrip()
              for i, row in enumerate(cells)]
    counts = {k: sum(r.count(k) for r in result["kind"]) for k in (*result["kinds"], OTHER)}
    lines.append("found: " + ", ".join(f"{n} {k}" for k, n in counts.items() if n))
    probe = result["probe"]
    lines.append(f"probe: {probe['batch']} random sequences of {probe['length']} tokens, each "
                 f"repeated once (seed {probe['seed']}); the probes:")
    lines += [f"  {k:<16s}{about}" for k, about in result["about"].items()]
    return "\n".join(lines)


def save_kinds(result: dict, out: str | os.PathLike[str], *, fmt: str = "png",
               source: str | None = None) -> dict[str, Path]:
    """Write ``heads.json`` (``result``, with ``source``: what model it describes) and the
    picture ``heads.png`` or ``heads.svg`` (``fmt``) into folder ``out``, atomically.

    ``out`` may be new, empty or hold only files attnlab writes
    (:func:`attnlab.io.outdir.check_own_dir`); it is locked while written.
    Returns ``{"json": path, "picture": path}``.
    """
    from ..io import HEADS_JSON, HEADS_PNG, HEADS_SVG, atomic_write_json
    from ..io.locks import output_lock
    from ..io.outdir import check_own_dir, drop_stale, make_dir, signed
    from ..viz import save_head_kinds
    from ..viz.heatmap import FORMATS

    if fmt not in FORMATS:
        raise ValueError(f"fmt (--format) must be one of {', '.join(FORMATS)}, got {fmt!r}")
    check_own_dir(out)
    folder = Path(out)
    with output_lock(out):
        make_dir(folder)
        data = folder / HEADS_JSON
        atomic_write_json(data, signed({"source": source, **result}))
        picture = save_head_kinds(folder / (HEADS_PNG if fmt == "png" else HEADS_SVG),
                                  result["kind"], result["score"], fmt=fmt,
                                  title=f"what each head does{' in ' + source if source else ''}"
                                        " (darker: stronger)")
        drop_stale(folder / (HEADS_SVG if fmt == "png" else HEADS_PNG))
    return {"json": data, "picture": picture}
