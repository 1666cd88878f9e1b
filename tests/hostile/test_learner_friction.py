"""What a new learner hit, tried as one would (issue 26, "Friction a new learner hit")."""

from __future__ import annotations

from pathlib import Path

import pytest

CAT = "The cat sat on the mat"


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    """A folder holding what `attnlab demo` leaves there (a short run of the same recipe)."""
    from attnlab.demo import train_demo_model

    cwd = tmp_path_factory.mktemp("learner")
    train_demo_model(steps=3, seed=0, out=str(cwd / "attnlab-demo"), meta={"demo": True},
                     progress=False)
    return cwd


def test_show_after_the_demo_uses_the_demo_model(demo_dir, cli):
    proc = cli(["show", "ababab acacac", "--out", "pics"], cwd=demo_dir, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "using ./attnlab-demo" in proc.stderr
    assert (demo_dir / "pics" / "attention.png").is_file()
    assert (demo_dir / "pics" / "attention.html").is_file()


def test_show_without_the_demo_says_to_run_it_first(tmp_path, cli, one_line_error):
    line = one_line_error(cli(["show", CAT], cwd=tmp_path, timeout=600),
                          "run `attnlab demo` first", "--ckpt DIR", "--model")
    assert line.startswith("attnlab show: error:")


@pytest.mark.parametrize("args", [[], ["--ckpt", "attnlab-demo"]], ids=["default", "ckpt"])
def test_unknown_characters_name_what_the_model_knows_and_a_sentence_that_works(demo_dir, args,
                                                                              cli):
    proc = cli(["show", CAT, "--out", "cat", *args], cwd=demo_dir, timeout=600)
    err = [ln for ln in proc.stderr.splitlines() if not ln.startswith("note:")]
    assert proc.returncode == 2 and len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "'T', 'h', 'e'" in err[0]  # what was wrong, as before
    assert "the model knows only these 8 characters: ' abcdxyz'" in err[0]
    assert "try a text it knows, such as 'ababab acacac xyzxyz'" in err[0]
    # ... and the offered sentence does work
    proc = cli(["show", "ababab acacac xyzxyz", "--out", "ok", *args], cwd=demo_dir,
               timeout=600)
    assert proc.returncode == 0, proc.stderr


def test_a_trained_checkpoint_offers_its_held_out_text(tmp_path, cli, one_line_error):
    """Not the demo: the sentence offered is the start of the text it was trained on."""
    import torch

    from attnlab.interop.auto import known_text, load_for_cli
    from attnlab.models import ToyAttnLM, ToyConfig
    from attnlab.text import CharTokenizer
    from attnlab.training import TrainConfig, train

    text = "注意力就是一切。" * 40
    tok = CharTokenizer.from_text(text)
    torch.manual_seed(0)
    model = ToyAttnLM(ToyConfig(vocab_size=tok.vocab_size, context_length=8, d_model=16))
    train(model, torch.tensor(tok.encode(text)), TrainConfig(steps=2, context=8, eval_every=1),
          out=tmp_path / "zh", tokenizer=tok, progress=False, log=None)
    _, tokenizer, meta = load_for_cli(str(tmp_path / "zh"), None)
    example = known_text(meta, tokenizer)
    assert example and set(example) <= set(text) and len(example) >= 8
    one_line_error(cli(["show", "attention", "--ckpt", "zh"], cwd=tmp_path, timeout=600),
                   "the model knows only these 8 characters", f"such as {example!r}")
    # lines of text and no space among the characters: one line is offered, not the lines
    # joined by a space it does not know
    text = "大家好，世界！\n" * 40
    tok = CharTokenizer.from_text(text)
    model = ToyAttnLM(ToyConfig(vocab_size=tok.vocab_size, context_length=8, d_model=16))
    train(model, torch.tensor(tok.encode(text)), TrainConfig(steps=2, context=8, eval_every=1),
          out=tmp_path / "lines", tokenizer=tok, progress=False, log=None)
    _, tokenizer, meta = load_for_cli(str(tmp_path / "lines"), None)
    assert known_text(meta, tokenizer) == "大家好，世界！"
