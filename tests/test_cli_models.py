"""`show`, `generate` and `ablate` on any model: a Hugging Face folder (--model DIR), an
attnlab checkpoint trained on the user's own text (--ckpt DIR), the bundled MiniLM."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers as T  # noqa: E402

from attnlab.cli import main  # noqa: E402

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "cat", "sat", "on", "mat", "a", "dog",
         "ran", "to", "park", "and", "slept", "."]


def _tokenizer(folder, special=False):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if special:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "gpt2"
    torch.manual_seed(0)
    T.GPT2LMHeadModel(T.GPT2Config(vocab_size=len(WORDS), n_positions=32, n_embd=32, n_layer=2,
                                   n_head=4)).save_pretrained(folder)
    _tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "bert"
    torch.manual_seed(0)
    T.BertModel(T.BertConfig(vocab_size=len(WORDS), hidden_size=24, num_hidden_layers=2,
                             num_attention_heads=3, intermediate_size=48,
                             max_position_embeddings=32)).save_pretrained(folder)
    _tokenizer(folder, special=True)
    return folder


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "eval.txt"
    path.write_text("the cat sat on the mat .\na dog ran to the park and slept .\n"
                    "the dog sat on a mat .\n")
    return path


def test_show_a_folder_with_rollout(gpt2_dir, tmp_path, capsys):
    assert main(["show", "the cat sat on the mat", "--model", str(gpt2_dir), "--rollout",
                 "--out", str(tmp_path / "s")]) == 0
    html = (tmp_path / "s" / "attention.html").read_text()
    # 2 layers, and the rollout beside them, not counted as a third
    assert "attention rollout" in html and '"layers":2' in html and '"rollout":"' in html
    assert (tmp_path / "s" / "attention.png").read_bytes()[:4] == b"\x89PNG"


def test_generate_from_a_folder_is_transformers_greedy(gpt2_dir, capsys):
    assert main(["generate", "--model", str(gpt2_dir), "--prompt", "the cat",
                 "--max-new-tokens", "6", "--temperature", "0"]) == 0
    out = capsys.readouterr().out.strip()
    hf = T.GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    want = hf.generate(torch.tensor([[4, 5]]), max_new_tokens=6, min_new_tokens=6,
                       do_sample=False, pad_token_id=0)[0, 2:]
    from tokenizers import Tokenizer

    # The streamed text is the tokenizer's own decoding of prompt and new tokens.
    tok = Tokenizer.from_file(str(gpt2_dir / "tokenizer.json"))
    assert out == tok.decode([4, 5] + want.tolist())
    assert out.split() == ["the", "cat", *(WORDS[i] for i in want.tolist())]


def test_generate_past_the_context_says_so_and_crops(gpt2_dir, capsys):
    # Helper-found: past the context (32 here) each token silently saw only the last 32.
    assert main(["generate", "--model", str(gpt2_dir), "--prompt", "the cat",
                 "--max-new-tokens", "6", "--temperature", "0"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["generate", "--model", str(gpt2_dir), "--prompt", "the cat",
                 "--max-new-tokens", "40", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "context of 32 tokens" in err and "last 32" in err
    from attnlab.interop.auto import load

    model, tok = load(str(gpt2_dir))
    want = model.generate([[4, 5]], 40, temperature=0, use_cache=False)[0].tolist()
    assert out.strip() == tok.decode(want).strip()


def test_generate_plans_the_fused_layers_once(gpt2_dir, capsys, monkeypatch):
    """Only attnlab's code runs between the printed tokens: the blocks are checked at
    the first decoded token, not at every one."""
    from attnlab.models import decoding

    checks, original = [], decoding._layer
    monkeypatch.setattr(decoding, "_layer", lambda *args: checks.append(1) or original(*args))
    assert main(["generate", "--model", str(gpt2_dir), "--prompt", "the cat",
                 "--max-new-tokens", "6", "--temperature", "0"]) == 0
    assert len(checks) == 2  # 2 layers, once (5 single-token steps)


def test_ablate_heads_on_a_folder(gpt2_dir, text_file, tmp_path, capsys):
    png, js = tmp_path / "h.png", tmp_path / "h.json"
    assert main(["ablate", "--model", str(gpt2_dir), "--text", str(text_file), "--heads",
                 "--png", str(png), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    table = json.loads(js.read_text())
    assert table["measure"] == "loss" and len(table["zero"]) == 2 and len(table["zero"][0]) == 4
    assert "head output zeroed" in out and f"{table['uniform'][1][2]:+.4f}" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_ablate_one_head_and_one_layer(gpt2_dir, text_file, tmp_path, capsys):
    js = tmp_path / "k.json"
    assert main(["ablate", "--model", str(gpt2_dir), "--text", str(text_file), "--layer", "1",
                 "--head", "2", "--json", str(js)]) == 0
    one = json.loads(js.read_text())
    assert one["heads"] == [[1, 2]] and "layer 1 head 2 knocked out" in capsys.readouterr().out
    assert main(["ablate", "--model", str(gpt2_dir), "--text", str(text_file), "--layer", "0",
                 "--json", str(js)]) == 0
    assert json.loads(js.read_text())["heads"] == [[0, h] for h in range(4)]


def test_ablate_an_encoder_folder_by_embedding_change(bert_dir, text_file, tmp_path, capsys):
    js = tmp_path / "e.json"
    assert main(["ablate", "--model", str(bert_dir), "--text", str(text_file), "--heads",
                 "--png", str(tmp_path / "e.png"), "--json", str(js)]) == 0
    table = json.loads(js.read_text())
    assert table["measure"] == "embedding_change" and table["baseline"] == pytest.approx(0)
    assert min(min(r) for r in table["zero"]) >= 0 and max(max(r) for r in table["zero"]) > 0
    assert main(["ablate", "--model", str(bert_dir), "--text", str(text_file)]) == 2
    err = capsys.readouterr().err
    assert "next-token loss, which an encoder (Encoder) does not have: use --heads" in err


def _err(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_the_wrong_option_for_a_folder_says_which_one(gpt2_dir, tmp_path, capsys):
    assert "is a Hugging Face folder (model_type 'gpt2'): use --model" in _err(
        capsys, "show", "the cat", "--ckpt", str(gpt2_dir))
    assert "needs --text FILE" in _err(capsys, "ablate", "--model", str(gpt2_dir), "--heads")
    assert "--head needs --layer" in _err(capsys, "ablate", "--model", str(gpt2_dir),
                                          "--head", "1")
    assert "--png 'h.png' is where --heads draws its heatmap: add --heads, or leave out " \
           "--png" in _err(capsys, "ablate", "--model", str(gpt2_dir), "--png", "h.png")
    assert "give --ckpt DIR" in _err(capsys, "generate", "--prompt", "x")
    (tmp_path / "neox").mkdir()
    (tmp_path / "neox" / "config.json").write_text('{"model_type": "gpt_neox"}')
    assert "model_type 'gpt_neox' is not supported (expected one of ['bloom', 'gemma2', " \
           "'gemma3_text', 'gpt2', 'llama', 'mistral', 'qwen2', 'qwen3'] (decoders)" in _err(
        capsys, "show", "x", "--model", str(tmp_path / "neox"))


def test_ablate_a_checkpoint_trained_on_my_own_text(tmp_path, capsys):
    """The issue's case: a model trained on text the demo corpus lacks ('z', 'b', ...) is
    evaluated on the held-out part of its own text, which training recorded."""
    from attnlab.models import ToyAttnLM
    from attnlab.text import CharTokenizer
    from attnlab.training import TrainConfig, split, train

    text = "zebras bring bright zebu breakfasts; " * 40
    tok = CharTokenizer.from_text(text)
    torch.manual_seed(0)
    model = ToyAttnLM(vocab_size=tok.vocab_size, context_length=16, d_model=16)
    tokens = torch.tensor(tok.encode(text))
    train(model, tokens, TrainConfig(steps=5, batch_size=4, context=16), out=tmp_path / "run",
          tokenizer=tok, progress=False, log=None)
    meta = json.loads((tmp_path / "run" / "config.json").read_text())
    assert meta["held_out"]["ids"] == split(tokens, 16)[1].tolist()
    js = tmp_path / "r.json"
    assert main(["ablate", "--ckpt", str(tmp_path / "run"), "--heads", "--png",
                 str(tmp_path / "r.png"), "--json", str(js)]) == 0
    assert "the held-out part of the training text" in capsys.readouterr().out
    assert json.loads(js.read_text())["layers"] == 1


def test_a_folder_without_a_fitting_tokenizer_is_refused_before_its_weights_are_read(
        gpt2_dir, tmp_path, capsys, monkeypatch):
    import shutil

    from attnlab.models import GPT

    def unread(*args, **kwargs):
        raise AssertionError("the weights were read before the tokenizer was checked")

    monkeypatch.setattr(GPT, "from_hf", unread)
    bare = tmp_path / "bare"
    shutil.copytree(gpt2_dir, bare)
    (bare / "tokenizer.json").unlink()
    assert "has no tokenizer.json" in _err(capsys, "generate", "--model", str(bare),
                                            "--prompt", "x")
    large = tmp_path / "large"
    shutil.copytree(gpt2_dir, large)
    from tokenizers import Tokenizer, models

    words = [*WORDS, "extra", "words"]
    Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")).save(
        str(large / "tokenizer.json"))
    assert (f"tokenizer.json has {len(words)} tokens but the model's vocab_size is "
            f"{len(WORDS)}") in _err(capsys, "generate", "--model", str(large), "--prompt", "x")


def test_a_model_file_that_is_not_a_regular_file_is_named_as_what_it_is(gpt2_dir, tmp_path,
                                                                       capsys):
    # It was "has no tokenizer.json" (or config.json, model.safetensors) where the file
    # was there but a FIFO, a device or a folder.
    import os
    import shutil

    cases = {"config.json": "is a device", "tokenizer.json": "is a FIFO",
             "model.safetensors": "not a regular file"}
    for name, words in cases.items():
        folder = tmp_path / name
        shutil.copytree(gpt2_dir, folder)
        (folder / name).unlink()
        if name == "config.json":
            (folder / name).symlink_to("/dev/zero")
        elif name == "tokenizer.json":
            os.mkfifo(folder / name)
        else:
            (folder / name).mkdir()
        err = _err(capsys, "generate", "--model", str(folder), "--prompt", "x")
        assert words in err and "has no" not in err, err


def test_a_prompt_stops_at_the_folders_end_of_text_token(gpt2_dir, tmp_path, capsys):
    # transformers' generate stops at generation_config.json's eos_token_id (else
    # config.json's); --prompt went on to --max-new-tokens.
    import shutil

    from attnlab.interop.auto import load_hf_folder

    folder = tmp_path / "eos"
    shutil.copytree(gpt2_dir, folder)
    model, tokenizer = load_hf_folder(folder)
    ids = tokenizer.encode("the cat")
    greedy = model.generate(torch.tensor([ids]), 6, temperature=0)[0, len(ids):].tolist()
    assert main(["generate", "--model", str(folder), "--prompt", "the cat", "--temperature",
                 "0", "--max-new-tokens", "6"]) == 0
    longer = capsys.readouterr().out
    stop = greedy[0]  # (a plain word here: printed, as a special token would not be)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop, 1]}))
    assert main(["generate", "--model", str(folder), "--prompt", "the cat", "--temperature",
                 "0", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip("\n") == tokenizer.decode(ids + greedy[:1]) and len(out) < len(longer)
    # every id of the list stops it, as in transformers (Gemma 3 lists end of text and of
    # turn): the second here
    never = next(i for i in range(2, 100) if i not in greedy)  # (and not the tokenizer's)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [never, stop]}))
    assert main(["generate", "--model", str(folder), "--prompt", "the cat", "--temperature",
                 "0", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == tokenizer.decode(ids + greedy[:1])


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "int8"])
def test_generate_at_a_precision_decodes_that_model(gpt2_dir, precision, capsys):
    """--precision holds the GPT's weights in bf16 or int8 (or float32 from a bf16
    folder): the printed text is that model's greedy continuation."""
    from attnlab.interop.auto import load
    from attnlab.modules.quantized import Int8Linear

    model, tok = load(str(gpt2_dir), precision)
    weight = model.blocks[0].mlp.fc
    if precision == "int8":
        assert isinstance(weight, Int8Linear)
    else:
        assert weight.weight.dtype == getattr(torch, precision)
    want = model.generate(torch.tensor([[4, 5]]), 6, temperature=0)[0].tolist()
    assert main(["generate", "--model", str(gpt2_dir), "--prompt", "the cat",
                 "--max-new-tokens", "6", "--temperature", "0", "--precision", precision]) == 0
    assert capsys.readouterr().out.strip() == tok.decode(want).strip()


