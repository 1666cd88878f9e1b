"""When the fused decoding plan is made (``models.decoding.Decoder``), and the attention
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
from test_decode import counting_fused_steps, fused_layers_off
from threads import threads as thread_count
from torch.overrides import TorchFunctionMode

from attnlab import _decode, _native, reference
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
    # Each generate call makes its plan anew.
    with counting_checks() as checks:
        model.generate(PROMPT, NEW, temperature=0)
    assert checks[0] == ONCE


class _Mode(TorchFunctionMode):
    """User code on every torch call: here it adds a hook to a block mid-generate."""

    def __init__(self, model):
        super().__init__()
        self.model, self.seen, self.calls = model, [], 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.detach:  # greedy sampling reads the logits: once a token
            self.calls += 1
            if self.calls == 2:
                self.model.blocks[1].register_forward_hook(lambda *a: self.seen.append(1))
        return func(*args, **(kwargs or {}))


class _Ids(torch.Tensor):
    pass


@pytest.mark.parametrize("user_code", ["function mode", "tensor subclass prompt"])
def test_generate_plans_every_token_where_user_code_runs_on_torch_calls(user_code):
    """A torch function mode, or a prompt of a tensor subclass, runs user code on
    every torch call, which may change the model mid-generate: planned every token."""
    model = _model()
    ids = torch.tensor(PROMPT)
    if user_code == "function mode":
        mode = _Mode(model)
        with counting_checks() as checks, mode:
            model.generate(ids, NEW, temperature=0)
        assert mode.seen  # the hook added at the second token saw the later ones
    else:
        with counting_checks() as checks:
            model.generate(ids.as_subclass(_Ids), NEW, temperature=0)
    assert checks[0] == PER_TOKEN


class _UsersNorm(torch.nn.LayerNorm):
    pass


@pytest.mark.parametrize("change", ["instance forward", "class of the user's", "global hook",
                                    "module hook", "qkv_hook", "qkv_hook module",
                                    "tensor subclass", "parameter subclass"])
def test_library_only_sees_where_user_code_could_run(change):
    model = _model()
    assert decoding.library_only(model)
    if change == "instance forward":
        model.norm.forward = model.norm.forward
    elif change == "class of the user's":
        model.norm = _UsersNorm(32)
    elif change == "global hook":
        handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    elif change == "module hook":
        model.blocks[1].mlp.register_forward_pre_hook(lambda *args: None)
    elif change == "qkv_hook":
        model.blocks[1].attn.qkv_hook = lambda q, k, v: (q, k, v)
    elif change == "qkv_hook module":  # (an nn.Module goes to _modules, not __dict__)
        model.blocks[1].attn.qkv_hook = torch.nn.Identity()
    elif change == "parameter subclass":
        class Watched(torch.nn.Parameter):
            pass
        model.blocks[0].norm1.weight = Watched(model.blocks[0].norm1.weight.detach())
    else:
        class Tagged(torch.Tensor):
            pass
        model.register_buffer("tag", torch.zeros(1).as_subclass(Tagged))
    try:
        assert not decoding.library_only(model)
    finally:
        if change == "global hook":
            handle.remove()


def _decode_tokens() -> list[torch.Tensor]:
    """Logits of three single-token steps, each planned afresh (no decoder given), the
    second and third after W_key of block 1 was given new storage in place (same
    Parameter, no longer packed, new values)."""
    model = _model()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        caches = model.new_cache(1, 8)
        model(ids[:, :3], caches=caches)
        out = [model(ids[:, 3:4], caches=caches)]  # the plan is made here
        weight = model.blocks[1].attn.W_key.weight
        weight.data = (weight.data * 1.5).clone()
        return out + [model(ids[:, 4:5], caches=caches), model(ids[:, 5:6], caches=caches)]


@needs_native
def test_a_plan_made_per_token_sees_a_replaced_weight():
    """Without a decoder each token is planned afresh: the unpacked W_key is seen (its
    block runs its modules, which pack it again) and the logits are those of the
    modules."""
    with counting_fused_steps("layers") as fused:
        got = _decode_tokens()
    with fused_layers_off():
        want = _decode_tokens()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    # 3 layers fused at the first token; the second declined whole then 2 of 3 one by
    # one; 3 again at the third (W_key was packed again by its module).
    assert fused[0] == 3 + 2 + 3


def _check_step(batch, kv_heads, group, head_dim, pos, window, threads, rope, seed):
    """decode_step at ``pos`` of caches longer than that (NaN beyond pos: never read)
    against the float64 reference, and the new key and value written at pos."""
    gen = torch.Generator().manual_seed(seed)
    heads, rows = kv_heads * group, pos + 1
    k_cache = torch.randn(batch, kv_heads, rows + 3, head_dim, generator=gen)
    v_cache = torch.randn(batch, kv_heads, rows + 3, head_dim, generator=gen)
    k_cache[:, :, rows:] = v_cache[:, :, rows:] = float("nan")
    qkv = torch.randn(batch, 1, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2
    cos = sin = None
    if rope:
        cos, sin = RotaryEmbedding(head_dim).tables(rows, torch.device("cpu"))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    queries = []
    for b in range(batch):
        q, k, v = qkv[b, 0].split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
        q, k, v = (t.view(-1, head_dim) for t in (q, k, v))
        if rope:
            q, k = (t * cos[pos] + t.roll(head_dim // 2, -1) * sin[pos] for t in (q, k))
        want_k[b, :, pos], want_v[b, :, pos] = k, v
        queries.append(q)
    with thread_count(threads):
        out = _native.load().decode_step(qkv, cos, sin, k_cache, v_cache, pos,
                                         _decode._window(window, pos), heads, kv_heads,
                                         1.0 / math.sqrt(head_dim))
    torch.testing.assert_close(k_cache, want_k, atol=1e-6, rtol=1e-6, equal_nan=True)
    assert torch.equal(v_cache.nan_to_num(), want_v.nan_to_num())
    for b in range(batch):  # the new query, end-aligned: causal and window as decoding
        want = reference.attention(queries[b][:, None].numpy(), want_k[b, :, :rows].numpy(),
                                   want_v[b, :, :rows].numpy(), causal=True, window=window)
        torch.testing.assert_close(out[b, 0].view(heads, head_dim),
                                   torch.from_numpy(want[:, 0]).float(), atol=1e-5, rtol=1e-5)


@needs_native
@settings(max_examples=30, deadline=None)
@given(batch=st.sampled_from([1, 2]), kv_heads=st.sampled_from([1, 2, 3]),
       group=st.sampled_from([1, 2, 3, 4, 5]),  # the kernel takes heads three at a time
       head_dim=st.sampled_from([4, 8, 14, 16, 64, 80, 128]),
       pos=st.integers(0, 300), window=st.one_of(st.none(), st.integers(1, 120)),
       threads=st.sampled_from([1, 2, 3]), rope=st.booleans(), seed=st.integers(0, 2**16))
def test_the_attention_step_equals_one_softmax_over_the_cache(batch, kv_heads, group, head_dim,
                                                             pos, window, threads, rope, seed):
    _check_step(batch, kv_heads, group, head_dim, pos, window, threads, rope, seed)


# Cases that take the split for certain: B * Hq * n * D >= 2**14 and a thread count that
# the (sequence, kv head) pairs do not divide.
@needs_native
@pytest.mark.parametrize("batch, kv_heads, group, head_dim, pos, window, threads", [
    (1, 3, 3, 64, 95, None, 2),     # SmolLM's heads, two threads
    (1, 1, 4, 128, 200, None, 3),   # three chunks
    (1, 3, 1, 80, 250, 100, 2),     # a window; D not a power of two
    (1, 1, 8, 14, 299, None, 4),    # D not a multiple of 8; four chunks
    (2, 1, 8, 64, 300, 40, 3),      # two sequences; chunks of 20 keys at the window's edge
])
def test_the_attention_step_over_a_long_cache_split_between_threads(
        batch, kv_heads, group, head_dim, pos, window, threads):
    """Long caches are cut into chunks of keys that the threads take, each chunk's
    softmax merged by its max and sum: the same rows as one softmax over all keys."""
    for seed, rope in ((0, True), (1, False)):
        _check_step(batch, kv_heads, group, head_dim, pos, window, threads, rope, seed)


def test_a_change_between_two_generate_calls_is_seen_by_the_second():
    """A decoder lasts one generate call: a block changed after it is planned anew."""
    model = _model()
    model.generate(PROMPT, NEW, temperature=0)
    torch.manual_seed(1)
    model.blocks[1].attn.out_proj = torch.nn.Linear(32, 32).eval()
    model.blocks[2].norm2.weight.data.mul_(-2.0)
    got = model.generate(PROMPT, NEW, temperature=0)
    with fused_layers_off():  # the modules alone
        want = model.generate(PROMPT, NEW, temperature=0)
    assert torch.equal(got, want)
    with torch.no_grad():  # and the logits agree, not only the greedy picks
        caches = model.new_cache(1, 8)
        ids = torch.tensor([PROMPT[0] + [4]])
        model(ids[:, :3], caches=caches)
        fused = model(ids[:, 3:], caches=caches, decoder=model.decoder())
        for cache in caches:
            cache.crop(3)
        with fused_layers_off():
            plain = model(ids[:, 3:], caches=caches)
    torch.testing.assert_close(fused, plain, atol=2e-5, rtol=2e-5)


@contextmanager
def counting_heads():
    """How many decoded tokens got their logits from the kernel (a run with a head, per
    call or per token of its greedy loop)."""
    count, original, loop = [0], _decode.Run.__call__, _decode.Run.greedy

    def counted(self, x, caches):
        out = original(self, x, caches)
        count[0] += out is not None and self.has_head
        return out

    def looped(self, *args, **kwargs):
        out = loop(self, *args, **kwargs)
        count[0] += 0 if out is None else len(out)
        return out
    _decode.Run.__call__, _decode.Run.greedy = counted, looped
    try:
        yield count
    finally:
        _decode.Run.__call__, _decode.Run.greedy = original, loop


@contextmanager
def heads_off():
    """The fused runs stop at the last block; the final norm and lm_head run as modules."""
    original = decoding._set_head
    decoding._set_head = lambda *args: None
    try:
        yield
    finally:
        decoding._set_head = original


@needs_native
@pytest.mark.parametrize("precision, tol", [("float32", 1e-5), ("bfloat16", 3e-2),
                                            ("int8", 1e-5)])
@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm", "rmsnorm_plus_one"])
def test_the_kernel_gives_the_logits_of_the_final_norm_and_output_layer(precision, tol, norm):
    """Decoding one token, the run ends with the model's final norm and output layer: the
    logits equal those of the modules after the fused blocks (bf16: the modules round the
    row to bf16 before the norm, the kernel keeps it float32)."""
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=300, d_model=64, num_heads=4, num_kv_heads=2,
                          num_layers=2, positions="rope", norm=norm, mlp="swiglu")).eval()
    with torch.no_grad():  # a final norm away from its initial weights (and bias)
        for p in model.norm.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    if precision == "int8":
        model.quantize("int8")
    elif precision == "bfloat16":
        model.to(torch.bfloat16)
    ids = torch.randint(0, 300, (1, 8))

    def logits():
        caches = model.new_cache(1, 8)
        with torch.inference_mode():
            model(ids[:, :3], caches=caches)
            return torch.cat([model(ids[:, t:t + 1], caches=caches) for t in range(3, 8)], 1)
    with counting_heads() as heads:
        got = logits()
    assert heads[0] == 5 and got.dtype == torch.float32
    with heads_off(), counting_heads() as heads:
        want = logits()
    assert heads[0] == 0
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@needs_native
@pytest.mark.parametrize("where", ["norm", "lm_head"])
def test_a_hooked_final_norm_or_output_layer_runs_as_a_module(where):
    """A hook on the final norm or the output layer sees every token, the blocks stay
    fused, and the tokens are the modules'."""
    model = _model()
    with fused_layers_off():
        want = model.generate(PROMPT, NEW, temperature=0)
    seen = []  # rows per call: the prompt's 3 (the output layer: its last only), then 1s
    handle = getattr(model, where).register_forward_hook(
        lambda m, args, out: seen.append(args[0].shape[1]))
    with counting_heads() as heads, counting_fused_steps("layers") as fused:
        assert torch.equal(model.generate(PROMPT, NEW, temperature=0), want)
    handle.remove()
    first = 3 if where == "norm" else 1
    assert seen == [first] + [1] * (NEW - 1) and heads[0] == 0 and fused[0] == PER_TOKEN
    with counting_heads() as heads:
        assert torch.equal(model.generate(PROMPT, NEW, temperature=0), want)
    assert heads[0] == NEW - 1


