"""The fused one-token decoding step (``_decode``) and the native RMSNorm against the
PyTorch paths they stand in for: values, the cache they leave, and where they stand aside.

With the kernel switched off (``ATTNLAB_NATIVE=0``) every test here still runs and
checks the PyTorch path against the same references.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import _decode, _native
from attnlab.cache import KVCache
from attnlab.models import GPT, GPTConfig, decoding
from attnlab.models.gpt import Block
from attnlab.models.gpt_config import _CHOICES
from attnlab.modules import MultiHeadAttention
from attnlab.modules.layers import RMSNorm

needs_native = pytest.mark.skipif(not _native.available(),
                                  reason=f"native kernel: {_native.unavailable_reason()}")


@contextmanager
def native_off():
    old = os.environ.get(_native.ENV_SWITCH)
    os.environ[_native.ENV_SWITCH] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[_native.ENV_SWITCH]
        else:
            os.environ[_native.ENV_SWITCH] = old


@contextmanager
def counting_fused_steps(name="step"):
    """Count what the fused kernel answered: attention steps (``_decode.step``) or, for
    ``"layers"``, decoder layers for each token fed (a ``_decode.Run`` takes a run of them
    per call, or per token of its greedy loop)."""
    count = [0]
    spied = [(_decode.Run, "__call__"), (_decode.Run, "greedy")] if name == "layers" else [
        (_decode, name)]
    originals = [getattr(owner, attr) for owner, attr in spied]

    def counter(original, attr):
        def fused(*args, **kwargs):
            out = original(*args, **kwargs)
            if out is not None:
                tokens = len(out) if attr == "greedy" else 1
                count[0] += tokens * len(args[0]) if name == "layers" else 1
            return out
        return fused
    for (owner, attr), original in zip(spied, originals):
        setattr(owner, attr, counter(original, attr))
    try:
        yield count
    finally:
        for (owner, attr), original in zip(spied, originals):
            setattr(owner, attr, original)


@contextmanager
def fused_layers_off():
    """The GPT blocks run their modules (the fused attention step still runs)."""
    originals = _decode.Run.__call__, _decode.Run.greedy
    _decode.Run.__call__ = lambda self, x, caches: None
    _decode.Run.greedy = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        _decode.Run.__call__, _decode.Run.greedy = originals


def _one_by_one(run, x, prompt_len):
    """``run`` on the prompt ``x[:, :prompt_len]`` at once, then on each later position
    alone (inference mode); the single-position outputs side by side."""
    with torch.inference_mode():
        run(x[:, :prompt_len])
        return torch.cat([run(x[:, t:t + 1]) for t in range(prompt_len, x.shape[1])], dim=1)


def _decode_one_by_one(mha, x, prompt_len):
    """Feed ``x`` (1, T, d) to ``mha`` with a cache: the prompt at once, then one token
    at a time; returns the outputs of the single-token steps and the cache."""
    cache = mha.new_cache(1, x.shape[1])
    return _one_by_one(lambda chunk: mha(chunk, cache=cache), x, prompt_len), cache


@settings(max_examples=40, deadline=None)
@given(kv_heads=st.sampled_from([1, 2, 4]), group=st.integers(1, 3),
       head_dim=st.sampled_from([2, 8, 14, 64]), rope=st.booleans(),
       window=st.one_of(st.none(), st.integers(1, 9)), prompt_len=st.integers(1, 6),
       steps=st.integers(1, 8), seed=st.integers(0, 2**16),
       scores=st.fixed_dictionaries({}, optional=dict(
           scale=st.sampled_from([0.05, 0.7]), softcap=st.sampled_from([0.3, 20.0]),
           alibi=st.just(True), sinks=st.just(True))))
def test_one_token_steps_equal_the_full_causal_attention(kv_heads, group, head_dim, rope,
                                                         window, prompt_len, steps, seed,
                                                         scores):
    """Decoding token by token through the cache (the fused step where the kernel is
    built) gives the rows the eager backend computes over the whole sequence, with any
    of the score variants (a scale, softcap, ALiBi, sinks) the step runs too."""
    heads = kv_heads * group
    torch.manual_seed(seed)
    mha = MultiHeadAttention(16, heads * head_dim, heads, num_kv_heads=kv_heads, causal=True,
                             rope=rope, window=window, qkv_bias=bool(seed % 2),
                             **scores).eval()
    if mha.sinks is not None:
        with torch.no_grad():
            mha.sinks.normal_()
    x = torch.randn(1, prompt_len + steps, 16)
    with counting_fused_steps() as fused:
        got, cache = _decode_one_by_one(mha, x, prompt_len)
    # (a one-token prompt is a decoding step too)
    assert fused[0] == ((steps + (prompt_len == 1)) if _native.available() else 0)
    mha.backend = "eager"
    with torch.no_grad():
        want = mha(x)[:, prompt_len:]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # The cache holds what the PyTorch path would have written: rotated keys, values.
    mha.backend = "auto"
    with native_off():
        _, plain = _decode_one_by_one(mha, x, prompt_len)
    assert cache.seq_len == plain.seq_len == x.shape[1]
    torch.testing.assert_close(cache.k, plain.k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache.v, plain.v)


@needs_native
def test_a_gpt_decodes_the_same_tokens_and_logits_fused_or_not():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, d_model=48, num_heads=6, num_kv_heads=2,
                          num_layers=2, positions="rope", norm="rmsnorm", mlp="swiglu",
                          window=6)).eval()
    prompt = torch.randint(0, 64, (1, 5))
    with counting_fused_steps("layers") as fused:
        tokens = model.generate(prompt, 12, temperature=0)
    assert fused[0] == 11 * 2  # every step after the prompt, in both layers
    with native_off():
        assert torch.equal(model.generate(prompt, 12, temperature=0), tokens)
    with fused_layers_off(), counting_fused_steps() as attention_only:
        assert torch.equal(model.generate(prompt, 12, temperature=0), tokens)
    assert attention_only[0] == 11 * 2


def _decode_logits(model, ids, prompt_len):
    """Logits of every single-token step after the prompt, and the caches left."""
    caches = model.new_cache(1, ids.shape[1])
    return _one_by_one(lambda chunk: model(chunk, caches=caches), ids, prompt_len), caches


@settings(max_examples=30, deadline=None)
@given(positions=st.sampled_from(["learned", "rope"]),
       norm=st.sampled_from(["layernorm", "rmsnorm"]),
       mlp=st.sampled_from(_CHOICES["mlp"]),
       kv_heads=st.sampled_from([1, 2, 4]),
       biases=st.booleans(), window=st.one_of(st.none(), st.integers(1, 5)),
       tie=st.booleans(), prompt_len=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_fused_layers_give_the_logits_and_caches_of_the_modules(
        positions, norm, mlp, kv_heads, biases, window, tie, prompt_len, seed):
    """Every GPT flavour the fused decoder layer knows (learned or rotary positions,
    LayerNorm or RMSNorm, GELU/GELU-tanh/SwiGLU, MHA/GQA/MQA, with or without biases,
    windows, tied output): logits and caches equal the modules' token by token."""
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=50, context_length=32, d_model=32, num_heads=4,
                    num_kv_heads=kv_heads, num_layers=2, positions=positions, norm=norm,
                    mlp=mlp, qkv_bias=biases, out_bias=biases, mlp_bias=biases,
                    window=window, tie_embeddings=tie)
    model = GPT(cfg).eval()
    with torch.no_grad():  # biases and norm weights away from their 0 / 1 initialisation
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    ids = torch.randint(0, 50, (1, prompt_len + 6))
    with counting_fused_steps("layers") as fused:
        got, caches = _decode_logits(model, ids, prompt_len)
    assert fused[0] == (6 + (prompt_len == 1)) * 2 if _native.available() else fused[0] == 0
    with fused_layers_off():
        want, plain = _decode_logits(model, ids, prompt_len)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    for c, p in zip(caches, plain):
        assert c.seq_len == p.seq_len == ids.shape[1]
        torch.testing.assert_close(c.k, p.k, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(c.v, p.v, atol=1e-6, rtol=1e-6)


@needs_native
def test_fused_layers_stand_aside_where_the_modules_must_run():
    """A hook anywhere in a block (also one for every module), qkv_hook, dropout in
    training, a chosen backend, float64: that block runs its modules, the hook sees
    every token, and the tokens are the modules' tokens."""
    torch.manual_seed(2)
    cfg = GPTConfig(vocab_size=40, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2,
                    positions="rope", norm="rmsnorm", mlp="swiglu")
    model = GPT(cfg).eval()
    prompt = torch.randint(0, 40, (1, 4))
    with fused_layers_off():
        want = model.generate(prompt, 5, temperature=0)
    seen = []

    def forward_hook(module, args, out):
        seen.append(args[0].shape[1])

    def qkv_hook(q, k, v):
        seen.append(q.shape[2])
        return q, k, v
    block = model.blocks[1]
    register = {
        "block": lambda: block.register_forward_hook(forward_hook),
        "linear": lambda: block.mlp.proj.register_forward_hook(forward_hook),
        "norm pre": lambda: block.norm2.register_forward_pre_hook(
            lambda m, args: seen.append(args[0].shape[1])),
        "global": lambda: torch.nn.modules.module.register_module_forward_hook(
            lambda m, args, out: seen.append(args[0].shape[1]) if m is block else None),
    }
    for name, add in register.items():
        seen.clear()
        handle = add()
        with counting_fused_steps("layers") as fused:
            assert torch.equal(model.generate(prompt, 5, temperature=0), want), name
        handle.remove()
        assert seen == [4, 1, 1, 1, 1], name  # the prompt, then every decoded token
        assert fused[0] == (0 if name == "global" else 4), name  # block 0 still fused
    seen.clear()
    block.attn.qkv_hook = qkv_hook
    with counting_fused_steps("layers") as fused:
        assert torch.equal(model.generate(prompt, 5, temperature=0), want)
    assert seen == [4, 1, 1, 1, 1] and fused[0] == 4
    block.attn.qkv_hook = None
    for name, change in {"backend": lambda: setattr(block.attn, "backend", "sdpa"),
                         "dropout": lambda: (setattr(block, "dropout", 0.5),
                                             model.train())}.items():
        change()
        with counting_fused_steps("layers") as fused:
            model.generate(prompt, 5, temperature=0)
        assert fused[0] == 4, name  # block 0 only
        block.attn.backend, block.dropout = "auto", 0.0
        model.eval()
    with counting_fused_steps("layers") as fused:
        model.double().generate(prompt, 5, temperature=0)
    assert fused[0] == 0
    # Back to float32: the first decoded token repacks the layouts, the rest are fused.
    with counting_fused_steps("layers") as fused:
        assert torch.equal(model.float().generate(prompt, 5, temperature=0), want)
    assert fused[0] >= 6


@needs_native
def test_a_declined_fused_layer_leaves_the_cache_as_it_was():
    """A layer the kernel does not take (a float64 parameter) is refused when added,
    naming what; caches it cannot write (float64) give None and the cache position
    back, so the modules can run the token instead."""
    torch.manual_seed(3)
    model = GPT(GPTConfig(vocab_size=30, d_model=16, num_heads=2, num_layers=1,
                          positions="rope", norm="rmsnorm", mlp="swiglu")).eval()
    block = model.blocks[0]
    x = torch.randn(1, 1, 16)
    with torch.no_grad():
        run = _decode.Run()
        assert run.add(decoding._layer(block, Block)) is None and len(run) == 1
        cache = KVCache(1, 4, 2, 8, dtype=torch.float64)
        assert run(x, [cache]) is None
        assert cache.seq_len == 0 and not cache.k.any()
        block.norm2.weight.data = block.norm2.weight.data.double()
        refused = _decode.Run()
        assert "norm2" in refused.add(decoding._layer(block, Block)) and len(refused) == 0


def test_the_fused_step_stands_aside_where_the_pytorch_path_must_run():
    """Hooks on q/k/v, masks, explicit positions, weights asked for, float64, gradients,
    a chosen backend: the module runs its PyTorch path (and the hook sees every token)."""
    torch.manual_seed(1)
    mha = MultiHeadAttention(8, 8, 2, causal=True, rope=True).eval()
    x = torch.randn(1, 4, 8)
    seen = []

    def hook(q, k, v):
        seen.append(q.shape[2])
        return q, k, v.mul(0)
    cases = {
        "hook": dict(setup=lambda m: setattr(m, "qkv_hook", hook)),
        "mask": dict(kwargs=dict(mask=torch.ones(1, 4, dtype=torch.bool))),
        "positions": dict(kwargs=dict(positions=torch.tensor([3]))),
        "weights": dict(kwargs=dict(return_weights=True)),
        "backend": dict(setup=lambda m: setattr(m, "backend", "sdpa")),
    }
    for name, case in cases.items():
        m = MultiHeadAttention(8, 8, 2, causal=True, rope=True).eval()
        m.load_state_dict(mha.state_dict())
        case.get("setup", lambda m: None)(m)
        cache = m.new_cache(1, 4)
        with torch.no_grad(), counting_fused_steps() as fused:
            m(x[:, :3], cache=cache)
            kwargs = dict(case.get("kwargs", {}))
            if "mask" in kwargs:
                kwargs["mask"] = kwargs["mask"][:, :4]
            m(x[:, 3:], cache=cache, **kwargs)
        assert fused[0] == 0, name
    assert seen == [3, 1]  # the hook saw the prompt and the decoded token
    m = MultiHeadAttention(8, 8, 2, causal=True, rope=True).double().eval()
    cache = m.new_cache(1, 4)
    with torch.no_grad(), counting_fused_steps() as fused:
        m(x[:, :3].double(), cache=cache)
        m(x[:, 3:].double(), cache=cache)
    assert fused[0] == 0
    cache = mha.new_cache(1, 4)
    with counting_fused_steps() as fused:  # gradients on: the step must be differentiable
        mha(x[:, :3], cache=cache)
        mha(x[:, 3:], cache=cache).sum().backward()
    assert fused[0] == 0 and mha.W_query.weight.grad is not None


@needs_native
def test_a_nan_query_gives_nan_as_every_backend_does():
    mha = MultiHeadAttention(4, 4, 1, causal=True).eval()
    x = torch.randn(1, 3, 4)
    x[0, 2, 0] = float("nan")
    got, _ = _decode_one_by_one(mha, x, 2)
    assert torch.isnan(got).all()


def test_a_full_cache_is_refused_and_left_as_it_was():
    mha = MultiHeadAttention(4, 4, 1, causal=True).eval()
    cache = mha.new_cache(1, 2)
    with torch.no_grad():
        mha(torch.randn(1, 2, 4), cache=cache)
        before = cache.k.clone()
        with pytest.raises(ValueError, match="longer than|overflow"):
            mha(torch.randn(1, 1, 4), cache=cache)
    assert cache.seq_len == 2 and torch.equal(cache.k, before)


def test_reserve_counts_positions_and_refuses_what_does_not_fit():
    cache = KVCache(1, 4, 1, 2)
    assert cache.reserve(3) == 0 and cache.seq_len == 3
    with pytest.raises(ValueError, match="reserve 2 positions but only 1"):
        cache.reserve(2)
    assert cache.seq_len == 3 and cache.reserve(1) == 3 and cache.remaining == 0


# ------------------------------------------------------------------- RMSNorm


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple),
       dim=st.sampled_from([1, 7, 8, 64, 576]), eps=st.sampled_from([1e-5, 1e-6, None]),
       affine=st.booleans(), seed=st.integers(0, 2**16))
