"""attnlab.io: atomic files, safetensors, JSON and atomic checkpoint directories."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from attnlab import io


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


# ------------------------------------------------------------------ atomic files


def test_atomic_write_variants_roundtrip(tmp_path):
    io.atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01binary")
    io.atomic_write_text(tmp_path / "t.txt", "héllo\n")
    io.atomic_write_json(tmp_path / "j.json", {"a": [1, 2.5, None], "ü": "x"})
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01binary"
    assert (tmp_path / "t.txt").read_text(encoding="utf-8") == "héllo\n"
    assert io.read_json(tmp_path / "j.json") == {"a": [1, 2.5, None], "ü": "x"}
    io.atomic_write_bytes(tmp_path / "b.bin", b"v2")  # overwrite
    assert (tmp_path / "b.bin").read_bytes() == b"v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.bin", "j.json", "t.txt"]


def test_atomic_write_keeps_mode_and_uses_umask(tmp_path):
    path = tmp_path / "f"
    old = os.umask(0o022)
    try:
        io.atomic_write_bytes(path, b"1")
        assert path.stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600
        path.chmod(0o640)
        io.atomic_write_bytes(path, b"2")
        assert path.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old)


def test_failed_replace_leaves_old_content_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    io.atomic_write_json(path, {"version": 1})

    def boom(src, dst):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        io.atomic_write_json(path, {"version": 2})
    with pytest.raises(OSError, match="disk on fire"):
        io.save_tensors(tmp_path / "w.safetensors", {"w": torch.ones(3)})
    monkeypatch.undo()
    assert io.read_json(path) == {"version": 1}
    assert list(tmp_path.iterdir()) == [path]


def test_write_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="data: expected bytes, got str"):
        io.atomic_write_bytes(tmp_path / "x", "text")
    with pytest.raises(TypeError, match="text: expected str, got bytes"):
        io.atomic_write_text(tmp_path / "x", b"x")
    with pytest.raises(TypeError, match="cannot be written as JSON"):
        io.atomic_write_json(tmp_path / "x", {"t": object()})
    with pytest.raises(IsADirectoryError, match="is a directory"):
        io.atomic_write_bytes(tmp_path, b"x")
    assert list(tmp_path.iterdir()) == []


def test_read_json_errors_name_the_path(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(io.CheckpointError, match=r"missing\.json.*file not found"):
        io.read_json(missing)
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1,')
    with pytest.raises(io.CheckpointError, match=r"bad\.json.*invalid JSON"):
        io.read_json(bad)
    lst = tmp_path / "list.json"
    lst.write_text("[1, 2]")
    with pytest.raises(io.CheckpointError, match=r"list\.json.*expected a JSON object.*list"):
        io.read_json(lst)
    assert issubclass(io.CheckpointError, ValueError)


# ----------------------------------------------------------------------- tensors


def test_tensor_roundtrip_dtypes_shared_and_metadata(tmp_path):
    base = torch.randn(4, 6)
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7, 2).to(torch.bfloat16),
        "i64": torch.tensor([0, -1, 2**62, -(2**63)], dtype=torch.int64),
        "bool": torch.tensor([True, False]),
        "emb": base,
        "head": base,  # tied weights: the same tensor twice
        "t": base.t(),  # non-contiguous view of the same storage
        "row": base[2],  # a slice
        "param": torch.nn.Parameter(torch.ones(2, 2)),  # requires grad
        "empty": torch.zeros(0, 3),
    }
    path = tmp_path / "model.safetensors"
    io.save_tensors(path, tensors, metadata={"format": "pt", "step": "12"})
    loaded = io.load_tensors(path)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype, name
        assert loaded[name].shape == t.shape, name
        assert torch.equal(loaded[name], t.detach()), name
    assert io.load_metadata(path) == {"format": "pt", "step": "12"}
    # the saved tensors are independent copies on load
    loaded["emb"].add_(1)
    assert not torch.equal(loaded["emb"], loaded["head"])
    # the caller's tensors were not modified or re-strided
    assert not tensors["t"].is_contiguous() and tensors["head"] is base


def test_metadata_defaults_and_validation(tmp_path):
    path = tmp_path / "a.safetensors"
    io.save_tensors(path, {"x": torch.zeros(1)})
    assert io.load_metadata(path) == {}
    with pytest.raises(TypeError, match="metadata: keys and values must be str"):
        io.save_tensors(path, {"x": torch.zeros(1)}, metadata={"step": 3})
    with pytest.raises(TypeError, match=r"tensors\['x'\]: expected a torch.Tensor, got list"):
        io.save_tensors(path, {"x": [1, 2]})
    with pytest.raises(TypeError, match="tensors: keys must be str"):
        io.save_tensors(path, {1: torch.zeros(1)})


@pytest.mark.parametrize("cut", [0, 4, 8, 20, -1, -64])
def test_truncated_file_raises_checkpoint_error(tmp_path, cut):
    path = tmp_path / "w.safetensors"
    io.save_tensors(path, {"a": torch.randn(16, 16), "b": torch.arange(10)})
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut >= 0 else data[:cut])
    with pytest.raises(io.CheckpointError, match=r"w\.safetensors.*not a valid safetensors"):
        io.load_tensors(path)


def test_garbage_and_missing_files(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header!!}")
    with pytest.raises(io.CheckpointError, match="not a valid safetensors"):
        io.load_tensors(path)
    with pytest.raises(io.CheckpointError, match="not a valid safetensors"):
        io.load_metadata(path)
    with pytest.raises(io.CheckpointError, match=r"nope\.safetensors.*file not found"):
        io.load_tensors(tmp_path / "nope.safetensors")
    with pytest.raises(io.CheckpointError, match="not a regular file"):
        io.load_tensors(tmp_path)


# -------------------------------------------------------------------- atomic dir


def _write_ckpt(d: Path, version: int) -> None:
    io.save_tensors(d / "model.safetensors", {"w": torch.full((4,), float(version))})
    io.atomic_write_json(d / "config.json", {"version": version})
    (d / "sub").mkdir()
    (d / "sub" / "note.txt").write_text(f"v{version}")


def _read_ckpt(d: Path) -> int:
    version = io.read_json(d / "config.json")["version"]
    assert torch.equal(io.load_tensors(d / "model.safetensors")["w"], torch.full((4,), version))
    assert (d / "sub" / "note.txt").read_text() == f"v{version}"
    return version


def test_atomic_dir_creates_and_replaces(tmp_path):
    final = tmp_path / "runs" / "ckpt"
    with io.atomic_dir(final) as tmp:
        assert tmp.parent == final.parent and tmp.is_dir() and not final.exists()
        _write_ckpt(tmp, 1)
    assert _read_ckpt(final) == 1
    (final / "stale.txt").write_text("from v1")
    with io.atomic_dir(final) as tmp:
        _write_ckpt(tmp, 2)
        assert _read_ckpt(final) == 1  # untouched while the new one is written
    assert _read_ckpt(final) == 2
    assert not (final / "stale.txt").exists()
    assert _siblings(final) == []


def test_atomic_dir_exception_keeps_old_dir(tmp_path):
    final = tmp_path / "ckpt"
    with io.atomic_dir(final) as tmp:
        _write_ckpt(tmp, 1)
    with pytest.raises(RuntimeError, match="crash while writing"), io.atomic_dir(final) as tmp:
        _write_ckpt(tmp, 2)
        raise RuntimeError("crash while writing")
    assert _read_ckpt(final) == 1
    assert _siblings(final) == []


def test_atomic_dir_failed_swap_rolls_back(tmp_path, monkeypatch):
    final = tmp_path / "ckpt"
    with io.atomic_dir(final) as tmp:
        _write_ckpt(tmp, 1)
    real_rename = os.rename

    def rename(src, dst):  # fail the last step: ready copy -> final
        if Path(dst) == final and ".ready-" in Path(src).name:
            raise OSError("power cut")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="power cut"), io.atomic_dir(final) as tmp:
        _write_ckpt(tmp, 2)
    monkeypatch.undo()
    assert _read_ckpt(final) == 1
    assert _siblings(final) == []


def test_atomic_dir_rejects_bad_targets(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="final_dir: .* is not a directory"), io.atomic_dir(
        tmp_path / "file"
    ):
        pass


def _crash_leftovers(final: Path, *, old: int | None, ready: int | None, tmp: bool) -> None:
    """Lay out what a writer killed between the two renames leaves behind."""
    for version, name in ((old, f"{final.name}.old-999999-01234567"),
                          (ready, f".{final.name}.ready-999999-0123abcd")):
        if version is not None:
            d = final.parent / name
            d.mkdir()
            _write_ckpt(d, version)
            (d / io.ATOMIC_MARKER).write_text(f"{final.name}\n{name.split('-', 1)[1]}\n")
    if tmp:
        d = final.parent / f".{final.name}.tmp-999999-deadbeef"
        d.mkdir()
        (d / "partial").write_bytes(b"x")
        (d / io.ATOMIC_MARKER).write_text(f"{final.name}\n999999-deadbeef\n")


@pytest.mark.parametrize(
    ("old", "ready", "expected"), [(1, 2, 2), (1, None, 1), (None, 2, 2)]
)
def test_recover_dir_restores_a_complete_copy(tmp_path, old, ready, expected):
    final = tmp_path / "ckpt"
    (tmp_path / "ckpt.old-notes").mkdir()  # not ours: must survive
    _crash_leftovers(final, old=old, ready=ready, tmp=True)
    assert io.recover_dir(final) is True
    assert _read_ckpt(final) == expected
    assert _siblings(final) == ["ckpt.old-notes"]
    assert io.recover_dir(final) is False


def test_recover_dir_cleans_up_when_final_exists(tmp_path):
    final = tmp_path / "ckpt"
    with io.atomic_dir(final) as d:
        _write_ckpt(d, 3)
    _crash_leftovers(final, old=1, ready=2, tmp=True)
    assert io.recover_dir(final) is False
    assert _read_ckpt(final) == 3
    assert _siblings(final) == []


def test_recover_dir_never_restores_a_partial_temp(tmp_path):
    final = tmp_path / "ckpt"
    _crash_leftovers(final, old=None, ready=None, tmp=True)
    assert io.recover_dir(final) is False
    assert not final.exists() and _siblings(final) == []
    assert io.recover_dir(tmp_path / "never-written") is False


def test_atomic_dir_recovers_before_writing(tmp_path):
    final = tmp_path / "ckpt"
    _crash_leftovers(final, old=1, ready=None, tmp=True)
    with io.atomic_dir(final) as d:
        _write_ckpt(d, 2)
    assert _read_ckpt(final) == 2
    assert _siblings(final) == []


# ------------------------------------------------------------ killed mid-write

_WRITER = textwrap.dedent(
    """
    import struct, sys
    from attnlab.io import atomic_write_bytes
    path, size = sys.argv[1], int(sys.argv[2])
    version = 0
    while True:
        version += 1
        body = bytes([version % 251]) * size
        atomic_write_bytes(path, struct.pack("<QQ", version, size) + body)
    """
)


def _check_complete(data: bytes) -> int:
    import struct

    version, size = struct.unpack("<QQ", data[:16])
    body = data[16:]
    assert len(body) == size, f"version {version}: {len(body)} of {size} bytes"
    assert body.count(bytes([version % 251])) == size, f"version {version}: mixed content"
    return version


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(5))
def test_sigkill_during_writes_leaves_one_complete_version(tmp_path, round_):
    path = tmp_path / "payload.bin"
    size = 8 * 1024 * 1024 + random.randrange(1024)
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(size)])
    try:
        deadline = time.monotonic() + 120
        while not path.exists():  # wait for the first complete version
            assert proc.poll() is None, "writer died"
            assert time.monotonic() < deadline, "writer never wrote"
            time.sleep(0.01)
        # readers during the writes always see one complete version...
        first_seen = seen = _check_complete(path.read_bytes())
        stop = time.monotonic() + random.uniform(0.1, 0.8)
        while time.monotonic() < stop:
            version = _check_complete(path.read_bytes())
            assert version >= seen
            seen = version
        time.sleep(random.uniform(0.0, 0.05))  # ...and so does the file after a kill
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    last = _check_complete(path.read_bytes())
    assert last >= first_seen >= 1
    # a killed writer may leave its temp file, never a damaged target
    leftovers = [p.name for p in tmp_path.iterdir() if p != path]
    assert all(n.startswith(".payload.bin.") and n.endswith(".tmp") for n in leftovers)
    assert len(leftovers) <= 1


_DIR_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from attnlab.io import atomic_dir
    with atomic_dir(sys.argv[1]) as tmp:
        (tmp / "part").write_text("partial")
        Path(sys.argv[2]).write_text(str(tmp))
        time.sleep(float(sys.argv[3]))
    """
)


