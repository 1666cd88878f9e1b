"""``generate``'s native greedy loop (``Decoder.greedy``, ``DecoderRun::greedy``): after the
second token, one call decodes the rest of a row's greedy tokens. The tokens must be the
ones that a forward and ``sample_next`` per token give (the same run without the loop),
including where the logits hold NaN or ties, where an end-of-text id stops a row, and in
float32, bf16 and int8; a model whose embedding or output does more than the kernel knows
falls back to the per-token path."""

from __future__ import annotations

from contextlib import contextmanager
from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import KVCache, _decode, _native
from attnlab.models import GPT, GPTConfig
from attnlab.modules.quantized import quantize

pytestmark = pytest.mark.skipif(not _native.available(),
                                reason=f"native kernel: {_native.unavailable_reason()}")

PROMPT = [[3, 1, 4, 1, 5]]


def _model(precision: str = "f32", **kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2,
               positions="rope", norm="rmsnorm", mlp="swiglu", context_length=64)
    model = GPT(GPTConfig(**{**cfg, **kw})).eval()
    with torch.no_grad():  # weights large enough that each token's row decides the next
        for p in model.parameters():
            p.mul_(8)
    if precision == "bf16":
        model.to(torch.bfloat16)
    elif precision == "int8":
        quantize(model)
    return model


@contextmanager
def loop_calls():
    """Tokens the native loop gave, per call (None where it declined)."""
    calls, original = [], _decode.Run.greedy

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append(out)
        return out
    _decode.Run.greedy = spy
    try:
        yield calls
    finally:
        _decode.Run.greedy = original


def _per_token(model: GPT, new: int, **kw) -> torch.Tensor:
    """The same greedy run, a forward and sample_next per token (a callback keeps
    generate off the loop)."""
    return model.generate(PROMPT, new, temperature=0, on_token=lambda tok: None, **kw)


@pytest.mark.parametrize("precision", ["f32", "bf16", "int8"])
@pytest.mark.parametrize("tied", [True, False])
def test_loop_gives_the_per_token_tokens(precision, tied):
    model = _model(precision, tie_embeddings=tied)
    want = _per_token(model, 20)
    with loop_calls() as calls:
        got = model.generate(PROMPT, 20, temperature=0)
    assert torch.equal(got, want) and len(set(got[0, 5:].tolist())) > 5
    # token 1 from the prompt, token 2 through the plan, 18 from one native call
    assert [len(c) for c in calls] == [18]


def test_long_runs_go_in_chunks_ctrl_c_can_stop():
    model = _model(context_length=256)
    want = _per_token(model, 150)
    with loop_calls() as calls:
        got = model.generate(PROMPT, 150, temperature=0)
    assert torch.equal(got, want) and [len(c) for c in calls] == [64, 64, 20]


def test_an_embed_of_the_users_is_run_for_every_token(monkeypatch):
    model = _model()
    model.embed = lambda ids, **kw: GPT.embed(model, ids, **kw) * 0.25
    want = _per_token(model, 12)
    with loop_calls() as calls:
        assert torch.equal(model.generate(PROMPT, 12, temperature=0), want)
    assert calls == []
    del model.embed
    original = GPT.embed
    monkeypatch.setattr(GPT, "embed", lambda self, ids, **kw: original(self, ids, **kw) * 0.25)
    want = _per_token(model, 12)
    with loop_calls() as calls:
        assert torch.equal(model.generate(PROMPT, 12, temperature=0), want)
    assert calls == []


def test_nan_and_tied_logits_pick_as_sample_next():
    """A NaN logit counts as -inf and the first of equal logits wins (NumPy's argmax,
    then torch's after nan_to_num): rows of the output layer made NaN and equal."""
    model = _model(tie_embeddings=False)
    with torch.no_grad():
        head = model.lm_head.weight
        head[7] = float("nan")
        head[40] *= 3  # likely to win now and then
        head[41:44] = head[40]  # equal logits: 40 wins
    want = _per_token(model, 24)
    with loop_calls() as calls:
        got = model.generate(PROMPT, 24, temperature=0)
    assert torch.equal(got, want) and calls and calls[0] is not None
    assert not set(got[0, 5:].tolist()) & {7, 41, 42, 43}
    # every logit NaN: token 0, as sample_next falls back to
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    assert model.generate(PROMPT, 6, temperature=0)[0, 5:].tolist() == [0] * 6