def test_rmsnorm_equals_torch(shape, dim, eps, affine, seed):
    torch.manual_seed(seed)
    norm = RMSNorm(dim, eps=eps, elementwise_affine=affine)
    if affine:
        torch.nn.init.normal_(norm.weight)
    x = torch.randn(*shape, dim) * 3
    with torch.no_grad():
        got = norm(x)
    want = F.rms_norm(x, (dim,), norm.weight, eps)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def test_rmsnorm_trains_and_keeps_torchs_state_dict():
    norm = RMSNorm(6, eps=1e-5)
    assert isinstance(norm, torch.nn.RMSNorm) and list(norm.state_dict()) == ["weight"]
    x = torch.randn(3, 6, requires_grad=True)
    norm(x).square().sum().backward()
    ref = torch.nn.RMSNorm(6, eps=1e-5)
    x2 = x.detach().clone().requires_grad_(True)
    ref(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(norm.weight.grad, ref.weight.grad)
    with torch.no_grad():
        nan_row = norm(torch.tensor([[1.0, float("nan"), 2.0, 0, 0, 0]]))
    assert torch.isnan(nan_row).all()


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 5), d_model=st.sampled_from([4, 24]), d_ff=st.sampled_from([1, 8, 50]),
       seed=st.integers(0, 2**16))
