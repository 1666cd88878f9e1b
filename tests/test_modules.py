"""MultiHeadAttention against the book, torch.nn.MultiheadAttention, and a transformers+SDPA
peer (GQA, RoPE, window); KV-cached decoding; cross-attention; masks; errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

# Peers are test dependencies (make install): a missing one fails, it does not skip.
from llms_from_scratch import ch03
from torch import nn
from transformers.models.llama import modeling_llama as llama

from attnlab.cache import KVCache
from attnlab.modules import MultiHeadAttention

INPUTS = torch.tensor([[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
                       [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]])
BACKENDS = ["eager", "sdpa", "tiled", "auto"]


def close(a, b, tol=1e-6):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def seeded(seed, cls, *args, **kwargs):
    torch.manual_seed(seed)
    return cls(*args, **kwargs)


def peer_forward(m: MultiHeadAttention, x, mask=None, positions=None):
    """The same module computed by peers: transformers' rotary + torch SDPA (GQA)."""
    b, t, _ = x.shape
    q = m.W_query(x).view(b, t, m.num_heads, m.head_dim).transpose(1, 2)
    k = m.W_key(x).view(b, t, m.num_kv_heads, m.head_dim).transpose(1, 2)
    v = m.W_value(x).view(b, t, m.num_kv_heads, m.head_dim).transpose(1, 2)
    if m.rotary is not None:
        pos = torch.arange(t).expand(b, t) if positions is None else positions
        inv = 1.0 / (m.rotary.base ** (torch.arange(0, m.head_dim, 2).float() / m.head_dim))
        freqs = pos[..., None].float() * inv
        emb = torch.cat((freqs, freqs), -1)
        q, k = llama.apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    allowed = torch.ones(t, t, dtype=torch.bool)
    if m.causal:
        allowed &= j <= i
    if m.window is not None:
        allowed &= (j > i - m.window) & ((j < i + m.window) | m.causal)
    if mask is not None:
        allowed = allowed & mask
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    return m.out_proj(out.transpose(1, 2).reshape(b, t, m.d_out))


# --------------------------------------------------------------- the book


@pytest.mark.parametrize(("d_in", "d_out", "heads", "seq", "batch", "qkv_bias"), [
    (3, 2, 2, 6, 2, False), (64, 64, 8, 32, 3, False), (64, 64, 8, 32, 3, True),
    (48, 32, 4, 17, 2, False)])
def test_matches_book_multihead_attention(d_in, d_out, heads, seq, batch, qkv_bias):
    book = seeded(123, ch03.MultiHeadAttention, d_in, d_out, seq, 0.0, heads, qkv_bias).eval()
    ours = seeded(123, MultiHeadAttention, d_in, d_out, heads, causal=True,
                  context_length=seq, qkv_bias=qkv_bias).eval()
    x = torch.stack((INPUTS, INPUTS)) if d_in == 3 else torch.randn(batch, seq, d_in)
    close(ours(x), book(x))
    close(ours(x[:, :5]), book(x[:, :5]))
    if d_in == 3:  # printed in the book
        close(ours(x)[0, 0], torch.tensor([0.3190, 0.4858]), tol=1e-4)
    grad = torch.randn(x.shape[0], x.shape[1], d_out)
    ours(x).backward(grad)
    book(x).backward(grad)
    for (name, p), (_, q) in zip(ours.named_parameters(), book.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_parameter_layout_and_count():
    m = MultiHeadAttention(64, 96, 8, num_kv_heads=2)
    assert [n for n, _ in m.named_parameters()] == [
        "W_query.weight", "W_key.weight", "W_value.weight", "out_proj.weight", "out_proj.bias"]
    head_dim = 96 // 8
    assert m.W_key.weight.shape == (head_dim * 2, 64)
    expected = 64 * 96 + 2 * 64 * head_dim * 2 + 96 * 96 + 96
    assert sum(p.numel() for p in m.parameters()) == expected
    m = MultiHeadAttention(64, 96, 8, num_kv_heads=1, qkv_bias=True, out_bias=False)
    assert sum(p.numel() for p in m.parameters()) == (
        64 * 96 + 96 + 2 * (64 * head_dim + head_dim) + 96 * 96)


# --------------------------------------------------------------- peers: transformers + SDPA


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("kv_heads", "rope", "window", "causal"), [
    (2, True, 4, True), (1, True, None, True), (4, False, 3, False), (8, True, 5, False)])
