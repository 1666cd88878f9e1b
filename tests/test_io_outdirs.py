"""Output folders as users have them: a delete cut short, private modes, mount points,
links to elsewhere, paths that are not UTF-8."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from test_io import _read_ckpt, _siblings, _write_ckpt

from attnlab import io
from attnlab.checkpoint import check_out_dir, load_checkpoint, same_weights, save_checkpoint
from attnlab.models import ToyAttnLM, ToyConfig


def test_a_delete_cut_short_leaves_a_folder_the_next_write_removes(tmp_path, monkeypatch):
    """The old copy is deleted after each swap; a Ctrl-C in the middle left a hidden
    folder the size of the model for ever when ``rmtree`` took the marker first."""
    final = tmp_path / "ckpt"
    with io.atomic_dir(final) as tmp:
        _write_ckpt(tmp, 1)
        for i in range(20):  # enough entries that the marker is not last by chance
            (tmp / f"extra-{i}").write_bytes(b"x")
    real_unlink = os.unlink
    removed: list[str] = []

    def unlink(path, *args, **kwargs):
        if ".tmp-" in str(path) or ".old-" in str(path) or "dir_fd" in kwargs:  # the old copy
            name = os.path.basename(path)
            if name != io.ATOMIC_MARKER and len(removed) >= 3:
                raise KeyboardInterrupt  # Ctrl-C a few files into the delete
            removed.append(name)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(KeyboardInterrupt), io.atomic_dir(final) as tmp:
        _write_ckpt(tmp, 2)
    monkeypatch.undo()
    assert io.ATOMIC_MARKER not in removed
    assert _read_ckpt(final) == 2
    assert len(_siblings(final)) == 1  # the half-deleted old copy, still marked
    with io.atomic_dir(final) as tmp:
        _write_ckpt(tmp, 3)
    assert _read_ckpt(final) == 3 and _siblings(final) == []


def test_a_checkpoint_keeps_the_modes_of_the_folder_and_files_it_replaces(tmp_path):
    out = tmp_path / "private"
    out.mkdir(mode=0o700)
    os.chmod(out, 0o700)  # (whatever the umask)
    model = ToyAttnLM(ToyConfig(vocab_size=8, context_length=8, d_model=8))
    save_checkpoint(model, out)
    assert (out.stat().st_mode & 0o777) == 0o700
    os.chmod(out / "model.safetensors", 0o600)
    save_checkpoint(model, out)
    assert (out.stat().st_mode & 0o777) == 0o700
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o600
    assert (out / "config.json").stat().st_mode & 0o777 == 0o644 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_mount_point_is_refused_before_work_and_a_failed_swap_leaves_no_marker(
        tmp_path, monkeypatch):
    """A Docker volume as --out trained, then failed at the first checkpoint (a mount
    point cannot be renamed) and left attnlab's marker in the user's folder."""
    out = tmp_path / "volume"
    out.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: str(p) == str(out) or real_ismount(p))
    with pytest.raises(ValueError, match="is a mount point; a checkpoint replaces its folder"):
        check_out_dir(out)
    monkeypatch.undo()
    with io.atomic_dir(out) as tmp:
        _write_ckpt(tmp, 1)
    real_rename = os.rename

    def rename(src, dst):
        if Path(src) == out:
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="busy"), io.atomic_dir(out) as tmp:
        _write_ckpt(tmp, 2)
    monkeypatch.undo()
    assert _read_ckpt(out) == 1
    assert not (out / io.ATOMIC_MARKER).exists() and _siblings(out) == []


def test_a_bind_mount_of_the_same_file_system_is_refused_as_a_mount_point(tmp_path,
                                                                          monkeypatch):
    """os.path.ismount compares devices: a bind mount (Docker's -v ./out:/out on the same
    disk) passed the check, trained, and failed at its first checkpoint."""
    from attnlab.checkpoint import folder

    out = tmp_path / "my out"
    out.mkdir()
    escaped = str(out).replace(" ", "\\040")
    table = tmp_path / "mountinfo"
    table.write_text(f"22 27 0:21 / /proc rw - proc proc rw\n"
                     f"31 27 8:1 /src {escaped} rw,relatime - ext4 /dev/sda1 rw\n")
    monkeypatch.setattr(folder, "MOUNTINFO", str(table))
    with pytest.raises(ValueError, match="is a mount point"):
        check_out_dir(out)
    check_out_dir(tmp_path / "elsewhere")  # a folder that is no mount point is taken


def test_an_out_that_links_elsewhere_is_checked_where_it_is_written(tmp_path):
    (tmp_path / "a-file").write_text("x")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "a-file" / "run")  # its folder cannot be made
    with pytest.raises(ValueError, match="cannot be written: .*a-file' is a file"):
        check_out_dir(link)


def test_paths_that_are_not_utf8_are_named_as_such(tmp_path, monkeypatch):
    """safetensors opens only UTF-8 paths: a checkpoint failed after training began, and a
    good file under such a name was called corrupt."""
    name = os.fsdecode(b"run\xe9")
    with pytest.raises(ValueError, match="is not a UTF-8 path"):
        check_out_dir(tmp_path / name)
    # a UTF-8 --out in a working folder that is not: the path as given is what is opened
    odd = tmp_path / os.fsdecode(b"caf\xe9")
    odd.mkdir()
    monkeypatch.chdir(odd)
    check_out_dir("run")
    model = ToyAttnLM(ToyConfig(vocab_size=8, context_length=8, d_model=8))
    save_checkpoint(model, "run")
    save_checkpoint(model, "run")
    assert [n for n in os.listdir(odd) if not n.endswith(".lock")] == ["run"]
    assert same_weights(load_checkpoint("run"), model)
    good = tmp_path / "good.safetensors"
    io.save_tensors(good, {"w": torch.ones(2)})
    odd = tmp_path / os.fsdecode(b"w\xe9.safetensors")
    os.link(good, odd)
    with pytest.raises(io.CheckpointError, match="safetensors opens only UTF-8 paths"):
        io.load_tensors(odd)


def test_a_json_list_is_attnlabs_only_when_every_record_is_signed(tmp_path):
    """A user's file merged from one of attnlab's records and notes of their own was
    taken for attnlab's (only its start was read) and replaced by ablate --json."""
    from attnlab.io.outdir import check_out_file, is_signed, signed

    ours = tmp_path / "ours.json"
    io.atomic_write_json(ours, signed([{"case": "x"}, {"case": "y"}]))
    assert is_signed(ours)
    check_out_file(ours)
    merged = tmp_path / "merged.json"
    merged.write_text('[{"written_by": "attnlab 0.1.0", "case": "x"},\n'
                      ' {"my_notes": "do not lose"}]\n')
    assert not is_signed(merged)
    with pytest.raises(ValueError):
        check_out_file(merged)
    notes = tmp_path / "notes.json"
    notes.write_text('[{"written_by": "attnlab 0.1.0"}, "my notes: do not lose", [1, 2], 42]')
    assert not is_signed(notes)
    assert "do not lose" in merged.read_text()
    record = tmp_path / "one.json"
    io.atomic_write_json(record, signed({"case": "x", "notes": [{"mine": 1}]}))
    assert is_signed(record)  # one record: its own signature is the file's