def test_swiglu_mlp_without_gradients_equals_its_training_path(rows, d_model, d_ff, seed):
    """One row (joint product, native silu * up) and several rows give what the same
    MLP computes with gradients on, layer by layer."""
    from attnlab.modules.layers import MLP

    torch.manual_seed(seed)
    mlp = MLP(d_model, d_ff, "swiglu", bias=bool(seed % 2))
    for x in (torch.randn(1, 1, d_model) * 3, torch.randn(rows, 2, d_model)):
        want = mlp.proj(F.silu(mlp.gate(x)) * mlp.fc(x))
        with torch.no_grad():
            got = mlp(x)
        torch.testing.assert_close(got, want.detach(), atol=2e-6, rtol=2e-5)


@needs_native
def test_a_piece_or_parameter_replaced_between_tokens_is_used_at_the_next():
    """Decoding token by token with forward (outside generate's held plan), nothing
    about a block is remembered between tokens: a new output projection, a parameter
    given new storage, a norm changed in place all show in the next token's logits,
    which stay the modules' logits."""
    torch.manual_seed(4)
    model = GPT(GPTConfig(vocab_size=30, d_model=32, num_heads=4, num_kv_heads=2,
                          num_layers=2, positions="rope", norm="rmsnorm", mlp="swiglu")).eval()
    ids = torch.randint(0, 30, (1, 8))
    edits = [
        lambda b: setattr(b.attn, "out_proj", torch.nn.Linear(32, 32)),
        lambda b: setattr(b.mlp.proj.weight, "data", torch.randn(32, b.mlp.proj.in_features)),
        lambda b: b.norm2.weight.data.mul_(3.0),
    ]
    for edit in edits:
        with torch.no_grad():
            edit(model.blocks[1])
        with counting_fused_steps("layers") as fused:
            got, _ = _decode_logits(model, ids, 4)
        assert fused[0] == 4 * 2
        with fused_layers_off():
            want, _ = _decode_logits(model, ids, 4)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@needs_native
