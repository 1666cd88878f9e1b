"""RotaryEmbedding against transformers' Llama RoPE; KVCache behaviour."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig  # test dependencies: missing fails, it does not skip
from transformers.models.llama import modeling_llama as llama

from attnlab.cache import KVCache
from attnlab.rope import RotaryEmbedding


def hf_rope(q, k, position_ids, head_dim, base):
    """transformers' own cos/sin (LlamaRotaryEmbedding) and apply_rotary_pos_emb."""
    config = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                         rope_parameters={"rope_type": "default", "rope_theta": base})
    rotary = llama.LlamaRotaryEmbedding(config)
    cos, sin = rotary(q, position_ids)  # (B, T, D)
    return llama.apply_rotary_pos_emb(q, k, cos, sin)


# --------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("head_dim", [2, 8, 64])
@pytest.mark.parametrize("base", [10000.0, 500000.0])
@pytest.mark.parametrize("offset", [0, 1, 37])
def test_rope_matches_transformers_llama(head_dim, base, offset):
    g = torch.Generator().manual_seed(head_dim + offset)
    q = torch.randn(2, 4, 9, head_dim, generator=g)
    k = torch.randn(2, 2, 9, head_dim, generator=g)
    pos = torch.arange(offset, offset + 9).expand(2, 9)
    q_hf, k_hf = hf_rope(q, k, pos, head_dim, base)
    rope = RotaryEmbedding(head_dim, base)
    # transformers computes the angles in float32, we in float64: a few ulps apart.
    tol = dict(atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(rope(q, offset), q_hf, **tol)
    torch.testing.assert_close(rope(k, offset), k_hf, **tol)
    torch.testing.assert_close(rope(q, pos), q_hf, **tol)  # explicit (batch, seq) positions
    torch.testing.assert_close(rope(q, pos[0]), q_hf, **tol)  # explicit (seq,) positions
    if offset == 0:
        torch.testing.assert_close(rope(q), q_hf, **tol)


@settings(max_examples=40, deadline=None)
@given(head_dim=st.sampled_from([8, 64, 128]), factor=st.sampled_from([1.5, 4.0, 8.0, 32.0]),
       low=st.sampled_from([0.5, 1.0, 2.0]), span=st.sampled_from([0.5, 3.0, 8.0]),
       context=st.sampled_from([16, 512, 8192]), base=st.sampled_from([10000.0, 500000.0]))
def test_scaled_frequencies_are_transformers(head_dim, factor, low, span, context, base):
    # Llama 3.1's "llama3" and "linear" RoPE scaling, as transformers computes them.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for kind, keys in (("llama3", dict(low_freq_factor=low, high_freq_factor=low + span,
                                       original_max_position_embeddings=context)),
                       ("linear", {})):
        scaling = {"rope_type": kind, "factor": factor, **keys}
        config = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                             max_position_embeddings=4 * context,
                             rope_parameters={**scaling, "rope_theta": base})
        want, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
        got = RotaryEmbedding(head_dim, base, scaling).inv_freq()
        assert attention_factor == 1.0
        torch.testing.assert_close(got, want.double(), rtol=1e-6, atol=0)  # (hf: float32)
        assert not torch.equal(got, RotaryEmbedding(head_dim, base).inv_freq())


@pytest.mark.parametrize("scaling, match", [
    ({"rope_type": "yarn", "factor": 4.0}, "rope_type of"),
    ({"rope_type": "linear"}, "factor=None"),
    ({"rope_type": "linear", "factor": -2}, "factor=-2"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 8192}, "must exceed low_freq_factor"),
    ("llama3", "not supported"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}, "'rope_theta' is not a key"),
    ({"rope_type": "linear", "factor": 2.0, "typo": 1}, "'typo' is not a key"),
])
def test_bad_scalings_are_named(scaling, match):
    with pytest.raises(ValueError, match=match):
        RotaryEmbedding(16, 10000.0, scaling)


