"""Generated hostile files: hypothesis mutates config.json, tokenizer.json and the
training state. Every mutation either loads correctly or is refused with one
ValueError/TypeError (never a KeyError, IndexError, RuntimeError or a hang)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab.checkpoint import load_checkpoint, load_checkpoint_tokenizer, save_checkpoint
from attnlab.models import GPT, GPTConfig, ToyAttnLM, ToyConfig
from attnlab.text import CharTokenizer
from attnlab.text.corpus import pattern_corpus
from attnlab.training import TrainConfig, train

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6)
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tok = CharTokenizer.from_text("abcdefgh ")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=16, d_model=16,
                          num_layers=1, num_heads=2))
    out = tmp_path_factory.mktemp("mut") / "ckpt"
    save_checkpoint(model, out, tokenizer=tok)
    return out


def _mutate(obj: dict, path: list[str], value, delete: bool) -> dict:
    obj = json.loads(json.dumps(obj))
    target = obj
    for key in path[:-1]:
        target = target[key]
    if delete:
        target.pop(path[-1], None)
    else:
        target[path[-1]] = value
    return obj


def _paths(obj: dict, prefix=()) -> list[list[str]]:
    found = []
    for key, value in obj.items():
        found.append([*prefix, key])
        if isinstance(value, dict):
            found.extend(_paths(value, (*prefix, key)))
    return found


def _refused_or_loaded(call):
    try:
        return call()
    except (ValueError, TypeError) as exc:
        assert str(exc) and "\n" not in str(exc).strip(), str(exc)
        return None


def _check(ckpt: Path, name: str, data, call) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "ckpt"
        shutil.copytree(ckpt, copy)
        (copy / name).write_text(json.dumps(data) if not isinstance(data, str) else data)
        _refused_or_loaded(lambda: call(copy))


@SETTINGS
@given(data=st.data(), value=JSON, delete=st.booleans())
def test_config_json_mutations(ckpt, data, value, delete):
    meta = json.loads((ckpt / "config.json").read_text())
    path = data.draw(st.sampled_from(_paths(meta)))
    _check(ckpt, "config.json", _mutate(meta, path, value, delete), load_checkpoint)


@SETTINGS
@given(data=st.data(), value=JSON, delete=st.booleans())
def test_tokenizer_json_mutations(ckpt, data, value, delete):
    meta = json.loads((ckpt / "tokenizer.json").read_text())
    path = data.draw(st.sampled_from(_paths(meta)))
    _check(ckpt, "tokenizer.json", _mutate(meta, path, value, delete),
           load_checkpoint_tokenizer)


@SETTINGS
@given(text=st.text(max_size=40) | st.binary(max_size=40).map(lambda b: b.decode("latin-1")))
def test_garbage_json_files(ckpt, text):
    for name, call in (("config.json", load_checkpoint),
                       ("tokenizer.json", load_checkpoint_tokenizer)):
        _check(ckpt, name, text, call)


def _setup():
    text = pattern_corpus(n_runs=200, seed=1)
    tok = CharTokenizer.from_text(text)
    torch.manual_seed(0)
    return (ToyAttnLM(ToyConfig(vocab_size=tok.vocab_size, context_length=16, d_model=8)),
            torch.tensor(tok.encode(text)), tok)


CFG = dict(batch_size=2, context=16, checkpoint_every=1, eval_every=1, eval_batches=1)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model, tokens, tok = _setup()
    out = tmp_path_factory.mktemp("state") / "run"
    train(model, tokens, TrainConfig(steps=1, **CFG), out=out, tokenizer=tok, progress=False,
          log=None)
    return out


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), value=JSON, delete=st.booleans())
def test_training_state_mutations(run, data, value, delete):
    state = json.loads((run / "training_state.json").read_text())
    paths = _paths(state) + [["param_groups", "0", k] for k in state["param_groups"][0]]
    path = data.draw(st.sampled_from(paths))
    if path[:2] == ["param_groups", "0"]:
        state["param_groups"][0] = _mutate(state["param_groups"][0], path[2:], value, delete)
        mutated = state
    else:
        mutated = _mutate(state, path, value, delete)

    def resume(copy):
        model, tokens, tok = _setup()
        return train(model, tokens, TrainConfig(steps=2, **CFG), out=copy, resume=True,
                     tokenizer=tok, progress=False, log=None)

    _check(run, "training_state.json", mutated, resume)
