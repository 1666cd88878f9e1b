"""`attnlab demo|train|generate|show|ablate` end to end, and their one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run(*args, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "attnlab", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "demo"
    done = run("demo", "--out", out, "--steps", "300")
    assert done.returncode == 0, done.stderr
    return out, done.stdout


def test_demo_writes_everything(demo_dir):
    out, stdout = demo_dir
    for name in ("attention.png", "attention.html", "model.safetensors", "config.json",
                 "tokenizer.json", "summary.json"):
        assert (out / name).exists(), name
    summary = json.loads((out / "summary.json").read_text())
    assert {"final_loss", "steps", "seconds"} <= set(summary) and summary["steps"] == 300
    assert "step   300" in stdout and "previous token" in stdout
    assert (out / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_worked_example(tmp_path):
    done = run("demo", "--worked-example")
    assert done.returncode == 0
    assert "z1 = 0.6698 * v1 + 0.3302 * v2 = [ 1.6605,  2.6605]" in done.stdout


def test_generate_streams_text(demo_dir):
    out, _ = demo_dir
    done = run("generate", "--ckpt", out, "--prompt", "abab", "--max-new-tokens", "15",
               "--temperature", "0")
    assert done.returncode == 0, done.stderr
    text = done.stdout.rstrip("\n")
    assert text.startswith("abab") and len(text) == 4 + 15
    assert text[4:8] == "abab"  # the greedy continuation of the pattern


@pytest.mark.slow
def test_show_and_ablate_on_a_checkpoint(demo_dir, tmp_path):
    out, _ = demo_dir
    done = run("show", "ababab xyz", "--ckpt", out, "--out", tmp_path / "show")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "show" / "attention.html").exists()
    assert (tmp_path / "show" / "attention.png").exists()
    done = run("ablate", "--ckpt", out, "--json", tmp_path / "ab.json")
    assert done.returncode == 0, done.stderr
    assert "uniform_attention" in done.stdout
    results = json.loads((tmp_path / "ab.json").read_text())
    assert results.pop("written_by").startswith("attnlab ")  # its signature
    assert set(results) == {"baseline", "constant_q", "zero_v", "constant_k",
                            "uniform_attention", "dropout_placement"}


TOY = ["--model", "toy", "--context", "16", "--batch-size", "4"]


@pytest.fixture(scope="module")
def train_dir(tmp_path_factory):
    """A finished ``attnlab train`` checkpoint (with training state) of the TOY settings."""
    out = tmp_path_factory.mktemp("cli") / "train"
    done = run("train", *TOY, "--steps", "4", "--out", out)
    assert done.returncode == 0, done.stderr
    return out


def _damaged_copies(src, tmp_path) -> dict:
    """Copies of the checkpoint ``src``, each with one file damaged."""
    damage = {
        "badconfig": ("config.json", b"{not json"),
        "badtok": ("tokenizer.json", b'{"type": "char", "chars": '),
        "hftok": ("tokenizer.json", json.dumps({"type": "hf", "tokenizer": "{not json"}).encode()),
        "bigtok": ("tokenizer.json", json.dumps({"type": "char",
                                                 "chars": list("abcdefghijklmnopqrstuvwxyz ")})
                   .encode()),
        "badstate": ("training_state.json", b'{"step": '),
        "nohistory": ("training_state.json", None),
        "badtensors": ("training_state.safetensors", b"\x00" * 20),
        "badbest": ("best/config.json", b'{"format": '),
    }
    dirs = {}
    for key, (name, data) in damage.items():
        d = tmp_path / key
        d.mkdir()
        for f in src.iterdir():
            if f.is_file():  # not best/: the damage is to the run's own files
                (d / f.name).write_bytes(f.read_bytes())
        if data is None:  # the training state without its history
            state = json.loads((d / name).read_text())
            state["history"] = None
            data = json.dumps(state).encode()
        (d / name).parent.mkdir(exist_ok=True)
        (d / name).write_bytes(data)
        dirs[key] = d
    return dirs


@pytest.mark.parametrize("args, words", [
    (["train", "--text", "/no/such/file"], ["--text", "cannot be read"]),
    (["train", "--text", "{empty}"], ["--text", "is empty"]),
    (["train", "--text", "{blank}"], ["--text", "holds only whitespace"]),
    (["train", "--text", "{short}", "--context", "64"], ["too short"]),
    (["train", "--text", "{binary}"], ["not UTF-8"]),
    (["train", "--steps", "-3"], ["--steps", "positive"]),
    (["train", "--batch-size", "0"], ["--batch-size", "positive"]),
    (["train", "--context", "0"], ["--context", "positive"]),
    (["train", "--lr", "0"], ["--lr", "positive"]),
    (["train", "--lr", "nan"], ["--lr", "positive"]),
    (["train", "--checkpoint-every", "0"], ["--checkpoint-every", "positive"]),
    (["train", "--seed", "-1"], ["--seed"]),
    (["train", "--seed", str(2**63)], ["--seed"]),
    (["demo", "--seed", "-3"], ["--seed"]),
    (["generate", "--ckpt", "{demo}", "--prompt", "ab", "--seed", "-1"], ["--seed"]),
    (["train", "--out", "{hf}", "--steps", "2"], ["--out", "not an attnlab checkpoint"]),
    (["demo", "--out", "{hf}", "--steps", "2"], ["--out", "not an attnlab checkpoint"]),
    (["demo", "--out", "{afile}", "--steps", "2"], ["--out", "is a file"]),
    (["demo", "--out", "{afile}/sub", "--steps", "2"], ["--out", "cannot be written"]),
    (["train", "--out", "{afile}/sub", "--steps", "2"], ["--out", "cannot be written"]),
    (["train", "--resume", "--out", "{train}", *TOY, "--lr", "0.01", "--steps", "8"],
     ["--resume", "other settings", "--lr 0.003", "0.01"]),
    (["train", "--resume", "--out", "{train}", *TOY, "--context", "24", "--steps", "8"],
     ["--resume", "other settings", "--context", "24 now"]),
    (["train", "--out", "{train}", *TOY, "--steps", "8"],
     ["--out", "holds a run already: add --resume to continue it, or --overwrite"]),
    (["train", "--resume", "--overwrite", "--out", "{train}", *TOY], ["--resume", "--overwrite",
                                                                       "not both"]),
    (["train", "--resume", "--out", "{badconfig}", *TOY, "--steps", "8"], ["config.json"]),
    (["train", "--resume", "--out", "{badtok}", *TOY, "--steps", "8"], ["tokenizer.json"]),
    (["train", "--resume", "--out", "{hftok}", *TOY, "--steps", "8"], ["tokenizer.json"]),
    (["train", "--resume", "--out", "{badstate}", *TOY, "--steps", "8"],
     ["training_state.json"]),
    (["train", "--resume", "--out", "{nohistory}", *TOY, "--steps", "8"],
     ["training state", "damaged"]),
    (["train", "--resume", "--out", "{badtensors}", *TOY, "--steps", "8"],
     ["training_state.safetensors"]),
    # (helper-found: it said the folder "also holds 'best'")
    (["train", "--resume", "--out", "{badbest}", *TOY, "--steps", "8"],
     ["best/config.json is damaged", "restore it or move it out"]),
    (["generate", "--ckpt", "{badconfig}", "--prompt", "ab"], ["config.json"]),
    (["generate", "--ckpt", "{badtok}", "--prompt", "ab"], ["tokenizer.json"]),
    (["generate", "--ckpt", "{hftok}", "--prompt", "ab"], ["tokenizer.json", "Hugging Face"]),
    (["generate", "--ckpt", "{bigtok}", "--prompt", "ab"], ["tokenizer.json", "vocab_size"]),
    (["generate", "--ckpt", "{demo}", "--prompt", "ab", "--temperature", "nan"],
     ["temperature", "finite"]),
    (["generate", "--ckpt", "{demo}", "--prompt", "ab", "--temperature", "inf"],
     ["temperature", "finite"]),
    (["generate", "--ckpt", "{demo}", "--prompt", "ab", "--top-k", "0"], ["--top-k"]),
    (["train", "--resume", "--out", "{demo}", "--model", "gpt"], ["--resume", "does not fit"]),
    # (helper-found: it said only that the text had characters not in the vocabulary)
    (["train", "--resume", "--out", "{train}", "--text", "{other}", "--steps", "99"],
     ["--resume", "trained on another text", "'注'"]),
    (["train", "--out", "{junk}", "--steps", "2"], ["--out", "not an attnlab checkpoint"]),
    (["generate", "--ckpt", "{demo}", "--prompt", "ab", "--temperature", "-1"],
     ["temperature"]),
    # the option as typed, not the Python parameter it feeds (helper-found)
    (["generate", "--ckpt", "{demo}", "--prompt", "ab", "--top-p", "2"], ["--top-p", "(0, 1]"]),
    (["generate", "--ckpt", "{tmp}/none", "--prompt", "ab"], ["does not exist"]),
    (["generate", "--ckpt", "{corrupt}", "--prompt", "ab"], ["model.safetensors"]),
    (["generate", "--ckpt", "{demo}", "--prompt", "QQ!"], ["--prompt", "'Q'"]),
    (["generate", "--ckpt", "{demo}", "--prompt", "ab", "--max-new-tokens", "0"],
     ["--max-new-tokens"]),
    (["show", "hello"], ["--ckpt"]),
    (["show", "abq", "--ckpt", "{demo}"], ["'q'"]),
])
def test_cli_errors_are_one_line_exit_2(args, words, demo_dir, train_dir, tmp_path):
    out, _ = demo_dir
    hf = tmp_path / "hf"  # a Hugging Face model folder: it has a config.json too
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    (hf / "pytorch_model.bin").write_bytes(b"weights")
    (tmp_path / "afile").write_text("a file")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("  \n")
    (tmp_path / "short.txt").write_text("abcabc")
    (tmp_path / "other.txt").write_text("注意力机制🐱\n" * 200)
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00\x81")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("someone's notes")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (corrupt / name).write_bytes((out / name).read_bytes())
    (corrupt / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes()[:100])
    fill = {"empty": tmp_path / "empty.txt", "blank": tmp_path / "blank.txt",
            "short": tmp_path / "short.txt",
            "binary": tmp_path / "binary.txt", "tmp": tmp_path, "corrupt": corrupt,
            "other": tmp_path / "other.txt",
            "demo": out, "junk": tmp_path / "junk", "hf": hf, "afile": tmp_path / "afile",
            "train": train_dir, **_damaged_copies(train_dir, tmp_path)}
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    mine = {p: p.read_bytes() for p in [*tmp_path.rglob("*"), *train_dir.iterdir()]
            if p.is_file()}
    done = run(*[a.format(**fill) for a in args], cwd=tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for w in words:
        assert w in lines[0], lines[0]
    assert done.stdout == "", done.stdout  # nothing half-done on stdout either
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert (tmp_path / "junk" / "notes.txt").read_text() == "someone's notes"
    # Nothing already on disk was touched, and nothing was added.
    assert {p: p.read_bytes() for p in [*tmp_path.rglob("*"), *train_dir.iterdir()]
            if p.is_file()} == mine


def test_failed_train_leaves_a_good_checkpoint_untouched(demo_dir, tmp_path):
    out, _ = demo_dir
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    (tmp_path / "tiny.txt").write_text("ab")
    done = run("train", "--text", tmp_path / "tiny.txt", "--out", out, "--context", "16",
               "--overwrite")
    assert done.returncode == 2 and "too short" in done.stderr, done.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_overwrite_trains_a_new_model_in_place_of_a_run(tmp_path):
    # Without --resume a run in --out is refused (above); --overwrite replaces it, as a
    # fresh run into an empty folder would have written it.
    first = run("train", *TOY, "--steps", "2", "--out", tmp_path / "run")
    fresh = run("train", *TOY, "--steps", "3", "--seed", "1", "--out", tmp_path / "fresh")
    again = run("train", *TOY, "--steps", "3", "--seed", "1", "--out", tmp_path / "run",
                "--overwrite")
    assert first.returncode == fresh.returncode == again.returncode == 0, again.stderr
    assert (tmp_path / "run" / "model.safetensors").read_bytes() == (
        tmp_path / "fresh" / "model.safetensors").read_bytes()


def test_resume_before_any_checkpoint_notes_it_and_starts_from_step_0(tmp_path):
    """A run killed before its first checkpoint is resumed by starting it again
    (deterministic, so the same run): a one-line note, not an error."""
    fresh = run("train", *TOY, "--steps", "3", "--out", tmp_path / "fresh")
    assert fresh.returncode == 0, fresh.stderr
    for out in (tmp_path / "new", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        done = run("train", *TOY, "--steps", "3", "--out", out, "--resume")
        assert done.returncode == 0, done.stderr
        # Into a pipe a run also prints its progress lines; the note is one line.
        lines = [line for line in done.stderr.strip().splitlines()
                 if not line.startswith(("train ", "step "))]
        assert len(lines) == 1 and "starting from step 0" in lines[0], done.stderr
        assert (out / "model.safetensors").read_bytes() == (
            tmp_path / "fresh" / "model.safetensors").read_bytes()


def test_resume_of_a_saved_model_without_training_state_is_refused(demo_dir, tmp_path):
    from attnlab.checkpoint import load_checkpoint, save_checkpoint

    out, _ = demo_dir
    saved = tmp_path / "saved"
    save_checkpoint(load_checkpoint(out), saved)
    before = {p.name: p.read_bytes() for p in saved.iterdir()}
    done = run("train", "--resume", "--out", saved, "--steps", "2")
    assert done.returncode == 2 and "no training state" in done.stderr, done.stderr
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == before



@pytest.mark.parametrize(("gpus", "local_rank", "want", "said"), [
    (1, 1, "cpu", False),   # rank 1 of two on one GPU: no cuda:1 to ask for
    (1, 0, "cpu", True),    # ... and every rank agrees on the CPU; local rank 0 says so
    (2, 1, "cuda:1", False),
    (4, 1, "cuda:1", False),
])
def test_more_processes_than_gpus_train_on_the_cpu(monkeypatch, capsys, gpus, local_rank,
                                                   want, said):
    import torch

    from attnlab.training import train_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert str(train_device()) == want
    err = capsys.readouterr().err
    assert err == ("attnlab: 2 processes on this machine but 1 CUDA device: training on the "
                   "CPU (gloo)\n" if said else "")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # not from torchrun: the world is on this machine
    assert str(train_device()) == want
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert str(train_device()) == "cpu"
    if gpus == 1:  # one GPU each, given by a launcher that sets CUDA_VISIBLE_DEVICES
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", str(local_rank + 4))
        assert str(train_device()) == "cuda:0"


def test_train_never_replaces_a_saved_model_without_overwrite(tmp_path, capsys):
    # a model saved with save_checkpoint has no training state; `train --out` replaced it
    # (only a run's state was protected), while --resume refused it
    import hashlib

    import torch

    import attnlab
    from attnlab.cli import main
    from attnlab.models import GPT, GPTConfig

    torch.manual_seed(0)
    attnlab.save_checkpoint(GPT(GPTConfig(vocab_size=50, context_length=32, d_model=32,
                                          num_layers=1, num_heads=2)), tmp_path / "mine")
    saved = tmp_path / "mine" / "model.safetensors"
    before = hashlib.sha256(saved.read_bytes()).hexdigest()
    args = ["train", "--steps", "2", "--batch-size", "2", "--context", "16", "--out",
            str(tmp_path / "mine")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "holds a saved model (model.safetensors): add --overwrite" in err
    assert hashlib.sha256(saved.read_bytes()).hexdigest() == before


def test_train_shapes_the_gpt_from_its_options_and_resume_keeps_them(tmp_path, capsys):
    import torch

    from attnlab.checkpoint import load_checkpoint
    from attnlab.cli import main

    out = tmp_path / "run"
    common = ["train", "--context", "16", "--batch-size", "4", "--out", str(out)]
    shape = ["--layers", "1", "--heads", "6", "--kv-heads", "3", "--d-model", "48",
             "--positions", "alibi", "--window", "4", "--softcap", "20", "--sinks"]
    assert main([*common, "--steps", "2", *shape]) == 0
    want = {"num_layers": 1, "num_heads": 6, "num_kv_heads": 3, "d_model": 48,
            "positions": "alibi", "window": 4, "attn_softcap": 20.0, "sinks": True}
    config = json.loads((out / "config.json").read_text())["config"]
    assert {k: config[k] for k in want} == want
    # The window reaches the attention: one layer of window 4, so the logits of
    # positions 10.. depend on tokens 7.. only, and those before on changed tokens.
    model = load_checkpoint(out)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator()
                        .manual_seed(0))
    other = ids.clone()
    other[0, :7] = (other[0, :7] + 1) % model.config.vocab_size
    with torch.no_grad():
        a, b = model(ids), model(other)
    assert torch.equal(a[0, 10:], b[0, 10:])
    assert all(not torch.allclose(a[0, t], b[0, t]) for t in range(10))
    # --resume takes the checkpoint's shape where no option is given, and refuses another
    assert main([*common, "--steps", "3", "--resume"]) == 0
    assert main([*common, "--steps", "4", "--resume", "--softcap", "10"]) == 2
    assert "attn_softcap=20.0 (given 10.0)" in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["config"] == config
    # the options given on a resume are checked with the checkpoint's shape, not the
    # defaults (--kv-heads 3 does not divide the default 4 heads)
    assert main([*common, "--steps", "4", "--resume", "--kv-heads", "3"]) == 0


@pytest.mark.parametrize("args, words", [
    (["--model", "toy", "--sinks"], "--sinks shapes --model gpt, not --model toy"),
    (["--heads", "3"], "--d-model=128 must be divisible by --heads=3"),
    (["--kv-heads", "3"], "--kv-heads=3 must divide --heads=4"),
    (["--d-model", "1000000"], "needs about"),
    (["--d-model", "28", "--positions", "rope"], "the head width --d-model / --heads = 7 "
                                                 "must be even"),
])
def test_train_shape_options_are_checked_before_anything_is_read(tmp_path, capsys, args,
                                                                  words):
    from attnlab.cli import main

    assert main(["train", "--text", str(tmp_path / "missing.txt"), "--out",
                 str(tmp_path / "run"), *args]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_demo_and_ablate_replace_their_own_output_only(tmp_path, capsys):
    """`attnlab demo --out DIR` (and ablate, which trains the demo first) replaced a
    model trained there, which `train` itself replaces only with --overwrite."""
    import hashlib

    from attnlab.cli import main

    run = tmp_path / "run"
    assert main(["train", "--steps", "1", "--batch-size", "2", "--context", "8",
                 "--out", str(run)]) == 0
    before = hashlib.sha256((run / "model.safetensors").read_bytes()).hexdigest()
    for args in (["demo", "--steps", "2"], ["ablate", "--layer", "0"]):
        capsys.readouterr()
        assert main([*args, "--out", str(run)]) == 2
        assert "holds a model that is not the demo's" in capsys.readouterr().err
    assert hashlib.sha256((run / "model.safetensors").read_bytes()).hexdigest() == before
    demo = tmp_path / "demo"
    for _ in range(2):  # the demo's own output is replaced, as `make demo` twice needs
        assert main(["demo", "--steps", "2", "--out", str(demo)]) == 0
