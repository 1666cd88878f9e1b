"""A friendlier command line: bare `attnlab`, --version, defaults in every help, progress that
never collides with its own lines and shows in a pipe, --resume saying where, ablate's output."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys

import pytest
import torch

import attnlab
from attnlab.cli import build_parser, main

COMMANDS = ["demo", "train", "generate", "show", "ablate", "learn", "bench"]


def test_bare_attnlab_prints_the_usage_with_every_command_and_exits_2(capsys):
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: attnlab")
    for command in COMMANDS:
        assert re.search(rf"^\s+{command}\s+\S", err, re.M), command


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"attnlab {attnlab.__version__}"


def subparsers():
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_help_shows_its_default(command):
    sub = subparsers()[command]
    formatter = sub._get_formatter()
    options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert options
    for action in options:
        text = formatter._get_help_string(action)
        assert "default" in text or "required" in text, (command, action.dest, text)
    help_text = sub.format_help()  # renders: every %(default)s fills in
    assert "%(" not in help_text


def test_help_shows_concrete_defaults():
    text = " ".join(subparsers()["train"].format_help().split())
    assert "total steps (default: 500)" in text
    assert "--resume continue from the checkpoint in --out (--steps is the total) " \
           "(default: off)" in text


def tiny_run(**cfg):
    from attnlab.models import ToyAttnLM, ToyConfig
    from attnlab.text import CharTokenizer
    from attnlab.training import TrainConfig

    text = "abcab " * 80
    tok = CharTokenizer.from_text(text)
    torch.manual_seed(0)
    model = ToyAttnLM(ToyConfig(vocab_size=tok.vocab_size, context_length=8, d_model=8))
    config = TrainConfig(**{"steps": 20, "batch_size": 4, "context": 8, "eval_every": 5,
                            "eval_batches": 1, "warmup": 2, **cfg})
    return model, torch.tensor(tok.encode(text)), config, tok


def test_a_run_into_a_pipe_prints_progress_lines_at_a_steady_pace(capsys):
    from attnlab.training import train

    model, tokens, cfg, _ = tiny_run()
    train(model, tokens, cfg, log=print)
    out, err = capsys.readouterr()
    steps = [int(m) for m in re.findall(r"^train\s+(\d+)/20 steps  loss \d", err, re.M)]
    assert steps == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]  # every tenth of the run
    assert "\r" not in err  # no bar redrawn into the pipe
    assert re.findall(r"^step\s+(\d+)  loss", out, re.M) == ["5", "10", "15", "20"]


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_step_lines_on_a_terminal_never_collide_with_the_bar(monkeypatch):
    from attnlab.training import train

    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    model, tokens, cfg, _ = tiny_run()
    train(model, tokens, cfg, log=lambda m: print(m, file=sys.stderr))
    raw = terminal.getvalue()
    assert "train:" in raw and "/20 [" in raw  # the bar was drawn
    lines = re.findall(r"(.)(step\s+\d+  loss)", raw)
    assert len(lines) == 4
    # each step line starts a fresh line: the bar was cleared (\r) before it
    assert all(before in "\r\n" for before, _ in lines), lines


def test_resume_says_the_step_it_resumed_from(tmp_path):
    from attnlab.training import train

    model, tokens, cfg, tok = tiny_run(steps=6, checkpoint_every=3)
    train(model, tokens, cfg, out=tmp_path / "run", tokenizer=tok, progress=False, log=None)
    model, tokens, cfg, tok = tiny_run(steps=9, checkpoint_every=3)
    said = []
    train(model, tokens, cfg, out=tmp_path / "run", tokenizer=tok, resume=True, progress=False,
          log=said.append)
    assert said[0] == f"resumed from step 6 of 9 (checkpoint in {tmp_path / 'run'})"


def test_a_file_given_for_a_checkpoint_directory_says_so(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello")
    for args in (["show", "hi", "--ckpt", str(corpus)],
                 ["generate", "--ckpt", str(corpus), "--prompt", "h"]):
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith(f"{str(corpus)!r} is a file, expected a checkpoint directory"), err


@pytest.fixture
def fast_ablate(tmp_path, monkeypatch):
    """A tiny real checkpoint with its held-out text; the experiments themselves replaced
    by a fixed result."""
    from attnlab import experiments
    from attnlab.checkpoint import save_checkpoint

    model, _, _, tok = tiny_run()
    save_checkpoint(model, tmp_path / "ckpt", tokenizer=tok,
                    held_out={"ids": tok.encode("abcab abcab "), "tokens": 12})
    results = {"baseline": {"loss": 1.0}}
    monkeypatch.setattr(experiments, "run_all", lambda model, ids, seed, **kw: results)
    monkeypatch.setattr(experiments, "format_report", lambda r: "REPORT")
    return tmp_path / "ckpt", results


def _after_report(out: str) -> str:
    """What ablate printed after its report (the JSON, when asked for)."""
    return out.split("REPORT\n", 1)[1]


def test_ablate_prints_json_only_when_asked(fast_ablate, tmp_path, capsys):
    ckpt, results = fast_ablate
    assert main(["ablate", "--ckpt", str(ckpt)]) == 0
    assert _after_report(capsys.readouterr().out) == ""
    assert main(["ablate", "--ckpt", str(ckpt), "--json", "-"]) == 0
    printed = capsys.readouterr()  # stdout is the JSON alone (`| jq`), the report on stderr
    assert json.loads(printed.out) == results
    assert "REPORT" in printed.err
    assert main(["ablate", "--ckpt", str(ckpt), "--json", str(tmp_path / "r.json")]) == 0
    written = json.loads((tmp_path / "r.json").read_text())  # signed as attnlab's
    assert written == {"written_by": f"attnlab {attnlab.__version__}", **results}


def test_ablate_says_up_front_that_it_trains_the_demo_model_and_how_long(monkeypatch, capsys,
                                                                         tmp_path):
    import attnlab.demo

    def stop(*args, **kwargs):
        raise KeyboardInterrupt  # what a user who reads the line and presses ^C does

    monkeypatch.setattr(attnlab.demo, "run_demo", stop)
    assert main(["ablate", "--out", str(tmp_path / "d")]) == 130
    out = capsys.readouterr().out
    assert "training the demo model first" in out and "about a minute" in out


@pytest.mark.parametrize("argv, named", [
    (["generate", "--ckpt", "nowhere", "--prompt", "床\udce5\udcba"], "--prompt"),
    (["generate", "--ckpt", "nowhere", "--chat", "\udce5"], "--chat"),
    (["show", "\udce5x", "--ckpt", "nowhere"], "the text"),
    (["learn", "3", "--text", "我 \udcff"], "--text"),
])
def test_text_that_is_not_utf8_is_named_as_such(argv, named, capsys):
    """A terminal not in UTF-8 passes bytes Python keeps as lone surrogates: named as text
    that is not UTF-8, before anything is loaded (it read as characters not in the
    tokenizer's vocabulary, such as '\\udce5')."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {named} is not UTF-8 text" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, dest, want", [
    # UTF-8 read under LC_ALL=C with Python's UTF-8 mode off: the bytes are UTF-8 (helper-
    # found: it was refused, blaming the terminal)
    (["generate", "--ckpt", "c", "--prompt", "\udce4\udcbd\udca0好"], "prompt", "你好"),
    (["show", "\udce5\udc8f\udcaf", "--ckpt", "c"], "text", "可"),
    # a Windows line end pasted into an option reads as a file's does (it was refused as
    # '\r', a character not in a char-level checkpoint's vocabulary)
    (["generate", "--ckpt", "c", "--prompt", "我\r\n喜\r欢"], "prompt", "我\n喜\n欢"),
    (["learn", "3", "--text", "a\r\nb"], "text", "a\nb"),
])
def test_text_options_are_read_as_utf8_with_files_line_ends(argv, dest, want):
    from attnlab.cli import _read_text_options

    args = build_parser().parse_args(argv)
    assert _read_text_options(args) is None
    assert getattr(args, dest) == want


