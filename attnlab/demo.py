"""The classic worked example of scaled dot-product attention, step by step.

Two tokens with 2-d queries, keys and values: small enough to check by hand.
"""

from __future__ import annotations

import math

import torch

from .functional import attention

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