def test_a_precision_is_for_a_gpts_weights(gpt2_dir, bert_dir, tmp_path, capsys):
    import shutil

    from attnlab.interop.auto import load

    assert "--precision int8 holds a GPT's weights; --model " in _err(
        capsys, "generate", "--model", str(bert_dir), "--prompt", "x", "--precision", "int8")
    assert "holds an Encoder" in _err(capsys, "generate", "--model", "minilm", "--prompt", "x",
                                      "--precision", "bfloat16")
    with pytest.raises(SystemExit) as exit_:  # argparse's own one line
        main(["generate", "--model", str(gpt2_dir), "--prompt", "x", "--precision", "int4"])
    assert exit_.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err
    # A bf16 folder stays bf16 unless float32 is asked for.
    half = tmp_path / "half"
    shutil.copytree(gpt2_dir, half)
    T.GPT2LMHeadModel.from_pretrained(gpt2_dir, dtype=torch.bfloat16).save_pretrained(half)
    assert load(str(half))[0].lm_head.weight.dtype == torch.bfloat16
    assert load(str(half), "float32")[0].lm_head.weight.dtype == torch.float32


def test_a_checkpoints_gpt_at_a_precision(tmp_path, capsys):
    """--ckpt: a GPT checkpoint quantised or converted after loading (its greedy text is
    that model's); a ToyAttnLM's is refused in one line, before anything is printed."""
    from attnlab.checkpoint import save_checkpoint
    from attnlab.interop.auto import load_for_cli
    from attnlab.models import GPT, GPTConfig, ToyAttnLM
    from attnlab.modules.quantized import Int8Linear
    from attnlab.text import CharTokenizer

    tok = CharTokenizer.from_text("abcdefgh ")
    torch.manual_seed(0)
    save_checkpoint(GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=32, d_model=32,
                                  num_layers=2, num_heads=4)), tmp_path / "gpt", tokenizer=tok)
    save_checkpoint(ToyAttnLM(vocab_size=tok.vocab_size, context_length=16, d_model=16),
                    tmp_path / "toy", tokenizer=tok)
    for precision in ("int8", "bfloat16"):
        model, _, _ = load_for_cli(str(tmp_path / "gpt"), None, precision=precision)
        fc = model.blocks[1].mlp.fc
        assert isinstance(fc, Int8Linear) if precision == "int8" else \
            fc.weight.dtype == torch.bfloat16
        want = model.generate(torch.tensor([tok.encode("abc")]), 5, temperature=0)[0]
        assert main(["generate", "--ckpt", str(tmp_path / "gpt"), "--prompt", "abc",
                     "--temperature", "0", "--max-new-tokens", "5",
                     "--precision", precision]) == 0
        assert capsys.readouterr().out.rstrip("\n") == tok.decode(want.tolist())
    err = _err(capsys, "generate", "--ckpt", str(tmp_path / "toy"), "--prompt", "abc",
               "--precision", "int8")
    assert "--precision int8 holds a GPT's weights; --ckpt " in err and "a ToyAttnLM" in err
