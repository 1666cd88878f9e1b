"""Shared tools of the hostile suite: run the CLI as a user would, snapshot files.

Every hostile case asserts the same three things: one clean error line (or a
correct result), no traceback, no hang (a subprocess timeout fails the test),
and the user's files byte-for-byte unchanged.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root``: files by content, links by target, folders by name."""
    found: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                found[rel] = "-> " + os.readlink(p)
            elif p.is_file():
                found[rel] = p.read_bytes()
            elif p.is_dir():
                found[rel] = "dir"
    return found


def run_cli(args: list[str], *, cwd: Path, timeout: float = 120,
            stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": ""}
    return subprocess.run([sys.executable, "-m", "attnlab", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, input=stdin)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, no traceback, exactly one line on stderr holding every needle."""
    err = proc.stderr
    assert "Traceback" not in err, err
    assert proc.returncode == 2, (proc.returncode, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture
def tiny_ckpt(tmp_path):
    """A small trained-shape GPT checkpoint with a char tokenizer, built in a blink."""
    import torch

    from attnlab.checkpoint import save_checkpoint
    from attnlab.models import GPT, GPTConfig
    from attnlab.text import CharTokenizer

    tok = CharTokenizer.from_text("abcdefgh ")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=32, d_model=16,
                          num_layers=1, num_heads=2))
    out = tmp_path / "ckpt"
    save_checkpoint(model, out, tokenizer=tok)
    return out


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def one_line_error():
    return assert_one_line_error


@pytest.fixture
def snap():
    return snapshot