@pytest.mark.slow
def test_recover_dir_waits_for_a_live_writer_in_another_process(tmp_path):
    final, started = tmp_path / "ckpt", tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", _DIR_WRITER, str(final), str(started), "1.5"])
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "writer did not start"
            time.sleep(0.01)
        writer_tmp = Path(started.read_text())
        assert writer_tmp.is_dir()
        t0 = time.monotonic()
        assert io.recover_dir(final) is False  # blocks on the writer's lock, deletes nothing
        assert time.monotonic() - t0 > 0.5
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (final / "part").read_text() == "partial"
    assert _siblings(final) == ["started"]


def test_reading_standard_input_stops_at_the_first_short_read():
    """A terminal ends its input with one Ctrl-D: the read that meets it comes back short,
    and a read after it would wait for a second one (it did, before)."""
    from io import BytesIO

    from attnlab.io.reading import read_stream_text

    class Terminal:
        def __init__(self, data: bytes):
            self.data, self.reads = data, 0

        def read(self, n: int) -> bytes:
            self.reads += 1
            assert self.reads == 1, "read again after the end: a second Ctrl-D was needed"
            return self.data[:n]

    assert read_stream_text(Terminal("注意力 😀\n".encode()), 1 << 20, "stdin") == "注意力 😀\n"
    with pytest.raises(io.CheckpointError, match="stdin holds more than"):
        read_stream_text(BytesIO(b"x" * 101), 100, "stdin")
    assert read_stream_text(BytesIO(b"x" * 100), 100, "stdin") == "x" * 100


