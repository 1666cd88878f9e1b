"""A mask_mod evaluated into blocks: every block's kind (empty, partial, full) and every
tile put back together equal the mask evaluated densely, pair by pair; the cache hands
back the same evaluation for the same function and shape, and stays bounded."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import blockmask
from attnlab.blockmask import EMPTY, FULL, PARTIAL, block_mask


def _dense(fn, batch, heads, q_len, k_len):
    """The mask_mod called once per (b, h, q, kv), with Python ints."""
    out = torch.zeros(batch, heads, q_len, k_len, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            for i in range(q_len):
                for j in range(k_len):
                    out[b, h, i, j] = bool(fn(b, h, i, j))
    return out


@st.composite
def problems(draw):
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    q_len, k_len = draw(st.integers(1, 13)), draw(st.integers(1, 13))
    table = torch.rand(batch, heads, q_len, k_len,
                       generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))) > 0.5
    fns = {
        "causal": lambda b, h, q, kv: kv <= q,
        "prefix": lambda b, h, q, kv: (kv <= q) | (kv < 4),
        "per-head band": lambda b, h, q, kv: (q - kv <= h) & (kv - q <= h),
        "per-batch": lambda b, h, q, kv: (kv + b) % 2 == 0,
        "table": lambda b, h, q, kv: table[b, h, q, kv],  # FlexAttention-style lookup
        "all": lambda b, h, q, kv: kv >= 0,
        "none": lambda b, h, q, kv: kv < 0,
    }
    name = draw(st.sampled_from(sorted(fns)))
    return dict(fn=fns[name], name=name, batch=batch, heads=heads, q_len=q_len, k_len=k_len,
                block_q=draw(st.integers(1, 6)), block_k=draw(st.integers(1, 6)))


@settings(max_examples=50, deadline=None)
@given(problems(), st.data())
def test_blocks_and_tiles_equal_the_dense_mask(p, data):
    shape = (p["batch"], p["heads"], p["q_len"], p["k_len"])
    bm = block_mask(p["fn"], *shape, block_q=p["block_q"], block_k=p["block_k"])
    want = _dense(p["fn"], *shape)
    dense = bm.dense().expand(shape)
    assert torch.equal(dense, want)
    bq, bk = p["block_q"], p["block_k"]
    for bi in range(bm.kinds.shape[2]):
        for bj in range(bm.kinds.shape[3]):
            tile = want[:, :, bi * bq:(bi + 1) * bq, bj * bk:(bj + 1) * bk]
            kinds = bm.kinds[:, :, bi, bj].expand(shape[:2])
            for b in range(shape[0]):
                for h in range(shape[1]):
                    t = tile[b, h]
                    expected = FULL if bool(t.all()) else PARTIAL if bool(t.any()) else EMPTY
                    assert int(kinds[b, h]) == expected
    q0 = data.draw(st.integers(0, p["q_len"] - 1))
    q1 = data.draw(st.integers(q0 + 1, p["q_len"]))
    k0 = data.draw(st.integers(0, p["k_len"] - 1))
    k1 = data.draw(st.integers(k0 + 1, p["k_len"]))
    region = want[:, :, q0:q1, k0:k1]
    assert torch.equal(bm.tile(q0, q1, k0, k1).expand(region.shape), region)
    # kind() may say PARTIAL for a region that blocks cover only in part (the kernels
    # then apply the tile's mask), never EMPTY or FULL when it is not.
    kind = bm.kind(q0, q1, k0, k1)
    assert kind != EMPTY or not bool(region.any())
    assert kind != FULL or bool(region.all())
    if q0 % bq == 0 and k0 % bk == 0 and q1 in (p["q_len"], q0 + bq) and k1 in (
            p["k_len"], k0 + bk):  # whole blocks: exact
        assert kind == (FULL if bool(region.all()) else EMPTY if not bool(region.any())
                        else PARTIAL)
    rows = torch.tensor(data.draw(st.lists(st.integers(0, p["q_len"] - 1), max_size=5)),
                        dtype=torch.long)
    assert torch.equal(bm.rows(rows).expand(shape[0], shape[1], len(rows), p["k_len"]),
                       want.index_select(2, rows))


def test_a_mask_that_ignores_batch_and_head_is_stored_once():
    bm = block_mask(lambda b, h, q, kv: kv <= q, 4, 12, 256, 256, block_q=64, block_k=64)
    assert (bm.batch, bm.heads) == (1, 1)
    assert [int((bm.kinds == k).sum()) for k in (EMPTY, PARTIAL, FULL)] == [6, 4, 6]
    assert bm.partial.shape == (4, 64, 64)  # only the diagonal tiles keep their bools


def test_flex_attentions_noop_mask_returns_a_0_d_tensor():
    bm = block_mask(lambda b, h, q, kv: b.new_ones(size=(), dtype=torch.bool), 1, 1, 5, 7)
    assert bool(bm.dense().all()) and bm.kind(0, 5, 0, 7) == FULL


def test_the_cache_returns_the_same_evaluation_and_stays_bounded(monkeypatch):
    calls = []

    def causal(b, h, q, kv):
        calls.append(1)
        return kv <= q

    first = block_mask(causal, 1, 2, 10, 10)
    assert block_mask(causal, 1, 2, 10, 10) is first and len(calls) == 1
    assert block_mask(causal, 1, 2, 10, 11) is not first  # another shape: evaluated again
    monkeypatch.setattr(blockmask, "CACHE_SIZE", 3)
    for n in range(1, 8):
        block_mask(causal, 1, 1, n, n)
    assert len(blockmask._CACHE) <= 3


DOCUMENTS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


def same_document(b, h, q, kv):
    return DOCUMENTS[q] == DOCUMENTS[kv]


def test_a_mask_reading_a_global_rebound_or_changed_in_place_is_evaluated_again():
    # The usual document mask of FlexAttention's examples: a global bound again for each
    # batch must give that batch's mask, as torch's create_block_mask (which evaluates
    # every call) gives it; so must the same tensor changed in place, and a function that
    # holds such a function (and_masks).
    global DOCUMENTS

    def dense(m):
        return m.dense()[0, 0]

    def want(ids):
        return ids[:, None] == ids[None, :]

    for ids in ([0, 0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1, 1, 1]):
        DOCUMENTS = torch.tensor(ids)
        assert torch.equal(dense(block_mask(same_document, 1, 1, 8, 8, block_q=4, block_k=4)),
                           want(DOCUMENTS))
    DOCUMENTS[6:] = 5
    assert torch.equal(dense(block_mask(same_document, 1, 1, 8, 8, block_q=4, block_k=4)),
                       want(DOCUMENTS))
    parts = (same_document, lambda b, h, q, kv: kv <= q)

    def both(b, h, q, kv):
        return parts[0](b, h, q, kv) & parts[1](b, h, q, kv)

    first = dense(block_mask(both, 1, 1, 8, 8, block_q=4, block_k=4))
    DOCUMENTS = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    assert not torch.equal(first, dense(block_mask(both, 1, 1, 8, 8, block_q=4, block_k=4)))
    assert torch.equal(dense(block_mask(both, 1, 1, 8, 8, block_q=4, block_k=4)),
                       torch.eye(8, dtype=torch.bool))
    # reading the same values again is the cached evaluation
    assert block_mask(both, 1, 1, 8, 8, block_q=4, block_k=4) is block_mask(
        both, 1, 1, 8, 8, block_q=4, block_k=4)


def test_inference_tensors_and_bound_methods_are_keyed_too():
    # An inference tensor keeps no version counter (reading it raised); a bound method is
    # a new object at each access (it missed the cache every call).
    with torch.inference_mode():
        ids = torch.tensor([0, 0, 1, 1])

    def same(b, h, q, kv):
        return ids[q] == ids[kv]

    assert torch.equal(block_mask(same, 1, 1, 4, 4, block_q=2, block_k=2).dense()[0, 0],
                       ids[:, None] == ids[None, :])

    class Documents:
        def __init__(self, ids):
            self.ids = ids

        def mask(self, b, h, q, kv):
            return self.ids[q] == self.ids[kv]

    docs = Documents(torch.tensor([0, 1, 1, 1]))
    first = block_mask(docs.mask, 1, 1, 4, 4, block_q=2, block_k=2)
    assert block_mask(docs.mask, 1, 1, 4, 4, block_q=2, block_k=2) is first
    other = Documents(torch.tensor([0, 0, 0, 1]))
    assert not torch.equal(block_mask(other.mask, 1, 1, 4, 4, block_q=2, block_k=2).dense(),
                           first.dense())


def test_a_tensor_handed_in_as_a_default_argument_is_read_again():
    # ``ids=ids`` binds the tensor as a default, not in the closure: changed in place, the
    # mask changes too, as FlexAttention's create_block_mask sees it.
    ids = torch.tensor([0, 0, 0, 1, 1, 1])

    def same_doc(b, h, q, k, ids=ids):
        return ids[q] == ids[k]

    def same_doc_kw(b, h, q, k, *, ids=ids):
        return ids[q] == ids[k]

    for fn in (same_doc, same_doc_kw):
        ids[3:] = 1
        two = block_mask(fn, 1, 1, 6, 6, block_q=2, block_k=2)
        ids.fill_(0)
        one = block_mask(fn, 1, 1, 6, 6, block_q=2, block_k=2)
        assert two.kinds.tolist() != one.kinds.tolist()
        assert (one.kinds == FULL).all()