def test_a_path_options_leading_tilde_is_the_home_folder(tmp_path, monkeypatch, capsys):
    """``--out=~/pics`` reaches attnlab with the ``~`` (the shell expands it only at the
    start of a word): it is the home folder, never a folder named '~' here. A text option
    (show's sentence) keeps it as typed."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    from attnlab.cli import _expand_home

    args = build_parser().parse_args(["show", "~ahoy", "--ckpt", "~/run", "--out=~/pics"])
    _expand_home(args)
    home = tmp_path / "home"
    assert (args.out, args.ckpt, args.text) == (str(home / "pics"), str(home / "run"), "~ahoy")
    assert main(["train", "--model", "toy", "--steps", "1", "--out=~/run",
                 "--text", "~/none.txt"]) == 2
    assert "home/none.txt" in capsys.readouterr().err
    assert not (tmp_path / "~").exists()


def _usage_error(argv, capsys, monkeypatch, lang=None) -> str:
    for name in ("LC_ALL", "LC_MESSAGES", "LANG"):
        monkeypatch.delenv(name, raising=False)
    if lang is not None:
        monkeypatch.setenv("LANG", lang)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1  # one line
    return err


@pytest.mark.parametrize("argv,chinese", [
    (["learn", "abc", "--lang", "zh"], "attnlab learn: error: 参数 N：无效的整数值：'abc'"),
    (["learn", "--lang=zh", "--text"], "参数 --text：需要一个值"),
    (["check", "--lang", "zh"], "attnlab check: error: 缺少必需的参数：FILE:NAME"),
    (["learn", "2", "--lang", "zh", "--bogus"], "attnlab: error: 无法识别的参数：--bogus"),
])
def test_a_learners_usage_errors_speak_chinese_where_the_lessons_do(argv, chinese, capsys,
                                                                       monkeypatch):
    """learn and check: argparse's own errors in Chinese with --lang zh or, without
    --lang, a Chinese locale; in English with --lang en and for the other commands."""
    assert chinese in _usage_error(argv, capsys, monkeypatch)
    english = [a for a in argv if a not in ("--lang", "zh", "--lang=zh")]
    assert chinese in _usage_error(english, capsys, monkeypatch, lang="zh_CN.UTF-8")
    err = _usage_error([*english, "--lang", "en"], capsys, monkeypatch, lang="zh_CN.UTF-8")
    assert "error: " in err and not re.search(r"[\u4e00-\u9fff]", err)
    err = _usage_error(["demo", "--bogus"], capsys, monkeypatch, lang="zh_CN.UTF-8")
    assert "unrecognized arguments: --bogus" in err


@pytest.mark.parametrize("argv,chinese", [
    (["learn", "x", "--la", "zh"], True),  # an abbreviation, as argparse takes it
    (["learn", "x", "--lang", "zh", "--lang", "en"], False),  # the last one wins
    (["learn", "x", "--lang", "en", "--lang=zh"], True),
    (["--lang=zh", "learn", "x"], True),  # before the command
])
def test_the_language_of_a_usage_error_is_the_one_argparse_reads(argv, chinese, capsys,
                                                                  monkeypatch):
    err = _usage_error(argv, capsys, monkeypatch)
    assert bool(re.search(r"[\u4e00-\u9fff]", err)) == chinese, err


def test_every_argparse_error_template_has_its_chinese():
    """Each message this Python's argparse writes is matched whole (a template argparse
    changes fails here, not silently in English)."""
    from attnlab.cli.options import _Parser
    from attnlab.cli.usage_zh import translate

    def error_of(parser, argv) -> str:
        messages = []
        parser.error = messages.append
        # (argparse goes on past an error that does not exit, and may then fail)
        with contextlib.suppress(TypeError, AttributeError, IndexError):
            parser.parse_args(argv)
        return messages[0]

    def make():
        parser = _Parser(prog="x")
        parser.add_argument("n", type=int)
        parser.add_argument("--one")
        parser.add_argument("--maybe", nargs="?")
        parser.add_argument("--many", nargs="+")
        parser.add_argument("--two", nargs=2)
        parser.add_argument("--flag", action="store_true")
        parser.add_argument("--kind", choices=["a", "b"])
        parser.add_argument("--rate", type=float)
        either = parser.add_mutually_exclusive_group()
        either.add_argument("--left", action="store_true")
        either.add_argument("--right", action="store_true")
        parser.add_argument("--longer-a")
        parser.add_argument("--longer-b")
        return parser

    cases = {
        ("1", "--kind", "c"): "无效的选择",
        ("x",): "无效的整数值",
        ("1", "--rate", "r"): "无效的数字值",
        (): "缺少必需的参数",
        ("1", "--zz"): "无法识别的参数",
        ("1", "--one"): "需要一个值",
        ("1", "--many"): "至少需要一个值",
        ("1", "--two", "a"): "需要 2 个值",
        ("1", "--flag=yes"): "忽略了显式给出的值",
        ("1", "--left", "--right"): "不能与参数",
        ("1", "--longer"): "有歧义的选项",
    }
    for argv, chinese in cases.items():
        if argv == ("1", "--zz"):
            message = "unrecognized arguments: --zz"  # the top parser's own (parse_args)
        else:
            message = error_of(make(), list(argv))
        assert chinese in translate(message), (argv, message, translate(message))
    group = _Parser(prog="x")
    required = group.add_mutually_exclusive_group(required=True)
    required.add_argument("--a")
    required.add_argument("--b")
    assert "必须给出以下参数之一" in translate(error_of(group, []))
    assert translate("steps must be positive, got 0") == "steps must be positive, got 0"


def test_ctrl_c_while_the_options_are_read_is_an_interruption(monkeypatch, capsys):
    # Helper-found: checking an option imports torch (a second or more), and a Ctrl-C
    # then printed a KeyboardInterrupt traceback instead of one line and status 130.
    import attnlab.cli as cli

    def slow_import(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", slow_import)
    assert cli.main(["train", "--steps", "3"]) == 130
    assert capsys.readouterr().err == "attnlab: interrupted\n"