@pytest.mark.parametrize("logits, token", [
    ({0: "nan"}, 1),  # NaN and -inf only: nan_to_num ranks NaN below -inf
    ({0: "nan", 3: torch.finfo(torch.float32).max, 5: "inf"}, 3),  # +inf ties the largest
    ({3: torch.finfo(torch.float32).max, 5: "inf"}, 5),  # no NaN: the raw values
])
def test_infinities_beside_nan_pick_as_sample_next(logits, token):
    """The logits are the output layer's bias (its weight zero), -inf but where given."""
    model = _model(tie_embeddings=False)
    bias = torch.full((64,), float("-inf"))
    for i, v in logits.items():
        bias[i] = float(v)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    model.lm_head.bias = torch.nn.Parameter(bias)
    with loop_calls() as calls:
        got = model.generate(PROMPT, 8, temperature=0)
    assert got[0, 5:].tolist() == [token] * 8 and calls and calls[0] is not None
    assert torch.equal(got, _per_token(model, 8))


@settings(max_examples=25, deadline=None)
@given(new=st.integers(1, 12), eos=st.lists(st.integers(0, 63), max_size=3))
def test_max_new_tokens_and_eos_as_the_per_token_path(new, eos):
    model = _int8_model()
    kw = {"eos_id": eos} if eos else {}
    assert torch.equal(model.generate(PROMPT, new, temperature=0, **kw),
                       _per_token(model, new, **kw))


@cache
def _int8_model() -> GPT:
    return _model("int8")


def test_a_bf16_cache_through_the_loop():
    model = _int8_model()
    want = _per_token(model, 16, cache_dtype=torch.bfloat16)
    with loop_calls() as calls:
        got = model.generate(PROMPT, 16, temperature=0, cache_dtype=torch.bfloat16)
    assert torch.equal(got, want) and [len(c) for c in calls] == [14]


@pytest.mark.parametrize("kw", [{"positions": "learned"}, {"logit_softcap": 5.0},
                                {"scale_embeddings": True}, {"embed_norm": True}])
def test_models_the_loop_does_not_know_decode_per_token(kw):
    model = _model(**kw)
    want = _per_token(model, 10)
    with loop_calls() as calls:
        got = model.generate(PROMPT, 10, temperature=0)
    assert torch.equal(got, want) and calls == []


def test_caches_keep_the_fed_positions_and_decline_without_room():
    model = _model()
    decoder = model.decoder()
    caches = model.new_cache(1, 12)
    with torch.inference_mode():
        model(torch.tensor(PROMPT), caches=caches)
        model(torch.tensor([[2]]), caches=caches, decoder=decoder)  # makes the plan
        assert caches[0].seq_len == 6
        before = [c.k.clone() for c in caches]
        assert decoder.greedy(2, 7, caches) is None  # 6 free positions
        assert all(c.seq_len == 6 and torch.equal(c.k, k) for c, k in zip(caches, before))
        tokens = decoder.greedy(2, 4, caches, stops=())
    assert len(tokens) == 4 and all(c.seq_len == 10 for c in caches)
    # an end-of-text id ends the loop after it: the caches hold what was fed
    stop = tokens[1]
    caches = model.new_cache(1, 12)
    with torch.inference_mode():
        model(torch.tensor(PROMPT), caches=caches)
        model(torch.tensor([[2]]), caches=caches, decoder=decoder)
        got = decoder.greedy(2, 4, caches, stops=[stop])
    assert got == tokens[:tokens.index(stop) + 1]
    assert all(c.seq_len == 6 + len(got) for c in caches)
    assert isinstance(caches[0], KVCache)