def test_gqa_rope_window_matches_peer(backend, kv_heads, rope, window, causal):
    m = seeded(0, MultiHeadAttention, 32, 64, 8, num_kv_heads=kv_heads, rope=rope,
               window=window, causal=causal, backend=backend).eval()
    x = torch.randn(2, 11, 32)
    close(m(x), peer_forward(m, x), tol=1e-5)
    # Explicit RoPE positions (a left-padded second row) against the peer's.
    if rope:
        pos = torch.stack((torch.arange(11), torch.arange(11) + 3))
        close(m(x, positions=pos), peer_forward(m, x, positions=pos), tol=1e-5)


# --------------------------------------------------------------- peers: torch MHA


def torch_mha(batch_first, bias, seed=0):
    return seeded(seed, nn.MultiheadAttention, 16, 4, bias=bias, batch_first=batch_first).eval()


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("backend", ["eager", "tiled", "auto"])
def test_from_torch_with_masks_and_weights(batch_first, bias, backend):
    t = torch_mha(batch_first, bias)
    ours = MultiHeadAttention.from_torch(t).eval()
    ours.backend = backend
    assert (ours.W_query.bias is not None) == bias and ours.num_heads == 4
    x = torch.randn(2, 5, 16)
    tx = x if batch_first else x.transpose(0, 1)
    attn_mask = torch.rand(5, 5) < 0.4  # torch: True = NOT allowed
    attn_mask.fill_diagonal_(False)  # every query keeps at least itself
    kpm = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])  # torch: True = padding
    attn_mask[3:, :3] = False  # rows 3, 4 of the padded sequence keep a real key
    out_t, w_t = t(tx, tx, tx, attn_mask=attn_mask, key_padding_mask=kpm,
                   average_attn_weights=False)
    out_t = out_t if batch_first else out_t.transpose(0, 1)
    mask = (~attn_mask)[None, None] & (~kpm)[:, None, None, :]  # ours: True = may attend
    out, w = ours(x, mask=mask, return_weights=True)
    close(out, out_t, tol=1e-5)
    close(w, w_t, tol=1e-5)
    # Key padding alone, given the tokenizer way (1 = real token) as a 2-D mask.
    out_t, _ = t(tx, tx, tx, key_padding_mask=kpm)
    out_t = out_t if batch_first else out_t.transpose(0, 1)
    close(ours(x, mask=(~kpm).long()), out_t, tol=1e-5)
    # A float additive mask goes through as it is.
    float_mask = torch.randn(5, 5)
    out_t, _ = t(tx, tx, tx, attn_mask=float_mask)
    out_t = out_t if batch_first else out_t.transpose(0, 1)
    close(ours(x, mask=float_mask[None, None]), out_t, tol=1e-5)


def test_from_torch_cross_attention_and_unsupported():
    t = torch_mha(True, True)
    ours = MultiHeadAttention.from_torch(t).eval()
    x, mem = torch.randn(2, 3, 16), torch.randn(2, 7, 16)
    close(ours(x, kv=mem), t(x, mem, mem)[0], tol=1e-5)
    with pytest.raises(ValueError, match="add_bias_kv=True is not supported"):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(16, 4, add_bias_kv=True))
    with pytest.raises(ValueError, match="kdim=8/vdim=16 different from embed_dim=16"):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(16, 4, kdim=8))
    with pytest.raises(TypeError, match="must be a torch.nn.MultiheadAttention"):
        MultiHeadAttention.from_torch(nn.Linear(2, 2))


# --------------------------------------------------------------- KV cache


@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_decoding_equals_full_forward(backend):
    m = seeded(1, MultiHeadAttention, 32, 64, 8, num_kv_heads=2, rope=True, window=4,
               causal=True, context_length=16, backend=backend).eval()
    x = torch.randn(2, 12, 32)
    full = m(x)
    cache = m.new_cache(2, 16)
    pieces = [m(x[:, :5], cache=cache)]  # prefill 5
    for i in range(5, 9):  # then one token at a time
        pieces.append(m(x[:, i:i + 1], cache=cache))
    assert cache.seq_len == 9
    pieces.append(m(x[:, 9:12], cache=cache))  # and a chunk of 3
    close(torch.cat(pieces, 1), full, tol=1e-5)
    assert cache.seq_len == 12
    # The cache holds the rotated keys: the same as a fresh prefill of all 12 tokens.
    again = m.new_cache(2, 16)
    m(x, cache=again)
    close(cache.get()[0], again.get()[0], tol=1e-5)