def test_a_block_or_piece_that_is_not_what_the_kernel_knows_runs_its_modules():
    """A Block subclass or a forward set on an instance (block or piece), a wrapper in
    place of a block, attention dropout turned on by ``attn.train()`` alone: the
    kernel stands aside for that block, and the logits are the modules' logits."""
    class Shifted(Block):
        def forward(self, x, *args):
            y, w = super().forward(x, *args)
            return y + 1.0, w

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        @property
        def attn(self):  # GPT.new_cache shapes each cache from block.attn
            return self.inner.attn

        def forward(self, *args):
            return self.inner(*args)

    def shifted(block):
        block.__class__ = Shifted

    def own_forward(block):
        real = block.forward
        block.forward = lambda x, *args: (real(x, *args)[0] * 0.5, None)

    def mlp_forward(block):
        real = block.mlp.forward
        block.mlp.forward = lambda x: real(x) * 2.0

    def dropout_in_attention(block):
        block.attn.dropout = 0.5
        block.attn.train()

    torch.manual_seed(5)
    cfg = GPTConfig(vocab_size=30, d_model=32, num_heads=4, num_layers=2, positions="rope",
                    norm="rmsnorm", mlp="swiglu")
    ids = torch.randint(0, 30, (1, 7))
    for edit in (shifted, own_forward, mlp_forward, dropout_in_attention,
                 lambda b: None):
        model = GPT(cfg).eval()
        edit(model.blocks[1])
        with counting_fused_steps("layers") as fused:
            torch.manual_seed(0)
            got, _ = _decode_logits(model, ids, 3)
        with fused_layers_off():
            torch.manual_seed(0)
            want, _ = _decode_logits(model, ids, 3)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        assert fused[0] == (8 if edit.__name__ == "<lambda>" else 4), edit.__name__
    model = GPT(cfg).eval()
    model.blocks[1] = Wrapper(model.blocks[1])
    with counting_fused_steps("layers") as fused:
        got, _ = _decode_logits(model, ids, 3)
    with fused_layers_off():
        want, _ = _decode_logits(model, ids, 3)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert fused[0] == 4


def test_rmsnorm_takes_a_weight_that_is_not_contiguous():
    norm = RMSNorm(6, eps=1e-5)
    norm.weight.data = torch.randn(12)[::2]
    x = torch.randn(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(norm(x), F.rms_norm(x, (6,), norm.weight, 1e-5))
