"""``generate``/``stream`` and the run sizes at their edges: an empty prompt, a stop token
the model cannot produce, a size that is a typo. Each is one ValueError or TypeError
naming the argument, what came and what was expected, before any token is made."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.models import GPT, GPTConfig, ToyAttnLM, ToyConfig
from attnlab.models.generation import MAX_NEW_TOKENS
from attnlab.training import MAX_STEPS, TrainConfig

VOCAB = 10


def _models():
    torch.manual_seed(0)
    return [GPT(GPTConfig(vocab_size=VOCAB, d_model=8, num_heads=2, num_layers=1,
                          context_length=16)),
            ToyAttnLM(ToyConfig(vocab_size=VOCAB, context_length=16, d_model=8))]


MODELS = _models()


def _calls(model, ids, **kw):
    """generate, and stream consumed (its checks run on the first step)."""
    return [lambda: model.generate(ids, 3, **kw), lambda: list(model.stream(ids, 3, **kw))]


@pytest.mark.parametrize("shape", [(1, 0), (0,), (0, 3), (2, 0), (0, 0)])
@pytest.mark.parametrize("model", MODELS, ids=lambda m: type(m).__name__)
def test_an_empty_prompt_tensor_is_one_value_error_naming_ids(model, shape):
    for call in _calls(model, torch.zeros(shape, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"ids must hold at least one prompt") as info:
            call()
        assert str(tuple(shape if len(shape) == 2 else (1, 0))) in str(info.value)
        assert "seq >= 1" in str(info.value)


BAD_EOS = st.one_of(
    st.integers(max_value=-1), st.integers(min_value=VOCAB),
    st.floats(allow_nan=True), st.booleans(), st.text(max_size=3),
    st.sampled_from([np.int64(-1), np.int64(VOCAB), np.float32(2.0), 2.0, 2.5]))


@settings(max_examples=60, deadline=None)
@given(eos=BAD_EOS, which=st.sampled_from([0, 1]), call=st.sampled_from([0, 1]))
def test_an_eos_id_outside_the_vocabulary_or_not_an_int_is_refused(eos, which, call):
    model = MODELS[which]
    with pytest.raises((TypeError, ValueError), match="eos_id") as info:
        _calls(model, torch.tensor([[1, 2]]), eos_id=eos, temperature=0)[call]()
    if isinstance(eos, bool) or not isinstance(eos, int | np.integer):
        assert info.type is TypeError
    else:
        assert info.type is ValueError and f"[0, {VOCAB})" in str(info.value)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: type(m).__name__)
def test_an_eos_id_in_the_vocabulary_still_stops(model):
    ids = torch.tensor([[1, 2, 3]])
    greedy = model.generate(ids, 8, temperature=0)
    eos = int(greedy[0, 3])  # the first new token: a stop after one step
    for given_eos in (eos, np.int64(eos)):
        stopped = model.generate(ids, 8, temperature=0, eos_id=given_eos)
        assert stopped.tolist() == greedy[:, :4].tolist()


@pytest.mark.parametrize("model", MODELS, ids=lambda m: type(m).__name__)
def test_max_new_tokens_over_the_bound_is_refused_before_any_step(model):
    for call in (lambda: model.generate(torch.tensor([[1]]), MAX_NEW_TOKENS + 1,
                                        use_cache=False),
                 lambda: next(iter(model.stream(torch.tensor([[1]]), 10**20,
                                                use_cache=False)))):
        with pytest.raises(ValueError, match=r"max_new_tokens must be an int in "
                                             r"\[0, 1,000,000\], got"):
            call()


@pytest.mark.parametrize("field, value", [("steps", MAX_STEPS + 1), ("steps", 10**23),
                                          ("checkpoint_every", 10**23)])
def test_a_run_longer_than_max_steps_is_refused(field, value):
    with pytest.raises(ValueError, match=f"{field.replace('_', '-')} must be a positive int "
                                         f"<= 1,000,000, got {value}"):
        TrainConfig(**{field: value})
    assert TrainConfig(steps=MAX_STEPS, checkpoint_every=MAX_STEPS).steps == MAX_STEPS


@pytest.mark.parametrize("model", MODELS, ids=lambda m: type(m).__name__)
def test_a_list_of_prompt_tensors_is_the_list_of_their_ids(model):
    """What a tokenizer's loop gives, prompts as 1-D tensors of their own lengths: the same
    tokens as the lists of ints; a float or 2-D tensor among them is named."""
    prompts = [[1, 2, 3], [4, 5]]
    want = model.generate(prompts, 3, temperature=0)
    got = model.generate([torch.tensor(p) for p in prompts], 3, temperature=0)
    assert torch.equal(got, want)
    assert torch.equal(model.generate([torch.tensor(p, dtype=torch.int32) for p in prompts], 3,
                                      temperature=0), want)
    for bad, shape, dtype in ((torch.tensor([1.0, 2.0]), (2,), torch.float32),
                              (torch.tensor([[1, 2]]), (1, 2), torch.int64)):
        with pytest.raises(TypeError, match=rf"ids must hold prompts as lists of ints or 1-D "
                                            rf"integer tensors, got a tensor of shape "
                                            rf"{re.escape(str(shape))} dtype {dtype}"):
            model.generate([torch.tensor([1, 2]), bad], 3, temperature=0)
    with pytest.raises(TypeError, match="1-D integer tensors, got 5 among them"):
        model.generate([torch.tensor([1, 2]), 5], 3, temperature=0)
