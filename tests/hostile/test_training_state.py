"""Training on hostile settings and damaged training states: a run never saves
non-finite weights, and a resume refuses a damaged state before training on it."""

from __future__ import annotations

import json

import pytest
import torch

from attnlab.checkpoint import load_checkpoint
from attnlab.io import load_tensors, save_tensors
from attnlab.models import ToyAttnLM, ToyConfig
from attnlab.text import CharTokenizer
from attnlab.text.corpus import pattern_corpus
from attnlab.training import TrainConfig, TrainingDiverged, train


def _setup():
    text = pattern_corpus(n_runs=200, seed=1)
    tok = CharTokenizer.from_text(text)
    torch.manual_seed(0)
    model = ToyAttnLM(ToyConfig(vocab_size=tok.vocab_size, context_length=16, d_model=16))
    return model, torch.tensor(tok.encode(text)), tok


def _cfg(**kw):
    return TrainConfig(**{"steps": 3, "batch_size": 4, "context": 16, "checkpoint_every": 1,
                          "eval_every": 1, "eval_batches": 1, **kw})


@pytest.fixture
def run(tmp_path):
    """A finished 2-step run to resume (and damage)."""
    model, tokens, tok = _setup()
    out = tmp_path / "run"
    train(model, tokens, _cfg(steps=2), out=out, tokenizer=tok, progress=False, log=None)
    return out


def _resume(out, steps=3):
    model, tokens, tok = _setup()
    return train(model, tokens, _cfg(steps=steps), out=out, resume=True, tokenizer=tok,
                 progress=False, log=None)


def test_a_diverging_run_stops_and_keeps_the_last_good_checkpoint(run, snap):
    before = snap(run)  # weight decay 1e36 passes every check, then blows the weights up
    with pytest.raises(TrainingDiverged, match=r"training stopped at step 3: .*not finite.*"
                                               r"last good checkpoint .*step 2.* is kept"):
        _diverge(run)
    del before["training_state.json"]  # the test itself changed it
    after = snap(run)
    del after["training_state.json"]
    assert after == before  # nothing non-finite was ever written over it
    assert all(torch.isfinite(p).all() for p in load_checkpoint(run).parameters())


def _diverge(out):
    """Resume the good run with weight decay made absurd in its saved state."""
    state = json.loads((out / "training_state.json").read_text())
    for g in state["param_groups"]:
        g["weight_decay"] = 1e36
    (out / "training_state.json").write_text(json.dumps(state))
    _resume(out, steps=5)


def test_lr_overflow_in_a_fresh_run_saves_nothing_non_finite(tmp_path):
    model, tokens, tok = _setup()
    out = tmp_path / "fresh"
    with pytest.raises(TrainingDiverged, match="not finite"):
        train(model, tokens, _cfg(steps=5, lr=1e30), out=out, tokenizer=tok, progress=False,
              log=None)
    if out.exists():
        assert all(torch.isfinite(p).all() for p in load_checkpoint(out).parameters())


def _damage_tensors(out, change):
    tensors = load_tensors(out / "training_state.safetensors")
    change(tensors)
    save_tensors(out / "training_state.safetensors", tensors)


DAMAGE = {
    "moment of the wrong shape": lambda t: t.__setitem__("optim.0.exp_avg", torch.zeros(3)),
    "a deleted moment": lambda t: t.pop("optim.1.exp_avg_sq"),
    "NaN moments": lambda t: t.__setitem__("optim.0.exp_avg",
                                           torch.full_like(t["optim.0.exp_avg"], float("nan"))),
    "negative second moment": lambda t: t.__setitem__(
        "optim.0.exp_avg_sq", -torch.ones_like(t["optim.0.exp_avg_sq"])),
    "a stray moment": lambda t: t.__setitem__("optim.99.exp_avg", torch.zeros(1)),
}


@pytest.mark.parametrize("what", DAMAGE)
def test_a_damaged_optimizer_state_is_refused(run, what, snap):
    _damage_tensors(run, DAMAGE[what])
    before = snap(run)
    with pytest.raises(ValueError, match="--resume: the training state .* is damaged"):
        _resume(run)
    assert snap(run) == before


STATE_DAMAGE = {
    "betas out of range": ("betas", [1.5, 0.9]),
    "betas not a pair": ("betas", 0.9),
    "lr nan": ("lr", float("nan")),
    "eps zero": ("eps", 0.0),
    "weight decay negative": ("weight_decay", -1.0),
}


@pytest.mark.parametrize("what", STATE_DAMAGE)
def test_damaged_optimizer_settings_are_refused(run, what):
    key, value = STATE_DAMAGE[what]
    state = json.loads((run / "training_state.json").read_text())
    state["param_groups"][0][key] = value
    (run / "training_state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match=f"--resume: .*damaged.*{key}"):
        _resume(run)


def test_a_step_beyond_steps_is_refused(run):
    with pytest.raises(ValueError, match=r"at step 2, beyond --steps 1"):
        _resume(run, steps=1)


def test_a_good_state_still_resumes(run):
    assert _resume(run)["resumed_from"] == 2


@pytest.mark.slow
def test_cli_lr_overflow_is_one_line_and_exit_2(tmp_path, cli, one_line_error):
    proc = cli(["train", "--model", "toy", "--lr", "1e30", "--steps", "6", "--context", "16",
                "--batch-size", "4", "--checkpoint-every", "1", "--out", "o"], cwd=tmp_path,
               timeout=300)
    one_line_error(proc, "training stopped at step", "not finite")
