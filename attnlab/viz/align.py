"""How two inputs' tokens pair up, and the difference of their weights where they do.

How tokens are aligned (:func:`align_tokens`): by the alignment with the fewest edits
(Levenshtein distance over the token strings, each insertion, deletion or substitution
costing 1). Equal tokens pair up; a substituted token pairs with its substitute ("the cat
sat" / "the dog sat": cat with dog); an inserted or deleted token has no partner ("the big
cat sat" / "the cat sat": big has none). Among alignments with as few edits, the one that
pairs the later tokens is taken (read from the end: a pair before a gap). The difference
``A - B`` of a cell (query i, key j of the first input) is defined where both i and j
have a partner: ``A[i, j] - B[partner(i), partner(j)]``; every other cell has none (NaN,
drawn light grey). Positions differ when the lengths do; the pairing follows the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .data import as_tokens

__all__ = ["align_tokens", "difference"]


def align_tokens(a: Sequence[str], b: Sequence[str]) -> list[int]:
    """For each token of ``a``, the index of its partner in ``b``, or -1 (the alignment
    with the fewest edits, module docstring). ``O(len(a) * len(b))``."""
    a, b = as_tokens(a), as_tokens(b)
    n, m = len(a), len(b)
    cost = np.zeros((n + 1, m + 1), dtype=np.int64)  # edits between a[:i] and b[:j]
    cost[:, 0], cost[0, :] = np.arange(n + 1), np.arange(m + 1)
    for i in range(1, n + 1):
        same = np.array([a[i - 1] == t for t in b], dtype=np.int64)
        row, up = cost[i], cost[i - 1]
        for j in range(1, m + 1):
            row[j] = min(up[j - 1] + 1 - same[j - 1], up[j] + 1, row[j - 1] + 1)
    partner = [-1] * n
    i, j = n, m
    while i and j:  # from the end: a pair (match or substitution) whenever it is optimal
        if cost[i, j] == cost[i - 1, j - 1] + (a[i - 1] != b[j - 1]):
            partner[i - 1] = j - 1
            i, j = i - 1, j - 1
        elif cost[i, j] == cost[i - 1, j] + 1:
            i -= 1
        else:
            j -= 1
    return partner


def difference(a: np.ndarray, b: np.ndarray, align: Sequence[int]) -> np.ndarray:
    """``A - B`` on the first input's cells, NaN where a query or key has no partner.

    Args:
        a: ``(layers, heads, q_a, k_a)`` weights of the first input (queries are its
            last ``q_a`` tokens).
        b: ``(layers, heads, q_b, k_b)`` of the second.
        align: ``k_a`` partner indices into the second input's tokens (-1: none), as
            :func:`align_tokens` returns them.
    """
    partner = np.asarray(align, dtype=np.int64)
    *_, q_a, k_a = a.shape
    *_, q_b, k_b = b.shape
    if partner.shape != (k_a,):
        raise ValueError(f"align: expected {k_a} partner indices, got {partner.shape}")
    rows = partner[k_a - q_a:] - (k_b - q_b)  # partner query rows (queries: the last tokens)
    ok_rows = (partner[k_a - q_a:] >= 0) & (rows >= 0)
    ok_cols = partner >= 0
    out = np.full(a.shape, np.nan)
    picked = b[..., np.where(ok_rows, rows, 0), :][..., np.where(ok_cols, partner, 0)]
    cells = ok_rows[:, None] & ok_cols[None, :]
    out[..., cells] = (a - picked)[..., cells]
    return out
