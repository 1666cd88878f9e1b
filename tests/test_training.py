"""Training: it learns, it is deterministic, and a killed run resumes bit-exactly."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from attnlab.checkpoint import load_checkpoint, same_weights
from attnlab.demo import run_demo
from attnlab.io import load_tensors
from attnlab.models import GPT, GPTConfig, ToyAttnLM, ToyConfig
from attnlab.text import CharTokenizer
from attnlab.text.corpus import pattern_corpus
from attnlab.training import TrainConfig, lr_at, train


def bigram_entropy(text: str) -> float:
    """H(next char | current char) in nats: the best loss without looking back."""
    pairs = Counter(zip(text, text[1:]))
    firsts = Counter(text[:-1])
    n = len(text) - 1
    return -sum(c / n * math.log(c / firsts[a]) for (a, _), c in pairs.items())


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    return out, run_demo(str(out), steps=400, seed=0, log=lambda _m: None)


def test_toy_model_learns_to_look_back(demo):
    _, summary = demo
    text = pattern_corpus(seed=0)
    # A model that only sees the current character cannot beat the bigram entropy
    # (~0.57 nats here: after an "a" it cannot tell b, c or d). Getting well below
    # it proves the head uses the previous token; unigram entropy is ~1.9 nats.
    h2 = bigram_entropy(text)
    assert h2 > 0.5
    assert summary["eval_loss"] < h2 - 0.15, (summary["eval_loss"], h2)
    assert summary["attention_shares_at_a"]["previous"] > 0.6


def test_lr_schedule_warms_up_then_decays():
    cfg = TrainConfig(steps=100, lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(0.1, abs=1e-3)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 99))


def test_every_window_of_the_stream_is_drawn_the_last_one_too():
    # Helper-found: randint's exclusive end left the last window (and the last token of
    # the text) out of every batch.
    from attnlab.training.data import sample

    rows = sample(torch.arange(12), 2000, 8, torch.Generator().manual_seed(0))
    assert torch.unique(rows[:, 0]).tolist() == [0, 1, 2, 3]
    assert torch.equal(rows[:, 1:], rows[:, :-1] + 1) and int(rows.max()) == 11


def test_a_learning_rate_past_float32_is_refused_up_front():
    # Helper-found: --lr 1e39 (finite in float64) failed inside Adam's step, a traceback.
    with pytest.raises(ValueError, match=r"lr must be a positive finite float32 number"):
        TrainConfig(lr=1e39)
    assert TrainConfig(lr=1e38).lr == 1e38


def test_resuming_for_more_steps_says_the_schedule_changes(tmp_path):
    # Helper-found: --resume --steps 200 after a 100-step run moved the learning rate
    # from the old schedule's end to the new one's middle (6x) without a word.
    text = pattern_corpus(n_runs=300, seed=1)
    tok = CharTokenizer.from_text(text)
    tokens = torch.tensor(tok.encode(text))

    def run(steps, resume, lines):
        torch.manual_seed(0)
        model = ToyAttnLM(ToyConfig(vocab_size=tok.vocab_size, context_length=16, d_model=16))
        cfg = TrainConfig(steps=steps, batch_size=4, context=16, eval_every=steps)
        train(model, tokens, cfg, progress=False, log=lines.append, out=tmp_path / "run",
              resume=resume, tokenizer=tok)
        return cfg

    run(6, False, [])
    lines: list[str] = []
    cfg = run(12, True, lines)
    note = next(line for line in lines if line.startswith("note:"))
    assert "planned for 6 steps" in note and "schedule of 12" in note
    assert f"{lr_at(6, cfg):.3g} at step 6" in note
    again: list[str] = []
    run(12, True, again)  # a finished run of the same total: nothing to say
    assert not any(line.startswith("note:") for line in again)


def test_a_full_disk_says_which_checkpoint_failed_and_which_is_kept(tmp_path, monkeypatch):
    # Helper-found: a full disk ended with "[Errno 28] No space left on device" alone.
    from attnlab import checkpoint

    text = pattern_corpus(n_runs=300, seed=1)
    tok = CharTokenizer.from_text(text)
    original, calls = checkpoint.save_training_state, []

    def fills_up(out, model, optimizer, gen, step, *rest):
        calls.append(step)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return original(out, model, optimizer, gen, step, *rest)

    monkeypatch.setattr(checkpoint, "save_training_state", fills_up)
    model = ToyAttnLM(ToyConfig(vocab_size=tok.vocab_size, context_length=16, d_model=16))
    cfg = TrainConfig(steps=6, batch_size=4, context=16, checkpoint_every=3)
    with pytest.raises(OSError, match=r"writing the checkpoint of step 6 in '.*run': No space "
                                      r"left on device; the checkpoint of step 3 is kept"):
        train(model, torch.tensor(tok.encode(text)), cfg, progress=False, log=None,
              out=tmp_path / "run", tokenizer=tok)
    assert load_checkpoint(tmp_path / "run") is not None


def _tiny_run(seed: int):
    text = pattern_corpus(n_runs=300, seed=1)
    tok = CharTokenizer.from_text(text)
    torch.manual_seed(seed)
    model = ToyAttnLM(ToyConfig(vocab_size=tok.vocab_size, context_length=16, d_model=16,
                                dropout=0.1))
    cfg = TrainConfig(steps=30, batch_size=8, context=16, seed=seed, eval_every=10)
    return model, train(model, torch.tensor(tok.encode(text)), cfg, progress=False, log=None)


def test_deterministic_given_seed():
    a, sa = _tiny_run(3)
    b, sb = _tiny_run(3)
    c, _ = _tiny_run(4)
    assert same_weights(a, b) and sa["history"] == sb["history"]
    assert not same_weights(a, c)


def _train_cmd(out: Path, steps: int, *extra: str) -> list[str]:
    # No --checkpoint-every: the default (a tenth of --steps) is what a killed run
    # must be able to resume from.
    return [sys.executable, "-m", "attnlab", "train", "--model", "gpt", "--steps", str(steps),
            "--context", "32", "--batch-size", "16", "--out", str(out), "--seed", "7", *extra]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _checkpointed_step(out: Path) -> int | None:
    import json

    try:
        return json.loads((out / "training_state.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return None  # not written yet, or being swapped in right now


def _resume_and_compare(out: Path, ref: Path, steps: int, *extra: str) -> str:
    resumed = subprocess.run(_train_cmd(out, steps, "--resume", *extra), capture_output=True,
                             text=True, env=_env(), timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    got, want = load_tensors(out / "model.safetensors"), load_tensors(ref / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert sorted(p.suffix for p in out.iterdir() if p.is_file()) == sorted(
        p.suffix for p in ref.iterdir() if p.is_file())
    return resumed.stderr


@pytest.fixture(scope="module")
def gpt_ref(tmp_path_factory):
    """An uninterrupted 60-step run (default checkpoints: every 6 steps)."""
    ref = tmp_path_factory.mktemp("ref") / "ref"
    subprocess.run(_train_cmd(ref, 60), check=True, capture_output=True, env=_env(),
                   timeout=300)
    return ref


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(tmp_path, gpt_ref):
    steps, ref = 60, gpt_ref
    import json

    ref_seconds = json.loads((ref / "summary.json").read_text())["seconds"]
    # Kill 1: the moment the first checkpoint (step 6 of 60) appears, so 54 steps
    # remain: certainly before the end, on any machine. Kill 2: a random moment up
    # to 30% of the run later; if a very fast machine finished by then, the
    # resume of a finished run must still match.
    rng = random.Random(0)
    for attempt, delay in enumerate([0.0, rng.uniform(0.0, 0.3 * ref_seconds)]):
        out = tmp_path / f"killed{attempt}"
        proc = subprocess.Popen(_train_cmd(out, steps), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=_env())
        deadline = time.time() + 120
        while _checkpointed_step(out) is None and time.time() < deadline:
            time.sleep(0.005)
        time.sleep(delay)
        if attempt == 0:
            assert proc.poll() is None, "the run finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if attempt == 0:
            assert _checkpointed_step(out) < steps
        _resume_and_compare(out, ref, steps)


@pytest.mark.slow
def test_sigkill_before_the_first_checkpoint_then_resume_starts_over(tmp_path, gpt_ref):
    """Killed mid-training with no checkpoint on disk yet: --resume notes it and
    trains from step 0, which (training being deterministic) is the same run."""
    steps, ref = 60, gpt_ref
    out = tmp_path / "killed"
    late = ("--checkpoint-every", "40")  # first checkpoint at step 40
    proc = subprocess.Popen(_train_cmd(out, steps, *late), stdout=subprocess.PIPE, text=True,
                            stderr=subprocess.DEVNULL, env=_env())
    first = proc.stdout.readline()  # the eval line of step 12: training is under way
    assert first.startswith("step    12"), first
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    assert not (out / "training_state.json").exists()
    stderr = _resume_and_compare(out, ref, steps, *late)
    assert "no checkpoint" in stderr and "starting from step 0" in stderr, stderr


def test_resuming_a_finished_run_changes_nothing(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "attnlab", "train", "--model", "toy", "--steps", "10",
           "--context", "16", "--batch-size", "8", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    weights = out / "model.safetensors"
    before = (weights.read_bytes(), weights.stat().st_mtime_ns)
    again = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert (weights.read_bytes(), weights.stat().st_mtime_ns) == before
    # Only safetensors and JSON: nothing that would need pickle to read.
    assert {p.suffix for p in out.rglob("*") if p.is_file()} == {".json", ".safetensors"}
    assert load_checkpoint(out).config.context_length == 16


def _one_and_two_processes(tmp_path, common, *split):
    """Train ``common`` in one process and under torchrun in two (with ``split``'s extra
    arguments); both must succeed and end with the same weights. Returns their
    summaries."""
    import json

    single = subprocess.run([sys.executable, "-m", "attnlab", *common, "--out",
                             str(tmp_path / "one")], capture_output=True, text=True,
                            env=_env(), timeout=300)
    assert single.returncode == 0, single.stderr
    # Each rank records, at the interpreter's exit, that it finalised: a rank that did
    # could abort there while gloo's threads free their last work (attnlab.cli.run).
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import atexit, os\n"
        "if 'RANK' in os.environ:\n"
        f"    atexit.register(lambda: open(os.path.join({str(site)!r}, 'finalised-' + "
        "os.environ['RANK']), 'w').close())\n")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    dual = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", "-m", "attnlab", *common, *split, "--out",
                           str(tmp_path / "two")], capture_output=True, text=True, env=env,
                          timeout=300)
    # The ranks' own lines first (an abort's reason), then the launcher's ending.
    told = [line for line in dual.stderr.splitlines()
            if any(w in line for w in ("terminate", "Error", "error:", "Abort"))]
    assert dual.returncode == 0, "\n".join(told[:20]) + "\n" + dual.stderr[-1500:]
    assert not sorted(p.name for p in site.glob("finalised-*"))
    a, b = load_checkpoint(tmp_path / "one"), load_checkpoint(tmp_path / "two")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4, msg=name)
    return [json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two")]


@pytest.mark.slow
def test_two_process_torchrun_matches_single_process(tmp_path):
    one, two = _one_and_two_processes(tmp_path, ["train", "--model", "toy", "--steps", "12",
                                                 "--context", "16", "--batch-size", "8",
                                                 "--seed", "1"])
    assert two["world_size"] == 2 and one["world_size"] == 1
    losses1 = [h[1] for h in one["history"]]
    losses2 = [h[1] for h in two["history"]]
    assert len(losses1) == len(losses2) == 12
    assert losses1 == pytest.approx(losses2, abs=1e-5)


def test_resume_finds_a_checkpoint_left_beside_its_directory(tmp_path):
    """A writer killed between its two renames leaves the complete new copy as
    ``.<name>.ready-*`` and no ``<name>``: resuming must find it, not say there is none."""
    from attnlab.training import has_checkpoint

    model, _ = _tiny_run(0)
    out = tmp_path / "run"
    text = pattern_corpus(n_runs=300, seed=1)
    cfg = TrainConfig(steps=2, batch_size=4, context=16, seed=0)
    train(model, torch.tensor(CharTokenizer.from_text(text).encode(text)), cfg, out=out,
          progress=False, log=None)
    (out / ".attnlab-atomic").write_text("run\n999-0123abcd\n")  # as the writer marks it
    out.rename(tmp_path / ".run.ready-999-0123abcd")
    assert has_checkpoint(out)
    assert (out / "model.safetensors").exists()


def test_out_dir_with_other_files_is_refused_and_kept(tmp_path):
    model, _ = _tiny_run(0)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    text = pattern_corpus(n_runs=300, seed=1)
    cfg = TrainConfig(steps=2, batch_size=4, context=16, seed=0)
    with pytest.raises(ValueError, match="not an attnlab checkpoint"):
        train(model, torch.tensor(CharTokenizer.from_text(text).encode(text)), cfg, out=out,
              progress=False, log=None)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


# ------------------------------------------------------------------ --out and --resume checks


def _toy_setup(dropout: float = 0.0, seed: int = 0):
    text = pattern_corpus(n_runs=300, seed=1)
    tok = CharTokenizer.from_text(text)
    torch.manual_seed(seed)
    model = ToyAttnLM(ToyConfig(vocab_size=tok.vocab_size, context_length=16, d_model=16,
                                dropout=dropout))
    return model, torch.tensor(tok.encode(text)), tok


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("entries", [
    # A Hugging Face model folder: its config.json is not attnlab's.
    {"config.json": '{"architectures": ["GPT2LMHeadModel"]}', "pytorch_model.bin": "weights"},
    {"config.json": "{not json", "model.safetensors": "x"},
    {"config.json": '{"format": 1, "model_type": "toy", "config": {}}', "notes.txt": "mine"},
    {"attention.png": "x"},  # attnlab's name, but no attnlab config: not provably ours
])
def test_out_dir_that_is_not_an_attnlab_checkpoint_is_refused_and_kept(tmp_path, entries):
    out = tmp_path / "model"
    out.mkdir()
    for name, text in entries.items():
        (out / name).write_text(text)
    before = _files(out)
    model, tokens, _ = _toy_setup()
    with pytest.raises(ValueError, match="not an attnlab checkpoint"):
        train(model, tokens, TrainConfig(steps=2, batch_size=4, context=16), out=out,
              progress=False, log=None)
    assert _files(out) == before


def test_out_dir_attnlab_wrote_is_accepted(tmp_path):
    """A checkpoint plus the demo's files and a temp file left by a killed atomic write."""
    out = tmp_path / "run"
    model, tokens, tok = _toy_setup()
    cfg = TrainConfig(steps=2, batch_size=4, context=16)
    train(model, tokens, cfg, out=out, tokenizer=tok, progress=False, log=None)
    from attnlab.io.outdir import signed

    (out / "summary.json").write_text(json.dumps(signed({"steps": 2})))
    (out / "attention.html").write_text('<!DOCTYPE html><html><head>'
                                        '<meta name="generator" content="attnlab">')
    for name in (".summary.json.abc123.tmp", ".attention.png.77.0a1b2c3d.tmp"):
        (out / name).write_text("x")
    train(model, tokens, TrainConfig(steps=3, batch_size=4, context=16), out=out,
          progress=False, log=None)
    assert load_checkpoint(out) is not None


