"""Hostile files: FIFOs, devices, folders, huge or deeply nested JSON, odd tokenizers.

Each is refused in one line naming the file, without hanging (a FIFO with no
writer blocks a plain open forever) and without reading unbounded data.
"""

from __future__ import annotations

import json
import os

import pytest

from attnlab.checkpoint import load_checkpoint, load_checkpoint_tokenizer
from attnlab.io import CheckpointError, read_json
from attnlab.io.reading import read_bytes
from attnlab.text import load_tokenizer


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def test_read_refuses_a_fifo_without_blocking(fifo):
    with pytest.raises(CheckpointError, match="is a FIFO; expected a regular file"):
        read_bytes(fifo, 100, "config")


def test_read_refuses_dev_zero_and_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="is a device"):
        read_json("/dev/zero")
    with pytest.raises(CheckpointError, match="is a directory"):
        read_json(tmp_path)


def test_read_refuses_a_file_over_its_limit(tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 2048 + b"{}")
    with pytest.raises(CheckpointError, match="over the limit of 1024 bytes"):
        read_json(big, limit=1024)


def test_deeply_nested_json_is_one_error(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="nested too deeply"):
        read_json(deep)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
@pytest.mark.parametrize("kind", ["fifo", "zero", "dir"])
def test_hostile_checkpoint_files_are_refused(tiny_ckpt, name, kind, snap):
    target = tiny_ckpt / name
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "zero":
        target.symlink_to("/dev/zero")
    else:
        target.mkdir()
    before = snap(tiny_ckpt)
    with pytest.raises(ValueError, match=name):
        load_checkpoint(tiny_ckpt)
        load_checkpoint_tokenizer(tiny_ckpt)
    assert snap(tiny_ckpt) == before


def test_config_over_a_mebibyte_is_refused(tiny_ckpt):
    meta = json.loads((tiny_ckpt / "config.json").read_text())
    meta["padding"] = "x" * (1 << 20)
    (tiny_ckpt / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="over the limit of 1 MiB"):
        load_checkpoint(tiny_ckpt)


def test_a_tokenizer_type_that_is_not_a_name_names_the_file(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"type": ["char"]}))
    with pytest.raises(ValueError, match=r"tokenizer.json.*unknown tokenizer type \['char'\]"):
        load_tokenizer(path)


def test_a_panicking_tokenizer_library_is_one_error(tmp_path, monkeypatch):
    """pyo3's PanicException derives from BaseException, not Exception."""
    import tokenizers

    from attnlab.text import HFTokenizer

    class PanicException(BaseException):
        pass

    def panic(_text):
        raise PanicException("called `Result::unwrap()` on an `Err` value: regex")

    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"model": {"type": "WordLevel", "vocab": {"a": 0}}}))
    monkeypatch.setattr(tokenizers.Tokenizer, "from_str", staticmethod(panic))
    with pytest.raises(ValueError, match="tokenizer.json.*not a valid Hugging Face"):
        HFTokenizer(path)
    with pytest.raises(ValueError, match="json_str: not a valid"):
        HFTokenizer.from_str("{}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fifo", "zero", "dir"])
def test_cli_text_that_is_not_a_regular_file(tmp_path, kind, cli, one_line_error):
    if kind == "fifo":
        os.mkfifo(tmp_path / "t")
        arg = str(tmp_path / "t")
    else:
        arg = "/dev/zero" if kind == "zero" else str(tmp_path)
    proc = cli(["train", "--text", arg, "--out", str(tmp_path / "o")], cwd=tmp_path, timeout=60)
    one_line_error(proc, "--text", "expected a regular file")
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_cli_generate_from_a_fifo_config(tiny_ckpt, tmp_path, cli, one_line_error):
    (tiny_ckpt / "config.json").unlink()
    os.mkfifo(tiny_ckpt / "config.json")
    proc = cli(["generate", "--ckpt", str(tiny_ckpt), "--prompt", "ab"], cwd=tmp_path,
               timeout=60)
    one_line_error(proc, "config.json", "FIFO")


def test_a_char_tokenizer_cut_short_is_refused_not_left_to_print_nothing(tiny_ckpt, snap):
    # Training sizes the model to its own tokenizer: fewer characters than the model's
    # vocabulary is another tokenizer or a damaged file, whose missing ids would print
    # nothing. The error names the file and both sizes.
    path = tiny_ckpt / "tokenizer.json"
    data = json.loads(path.read_text())
    data["chars"] = data["chars"][:4]
    path.write_text(json.dumps(data))
    before = snap(tiny_ckpt)
    with pytest.raises(ValueError, match=r"tokenizer.json' has 4 tokens .* expected exactly"):
        load_checkpoint_tokenizer(tiny_ckpt)
    assert snap(tiny_ckpt) == before


def test_the_finite_check_of_a_loaded_model_reads_every_chunk():
    # (chunked so that an embedding's check makes no mask as big as the embedding)
    import torch

    from attnlab.checkpoint.format import _all_finite

    t = torch.zeros(10, 7)
    assert _all_finite(t, chunk=8) and _all_finite(torch.zeros(0), chunk=8)
    for where, bad in ((69, float("nan")), (33, float("inf")), (0, -float("inf"))):
        u = t.clone()
        u.view(-1)[where] = bad
        assert not _all_finite(u, chunk=8)
    assert _all_finite(t.t(), chunk=8)  # a transposed view