def test_text_is_read_as_python_reads_text_files(tmp_path):
    """A Windows editor's file: a byte-order mark and CRLF line ends. Read as UTF-8 with the
    BOM dropped and every line end a "\\n" (a tokenizer trained on it learned "\\r" and
    "\\ufeff" as characters, and generated text carried them); standard input the same."""
    import io as _io

    from attnlab.io.reading import read_stream_text, read_text

    data = "\ufeff床前明月光🌙\r\n疑是地上霜\r\rend\r".encode()
    (tmp_path / "poem.txt").write_bytes(data)
    want = "床前明月光🌙\n疑是地上霜\n\nend\n"
    assert read_text(tmp_path / "poem.txt", 1000) == want
    assert read_stream_text(_io.BytesIO(data), 1000, "--text -") == want
    (tmp_path / "blank.txt").write_bytes(b"\xef\xbb\xbf\r\n\r\n")
    assert read_text(tmp_path / "blank.txt", 1000).strip() == ""


@pytest.mark.parametrize("text, encoding, hint", [
    ("我喜欢蓝色的天空。\n你好，世界！\n", "gbk", True),  # Chinese Windows' Notepad
    ("注意力机制", "gb18030", True),
    ("café résumé naïve", "latin-1", False),  # pairs of its bytes are GBK too: no hint
    # (review-found: Japanese and Korean bytes read as Chinese in GB18030 too; the hint
    # names their encodings, not GB18030 alone)
    ("今日は良い天気ですね。", "shift_jis", True),
    ("오늘은 날씨가 좋네요.", "euc_kr", True),
])
def test_a_file_in_gbk_says_what_it_is_and_how_to_convert_it(tmp_path, text, encoding, hint):
    from attnlab.io.reading import read_text

    path = tmp_path / "text.txt"
    path.write_bytes(text.encode(encoding))
    with pytest.raises(ValueError, match="is not UTF-8 text") as info:
        read_text(path, 1 << 20)
    assert ("iconv -f gb18030 -t utf-8" in str(info.value)) == hint, info.value
    assert ("Shift-JIS for Japanese, EUC-KR for Korean" in str(info.value)) == hint