def test_unwritable_out_is_refused_before_training(tmp_path):
    (tmp_path / "afile").write_text("x")
    model, tokens, _ = _toy_setup()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="--out .* cannot be written"):
        train(model, tokens, TrainConfig(steps=2, batch_size=4, context=16),
              out=tmp_path / "afile" / "run", progress=False, log=None)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_resume_with_no_checkpoint_yet_starts_from_step_0(tmp_path, capsys):
    model, tokens, _ = _toy_setup()
    cfg = TrainConfig(steps=4, batch_size=4, context=16)
    summary = train(model, tokens, cfg, out=tmp_path / "new", resume=True, progress=False,
                    log=lambda _m: None)
    assert summary["steps"] == 4 and summary["resumed_from"] is None
    assert "starting from step 0" in capsys.readouterr().err
    fresh, _, _ = _toy_setup()
    train(fresh, tokens, cfg, progress=False, log=None)
    assert same_weights(model, fresh)


def test_resume_of_a_model_without_training_state_is_refused(tmp_path):
    from attnlab.checkpoint import save_checkpoint

    model, tokens, _ = _toy_setup()
    save_checkpoint(model, tmp_path / "saved")
    before = _files(tmp_path / "saved")
    with pytest.raises(ValueError, match="no training state"):
        train(model, tokens, TrainConfig(steps=2, batch_size=4, context=16),
              out=tmp_path / "saved", resume=True, progress=False, log=None)
    assert _files(tmp_path / "saved") == before