@settings(max_examples=15, deadline=None)
@given(chunks=st.lists(st.integers(1, 4), min_size=1, max_size=5),
       kv_heads=st.sampled_from([1, 2, 4]), window=st.sampled_from([None, 1, 3]),
       rope=st.booleans(), seed=st.integers(0, 2**16))
def test_cached_decoding_any_chunking(chunks, kv_heads, window, rope, seed):
    m = seeded(seed, MultiHeadAttention, 8, 16, 4, num_kv_heads=kv_heads, rope=rope,
               window=window, causal=True).eval()
    total = sum(chunks)
    x = torch.randn(1, total, 8)
    cache = KVCache(1, total, kv_heads, 4)
    outs, start = [], 0
    for n in chunks:
        outs.append(m(x[:, start:start + n], cache=cache))
        start += n
    close(torch.cat(outs, 1), m(x), tol=1e-5)


# --------------------------------------------------------------- cross-attention, masks


@pytest.mark.parametrize("kind", ["int", "bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
def test_cross_attention_with_padding_equals_unpadded(kind, causal):
    m = seeded(2, MultiHeadAttention, 16, 32, 4, num_kv_heads=2, causal=causal).eval()
    x, mem = torch.randn(2, 4, 16), torch.randn(2, 7, 16)
    keep = torch.tensor([[1] * 7, [1] * 3 + [0] * 4])  # as a tokenizer returns it
    mask = {"int": keep, "bool": keep.bool(),
            "float": torch.zeros(2, 7).masked_fill(keep == 0, float("-inf"))}[kind]
    out = m(x, kv=mem, mask=mask)
    close(out[0], m(x[:1], kv=mem[:1])[0], tol=1e-5)
    close(out[1], m(x[1:], kv=mem[1:, :3])[0], tol=1e-5)
    # With kv the module is never causal: every query sees every real key.
    _, w = m(x, kv=mem, mask=mask, return_weights=True)
    assert (w[0] > 0).all()


def test_weights_sum_to_one_and_respect_the_mask():
    m = seeded(3, MultiHeadAttention, 16, 32, 4, num_kv_heads=1, causal=True, window=3).eval()
    x = torch.randn(2, 8, 16)
    keep = torch.tensor([[1] * 8, [0, 0] + [1] * 6]).bool()  # left padding in row 1
    out, w = m(x, mask=keep, return_weights=True)
    assert w.shape == (2, 4, 8, 8)
    i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
    allowed = (j <= i) & (j > i - 3) & keep[:, None, None, :]
    assert (w[~allowed.expand_as(w)] == 0).all()
    assert (w[allowed.expand_as(w)] > 0).all()
    rows = allowed.any(-1).expand(2, 4, 8)  # rows with at least one key
    torch.testing.assert_close(w.sum(-1)[rows], torch.ones(int(rows.sum())))
    assert (w.sum(-1)[~rows] == 0).all() and (out[1, :2] == m.out_proj.bias).all()


def test_dropout_only_in_training():
    for kw in ({"dropout": 0.5}, {"resid_dropout": 0.5}):
        m = seeded(4, MultiHeadAttention, 16, 16, 2, causal=True, **kw)
        x = torch.randn(2, 6, 16)
        m.eval()
        close(m(x), m(x))
        m.train()
        a, b = m(x), m(x)
        assert not torch.allclose(a, b), kw
        m.eval()
        assert not torch.allclose(a, m(x)), kw
    m = seeded(4, MultiHeadAttention, 16, 16, 2, causal=True).train()  # no dropout
    close(m(x), m(x))


# --------------------------------------------------------------- bad input


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"d_in": 16, "d_out": 10, "num_heads": 4}, "d_out=10 must be divisible by num_heads=4"),
    ({"d_in": 16, "d_out": 16, "num_heads": 4, "num_kv_heads": 3},
     "num_heads=4 must be divisible by num_kv_heads=3"),
    ({"d_in": 16, "d_out": 16, "num_heads": 0}, "num_heads must be a positive int, got 0"),
    ({"d_in": 16, "d_out": 16, "num_heads": 2, "window": 0}, "window must be a positive int"),
    ({"d_in": 16, "d_out": 16, "num_heads": 2, "dropout": 2.0}, "dropout must be a number"),
    ({"d_in": 16, "d_out": 16, "num_heads": 2, "backend": "cuda"}, "backend must be one of"),
    ({"d_in": 16, "d_out": 12, "num_heads": 4, "rope": True}, "rope needs an even head_dim"),
])
def test_bad_construction(kwargs, needle):
    with pytest.raises(ValueError) as err:
        MultiHeadAttention(**kwargs)
    assert needle in str(err.value)


