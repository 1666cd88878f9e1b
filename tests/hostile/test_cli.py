"""The command line under hostile options and files: one line on stderr and exit 2,
or a correct result; never a traceback, a hang, or a change to the user's files."""

from __future__ import annotations

import os

import pytest
import torch

from attnlab.io import load_tensors, save_tensors

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("option", [["--temperature", "1e-45"], ["--top-p", "1e-300"],
                                    ["--temperature", "1e-300", "--top-k", "1"]])
def test_generate_with_degenerate_sampling_finishes(tiny_ckpt, tmp_path, cli, option):
    proc = cli(["generate", "--ckpt", str(tiny_ckpt), "--prompt", "ab", "--max-new-tokens",
                "5", *option], cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.startswith("ab") and len(proc.stdout.rstrip("\n")) == 7


def test_generate_from_a_nan_checkpoint_is_refused_before_output(tiny_ckpt, tmp_path, cli,
                                                                 one_line_error):
    weights = load_tensors(tiny_ckpt / "model.safetensors")
    name = next(iter(weights))
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_tensors(tiny_ckpt / "model.safetensors", weights)
    proc = cli(["generate", "--ckpt", str(tiny_ckpt), "--prompt", "ab", "--temperature", "0"],
               cwd=tmp_path)
    one_line_error(proc, "NaN or inf", name)
    assert proc.stdout == ""


def test_an_unknown_format_number_is_refused(tiny_ckpt, tmp_path, cli, one_line_error):
    import json

    meta = json.loads((tiny_ckpt / "config.json").read_text())
    meta["format"] = 99
    (tiny_ckpt / "config.json").write_text(json.dumps(meta))
    proc = cli(["generate", "--ckpt", str(tiny_ckpt), "--prompt", "ab"], cwd=tmp_path)
    one_line_error(proc, "format must be 1, got 99")


def test_train_into_a_symlink_to_a_user_folder_is_refused(tmp_path, cli, one_line_error,
                                                         snap):
    user = tmp_path / "thesis"
    user.mkdir()
    (user / "chapter1.tex").write_text("\\chapter{One}")
    (tmp_path / "linkout").symlink_to(user, target_is_directory=True)
    before = snap(tmp_path)
    proc = cli(["train", "--model", "toy", "--steps", "2", "--out", "linkout"], cwd=tmp_path)
    one_line_error(proc, "linkout", "chapter1.tex")
    assert snap(tmp_path) == before


def test_train_into_a_symlink_to_an_empty_folder_follows_it(tmp_path, cli):
    (tmp_path / "target").mkdir()
    (tmp_path / "linkout").symlink_to(tmp_path / "target", target_is_directory=True)
    proc = cli(["train", "--model", "toy", "--steps", "2", "--context", "16",
                "--batch-size", "4", "--out", "linkout"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert os.path.islink(tmp_path / "linkout")
    assert (tmp_path / "target" / "model.safetensors").is_file()


@pytest.mark.parametrize("option", [["--batch-size", str(10**12)], ["--context", str(10**9)],
                                    ["--model", "toy", "--context", str(10**9)]])
def test_absurd_sizes_are_refused_before_allocating(tmp_path, cli, one_line_error, option):
    proc = cli(["train", *option, "--out", "o"], cwd=tmp_path, timeout=120)
    one_line_error(proc, "GiB of memory", "this machine has")
    assert not (tmp_path / "o").exists()


def test_a_prompt_outside_the_tokenizer_is_one_line(tiny_ckpt, tmp_path, cli, one_line_error):
    proc = cli(["generate", "--ckpt", str(tiny_ckpt), "--prompt", "xyz"], cwd=tmp_path)
    one_line_error(proc, "--prompt")


def _generate_args(ckpt) -> list[str]:
    return ["generate", "--ckpt", str(ckpt), "--prompt", "abc", "--max-new-tokens", "400",
            "--temperature", "0"]


def test_a_closed_stdout_is_one_line(tiny_ckpt, tmp_path, one_line_error):
    """`attnlab generate ... >&-` (no standard output at all) said AttributeError with a
    traceback."""
    import subprocess
    import sys

    from conftest import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(f"{sys.executable} -m attnlab {' '.join(_generate_args(tiny_ckpt))} "
                          ">&-", shell=True, cwd=tmp_path, env=env, capture_output=False,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    one_line_error(proc, "standard output is closed")


def test_a_reader_that_goes_away_ends_the_command_quietly(tiny_ckpt, tmp_path):
    """`attnlab generate ... | head -c 3` printed "error: [Errno 32] Broken pipe" and exited
    2; now it ends as a program killed by SIGPIPE does (status 141), saying nothing."""
    import subprocess
    import sys

    from conftest import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        f"{sys.executable} -m attnlab {' '.join(_generate_args(tiny_ckpt))} | head -c 3 "
        ">/dev/null; echo status=${PIPESTATUS[0]} >&2", shell=True, executable="/bin/bash",
        cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True, timeout=120)
    said = [line for line in proc.stderr.strip().splitlines() if not line.startswith("note:")]
    assert said == ["status=141"], proc.stderr  # (the note: 400 tokens pass the context)


def _run_generate_to(stdout, stderr, tiny_ckpt, tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "attnlab", *_generate_args(tiny_ckpt)],
                            cwd=tmp_path, env=env, stdout=stdout, stderr=stderr)


def test_a_socket_whose_reader_went_away_ends_quietly_too(tiny_ckpt, tmp_path):
    """A closed socket reports a hang-up, not an error, to poll: it read as another
    pipe's failure (exit 2, 'Broken pipe')."""
    import socket

    ours, theirs = socket.socketpair()
    proc = _run_generate_to(theirs.fileno(), -1, tiny_ckpt, tmp_path)
    theirs.close()
    ours.recv(3)
    ours.close()
    assert proc.wait(timeout=120) == 141


def test_a_stderr_whose_reader_went_away_ends_quietly(tmp_path):
    """stdout to a file, stderr into a pipe whose reader is gone (`2>&1 >out.txt | head`):
    the error line itself could not be written, so Python printed a traceback nobody saw
    and exited 1."""
    import subprocess
    import sys

    from conftest import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line on stderr
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.run([sys.executable, "-m", "attnlab", "train", "--steps", "2",
                               "--batch-size", "2", "--context", "16", "--out", "run"],
                              cwd=tmp_path, env=env, stdout=out, stderr=write_end, timeout=300)
    os.close(write_end)
    assert proc.returncode == 141


def test_a_prompt_from_standard_input_is_the_prompt_given_inline(tiny_ckpt, tmp_path, cli,
                                                                  one_line_error):
    """`echo abc | attnlab generate --prompt -` continues "abc" (echo's newline dropped),
    exactly as `--prompt abc` does; an empty pipe is one line."""
    args = ["generate", "--ckpt", str(tiny_ckpt), "--max-new-tokens", "8",
            "--temperature", "0", "--prompt"]
    piped = cli([*args, "-"], cwd=tmp_path, stdin="abc\n")
    inline = cli([*args, "abc"], cwd=tmp_path)
    assert piped.returncode == inline.returncode == 0, piped.stderr
    assert piped.stdout == inline.stdout and piped.stdout.startswith("abc")
    one_line_error(cli([*args, "-"], cwd=tmp_path, stdin=""), "--prompt is empty")