def test_default_checkpoint_interval_is_a_tenth_of_the_run(tmp_path, monkeypatch):
    """Without --checkpoint-every a killed run must still have something to resume."""
    import attnlab.checkpoint as checkpoint
    import attnlab.training as training
    from attnlab.cli import main

    saved_at = []
    real_save = checkpoint.save_training_state

    def spy(out, model, optimizer, gen, step, *rest):
        saved_at.append(step)
        real_save(out, model, optimizer, gen, step, *rest)

    monkeypatch.setattr(checkpoint, "save_training_state", spy)
    assert main(["train", "--model", "toy", "--steps", "20", "--context", "16",
                 "--batch-size", "4", "--out", str(tmp_path / "run")]) == 0
    assert saved_at == list(range(2, 21, 2))
    assert training.default_checkpoint_every(5) == 1
    assert training.default_checkpoint_every(500) == 50


def _interrupted_run(out: Path, cfg: TrainConfig, stop_after: int, dropout: float):
    """Train into ``out`` and die right after the checkpoint of ``stop_after``."""
    _interrupted_run_of(lambda: (*_toy_setup(dropout), None), out, cfg, stop_after)


def test_resume_with_dropout_is_bit_identical(tmp_path):
    """Dropout draws from torch's RNG: the checkpoint must carry its state."""
    cfg = TrainConfig(steps=12, batch_size=4, context=16, checkpoint_every=4, eval_every=5)
    ref, tokens, tok = _toy_setup(dropout=0.2)
    want = train(ref, tokens, cfg, progress=False, log=None)
    _interrupted_run(tmp_path / "run", cfg, stop_after=8, dropout=0.2)
    model, _, _ = _toy_setup(dropout=0.2, seed=123)  # its weights come from the checkpoint
    got = train(model, tokens, cfg, out=tmp_path / "run", resume=True, tokenizer=tok,
                progress=False, log=None)
    assert got["resumed_from"] == 8
    assert same_weights(model, ref)
    assert got["history"] == want["history"]