@needs_native
@pytest.mark.parametrize("change", ["new lm_head", "quantize"])
def test_a_decoder_reads_the_final_norm_and_output_layer_when_it_plans(change):
    """A decoder made before the output layer is replaced (or the model quantised) plans
    with the model's output layer as it is at the first decoded token."""
    ids, logits = torch.tensor([[1, 2, 3]]), []
    for held in (False, True):
        model = _model(tie_embeddings=False)
        decoder = model.decoder(ids)
        if change == "quantize":
            model.quantize("int8")
        else:
            torch.manual_seed(1)
            model.lm_head = torch.nn.Linear(32, 40, bias=False)
        caches = model.new_cache(1, 8)
        with torch.inference_mode(), counting_heads() as heads:
            model(ids, caches=caches)
            logits.append(model(torch.tensor([[4]]), caches=caches,
                                **({"decoder": decoder} if held else {})))
        assert heads[0] == 1
    torch.testing.assert_close(logits[1], logits[0], atol=1e-6, rtol=1e-6)


class _Names(TorchFunctionMode):
    """A FLOP counter's view: the name of every torch call."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@needs_native
def test_a_torch_function_mode_sees_the_output_layer_of_a_decoded_token():
    model = _model()
    caches = model.new_cache(1, 8)
    with torch.inference_mode():
        model(torch.tensor(PROMPT), caches=caches)
        with _Names() as mode, counting_heads() as heads:
            model(torch.tensor([[4]]), caches=caches)
    assert heads[0] == 0 and "linear" in mode.names
