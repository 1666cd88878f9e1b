"""One key rule per language: ``masks.key_bounds`` / ``masks.KeyRule`` in Python and
``Rule`` in ``csrc/mask.h``, which the flash forward, backward and decoding step include.

The two are held equal here over every (q_len, k_len, offset, causal, window) of a
hypothesis sweep, windows wider than the sequence included, for each row's keys, each
block's keys and each tile's "needs no mask"; and the Python rule is held to a plain
statement of the convention written out here, pair by pair. Documents (packed
sequences, per-document end alignment) are held to their convention the same way, in
Python only until ``csrc/mask.h`` has them.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import _native
from attnlab.masks import Documents, KeyRule, key_bounds

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


# ------------------------------------------------------------------ documents


def _ids(draw, length):
    steps = draw(st.lists(st.sampled_from([0, 0, 0, 1, 2]), min_size=length, max_size=length))
    return [sum(steps[:i + 1]) for i in range(length)]


@st.composite
def document_rules(draw):
    q_len, k_len = draw(st.integers(0, 14)), draw(st.integers(0, 14))
    batch = draw(st.integers(1, 3))
    q_ids = torch.tensor([_ids(draw, q_len) for _ in range(batch)], dtype=torch.long)
    k_ids = torch.tensor([_ids(draw, k_len) for _ in range(batch)], dtype=torch.long)
    return dict(q_len=q_len, k_len=k_len, causal=draw(st.booleans()),
                window=draw(st.one_of(st.none(), st.integers(1, 20))),
                q_ids=q_ids.reshape(batch, q_len), k_ids=k_ids.reshape(batch, k_len))


def _pairwise_documents(r):
    """The document rule, pair by pair (attention()'s docstring): a query sees only keys
    of its own document; the r-th of a document's nq queries sits at position
    r + nk - nq among the document's nk keys, and the causal/window rule is taken there."""
    batch = r["q_ids"].shape[0]
    allowed = torch.zeros(batch, 1, r["q_len"], r["k_len"], dtype=torch.bool)
    for b in range(batch):
        q_ids, k_ids = r["q_ids"][b].tolist(), r["k_ids"][b].tolist()
        for i in range(r["q_len"]):
            queries = [x for x in range(r["q_len"]) if q_ids[x] == q_ids[i]]
            keys = [x for x in range(r["k_len"]) if k_ids[x] == q_ids[i]]
            p = queries.index(i) + len(keys) - len(queries)
            for c, j in enumerate(keys):
                ok = not (r["causal"] and c > p)
                if r["window"] is not None:
                    ok = ok and c > p - r["window"] and (r["causal"] or c < p + r["window"])
                allowed[b, 0, i, j] = ok
    return allowed


def _document_rule(r):
    return KeyRule(r["q_len"], r["k_len"], causal=r["causal"], window=r["window"],
                   documents=Documents(r["q_ids"], r["k_ids"]))


@settings(max_examples=300, deadline=None)
@given(document_rules())
def test_the_document_rule_is_the_convention(r):
    rule = _document_rule(r)
    want = _pairwise_documents(r)
    assert torch.equal(rule.allowed(), want)
    assert rule.pairs() == int(want.sum())
    lo, hi = rule.bounds(torch.arange(r["q_len"]))  # (B, q_len)
    assert bool((lo <= hi).all()) and bool((lo[:, 1:] >= lo[:, :-1]).all())
    assert bool((hi[:, 1:] >= hi[:, :-1]).all()), "both ends must not decrease with the row"


@settings(max_examples=200, deadline=None)
@given(document_rules(), st.integers(1, 9), st.integers(1, 9))
def test_document_blocks_and_full_tiles_follow_from_the_rows(r, bq, bk):
    rule = _document_rule(r)
    allowed = rule.allowed()[:, 0]  # (B, q_len, k_len)
    for qs in range(0, r["q_len"], bq):
        qe = min(qs + bq, r["q_len"])
        lo, hi = rule.block(qs, qe)
        rows = allowed[:, qs:qe]
        seen = rows.any(dim=1).any(dim=0).nonzero().flatten()
        if len(seen):  # every key any row of any batch element sees lies in the block's range
            assert lo <= int(seen.min()) and int(seen.max()) < hi
        for ks in range(0, r["k_len"], bk):
            ke = min(ks + bk, r["k_len"])
            assert rule.full(qs, qe, ks, ke) == bool(rows[:, :, ks:ke].all())


@needs_native
@settings(max_examples=300, deadline=None)
@given(document_rules(), st.integers(1, 9), st.integers(1, 9))
def test_cpp_document_rule_equals_the_python_rule(r, bq, bk):
    """mask.h's rule with documents, per batch element: each row's keys, each block's
    keys (its first row's lo to its last row's hi) and each tile's "needs no mask"."""
    rule = _document_rule(r)
    docs = rule.documents
    planes = torch.stack([docs.starts, docs.ends, docs.offsets]).contiguous()
    lo, hi, block_lo, block_hi, full = _native.load().rule_tiles(
        r["q_len"], r["k_len"], 0, r["causal"], r["window"] or 0, bq, bk, planes)
    want_lo, want_hi = rule.bounds(torch.arange(r["q_len"]))
    assert torch.equal(lo, want_lo) and torch.equal(hi, want_hi)
    allowed = rule.allowed()[:, 0]
    for c, qs in enumerate(range(0, r["q_len"], bq)):
        qe = min(qs + bq, r["q_len"])
        assert torch.equal(block_lo[:, c], want_lo[:, qs])
        assert torch.equal(block_hi[:, c], torch.maximum(want_hi[:, qe - 1], want_lo[:, qs]))
        for d, ks in enumerate(range(0, r["k_len"], bk)):
            ke = min(ks + bk, r["k_len"])
            assert full[:, c, d].tolist() == allowed[:, qs:qe, ks:ke].flatten(1).all(1).tolist()


def test_documents_with_as_many_queries_as_keys_are_the_global_rule_within_each():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    rule = KeyRule(8, 8, causal=True, window=2, documents=Documents(ids, ids))
    plain = KeyRule(8, 8, causal=True, window=2).allowed()
    same = ids[0, :, None] == ids[0, None, :]
    assert torch.equal(rule.allowed()[0, 0], plain & same)
    assert rule.positions(torch.arange(8)).tolist() == [list(range(8))]


def test_a_document_with_more_queries_than_keys_aligns_to_its_end():
    q_ids = torch.tensor([[0, 0, 0, 1]])  # document 0: 3 queries over 1 key
    k_ids = torch.tensor([[0, 1, 1]])
    rule = KeyRule(4, 3, causal=True, documents=Documents(q_ids, k_ids))
    assert rule.allowed()[0, 0].int().tolist() == [[0, 0, 0], [0, 0, 0], [1, 0, 0], [0, 1, 1]]
    with pytest.raises(ValueError, match="offset or documents"):
        KeyRule(4, 3, offset=0, documents=Documents(q_ids, k_ids))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 12), st.integers(0, 12), st.booleans(),
       st.one_of(st.none(), st.integers(1, 6)), st.one_of(st.none(), st.integers(-14, 14)))
def test_every_row_sees_a_key_is_told_without_the_mask_and_is_never_wrong(
        q_len, k_len, causal, window, offset):
    """The shortcut that lets the sdpa and eager routes skip the empty-row pass: where it
    says every row sees a key, the mask has no empty row; and for end-aligned rules it
    says so exactly when the mask agrees (q_len <= k_len, or no rule and some key), but
    for a window looking both ways, which may reach keys from rows past them."""
    rule = KeyRule(q_len, k_len, causal=causal, window=window, offset=offset)
    allowed = rule.allowed() if q_len and k_len else torch.zeros(q_len, k_len, dtype=torch.bool)
    every = bool(allowed.any(dim=-1).all())
    if rule.every_row_sees_a_key:
        assert every
    if offset is None and (causal or window is None):
        assert rule.every_row_sees_a_key == every