@pytest.mark.parametrize("change, words", [
    ({"lr": 0.01}, ["--lr", "0.003", "0.01"]),
    ({"batch_size": 8, "seed": 3}, ["--batch-size 4", "8 now", "--seed 0", "3 now"]),
    ({"warmup": 5}, ["--warmup"]),
])
def test_resume_with_other_settings_is_refused(tmp_path, change, words):
    out = tmp_path / "run"
    model, tokens, tok = _toy_setup()
    base = dict(steps=3, batch_size=4, context=16, lr=3e-3)
    train(model, tokens, TrainConfig(**base), out=out, tokenizer=tok, progress=False, log=None)
    before = _files(out)
    with pytest.raises(ValueError) as info:
        train(model, tokens, TrainConfig(**{**base, "steps": 6, **change}), out=out,
              resume=True, progress=False, log=None)
    assert "other settings" in str(info.value)
    for w in words:
        assert w in str(info.value), str(info.value)
    assert _files(out) == before


@pytest.mark.parametrize("change", [{"attn_softcap": 5.0}, {"window": 4}, {"sinks": True},
                                    {"positions": "alibi"}])
def test_resume_into_a_model_of_other_settings_but_the_same_weights_is_refused(tmp_path,
                                                                              change):
    """A softcap, a window, sinks or ALiBi change no weight's shape (sinks: a new one):
    the checkpoint's weights would load into another model and train it as if resumed."""
    out = tmp_path / "run"
    text = pattern_corpus(n_runs=300, seed=1)
    tok = CharTokenizer.from_text(text)
    tokens = torch.tensor(tok.encode(text))
    sizes = dict(vocab_size=tok.vocab_size, context_length=16, d_model=16, num_layers=1,
                 num_heads=2, positions="rope")
    base = dict(batch_size=4, context=16)
    train(GPT(GPTConfig(**sizes)), tokens, TrainConfig(steps=2, **base), out=out,
          tokenizer=tok, progress=False, log=None)
    before = _files(out)
    field, value = next(iter(change.items()))
    with pytest.raises(ValueError, match=rf"GPT with {field}=.* \(given {value!r}\)"):
        train(GPT(GPTConfig(**{**sizes, **change})), tokens, TrainConfig(steps=4, **base),
              out=out, resume=True, progress=False, log=None)
    assert _files(out) == before
    # another kernel for the same attention resumes
    got = train(GPT(GPTConfig(**sizes, backend="eager")), tokens,
                TrainConfig(steps=3, **base), out=out, resume=True, progress=False, log=None)
    assert got["resumed_from"] == 2


