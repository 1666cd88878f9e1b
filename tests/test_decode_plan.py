"""When the fused decoding plan is made (``models.decoding.held``), and the attention
step over long caches, whose keys are split between threads and merged.

The plan says which blocks the native kernel may stand in for. It is made for every
token, except in ``generate`` without a callback on a model that runs only library
code: there it is made at the first decoded token and kept to the last.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import _decode, _native
from attnlab.models import GPT, GPTConfig, decoding
from attnlab.rope import RotaryEmbedding

needs_native = pytest.mark.skipif(not _native.available(),
                                  reason=f"native kernel: {_native.unavailable_reason()}")

LAYERS = 3


def _model(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=40, d_model=32, num_heads=4, num_kv_heads=2,
                         num_layers=LAYERS, positions="rope", norm="rmsnorm", mlp="swiglu",
                         **kw)).eval()


@contextmanager
def counting_checks():
    """How many times a block was checked (``decoding._layer``)."""
    count, original = [0], decoding._layer

    def counted(*args):
        count[0] += 1
        return original(*args)
    decoding._layer = counted
    try:
        yield count
    finally:
        decoding._layer = original


PROMPT, NEW = [[1, 2, 3]], 6
# The prompt runs as one forward; the other NEW - 1 tokens are one-row steps.
PER_TOKEN, ONCE = (NEW - 1) * LAYERS, LAYERS


@needs_native
def test_generate_checks_the_blocks_once_where_nothing_of_the_users_can_run():
    model = _model()
    with counting_checks() as checks:
        want = model.generate(PROMPT, NEW, temperature=0)
    assert checks[0] == ONCE
    # A callback, a hook anywhere in the model, streaming: user code runs between
    # tokens, so every token is checked afresh; the tokens are the same.
    with counting_checks() as checks:
        got = model.generate(PROMPT, NEW, temperature=0, on_token=lambda tok: None)
    assert checks[0] == PER_TOKEN and torch.equal(got, want)
    handle = model.lm_head.register_forward_hook(lambda *args: None)
    with counting_checks() as checks:
        got = model.generate(PROMPT, NEW, temperature=0)
    handle.remove()
    assert checks[0] == PER_TOKEN and torch.equal(got, want)
    with counting_checks() as checks:
        got = torch.stack(list(model.stream(PROMPT, NEW, temperature=0)), dim=1)
    assert checks[0] == PER_TOKEN and torch.equal(got, want[:, 3:])
    # Outside generate the plan is per token again.
    with counting_checks() as checks:
        model.generate(PROMPT, NEW, temperature=0)
    assert checks[0] == ONCE


class _UsersNorm(torch.nn.LayerNorm):
    pass


@pytest.mark.parametrize("change", ["instance forward", "class of the user's", "global hook",
                                    "qkv_hook", "tensor subclass"])
def test_library_only_sees_where_user_code_could_run(change):
    model = _model()
    assert decoding._library_only(model)
    if change == "instance forward":
        model.norm.forward = model.norm.forward
    elif change == "class of the user's":
        model.norm = _UsersNorm(32)
    elif change == "global hook":
        handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    elif change == "qkv_hook":
        model.blocks[1].attn.qkv_hook = lambda q, k, v: (q, k, v)
    else:
        class Tagged(torch.Tensor):
            pass
        model.register_buffer("tag", torch.zeros(1).as_subclass(Tagged))
    try:
        assert not decoding._library_only(model)
    finally:
        if change == "global hook":
            handle.remove()


@needs_native
def test_a_held_plan_still_declines_what_the_kernel_does_not_take():
    """Held or not, the kernel checks every tensor at every call: a layer it declines
    runs its modules, and the tokens are those of the modules."""
    model = _model()
    want = model.generate(PROMPT, NEW, temperature=0)
    with decoding.held(model):
        plan = decoding._plan(model.blocks, type(model.blocks[0]))
        assert [(a, b) for a, b, run in plan] == [(0, LAYERS)] and len(plan[0][2]) == LAYERS
    model.double()
    assert torch.equal(model.generate(PROMPT, NEW, temperature=0), want)


def _reference(q, k, v, lo):
    """Attention of one query per head over keys lo..end: (Hq, D) from q (Hq, D) and
    k, v (Hkv, n, D), in float64."""
    group = q.shape[0] // k.shape[0]
    k, v = (t[:, lo:].double().repeat_interleave(group, 0) for t in (k, v))
    w = torch.softmax(torch.einsum("hd,hnd->hn", q.double(), k) / math.sqrt(q.shape[-1]), -1)
    return torch.einsum("hn,hnd->hd", w, v)


@needs_native
@settings(max_examples=25, deadline=None)
@given(kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 3]),
       head_dim=st.sampled_from([8, 14, 64, 80]), pos=st.integers(0, 300),
       window=st.one_of(st.none(), st.integers(1, 120)), threads=st.sampled_from([1, 2, 3]),
       rope=st.booleans(), seed=st.integers(0, 2**16))
def test_the_attention_step_over_a_long_cache_split_between_threads(
        kv_heads, group, head_dim, pos, window, threads, rope, seed):
    """Long caches are cut into chunks of keys that the threads take, each chunk's
    softmax merged by its max and sum: the same rows as one softmax over all keys."""
    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    k_cache = torch.randn(1, kv_heads, pos + 1, head_dim, generator=gen)
    v_cache = torch.randn(1, kv_heads, pos + 1, head_dim, generator=gen)
    qkv = torch.randn(1, 1, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2
    cos = sin = None
    if rope:
        cos, sin = RotaryEmbedding(head_dim).tables(pos + 1, torch.device("cpu"))
    q, k, v = qkv[0, 0].split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
    q, k, v = (t.view(-1, head_dim) for t in (q, k, v))
    if rope:
        q, k = (t * cos[pos] + t.roll(head_dim // 2, -1) * sin[pos] for t in (q, k))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[0, :, pos], want_v[0, :, pos] = k, v
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = _native.load().decode_step(qkv, cos, sin, k_cache, v_cache, pos,
                                         _decode._window(window, pos), heads, kv_heads,
                                         1.0 / math.sqrt(head_dim))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(k_cache, want_k, atol=1e-6, rtol=1e-6)
    assert torch.equal(v_cache, want_v)
    lo = 0 if window is None else max(0, pos - window + 1)
    want = _reference(q, want_k[0], want_v[0], lo).float()
    torch.testing.assert_close(out.view(heads, head_dim), want, atol=1e-5, rtol=1e-5)