def test_a_configs_scaling_is_read_as_transformers_reads_it():
    from attnlab.layouts.common import rope_scaling

    saved = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert rope_scaling(saved) is None
    # an edit that extends the context: transformers reads rope_scaling first
    assert rope_scaling({**saved, "rope_scaling": {"type": "linear", "factor": 4.0}}) == {
        "rope_type": "linear", "factor": 4.0}
    # llama3 without its original context: the model's own, as transformers takes it
    assert rope_scaling({"max_position_embeddings": 2048, "rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0}})["original_max_position_embeddings"] == 2048
    with pytest.raises(ValueError, match="rope_type='factors' is not supported"):
        rope_scaling({"rope_parameters": {"rope_type": "factors", "factors": [2.0] * 4}})


def test_cos_sin_are_transformers_tables():
    config = LlamaConfig(hidden_size=32, num_attention_heads=2, head_dim=16)
    x = torch.zeros(1, 7, 16)
    cos_hf, sin_hf = llama.LlamaRotaryEmbedding(config)(x, torch.arange(3, 10)[None])
    cos, sin = RotaryEmbedding(16).cos_sin(7, 3)
    torch.testing.assert_close(cos, cos_hf[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin, sin_hf[0], atol=1e-6, rtol=1e-6)


def test_rope_per_sequence_positions_match_transformers():
    # Left-padded batch: each row starts at its own position.
    q = torch.randn(2, 3, 5, 16)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    q_hf, _ = hf_rope(q, q, pos, 16, 10000.0)
    torch.testing.assert_close(RotaryEmbedding(16)(q, pos), q_hf, atol=2e-5, rtol=1e-5)


def test_rope_long_positions_stay_accurate():
    """At position 10^6 float32 angles are off by ~0.03 rad; our table is not."""
    head_dim, p = 8, 1_000_003
    x = torch.randn(1, 1, 1, head_dim, dtype=torch.float64)
    ours = RotaryEmbedding(head_dim)(x.float(), p).double()
    inv = 1.0 / 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)
    ang = np.concatenate([p * inv, p * inv])  # exact float64 angles
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
    expect = x * torch.from_numpy(np.cos(ang)) + torch.cat((-x2, x1), -1) * torch.from_numpy(
        np.sin(ang))
    torch.testing.assert_close(ours, expect, atol=1e-6, rtol=1e-6)
    ours64 = RotaryEmbedding(head_dim)(x, p)  # float64 input: float64 all the way
    torch.testing.assert_close(ours64, expect, atol=1e-12, rtol=1e-12)
    assert rope_table_len(RotaryEmbedding(head_dim), x.float(), p) <= 1 << 15  # no huge table
    # Either side of the table's end, table and direct computation agree.
    rope = RotaryEmbedding(head_dim)
    pos = torch.arange((1 << 15) - 3, (1 << 15) + 3)
    y = torch.randn(1, 1, 6, head_dim)
    torch.testing.assert_close(rope(y, pos), rope(y.double(), pos).float(), atol=1e-6,
                               rtol=1e-6)
    torch.testing.assert_close(rope(y, (1 << 15) - 3), rope(y, pos))


def rope_table_len(rope, x, p):
    rope(x, p)
    return rope._cos.shape[0]


@settings(max_examples=30, deadline=None)
@given(m=st.integers(0, 5000), n=st.integers(0, 5000), shift=st.integers(0, 5000),
       half=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_rope_scores_depend_only_on_relative_position(m, n, shift, half, seed):
    """<rope(q, m), rope(k, n)> = <rope(q, m + s), rope(k, n + s)>; norms are kept."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, 1, 1, 2 * half, generator=g, dtype=torch.float64)
    rope = RotaryEmbedding(2 * half)
    a = (rope(q, m) * rope(k, n)).sum()
    b = (rope(q, m + shift) * rope(k, n + shift)).sum()
    assert math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-9)
    assert math.isclose(float(rope(q, m).norm()), float(q.norm()), rel_tol=1e-12)


def test_rope_table_grows_and_survives_half():
    rope = RotaryEmbedding(8)
    x = torch.randn(1, 1, 3, 8)
    first = rope(x, 5)
    rope(torch.randn(1, 1, 1, 8), 5000)  # grows the table
    assert rope._cos.shape[0] >= 5001
    torch.testing.assert_close(rope(x, 5), first)
    assert list(rope.state_dict()) == [] and list(rope.named_buffers()) == []
    rope.half()  # nothing to cast: the tables stay float32
    torch.testing.assert_close(rope(x, 5), first)
    assert rope(x.half(), 5).dtype == torch.float16


def test_rope_bad_input():
    with pytest.raises(ValueError, match="head_dim must be an even int >= 2 for RoPE, got 7"):
        RotaryEmbedding(7)
    rope = RotaryEmbedding(8)
    with pytest.raises(ValueError, match=r"head_dim=8\), got \(1, 1, 3, 6\)"):
        rope(torch.randn(1, 1, 3, 6))
    with pytest.raises(ValueError, match=r"shape \(seq=3,\) or \(batch, seq=3\), got shape \(4,\)"):
        rope(torch.randn(1, 1, 3, 8), torch.arange(4))
    with pytest.raises(ValueError, match="offset must be an int >= 0, got -1"):
        rope(torch.randn(1, 1, 3, 8), -1)


# --------------------------------------------------------------------- KVCache


def kv(b=2, h=3, t=1, d=4, fill=None):
    k = torch.randn(b, h, t, d) if fill is None else torch.full((b, h, t, d), float(fill))
    return k, k + 100


def test_cache_appends_and_returns_views():
    c = KVCache(2, 10, 3, 4)
    assert c.seq_len == 0 and c.remaining == 10
    k1, v1 = kv(t=4)
    k_all, v_all = c.update(k1, v1)
    assert c.seq_len == 4 and k_all.shape == (2, 3, 4, 4)
    torch.testing.assert_close(k_all, k1)
    k2, v2 = kv(t=1)
    k_all, v_all = c.update(k2, v2)
    assert c.seq_len == 5 and k_all.shape == (2, 3, 5, 4)
    torch.testing.assert_close(k_all, torch.cat((k1, k2), 2))
    torch.testing.assert_close(v_all, torch.cat((v1, v2), 2))
    # Views of the preallocated buffers: no copy of the history per step.
    assert k_all.data_ptr() == c.k.data_ptr() and v_all.data_ptr() == c.v.data_ptr()
    assert k_all._base is c.k
    k_get, _ = c.get()
    assert k_get.data_ptr() == c.k.data_ptr() and k_get.shape[2] == 5


def test_cache_overflow_says_how_many_and_writes_nothing():
    c = KVCache(1, 6, 2, 4)
    c.update(*kv(b=1, h=2, t=4, fill=1))
    before = c.k.clone()
    with pytest.raises(ValueError) as err:
        c.update(*kv(b=1, h=2, t=3, fill=2))
    msg = str(err.value)
    assert "append 3 positions" in msg and "only 2" in msg and "max_seq_len=6" in msg
    assert c.seq_len == 4
    assert torch.equal(c.k, before)
    c.update(*kv(b=1, h=2, t=2, fill=3))  # exactly fills it
    assert c.seq_len == 6 and c.remaining == 0


def test_cache_reset_and_crop():
    c = KVCache(1, 8, 1, 4)
    c.update(*kv(b=1, h=1, t=5, fill=1))
    c.crop(3)
    assert c.seq_len == 3
    k_all, _ = c.update(*kv(b=1, h=1, t=1, fill=7))
    assert k_all[0, 0, :, 0].tolist() == [1, 1, 1, 7]
    with pytest.raises(ValueError, match=r"crop length must be an int in \[0, seq_len=4\], got 5"):
        c.crop(5)
    c.reset()
    assert c.seq_len == 0 and c.remaining == 8
    k_all, _ = c.update(*kv(b=1, h=1, t=2, fill=9))
    assert k_all[0, 0, :, 0].tolist() == [9, 9]


def test_cache_reserve_takes_ints_only():
    """reserve/crop take Python and NumPy ints; a bool, a float or a string is refused
    (checks.is_int, asked for every layer's cache at every decoded token)."""
    import numpy as np

    c = KVCache(1, 8, 1, 4)
    assert c.reserve(2) == 0 and c.reserve(np.int64(3)) == 2 and c.seq_len == 5
    c.crop(np.int32(1))
    assert c.seq_len == 1
    for bad in (True, 1.0, "1", None, np.bool_(True)):
        with pytest.raises(ValueError, match="KV cache overflow"):
            c.reserve(bad)
        with pytest.raises(ValueError, match="crop length must be an int"):
            c.crop(bad)
    assert c.seq_len == 1


@pytest.mark.parametrize(("shape", "needle"), [
    ((3, 3, 1, 4), "batch_size 2 but the k/v has batch size 3"),
    ((2, 1, 1, 4), "num_kv_heads=3, head_dim=4 but the k/v has num_kv_heads=1, head_dim=4"),
    ((2, 3, 1, 5), "num_kv_heads=3, head_dim=5"),
    ((2, 3, 4), "k must be (batch, num_kv_heads, seq, head_dim), got (2, 3, 4)"),
])
def test_cache_rejects_wrong_shapes(shape, needle):
    c = KVCache(2, 10, 3, 4)
    with pytest.raises(ValueError) as err:
        c.update(torch.randn(shape), torch.randn(shape))
    assert needle in str(err.value)
    assert c.seq_len == 0


def test_cache_rejects_mismatched_k_v_and_bad_sizes():
    c = KVCache(1, 4, 1, 2)
    with pytest.raises(ValueError, match=r"k has shape \(1, 1, 2, 2\) but v has \(1, 1, 1, 2\)"):
        c.update(torch.randn(1, 1, 2, 2), torch.randn(1, 1, 1, 2))
    with pytest.raises(ValueError, match="max_seq_len must be a positive int, got 0"):
        KVCache(1, 0, 1, 2)


def test_cache_dtype_and_device():
    c = KVCache(1, 4, 1, 2, dtype=torch.float64)
    assert c.k.dtype == torch.float64 and c.dtype == torch.float64
    k_all, _ = c.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
    assert k_all.dtype == torch.float64