def test_resume_on_another_text_is_refused_and_a_run_saved_before_the_check_resumes(
        tmp_path):
    # Another text of the same characters fits the model and the tokenizer: only the
    # state's record of the tokens tells it from the run's own.
    out = tmp_path / "run"
    model, tokens, tok = _toy_setup()
    base = dict(batch_size=4, context=16)
    train(model, tokens, TrainConfig(steps=3, **base), out=out, tokenizer=tok,
          progress=False, log=None)
    before = _files(out)
    other = tokens.flip(0)
    with pytest.raises(ValueError, match="was trained on another text .* same --text"):
        train(model, other, TrainConfig(steps=6, **base), out=out, resume=True,
              progress=False, log=None)
    assert _files(out) == before
    state = json.loads((out / "training_state.json").read_text())
    assert state["train_config"]["data"]["tokens"] == len(tokens)
    del state["train_config"]["data"]  # as a run saved before the record was kept
    (out / "training_state.json").write_text(json.dumps(state))
    got = train(model, tokens, TrainConfig(steps=4, **base), out=out, resume=True,
                progress=False, log=None)
    assert got["resumed_from"] == 3
    # the same ids as a Python list are the same text
    got = train(model, tokens.tolist(), TrainConfig(steps=5, **base), out=out, resume=True,
                progress=False, log=None)
    assert got["resumed_from"] == 4


def test_resume_may_change_steps_and_checkpoint_interval(tmp_path):
    out = tmp_path / "run"
    model, tokens, tok = _toy_setup()
    train(model, tokens, TrainConfig(steps=3, batch_size=4, context=16, checkpoint_every=1),
          out=out, tokenizer=tok, progress=False, log=None)
    got = train(model, tokens, TrainConfig(steps=5, batch_size=4, context=16,
                                           checkpoint_every=2, eval_every=2),
                out=out, resume=True, progress=False, log=None)
    assert got["resumed_from"] == 3 and got["steps"] == 5


@pytest.mark.parametrize("damage", [
    lambda s: s.pop("history"),
    lambda s: s.update(history=None),
    lambda s: s.update(history=s["history"][:-1]),
    lambda s: s.update(step="3"),
    lambda s: s.pop("train_config"),
    lambda s: s.update(param_groups=[]),
])
def test_damaged_training_state_is_a_checkpoint_error(tmp_path, damage):
    import json

    from attnlab.io import CheckpointError

    out = tmp_path / "run"
    model, tokens, tok = _toy_setup()
    cfg = TrainConfig(steps=3, batch_size=4, context=16)
    train(model, tokens, cfg, out=out, tokenizer=tok, progress=False, log=None)
    state = json.loads((out / "training_state.json").read_text())
    damage(state)
    (out / "training_state.json").write_text(json.dumps(state))
    before = _files(out)
    with pytest.raises(CheckpointError, match="training state .* damaged"):
        train(model, tokens, TrainConfig(steps=6, batch_size=4, context=16), out=out,
              resume=True, progress=False, log=None)
    assert _files(out) == before


def test_negative_or_huge_seed_is_refused():
    for seed in (-1, 2**63):
        with pytest.raises(ValueError, match="seed"):
            TrainConfig(seed=seed)
    TrainConfig(seed=2**63 - 1)


# ------------------------------------------------------------------ overfitting and best/


def _overfit_setup(seed: int = 0):
    """A 400-character random text: nothing to learn that carries over to held-out text,
    so the held-out loss climbs while the training loss falls (the issue's 5 KB case,
    small)."""
    rng = random.Random(0)
    text = "".join(rng.choice("abcdefghijklmnopqrst") for _ in range(400))
    tok = CharTokenizer.from_text(text)
    torch.manual_seed(seed)
    model = ToyAttnLM(ToyConfig(vocab_size=tok.vocab_size, context_length=8, d_model=32))
    cfg = TrainConfig(steps=80, batch_size=16, context=8, lr=3e-2, warmup=0, eval_every=8,
                      checkpoint_every=12)
    return model, torch.tensor(tok.encode(text)), tok, cfg