def _bad_calls():
    m = MultiHeadAttention(16, 16, 4, num_kv_heads=2, context_length=6, causal=True)
    x = torch.randn(2, 3, 16)
    return [
        (m, (torch.randn(2, 3, 8),), {}, "x has 8 features (shape (2, 3, 8)) but d_in=16"),
        (m, (torch.randn(1, 1, 3, 16),), {}, "x must be (batch, seq, features=16) (batch "
                                             "first) or one (seq, features=16) sequence, "
                                             "got (1, 1, 3, 16)"),
        (m, (torch.randn(1, 7, 16),), {}, "sequence of 7 tokens (0 cached + 7 new) is longer "
                                          "than context_length=6"),
        (m, (x,), {"cache": KVCache(3, 8, 2, 4)},
         "cache has batch_size 3 but the input has batch size 2"),
        (m, (x,), {"cache": KVCache(2, 8, 4, 4)},
         "cache holds num_kv_heads=4, head_dim=4 but the input has num_kv_heads=2, head_dim=4"),
        (m, (x,), {"kv": torch.randn(2, 5, 12)}, "kv has shape (2, 5, 12) but expected"),
        (m, (x,), {"kv": x, "cache": KVCache(2, 8, 2, 4)}, "cache with kv"),
        (m, (x,), {"mask": torch.ones(3, 3, dtype=torch.bool)},
         "a 2-D mask is a key-padding mask (batch=2, k_len=3), got shape (3, 3)"),
        (m, (x,), {"positions": torch.arange(3)}, "positions is only used with rope=True"),
        (m, (x,), {"mask": torch.ones(3, 3, 3, dtype=torch.bool)},
         "a 3-D mask is (batch=2, q_len, k_len), got shape (3, 3, 3)"),
        (m, (x,), {"kv": torch.randn(2, 7, 16)}, "kv of 7 tokens is longer than "
                                                  "context_length=6"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_input_names_the_problem(case):
    m, args, kwargs, needle = _bad_calls()[case]
    with pytest.raises(ValueError) as err:
        m(*args, **kwargs)
    assert needle in str(err.value)


def test_3d_mask_is_per_example_not_per_head():
    """(batch, q_len, k_len) with batch == heads: each example keeps its own mask."""
    m = seeded(0, MultiHeadAttention, 8, 8, 2).eval()
    x = torch.randn(2, 3, 8)
    mask3 = torch.ones(2, 3, 3, dtype=torch.bool)
    mask3[1, :, 0] = False  # only example 1 may not see key 0
    out, w = m(x, mask=mask3, return_weights=True)
    assert torch.all(w[1, :, :, 0] == 0) and torch.all(w[0, :, :, 0] > 0)
    for i in range(2):  # each example alone, through the peer (torch SDPA)
        close(out[i:i + 1], peer_forward(m, x[i:i + 1], mask=mask3[i]))


def test_cache_counts_toward_context_length():
    m = MultiHeadAttention(16, 16, 4, context_length=6, causal=True)
    cache = m.new_cache(1, 10)
    m(torch.randn(1, 5, 16), cache=cache)
    with pytest.raises(ValueError, match=r"7 tokens \(5 cached \+ 2 new\).*context_length=6"):
        m(torch.randn(1, 2, 16), cache=cache)
    assert cache.seq_len == 5  # nothing appended by the refused call


# --------------------------------------------------------------- contract and bench helper


def test_forward_goes_through_attnlab_attention(monkeypatch):
    from attnlab.modules import multihead

    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    real = multihead.attention
    monkeypatch.setattr(multihead, "attention", spy)
    m = MultiHeadAttention(16, 16, 4, causal=True, backend="tiled", dropout=0.3).eval()
    m(torch.randn(1, 5, 16))
    assert len(calls) == 1
    # causal with no window builds no mask: attention handles it
    assert calls[0]["mask"] is None and calls[0]["causal"] is True
    assert calls[0]["backend"] == "tiled" and calls[0]["dropout_p"] == 0.0
    m.train()
    m(torch.randn(1, 5, 16))
    assert calls[1]["dropout_p"] == 0.3


@pytest.mark.parametrize("backward", [False, True])
def test_bench_cases_build_and_run(backward):
    from attnlab.bench import modules as bench

    quick = bench.cases(quick=True)
    assert [c.name for c in quick] == ["fwd B=2 T=256", "fwd+bwd B=2 T=256"]
    for case in quick:
        assert [i.name for i in case.impls] == list(bench.IMPLS)
        assert {i.factory[:2] for i in case.impls} == {(bench.MOD, "make_step")}
    full = bench.cases(quick=False)
    assert [c.name for c in full] == ["fwd B=8 T=1024", "fwd+bwd B=8 T=1024"]
    for impl in bench.IMPLS:  # every implementation runs (tiny sizes here)
        step = bench.make_step(impl, batch=1, seq=8, backward=backward, d=24, heads=2)
        out = step()
        if not backward:
            assert out.shape == (1, 8, 24)


def test_refused_call_leaves_the_cache_unchanged():
    m = MultiHeadAttention(16, 16, 4, causal=True, rope=True, backend="sdpa")
    cache = m.new_cache(2, 10)
    m(torch.randn(2, 3, 16), cache=cache)
    snapshot = cache.get()[0].clone()
    x = torch.randn(2, 1, 16)
    with pytest.raises(ValueError, match="a 2-D mask is a key-padding mask"):
        m(x, cache=cache, mask=torch.ones(2, 3, dtype=torch.bool))  # k_len is 4 now
    with pytest.raises(ValueError, match="does not broadcast"):
        m(x, cache=cache, mask=torch.ones(1, 1, 1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="cannot return weights"):
        m(x, cache=cache, return_weights=True)
    assert cache.seq_len == 3 and torch.equal(cache.get()[0], snapshot)
    # And a good call afterwards continues from position 3.
    m(x, cache=cache, mask=torch.ones(2, 4, dtype=torch.bool))
    assert cache.seq_len == 4


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([(4, 4), (4, 2), (4, 1)]), st.integers(1, 4), st.booleans(),
       st.booleans())
def test_decoding_path_equals_the_training_path(heads, steps, qkv_bias, explicit_pos):
    """Decoding one sequence without gradients projects q|k|v with one matmul and
    rotates q and k together; it must give what the three projections and two
    rotations give, cache, RoPE, GQA and explicit positions included."""
    num_heads, num_kv_heads = heads
    m = seeded(0, MultiHeadAttention, 16, 16, num_heads, num_kv_heads=num_kv_heads,
               causal=True, rope=True, qkv_bias=qkv_bias)
    prompt, tokens = torch.randn(1, 3, 16), torch.randn(1, steps, 16)
    outs = []
    for grad in (True, False):
        cache = m.new_cache(1, 8)
        with torch.set_grad_enabled(grad):
            m(prompt, cache=cache)
            for i in range(steps):  # one row per call: the fused path when grad is off
                pos = torch.tensor([[5 + i]]) if explicit_pos else None
                out = m(tokens[:, i:i + 1], cache=cache, positions=pos)
        outs.append((out, cache.get()[0].clone()))
    close(outs[0][0], outs[1][0])
    close(outs[0][1], outs[1][1])  # the cached (rotated) keys too


def test_inference_fused_projections_follow_the_weights():
    """Without gradients Q/K/V run as one cached matmul; it must track weight updates
    and work for modules whose parameters were made under inference_mode."""
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 16, 4, num_kv_heads=2, causal=True, qkv_bias=True)
    x = torch.randn(1, 1, 16)  # one row: the fused copy serves it without gradients
    with torch.no_grad():
        fused = m(x)
    close(fused, m(x))  # grad enabled: the three separate projections
    with torch.no_grad():
        m.W_value.weight.mul_(2.0)  # an in-place update, as an optimizer step makes
        updated = m(x)
    close(updated, m(x))
    assert not torch.allclose(updated, fused)
    with torch.inference_mode():  # parameters that are inference tensors
        inside = seeded(1, MultiHeadAttention, 16, 16, 4, num_kv_heads=2, causal=True)
    outside = seeded(1, MultiHeadAttention, 16, 16, 4, num_kv_heads=2, causal=True)
    with torch.inference_mode():
        close(inside(x), outside(x))
