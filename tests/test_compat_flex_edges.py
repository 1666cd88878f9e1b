"""``attnlab.compat.flex_attention`` where FlexAttention code leans on torch's own
behaviour: a torch ``BlockMask`` made with ``H``/``B`` None for a mask that reads ``h``/``b``,
one reused after a tensor it reads changed, a mask_mod that reads a global inside a
comprehension, a score_mod that returns a broadcast score, torch's newer keywords and a
key/value batch of one. Each against torch's own eager FlexAttention on the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

from attnlab.compat import create_block_mask, flex_attention

L = 64
g = torch.Generator().manual_seed(11)
Q, K, V = (torch.randn(2, 2, L, 8, generator=g) for _ in range(3))
DOC = torch.tensor([0] * 20 + [1] * 30 + [2] * 14)
IDS = torch.zeros(1, L, dtype=torch.long)


def _torch(q, k, v, block=None, score_mod=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "unfused implementation": the one compared here
        return torch_flex.flex_attention(q, k, v, block_mask=block, score_mod=score_mod)


def per_head(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (kv_idx % (h + 2) == 0)


def documents(b, h, q_idx, kv_idx):
    return DOC[q_idx] == DOC[kv_idx]


def documents_in_a_comprehension(b, h, q_idx, kv_idx):
    return torch.stack([IDS[0, q_idx] == IDS[0, kv_idx] for _ in range(1)]).all(0)


def test_a_torch_mask_made_for_every_head_is_asked_at_each_head():
    # torch's kernels call the mask_mod with the real h on partial blocks; asking it at
    # h = 0 alone gave head 1 head 0's mask (off by 1.9)
    block = torch_flex.create_block_mask(per_head, None, None, L, L, device="cpu",
                                         BLOCK_SIZE=16)
    torch.testing.assert_close(flex_attention(Q, K, V, block_mask=block),
                               _torch(Q, K, V, block), atol=2e-5, rtol=2e-5)


def test_a_torch_mask_is_asked_again_once_a_tensor_it_reads_changed():
    block = torch_flex.create_block_mask(documents, None, None, L, L, device="cpu",
                                         BLOCK_SIZE=16)
    before = DOC.clone()
    try:
        flex_attention(Q, K, V, block_mask=block)
        DOC[20:24] = 0  # a boundary moves within the partial blocks it was in
        torch.testing.assert_close(flex_attention(Q, K, V, block_mask=block),
                                   _torch(Q, K, V, block), atol=2e-5, rtol=2e-5)
    finally:
        DOC.copy_(before)


def test_a_global_read_inside_a_comprehension_is_part_of_the_cache_key():
    try:
        block = create_block_mask(documents_in_a_comprehension, None, None, L, L,
                                  BLOCK_SIZE=16)
        flex_attention(Q, K, V, block_mask=block)
        IDS[0, 32:] = 1
        block = create_block_mask(documents_in_a_comprehension, None, None, L, L,
                                  BLOCK_SIZE=16)
        want = torch_flex.create_block_mask(documents_in_a_comprehension, None, None, L, L,
                                            device="cpu", BLOCK_SIZE=16)
        torch.testing.assert_close(flex_attention(Q, K, V, block_mask=block),
                                   _torch(Q, K, V, want), atol=2e-5, rtol=2e-5)
    finally:
        IDS.zero_()


def test_a_score_mod_of_the_indices_alone_broadcasts():
    def distance(score, b, h, q_idx, kv_idx):
        return -(q_idx - kv_idx).abs().float()  # no score in it: (1, 1, 1, L, S) here

    torch.testing.assert_close(flex_attention(Q, K, V, score_mod=distance),
                               _torch(Q, K, V, score_mod=distance), atol=2e-5, rtol=2e-5)


def test_torchs_newer_keywords_and_one_key_batch_for_every_query_batch():
    block = create_block_mask(documents, 2, None, L, L, BLOCK_SIZE=16,
                              separate_full_blocks=False, compute_dq_write_order=False,
                              dq_kv_order=True)
    want = _torch(Q, K[:1], V[:1], torch_flex.create_block_mask(documents, 2, None, L, L,
                                                                device="cpu"))
    torch.testing.assert_close(flex_attention(Q, K[:1], V[:1], block_mask=block), want,
                               atol=2e-5, rtol=2e-5)


def test_a_torch_mask_of_one_b_and_h_is_kept_once_and_freed_with_its_owner():
    # evaluated at the call's batch and heads, a mask that reads neither is still stored
    # once (it was stored per (b, h): 64 MB of tiles for a causal 8 x 32 x 2048); and a
    # mask_mod reading the module that owns the mask (self.docs) lets the module go
    import gc
    import weakref

    from attnlab.compat.flex import _as_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    block = torch_flex.create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=16)
    ours = _as_block_mask(block, Q, K)
    assert tuple(ours.kinds.shape[:2]) == (1, 1)

    class Owner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("docs", DOC.clone())
            self.block = torch_flex.create_block_mask(
                lambda b, h, q, k: self.docs[q] == self.docs[k], None, None, L, L,
                device="cpu", BLOCK_SIZE=16)

        def forward(self, x):
            return flex_attention(x, x, x, block_mask=self.block)

    owner = Owner()
    owner(Q)
    gone = weakref.ref(owner)
    del owner
    from attnlab import blockmask

    blockmask._CACHE.clear()  # (its own cache holds what a mask_mod reads, by design)
    gc.collect()
    assert gone() is None


def test_a_partial_mask_mod_is_evaluated_again_once_what_it_binds_changes():
    import functools

    def same_doc(ids, b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    ids = DOC.clone()
    mod = functools.partial(same_doc, ids)
    flex_attention(Q, K, V, block_mask=create_block_mask(mod, None, None, L, L, BLOCK_SIZE=16))
    ids[20:24] = 0
    got = flex_attention(Q, K, V, block_mask=create_block_mask(mod, None, None, L, L,
                                                               BLOCK_SIZE=16))
    want = _torch(Q, K, V, torch_flex.create_block_mask(mod, None, None, L, L, device="cpu",
                                                        BLOCK_SIZE=16))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_attnlabs_own_mask_made_with_h_none_is_asked_at_every_head_as_torchs():
    # Helper-found: compat.create_block_mask(mod, None, None, ...) evaluated the mask at
    # h = 0 and used that for every head (1.64 off torch's result); torch's kernels ask
    # the mask_mod with the real h.
    want = _torch(Q, K, V, torch_flex.create_block_mask(per_head, None, None, L, L,
                                                        device="cpu"))
    got = flex_attention(Q, K, V, block_mask=create_block_mask(per_head, None, None, L, L))
    torch.testing.assert_close(got, want)


def test_attnlabs_own_mask_sees_a_tensor_it_reads_changed_in_place():
    # Helper-found: an attnlab block mask kept the documents it was made with.
    docs = DOC.clone()

    def by_docs(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]

    mine = create_block_mask(by_docs, None, None, L, L, BLOCK_SIZE=16)
    theirs = torch_flex.create_block_mask(by_docs, None, None, L, L, device="cpu",
                                          BLOCK_SIZE=16)
    docs[:] = 0
    docs[30:] = 1
    torch.testing.assert_close(flex_attention(Q, K, V, block_mask=mine),
                               _torch(Q, K, V, theirs))


def test_create_block_mask_answers_as_torchs_block_mask():
    mine = create_block_mask(per_head, 2, 4, 256, 256)
    theirs = torch_flex.create_block_mask(per_head, 2, 4, 256, 256, device="cpu")
    assert mine.shape == theirs.shape == (2, 4, 256, 256)
    assert tuple(theirs.BLOCK_SIZE) == mine.BLOCK_SIZE and mine.mask_mod is per_head
    assert torch.equal(mine.to_dense(), theirs.to_dense().to(torch.int32))
    assert abs(mine.sparsity() - theirs.sparsity()) < 1e-9
    moved = mine.to("cpu")
    assert moved.shape == mine.shape and torch.equal(moved.to_dense(), mine.to_dense())
    assert create_block_mask(per_head, None, None, 64, 64).shape == (1, 1, 64, 64)
    # lengths that are no multiple of the block: torch counts whole blocks (review-found)
    odd = create_block_mask(per_head, 2, 3, 20, 20, BLOCK_SIZE=8)
    want = torch_flex.create_block_mask(per_head, 2, 3, 20, 20, device="cpu", BLOCK_SIZE=8)
    assert abs(odd.sparsity() - want.sparsity()) < 1e-9


def test_a_block_mask_of_another_shape_is_named_as_block_mask():
    wrong = create_block_mask(lambda b, h, q, kv: (kv <= q) | (b > 0), 3, None, L, L)
    with pytest.raises(ValueError, match=r"block_mask is for \(B, H, Q_LEN, KV_LEN\) = "
                                         r"\(3, 1, 64, 64\), but the inputs have \(2, 2, 64, "
                                         r"64\)"):
        flex_attention(Q, K, V, block_mask=wrong)
    with pytest.raises(ValueError, match=r"block_mask is for \(Q_LEN, KV_LEN\)|block_mask is "
                                         r"for \(B, H, Q_LEN, KV_LEN\) = \(1, 1, 32, 32\)"):
        flex_attention(Q, K, V, block_mask=create_block_mask(per_head, None, None, 32, 32))