def test_rising_held_out_loss_warns_and_the_best_checkpoint_is_kept(tmp_path):
    from attnlab.training import evaluate, split

    out = tmp_path / "run"
    model, tokens, tok, cfg = _overfit_setup()
    lines = []
    summary = train(model, tokens, cfg, out=out, tokenizer=tok, progress=False,
                    log=lines.append)
    evals = [(h[0], h[2]) for h in summary["history"] if h[2] is not None]
    best_step, best_loss = min(evals, key=lambda e: e[1])
    assert best_step < cfg.steps and evals[-1][1] > best_loss  # it did overfit
    warnings = [ln for ln in lines if ln.startswith("warning:")]
    assert len(warnings) == 1 and summary["overfitting"]
    for words in ("overfitting", "held-out loss rose from", f"(step {best_step})",
                  "400-token text", "more text", "--steps", f"{out}/best/",
                  "uniform guess over its 20 tokens"):
        assert words in warnings[0], (words, warnings[0])
    assert (summary["best_step"], summary["best_eval_loss"]) == (best_step, best_loss)
    # out/ is the last step, as before; out/best/ the step of the lowest held-out loss,
    # a checkpoint of its own whose held-out loss is exactly the one recorded
    _, eval_stream = split(tokens, cfg.context)
    best = load_checkpoint(out / "best")
    assert evaluate(best, eval_stream, cfg) == best_loss
    assert same_weights(load_checkpoint(out), model)
    assert not same_weights(best, model)
    meta = json.loads((out / "best" / "config.json").read_text())
    assert meta["best"] == {"step": best_step, "eval_loss": best_loss}
    assert (out / "best" / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()


def test_no_warning_when_the_held_out_loss_falls(tmp_path):
    model, tokens, tok = _toy_setup()
    lines = []
    summary = train(model, tokens, TrainConfig(steps=40, batch_size=8, context=16, lr=1e-2,
                                               eval_every=5), out=tmp_path / "run",
                    tokenizer=tok, progress=False, log=lines.append)
    assert not summary["overfitting"] and not any("warning" in ln for ln in lines)
    assert summary["best_step"] == 40 and (tmp_path / "run" / "best").is_dir()


def test_resume_keeps_the_same_best_checkpoint(tmp_path):
    """Killed after a checkpoint later than the best eval, resumed: out/ and out/best/ are
    byte for byte those of the uninterrupted run."""
    model, tokens, tok, cfg = _overfit_setup()
    train(model, tokens, cfg, out=tmp_path / "ref", tokenizer=tok, progress=False, log=None)
    _interrupted_run_of(_overfit_setup, tmp_path / "run", cfg, stop_after=60)
    assert json.loads((tmp_path / "run" / "best" / "config.json").read_text())["best"][
        "step"] < 60
    model, _, _, _ = _overfit_setup(seed=5)
    got = train(model, tokens, cfg, out=tmp_path / "run", resume=True, tokenizer=tok,
                progress=False, log=None)
    assert got["resumed_from"] == 60
    for name in ("model.safetensors", "best/model.safetensors", "best/config.json"):
        assert (tmp_path / "run" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()


def _interrupted_run_of(setup, out: Path, cfg: TrainConfig, stop_after: int):
    import attnlab.checkpoint as checkpoint

    real_save = checkpoint.save_training_state

    class Killed(BaseException):
        pass

    def save_then_die(out_, model, optimizer, gen, step, *rest):
        real_save(out_, model, optimizer, gen, step, *rest)
        if step == stop_after:
            raise Killed

    model, tokens, tok, _ = setup()
    checkpoint.save_training_state = save_then_die
    try:
        with pytest.raises(Killed):
            train(model, tokens, cfg, out=out, tokenizer=tok, progress=False, log=None)
    finally:
        checkpoint.save_training_state = real_save


def test_out_with_best_is_attnlabs_but_not_with_a_foreign_file_in_best(tmp_path):
    out = tmp_path / "run"
    model, tokens, tok = _toy_setup()
    cfg = TrainConfig(steps=2, batch_size=4, context=16)
    train(model, tokens, cfg, out=out, tokenizer=tok, progress=False, log=None)
    assert (out / "best" / "model.safetensors").is_file()
    train(model, tokens, TrainConfig(steps=3, batch_size=4, context=16), out=out,
          progress=False, log=None)  # an attnlab folder, best/ and all
    (out / "best" / "notes.txt").write_text("mine")
    before = _files(out)
    with pytest.raises(ValueError, match="not an attnlab checkpoint.*'best'"):
        train(model, tokens, cfg, out=out, progress=False, log=None)
    assert _files(out) == before


@pytest.mark.slow
def test_context_parallel_torchrun_matches_single_process(tmp_path):
    """One sequence split over two processes (ring attention, zig-zag shards): the same
    loss curve, held-out loss and weights as one process at the same seed."""
    one, two = _one_and_two_processes(tmp_path, ["train", "--model", "gpt", "--steps", "4",
                                                 "--context", "24", "--batch-size", "2",
                                                 "--seed", "3"], "--context-parallel", "2")
    assert [h[0] for h in one["history"]] == [h[0] for h in two["history"]] == [1, 2, 3, 4]
    assert [h[1] for h in two["history"]] == pytest.approx([h[1] for h in one["history"]],
                                                           abs=1e-5)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], abs=1e-5)


