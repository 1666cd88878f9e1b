"""One key rule per language: ``masks.key_bounds`` / ``masks.KeyRule`` in Python and
``Rule`` in ``csrc/mask.h``, which the flash forward, backward and decoding step include.

The two are held equal here over every (q_len, k_len, offset, causal, window) of a
hypothesis sweep, windows wider than the sequence included, for each row's keys, each
block's keys and each tile's "needs no mask"; and the Python rule is held to a plain
statement of the convention written out here, pair by pair.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import _native
from attnlab.masks import KeyRule, key_bounds

needs_native = pytest.mark.skipif(not _native.available(),
                                  reason=f"native kernel: {_native.unavailable_reason()}")


def _pairwise(q_len, k_len, offset, causal, window):
    """The convention, one (query, key) pair at a time (README, Conventions)."""
    allowed = torch.zeros(q_len, k_len, dtype=torch.bool)
    for i in range(q_len):
        p = i + offset
        for j in range(k_len):
            ok = not (causal and j > p)
            if window is not None:
                ok = ok and j > p - window and (causal or j < p + window)
            allowed[i, j] = ok
    return allowed


rules = st.fixed_dictionaries({
    "q_len": st.integers(0, 40),
    "k_len": st.integers(0, 40),
    "causal": st.booleans(),
    "window": st.one_of(st.none(), st.integers(1, 90)),  # wider than the sequence too
    "offset": st.one_of(st.none(), st.integers(-50, 50)),  # None: end-aligned
})


@settings(max_examples=300, deadline=None)
@given(rules)
def test_python_rule_is_the_convention(r):
    rule = KeyRule(**r)
    want = _pairwise(r["q_len"], r["k_len"], rule.offset, r["causal"], r["window"])
    assert torch.equal(rule.allowed(), want)
    assert rule.pairs() == int(want.sum())
    lo, hi = rule.bounds(torch.arange(r["q_len"]))
    assert bool((lo <= hi).all()) and bool((lo[1:] >= lo[:-1]).all())
    assert bool((hi[1:] >= hi[:-1]).all()), "both ends must not decrease with the position"
    for i in range(r["q_len"]):  # the int path agrees with the tensor path
        assert rule.bounds(i) == (int(lo[i]), int(hi[i]))


@settings(max_examples=200, deadline=None)
@given(rules, st.integers(1, 9), st.integers(1, 9))
def test_blocks_and_full_tiles_follow_from_the_rows(r, bq, bk):
    rule = KeyRule(**r)
    allowed = rule.allowed()
    for qs in range(0, r["q_len"], bq):
        qe = min(qs + bq, r["q_len"])
        lo, hi = rule.block(qs, qe)
        rows = allowed[qs:qe]
        seen = rows.any(dim=0).nonzero().flatten()
        if len(seen):  # every key any row sees lies in the block's range
            assert lo <= int(seen.min()) and int(seen.max()) < hi
        for ks in range(0, r["k_len"], bk):
            ke = min(ks + bk, r["k_len"])
            assert rule.full(qs, qe, ks, ke) == bool(rows[:, ks:ke].all())


@needs_native
@settings(max_examples=300, deadline=None)
@given(rules, st.integers(1, 9), st.integers(1, 9))
def test_cpp_rule_equals_the_python_rule(r, bq, bk):
    rule = KeyRule(**r)
    ops = _native.load()
    lo, hi, block_lo, block_hi, full = ops.rule_tiles(
        r["q_len"], r["k_len"], rule.offset, r["causal"], r["window"] or 0, bq, bk)
    want_lo, want_hi = rule.bounds(torch.arange(r["q_len"]))
    assert torch.equal(lo[0], want_lo) and torch.equal(hi[0], want_hi)
    for b, qs in enumerate(range(0, r["q_len"], bq)):
        qe = min(qs + bq, r["q_len"])
        assert (int(block_lo[0, b]), int(block_hi[0, b])) == rule.block(qs, qe)
        for c, ks in enumerate(range(0, r["k_len"], bk)):
            assert bool(full[0, b, c]) == rule.full(qs, qe, ks, min(ks + bk, r["k_len"]))


def test_key_bounds_takes_ints_and_tensors():
    assert key_bounds(5, 10, causal=True, window=3) == (3, 6)
    assert key_bounds(-2, 10, causal=True, window=None) == (0, 0)  # before the first key
    lo, hi = key_bounds(torch.tensor([0, 9, 20]), 10, causal=False, window=2)
    assert lo.tolist() == [0, 8, 10] and hi.tolist() == [2, 10, 10]
