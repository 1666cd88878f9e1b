"""The classic worked example of scaled dot-product attention, step by step.

Two tokens with 2-d queries, keys and values: small enough to check by hand. And
``attnlab demo``'s story (:func:`run_demo`): the worked example, the toy model trained
on the demo's recipe (:mod:`attnlab.recipe`), what its head learned as pictures. It sits
at the command line's level: it drives training, checkpoints and pictures the way a
command does, and nothing in the library imports it (the recipe is what they share).
"""

from __future__ import annotations

import math

import torch

from .functional import attention
from .recipe import DEMO_OUT, SAMPLE, train_demo_model

__all__ = ["worked_example", "format_worked_example", "describe_head", "format_matrix",
           "run_demo", "train_demo_model", "DEMO_OUT", "SAMPLE"]

QUERIES = [[1.0, 0.0], [0.0, 1.0]]
KEYS = [[1.0, 1.0], [0.0, 2.0]]
VALUES = [[1.0, 2.0], [3.0, 4.0]]


def worked_example() -> dict[str, list]:
    """Every intermediate of attention on the 2x2 example, as nested lists.

    Keys: ``queries``, ``keys``, ``values``, ``scores`` (q . k), ``scaled``
    (scores / sqrt(d)), ``weights`` (softmax of each row), ``context``
    (weights @ values). ``weights``/``context`` come from ``attnlab.attention``.
    """
    q, k, v = (torch.tensor(x, dtype=torch.float64) for x in (QUERIES, KEYS, VALUES))
    scores = q @ k.T
    scaled = scores / math.sqrt(q.shape[-1])
    context, weights = attention(q[None], k[None], v[None], return_weights=True)
    return {
        "queries": QUERIES, "keys": KEYS, "values": VALUES,
        "scores": scores.tolist(), "scaled": scaled.tolist(),
        "weights": weights[0].tolist(), "context": context[0].tolist(),
    }


