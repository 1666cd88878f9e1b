"""Data loss: attnlab never replaces, renames or deletes anything it did not write."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from attnlab import io
from attnlab.checkpoint import load_checkpoint, save_checkpoint
from attnlab.models import ToyAttnLM, ToyConfig


def _user_folder(path, note="my notes"):
    path.mkdir()
    (path / "notes.txt").write_text(note)
    return path


def test_recover_leaves_a_users_old_looking_folder_alone(tmp_path, tiny_ckpt, snap):
    user = _user_folder(tmp_path / "ckpt.old-1")
    before = snap(user)
    io.recover_dir(tiny_ckpt)
    load_checkpoint(tiny_ckpt)
    assert snap(user) == before


def test_recover_never_puts_a_users_folder_in_place_of_a_missing_one(tmp_path):
    user = _user_folder(tmp_path / "results.old-2")
    (tmp_path / ".results.ready-12-0123abcd").mkdir()  # named like ours, not ours
    assert io.recover_dir(tmp_path / "results") is False
    assert not (tmp_path / "results").exists()
    assert (user / "notes.txt").read_text() == "my notes"
    assert (tmp_path / ".results.ready-12-0123abcd").is_dir()


def test_generate_on_a_missing_ckpt_renames_nothing(tmp_path, cli, one_line_error):
    user = _user_folder(tmp_path / "results.old-2")
    proc = cli(["generate", "--ckpt", "results", "--prompt", "a"], cwd=tmp_path)
    one_line_error(proc, "results")
    assert (user / "notes.txt").read_text() == "my notes"
    assert not (tmp_path / "results").exists()


def test_a_crash_leftover_of_our_own_is_still_recovered(tmp_path, tiny_ckpt):
    """The marker rule keeps recovery working for what attnlab did write."""
    real = os.rename
    calls = []

    def crash_before_the_last_rename(src, dst):
        calls.append((src, dst))
        if str(dst) == str(tiny_ckpt) and ".ready-" in str(src):
            raise KeyboardInterrupt  # killed between the two renames
        real(src, dst)

    model = load_checkpoint(tiny_ckpt)
    os.rename = crash_before_the_last_rename
    try:
        with pytest.raises(KeyboardInterrupt), io.atomic_dir(tiny_ckpt) as tmp:
            (tmp / "x").write_text("new")
    finally:
        os.rename = real
    assert tiny_ckpt.is_dir()  # rolled back
    save_checkpoint(model, tiny_ckpt)
    assert not [p for p in tmp_path.iterdir() if p.name != "ckpt"]


def test_save_checkpoint_refuses_a_folder_of_user_files(tmp_path, snap):
    d = tmp_path / "d"
    (d / "docs").mkdir(parents=True)
    (d / "docs" / "thesis.txt").write_text("four years of work")
    before = snap(d)
    with pytest.raises(ValueError, match=r"directory .* not an attnlab checkpoint.*docs"):
        save_checkpoint(ToyAttnLM(ToyConfig()), d)
    assert snap(d) == before


def test_save_checkpoint_replaces_its_own_checkpoint(tiny_ckpt):
    model = ToyAttnLM(ToyConfig())
    save_checkpoint(model, tiny_ckpt)
    assert type(load_checkpoint(tiny_ckpt)) is ToyAttnLM
    assert sorted(p.name for p in tiny_ckpt.iterdir()) == ["config.json", "model.safetensors"]


def test_a_symlinked_out_is_followed_never_replaced(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / "linkout"
    link.symlink_to(target, target_is_directory=True)
    save_checkpoint(ToyAttnLM(ToyConfig()), link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert (target / "model.safetensors").is_file()
    save_checkpoint(ToyAttnLM(ToyConfig()), link)  # and again, over its own checkpoint
    assert link.is_symlink() and type(load_checkpoint(link)) is ToyAttnLM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["linkout", "target"]


def test_show_refuses_a_folder_of_user_files(tmp_path, tiny_ckpt, cli, one_line_error, snap):
    out = _user_folder(tmp_path / "pics")
    before = snap(out)
    proc = cli(["show", "abc", "--ckpt", str(tiny_ckpt), "--out", str(out)], cwd=tmp_path)
    one_line_error(proc, "--out", "notes.txt")
    assert snap(out) == before


def test_show_writes_into_its_own_folder_again(tmp_path, tiny_ckpt):
    from attnlab.checkpoint import load_checkpoint_tokenizer
    from attnlab.viz import show_attention

    model, tok = load_checkpoint(tiny_ckpt), load_checkpoint_tokenizer(tiny_ckpt)
    for _ in range(2):
        paths = show_attention(model, tok, "abc", tmp_path / "pics")
    assert paths["png"].is_file() and paths["html"].is_file()


_HOLD = """
import sys, time
from attnlab.io.locks import output_lock
with output_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(60)
"""


def test_a_second_writer_is_refused_naming_the_holder(tmp_path, tiny_ckpt, snap):
    env = {**os.environ, "PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[2])}
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tiny_ckpt)], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = snap(tiny_ckpt)
        with pytest.raises(ValueError, match=rf"in use by another attnlab run \(pid {holder.pid}"):
            save_checkpoint(ToyAttnLM(ToyConfig()), tiny_ckpt)
        assert snap(tiny_ckpt) == before
    finally:
        holder.kill()
        holder.wait()
    # The holder was killed: its lock is taken over, no waiting, no error.
    save_checkpoint(ToyAttnLM(ToyConfig()), tiny_ckpt)
    assert not (tmp_path / ".ckpt.lock").exists()


def test_a_stale_lock_file_of_a_dead_process_is_taken_over(tmp_path, tiny_ckpt):
    (tmp_path / ".ckpt.lock").write_text("999999\n")
    save_checkpoint(ToyAttnLM(ToyConfig()), tiny_ckpt)
    assert type(load_checkpoint(tiny_ckpt)) is ToyAttnLM


@pytest.mark.slow
def test_two_concurrent_trainers_one_is_refused(tmp_path, cli, one_line_error):
    # The first run trains far longer than the test lasts and is stopped once the second
    # has been refused: the refusal, not the training, is what this checks.
    args = ["train", "--model", "toy", "--steps", "100000", "--context", "16", "--batch-size",
            "4", "--checkpoint-every", "20", "--out", "shared"]
    env = {**os.environ, "PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[2])}
    first = subprocess.Popen([sys.executable, "-m", "attnlab", *args], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "shared" / "config.json").exists():
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        second = cli(args, cwd=tmp_path)
        one_line_error(second, "shared", f"pid {first.pid}")
        assert first.poll() is None  # the holder was still training all along
    finally:
        first.kill()
        first.wait()
    # Killed mid-run, the folder still holds the last whole checkpoint.
    assert load_checkpoint(tmp_path / "shared").config.context_length == 16