def test_a_delete_that_fails_keeps_the_marker_and_the_next_write_retries(tmp_path, monkeypatch):
    """A file the delete may not remove (EPERM, a busy NFS file): the marker went with the
    rest and the half-deleted copy was nobody's for ever."""
    final = tmp_path / "ckpt"
    with io.atomic_dir(final) as tmp:
        _write_ckpt(tmp, 1)
    real_unlink = os.unlink
    blocked = {"on": True}

    def unlink(path, *args, **kwargs):
        if blocked["on"] and os.path.basename(path) == "model.safetensors" and (
                ".tmp-" in str(path) or ".old-" in str(path) or "dir_fd" in kwargs):
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    with io.atomic_dir(final) as tmp:
        _write_ckpt(tmp, 2)
    left = _siblings(final)
    assert len(left) == 1 and (final.parent / left[0] / io.ATOMIC_MARKER).exists()
    blocked["on"] = False
    with io.atomic_dir(final) as tmp:
        _write_ckpt(tmp, 3)
    assert _read_ckpt(final) == 3 and _siblings(final) == []


def _as_a_user(monkeypatch):
    """os.unlink and os.rmdir refused in a folder without its owner's write bit, as for
    a user who is not root (the tests may run as root, who ignores the bits)."""
    import stat

    def guarded(real):
        def call(path, *args, dir_fd=None, **kwargs):
            parent = os.fstat(dir_fd) if dir_fd is not None else \
                os.stat(os.path.dirname(os.path.abspath(path)))
            if not parent.st_mode & stat.S_IWUSR:
                raise PermissionError(errno.EACCES, "Permission denied", path)
            return real(path, *args, dir_fd=dir_fd, **kwargs)
        return call

    monkeypatch.setattr(os, "unlink", guarded(os.unlink))
    monkeypatch.setattr(os, "rmdir", guarded(os.rmdir))


def test_a_read_only_subfolder_does_not_make_the_copies_undeletable(tmp_path, monkeypatch):
    """A user's chmod 555 on a folder inside the checkpoint: the copy set aside (the
    user's live folder, 555 inside) could not be emptied and stayed for ever."""
    final = tmp_path / "ckpt"
    with io.atomic_dir(final) as tmp:
        _write_ckpt(tmp, 1)
    os.chmod(final / "sub", 0o555)
    _as_a_user(monkeypatch)
    for version in (2, 3):
        with io.atomic_dir(final) as tmp:
            _write_ckpt(tmp, version)
    assert (final / "sub").stat().st_mode & 0o777 == 0o755  # the user's bits, and u+w
    assert _siblings(final) == []


def test_only_a_signed_picture_of_an_earlier_run_is_dropped(tmp_path):
    """drop_stale removes the other format's picture attnlab signed (show/heads into their
    own folder again); a user's file of the same name, a link, or nothing is left alone."""
    from attnlab.io.outdir import drop_stale, figure_metadata
    from attnlab.viz.heatmap import figure_bytes, heatmap

    fig = heatmap(torch.tensor([[1.0, 0.0], [0.5, 0.5]]), ["a", "b"])
    ours = tmp_path / "attention.png"
    io.atomic_write_bytes(ours, figure_bytes(fig, "png", dpi=50))
    assert "attnlab" in " ".join(figure_metadata("png").values())
    assert drop_stale(ours) and not ours.exists()
    assert not drop_stale(ours)  # nothing there
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"\x89PNG\r\n\x1a\n my own picture")
    link = tmp_path / "link.png"
    io.atomic_write_bytes(tmp_path / "target.png", figure_bytes(fig, "png", dpi=50))
    link.symlink_to(tmp_path / "target.png")
    assert not drop_stale(mine) and not drop_stale(link)
    assert mine.exists() and link.exists() and (tmp_path / "target.png").exists()