def test_context_parallel_must_divide_the_processes_and_needs_a_gpt():
    from attnlab.training.distributed import context_split

    assert context_split(object(), 1, 0, 1, 32) is None
    with pytest.raises(ValueError, match=r"--context-parallel 3 must divide the number of "
                                         r"processes \(2\)"):
        context_split(object(), 2, 0, 3, 32)
    with pytest.raises(ValueError, match="needs a model that can split its sequence"):
        context_split(ToyAttnLM(ToyConfig(vocab_size=5, context_length=8)), 2, 0, 2, 32)
    with pytest.raises(ValueError, match="context_parallel must be a positive int"):
        context_split(object(), 2, 0, 0, 32)


def test_a_file_put_into_out_during_the_run_is_never_deleted(tmp_path, monkeypatch):
    """Each checkpoint replaces --out as a whole: a file the user drops into it between two
    checkpoints stops the run at the next one (named), and stays, with the last good
    checkpoint beside it."""
    from attnlab import checkpoint

    out = tmp_path / "run"
    model, tokens, tok = _toy_setup()
    real = checkpoint.save_training_state
    saves = []

    def save_then_drop_a_note(out_dir, *args):
        real(out_dir, *args)
        saves.append(args[3])  # the step
        if len(saves) == 1:
            (out_dir / "my-notes.txt").write_text("注意力 notes")

    monkeypatch.setattr(checkpoint, "save_training_state", save_then_drop_a_note)
    with pytest.raises(ValueError, match=r"holds .my-notes.txt.*attnlab did not write"):
        train(model, tokens, TrainConfig(steps=4, batch_size=4, context=16, checkpoint_every=2),
              out=out, tokenizer=tok, progress=False, log=None)
    assert (out / "my-notes.txt").read_text() == "注意力 notes"
    assert json.loads((out / "training_state.json").read_text())["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing left beside it


def test_the_marker_is_never_written_through_a_link_in_the_live_folder(tmp_path):
    """A ``.attnlab-atomic`` link planted in the folder being replaced: refused as not
    attnlab's, the file it points to untouched."""
    from attnlab import io
    from attnlab.io.outdir import refuse_foreign

    out = tmp_path / "run"
    with io.atomic_dir(out) as tmp:
        (tmp / "config.json").write_text("{}")
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (out / io.ATOMIC_MARKER).symlink_to(victim)
    with (pytest.raises(ValueError, match="attnlab did not write"),
          io.atomic_dir(out, check=refuse_foreign) as tmp):
        (tmp / "config.json").write_text("{}")
    with pytest.raises(OSError), io.atomic_dir(out) as tmp:  # unchecked: not followed either
        (tmp / "config.json").write_text("{}")
    assert victim.read_text() == "mine" and (out / io.ATOMIC_MARKER).is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "victim.txt"]


@pytest.mark.parametrize("out", [".", "..", "{here}"])
def test_out_that_is_the_working_directory_or_holds_it_is_refused(tmp_path, monkeypatch, out):
    """``--out .`` would have each checkpoint rename the folder the process (and the
    user's shell) stands in, and delete it."""
    here = tmp_path / "p"
    here.mkdir()
    monkeypatch.chdir(here)
    model, tokens, _ = _toy_setup()
    with pytest.raises(ValueError, match="is the current directory or holds it"):
        train(model, tokens, TrainConfig(steps=2, batch_size=4, context=16),
              out=out.format(here=here), progress=False, log=None)
    assert here.is_dir() and list(here.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]


def test_an_out_whose_name_leaves_no_room_for_the_copy_beside_it_is_refused_first(tmp_path):
    """A name of 234 bytes fits, but the copy built beside it (``.<name>.ready-<pid>-<hex>``)
    does not: refused before training, naming --out, not at the first checkpoint."""
    model, tokens, _ = _toy_setup()
    out = tmp_path / ("运" * 78)
    with pytest.raises(ValueError, match="--out .* cannot be written: File name too long"):
        train(model, tokens, TrainConfig(steps=2, batch_size=4, context=16), out=out,
              progress=False, log=None)
    assert list(tmp_path.iterdir()) == []


def test_checking_an_out_creates_no_folder(tmp_path):
    """A refused run leaves no trace of the folders it would have made."""
    from attnlab.checkpoint import check_out_dir
    from attnlab.io.outdir import check_own_dir

    check_out_dir(tmp_path / "typo" / "a" / "run")
    check_own_dir(tmp_path / "typo" / "b" / "pics")
    assert list(tmp_path.iterdir()) == []