@pytest.mark.parametrize("encoding, codec", [
    ("utf-16", "utf-16"),  # Windows Notepad's "Unicode", PowerShell 5's `>`: a BOM
    ("utf-16-le", "utf-16le"), ("utf-16-be", "utf-16be"),  # no BOM: the zero bytes tell
])
def test_a_file_in_utf16_is_named_so_not_as_gbk(tmp_path, encoding, codec):
    """Helper-found: UTF-16 text got GBK's hint, whose iconv turned it into mojibake."""
    import io as _io

    from attnlab.io.reading import read_stream_text, read_text

    data = ("注意力机制让模型学会关注重要的词。\r\n" * 30).encode(encoding)
    (tmp_path / "text.txt").write_bytes(data)
    for read in (lambda: read_text(tmp_path / "text.txt", 1 << 20),
                 lambda: read_stream_text(_io.BytesIO(data), 1 << 20, "--prompt -")):
        with pytest.raises(ValueError, match="is not UTF-8 text") as info:
            read()
        assert f"iconv -f {codec} -t utf-8" in str(info.value), info.value
        assert "gb18030" not in str(info.value)
    # a binary file's zero bytes (both places) are not taken for UTF-16
    (tmp_path / "bin").write_bytes(bytes(range(256)) * 8)
    with pytest.raises(ValueError, match="is not UTF-8 text") as info:
        read_text(tmp_path / "bin", 1 << 20)
    assert "UTF-16" not in str(info.value)