def format_worked_example(steps: dict[str, list]) -> str:
    def vec(x):
        return "[" + ", ".join(f"{a:7.4f}" for a in x) + "]"

    lines = ["Scaled dot-product attention, by hand: two tokens, d = 2", ""]
    for name in ("queries", "keys", "values"):
        for i, row in enumerate(steps[name]):
            lines.append(f"  {name[0]}{i + 1} = {vec(row)}")
    lines += ["", "1. scores: the dot product of each query with each key"]
    for i, row in enumerate(steps["scores"]):
        terms = "  ".join(
            f"q{i + 1}.k{j + 1} = {s:g}" for j, s in enumerate(row)
        )
        lines.append(f"   {terms}")
    d = len(steps["queries"][0])
    lines += ["", f"2. scale by 1/sqrt(d) = 1/sqrt({d}) = {1 / math.sqrt(d):.4f}"]
    lines += [f"   row {i + 1}: {vec(r)}" for i, r in enumerate(steps["scaled"])]
    lines += ["", "3. softmax of each row: how much each query attends to each key"]
    lines += [f"   row {i + 1}: {vec(r)}  (sums to {sum(r):.4f})"
              for i, r in enumerate(steps["weights"])]
    lines += ["", "4. context vectors: the weighted sum of the values"]
    for i, (w, c) in enumerate(zip(steps["weights"], steps["context"])):
        parts = " + ".join(f"{a:.4f} * v{j + 1}" for j, a in enumerate(w))
        lines.append(f"   z{i + 1} = {parts} = {vec(c)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the demo

def describe_head(weights: torch.Tensor, rows: list[int] | None = None) -> dict[str, float]:
    """Average share of attention on the token itself, the previous one and further back.

    ``weights`` is ``(q_len, k_len)`` of a causal head; ``rows`` the query rows to
    average (default all but row 0, which can only see itself).
    """
    rows_t = torch.tensor(rows if rows is not None else range(1, weights.shape[0]))
    w = weights.double()[rows_t]
    itself = w[torch.arange(len(rows_t)), rows_t].mean()
    previous = w[torch.arange(len(rows_t)), rows_t - 1].mean()
    return {"itself": float(itself), "previous": float(previous),
            "further_back": float(1 - itself - previous)}


def format_matrix(weights: torch.Tensor, tokens: list[str]) -> str:
    """Attention weights as percentages, one row per query token."""
    shown = [repr(t)[1:-1] or " " for t in tokens]
    header = "      " + "".join(f"{t:>4s}" for t in shown)
    lines = [header]
    for i, row in enumerate(weights.tolist()):
        cells = "".join(f"{round(100 * x):4d}" if j <= i else "   ." for j, x in enumerate(row))
        lines.append(f"  {shown[i]:>3s} {cells}")
    return "\n".join(lines)


def run_demo(out: str = DEMO_OUT, steps: int = 400, seed: int = 0,
             log=print) -> dict:
    """Train ``ToyAttnLM`` on :func:`pattern_corpus`, report and draw what the head learned.

    Writes ``out/attention.png``, ``out/attention.html``, a checkpoint and
    ``out/summary.json`` (names from :mod:`attnlab.io`); returns the summary.
    """
    from .checkpoint import check_out_dir
    from .io.locks import output_lock

    # Before the banner: a refused --out is one line, with nothing printed before it.
    check_out_dir(out)
    with output_lock(out):
        _check_demo_out(out)
        return _run_demo(out, steps, seed, log)


def _check_demo_out(out: str) -> None:
    """The demo replaces its own output only: a model trained or saved in ``out`` by other
    means is kept (``attnlab train`` itself replaces one only with --overwrite)."""
    from .checkpoint.format import peek_config

    meta = peek_config(out)
    if meta and meta.get("demo") is not True:
        raise ValueError(f"--out {str(out)!r} holds a model that is not the demo's (trained "
                         "or saved there otherwise); the demo replaces only its own output: "
                         "choose another --out")


def _run_demo(out, steps, seed, log) -> dict:
    from pathlib import Path

    from .io import SUMMARY_FILE, atomic_write_json
    from .io.outdir import signed
    from .viz import show_attention

    model, tokenizer, summary = train_demo_model(steps=steps, seed=seed, log=log, out=out,
                                                 meta={"demo": True})
    sample = SAMPLE
    paths = show_attention(model, tokenizer, sample, out, title="ToyAttnLM on " + sample)
    with torch.no_grad():
        _, attentions = model(torch.tensor([tokenizer.encode(sample)]), output_attentions=True)
    weights = attentions[0][0, 0]  # (q_len, k_len) of the one head
    shares = describe_head(weights)
    # Queries where the rule needs the previous token: an "a" inside a run.
    at_a = [i for i in range(1, len(sample)) if sample[i] == "a" and sample[i - 1] != " "]
    a_shares = describe_head(weights, at_a)
    log("")
    log(f"Attention of the head on {sample!r} (percent; row = query, column = key):")
    log(format_matrix(weights, list(sample)))
    log("")
    log(f"What the head learned: on average {100 * shares['previous']:.0f}% of each token's "
        f"attention goes to the previous token, {100 * shares['itself']:.0f}% to itself and "
        f"{100 * shares['further_back']:.0f}% further back.")
    log(f"At an 'a' inside a run, where the next letter is whichever came before the 'a', "
        f"{100 * a_shares['previous']:.0f}% goes to the previous token"
        + (": the head learned to look back one token." if a_shares["previous"] > 0.5
           else "."))
    result = {"final_loss": summary["final_loss"], "eval_loss": summary["eval_loss"],
              "steps": summary["steps"], "seconds": summary["seconds"],
              "tokens_per_s": summary["tokens_per_s"], "attention_shares": shares,
              "attention_shares_at_a": a_shares,
              "files": {"png": str(paths["png"]), "html": str(paths["html"]),
                        "checkpoint": str(out)}}
    atomic_write_json(Path(out) / SUMMARY_FILE, signed(result))
    log(f"Wrote {paths['png']}, {paths['html']}, the checkpoint and {SUMMARY_FILE} in {out}/")
    return result