def test_a_run_written_before_summaries_were_signed_resumes(tmp_path):
    """An earlier attnlab wrote summary.json unsigned: beside the run's own config.json it
    is still the run's, so --resume (and a demo run again) takes the folder."""
    out = tmp_path / "run"
    model, tokens, tok = _toy_setup()
    train(model, tokens, TrainConfig(steps=2, batch_size=4, context=16), out=out,
          tokenizer=tok, progress=False, log=None)
    (out / "summary.json").write_text(json.dumps({"steps": 2}))  # as written before
    summary = train(model, tokens, TrainConfig(steps=3, batch_size=4, context=16), out=out,
                    resume=True, tokenizer=tok, progress=False, log=None)
    assert summary["steps"] == 3
    mine = tmp_path / "pics"  # without an attnlab checkpoint, the name alone proves nothing
    mine.mkdir()
    (mine / "summary.json").write_text("{}")
    from attnlab.io.outdir import foreign_entries

    assert foreign_entries(mine) == ["summary.json"]


def test_a_file_that_comes_in_while_the_folder_is_swapped_is_kept_and_said_so(tmp_path):
    """The narrow race: the live folder passes its check, then gains a file before it is
    set aside. The new copy is in place; the old one is kept with the file, unmarked (no
    recovery deletes it), and the message says so, not that nothing was written."""
    from attnlab import io
    from attnlab.io.outdir import refuse_foreign

    out = tmp_path / "ck"
    config = {"format": 1, "model_type": "toy"}
    with io.atomic_dir(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(config))
    calls = []

    def check_then_a_file_comes(folder):
        refuse_foreign(folder)
        calls.append(folder)
        if len(calls) == 1:
            (folder / "notes.txt").write_text("mine")

    with pytest.raises(ValueError, match=r"holds the new copy.*kept, with them, as"), \
            io.atomic_dir(out, check=check_then_a_file_comes) as tmp:
        (tmp / "config.json").write_text(json.dumps({**config, "new": 1}))
    assert json.loads((out / "config.json").read_text())["new"] == 1
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("ck.old-")]
    assert len(kept) == 1 and (kept[0] / "notes.txt").read_text() == "mine"
    assert not (kept[0] / io.ATOMIC_MARKER).exists()
    io.recover_dir(out)
    assert (kept[0] / "notes.txt").read_text() == "mine"


def test_a_rank_that_left_its_group_ends_without_finalising(monkeypatch, capsys):
    # attnlab.cli.run: where gloo's threads outlive the group (distributed.threads_left),
    # the process ends with os._exit once its streams are flushed, after a finished run
    # and after an error main() does not turn into a line; otherwise as before.
    from attnlab import cli
    from attnlab.training import distributed

    class Ended(Exception):
        pass

    ended = []

    def end(status):
        ended.append(status)
        raise Ended

    def failing():
        raise RuntimeError("a collective failed")

    monkeypatch.setattr(os, "_exit", end)
    monkeypatch.setattr(distributed, "_THREADS_LEFT", True)
    for main, status in ((failing, 1), (lambda: 3, 3)):
        monkeypatch.setattr(cli, "main", main)
        with pytest.raises(Ended):
            cli.run()
        assert ended[-1] == status
    assert "RuntimeError: a collective failed" in capsys.readouterr().err
    monkeypatch.setattr(distributed, "_THREADS_LEFT", False)
    with pytest.raises(SystemExit) as info:
        cli.run()
    assert info.value.code == 3
    monkeypatch.setattr(cli, "main", failing)
    with pytest.raises(RuntimeError, match="a collective failed"):
        cli.run()
    assert ended == [1, 3]


def test_the_api_checkpoints_every_tenth_of_the_run_when_not_told(tmp_path):
    # as the CLI does (default_checkpoint_every): a run of the API killed at its last step
    # had nothing to resume from
    from unittest import mock

    from attnlab import checkpoint as ckpt

    torch.manual_seed(0)
    model = ToyAttnLM(ToyConfig(vocab_size=10, context_length=8, d_model=16))
    data = torch.randint(0, 10, (2000,), generator=torch.Generator().manual_seed(0))
    with mock.patch.object(ckpt, "save_training_state", wraps=ckpt.save_training_state) as save:
        train(model, data, TrainConfig(steps=20, context=8, batch_size=4, eval_every=10),
              out=tmp_path / "run", progress=False, log=None)
    assert [c.args[4] for c in save.call_args_list] == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]


def test_a_resumed_run_knows_how_far_past_its_best_it_was_and_whether_it_warned():
    # neither is in the checkpoint: replayed from the history, a resumed run warns once,
    # when and as the whole run does (it warned again, or never)
    from attnlab.training.loop import _Best

    model = ToyAttnLM(ToyConfig(vocab_size=10, context_length=8, d_model=16))
    evals = [3.0, 2.5, 2.6, 2.7, 2.95, 3.2, 2.4, 2.5, 2.9]
    live, history = _Best(keep=False), []
    for i, loss in enumerate(evals):
        live.update(i, loss, model)
        live.overfitting(i, loss, 1.0, 100, 10, None)
        history += [[i * 2 + 1, 1.0, None], [i * 2 + 2, 1.0, loss]]
        resumed = _Best(keep=False)
        resumed.replay(history)
        assert (resumed.evals_past, resumed.warned) == (live.evals_past, live.warned), i
    assert live.warned
