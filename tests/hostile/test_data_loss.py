"""Data loss: attnlab never replaces, renames or deletes anything it did not write."""

from __future__ import annotations

import json
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
    (tmp_path / ".ckpt.lock").write_text("attnlab lock 999999\n")
    save_checkpoint(ToyAttnLM(ToyConfig()), tiny_ckpt)
    assert type(load_checkpoint(tiny_ckpt)) is ToyAttnLM


@pytest.mark.parametrize("kind", ["text", "digits", "empty", "link", "folder"])
def test_a_file_of_the_lock_files_name_that_attnlab_did_not_write_is_left_alone(
        tmp_path, tiny_ckpt, kind, snap):
    """The user's own ``.ckpt.lock`` (or a link, or a folder of that name) is never
    truncated, written through or removed: the run is refused and the checkpoint kept."""
    lock = tmp_path / ".ckpt.lock"
    target = tmp_path / "notes.txt"
    target.write_text("注意力 notes 🙂\n", encoding="utf-8")
    if kind == "text":
        lock.write_text("my own lock notes\n")
    elif kind == "digits":  # a year, a count: digits alone are not attnlab's signature
        lock.write_text("2024\n")
    elif kind == "empty":
        lock.touch()
    elif kind == "link":
        lock.symlink_to(target)
    else:
        lock.mkdir()
    before = snap(tiny_ckpt)
    with pytest.raises(ValueError, match="is not a lock file attnlab wrote"):
        save_checkpoint(ToyAttnLM(ToyConfig()), tiny_ckpt)
    assert snap(tiny_ckpt) == before
    assert target.read_text(encoding="utf-8") == "注意力 notes 🙂\n"
    if kind == "text":
        assert lock.read_text() == "my own lock notes\n"
    elif kind == "digits":
        assert lock.read_text() == "2024\n"
    elif kind == "empty":
        assert lock.is_file() and lock.stat().st_size == 0
    elif kind == "link":
        assert lock.is_symlink()
    else:
        assert lock.is_dir()


def test_the_lock_file_names_attnlab_and_the_holder(tmp_path):
    from attnlab.io.locks import output_lock

    with output_lock(tmp_path / "out") as path:
        assert path.read_text() == f"attnlab lock {os.getpid()}\n"
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []  # nothing else left beside the output


def test_a_user_file_put_in_the_lock_files_place_during_a_run_stays(tmp_path):
    from attnlab.io.locks import output_lock

    with output_lock(tmp_path / "out") as path:
        path.unlink()
        path.write_text("mine\n")
    assert path.read_text() == "mine\n"


def test_digits_then_more_are_not_a_lock_file(tmp_path):
    """Only a whole short file 'attnlab lock <pid>' is attnlab's."""
    from attnlab.io.locks import output_lock

    lock = tmp_path / ".out.lock"
    lock.write_text("1" * 70 + " and the rest of my notes\n")
    with (pytest.raises(ValueError, match="is not a lock file attnlab wrote"),
          output_lock(tmp_path / "out")):
        pass
    assert lock.read_text() == "1" * 70 + " and the rest of my notes\n"


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


# ------------------------------------------------------- single output files (--json, --png)


def _figure(**savefig_kw):
    import io as stdio

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1, 1))
    fig.add_subplot().plot([0, 1])
    buf = stdio.BytesIO()
    fig.savefig(buf, **savefig_kw)
    return fig, buf.getvalue()


def test_an_output_file_is_replaced_only_where_attnlab_signed_it(tmp_path, snap):
    from attnlab.io.outdir import check_out_file, is_signed, signed
    from attnlab.viz.heatmap import figure_bytes

    fig, plain_png = _figure(format="png")  # matplotlib's own "Software" chunk
    _, plain_svg = _figure(format="svg")
    users = {
        "notes.json": b'{"my": "results", "written_by": "me"}\n',
        "records.json": b'[{"suite": "attention", "case": "x", "impl": "y"}]\n',
        "fake.json": b'{"written_by": "attnlabs inc."}',  # a prefix, not the signature
        "plot.png": plain_png,
        "plot.svg": plain_svg,
        "notes.txt": "注意力 🙂 my notes\n".encode(),
        "empty.json": b"",
    }
    for name, data in users.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "link.json").symlink_to(tmp_path / "notes.json")
    ours = {
        "bench.json": json.dumps(signed([{"suite": "a", "case": "b", "impl": "c"}] * 2),
                                 indent=1).encode(),
        "ablate.json": json.dumps(signed({"heads": [[0, 1]]})).encode(),
        "heads.png": figure_bytes(fig, "png"),
        "heads.svg": figure_bytes(fig, "svg"),
    }
    for name, data in ours.items():
        (tmp_path / name).write_bytes(data)
    before = snap(tmp_path)
    for name in [*users, "link.json"]:
        assert not is_signed(tmp_path / name), name
        with pytest.raises(ValueError, match=r"^--json '.*" + name.replace(".", r"\.")
                           + r"' is (a file attnlab did not write|a symlink)"):
            check_out_file(tmp_path / name, "--json")
    for name in ours:
        assert is_signed(tmp_path / name), name
        check_out_file(tmp_path / name, "--json")  # its own: may be replaced
    check_out_file(tmp_path / "new.json", "--json")
    assert snap(tmp_path) == before
    assert json.loads(ours["bench.json"])[1]["written_by"].startswith("attnlab ")


def test_bench_json_replaces_its_own_records_and_refuses_a_users_file(tmp_path, monkeypatch,
                                                                      snap):
    from attnlab import bench

    record = {"suite": "attention", "case": "c", "impl": "i", "median_ms": 1.0}
    monkeypatch.setattr(bench, "run_cases", lambda cases, **kw: [dict(record)])
    out = tmp_path / "b.json"
    for _ in range(2):  # the second run replaces the first run's file
        (returned,) = bench.run(["attention"], quick=True, json_path=out, log=None)
        assert returned["median_ms"] == 1.0 and "written_by" not in returned
        assert json.loads(out.read_text()) == [{"written_by": io.outdir.SIGNATURE, **returned}]
    mine = tmp_path / "mine.json"
    mine.write_text('[{"suite": "attention", "mine": true}]')
    before = snap(tmp_path)
    with pytest.raises(ValueError, match="json_path .*mine.json' is a file attnlab did not"):
        bench.run(["attention"], quick=True, json_path=mine, log=None)
    assert snap(tmp_path) == before


@pytest.mark.parametrize("name", ["attention.png", "attention.html", "summary.json"])
def test_show_leaves_a_users_file_of_its_own_name_alone(tmp_path, tiny_ckpt, name, snap):
    """A folder holding the user's own ``attention.png`` (no attnlab signature in it): the
    name alone does not make it attnlab's, so show refuses the folder instead of writing
    over it; a folder show wrote itself is written again."""
    from attnlab.checkpoint import load_checkpoint_tokenizer
    from attnlab.viz import show_attention

    model, tok = load_checkpoint(tiny_ckpt), load_checkpoint_tokenizer(tiny_ckpt)
    mine = tmp_path / "pics"
    mine.mkdir()
    (mine / name).write_bytes(b"\x89PNG\r\n\x1a\n my own picture" if name.endswith("png")
                              else b"<html>my page</html>" if name.endswith("html")
                              else b'{"my": "numbers"}')
    before = snap(mine)
    with pytest.raises(ValueError, match=f"attnlab did not write.*{name}"):
        show_attention(model, tok, "abc", mine)
    assert snap(mine) == before
    ours = tmp_path / "ours"
    show_attention(model, tok, "abc", ours)
    show_attention(model, tok, "abc", ours)  # its own signed files: accepted
    assert sorted(p.name for p in ours.iterdir()) == ["attention.html", "attention.png"]


def test_a_hugging_face_folder_is_not_taken_for_an_output_folder(tmp_path, tiny_ckpt, snap):
    """config.json, model.safetensors and tokenizer.json are a checkpoint's names, but a
    Hugging Face folder's config.json is not attnlab's: show does not fill the folder."""
    from attnlab.checkpoint import load_checkpoint_tokenizer
    from attnlab.io.outdir import foreign_entries
    from attnlab.viz import show_attention

    hf = tmp_path / "my-llama"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama", "architectures": ["X"]}')
    (hf / "model.safetensors").write_bytes(b"weights")
    (hf / "tokenizer.json").write_text("{}")
    before = snap(hf)
    assert foreign_entries(hf) == ["config.json"]
    assert foreign_entries(tiny_ckpt) == []  # attnlab's own config.json
    model, tok = load_checkpoint(tiny_ckpt), load_checkpoint_tokenizer(tiny_ckpt)
    with pytest.raises(ValueError, match="attnlab did not write.*config.json"):
        show_attention(model, tok, "abc", hf)
    assert snap(hf) == before


def test_an_out_that_links_to_a_missing_folder_is_made_where_it_points(tmp_path, tiny_ckpt):
    """``--out`` a symlink to a folder not made yet: show makes the folder it points to (as
    a checkpoint does), where mkdir stopped at the link ("[Errno 17] File exists")."""
    from attnlab.checkpoint import load_checkpoint_tokenizer
    from attnlab.viz import show_attention

    link = tmp_path / "pics"
    link.symlink_to(tmp_path / "later" / "pics", target_is_directory=True)
    model, tok = load_checkpoint(tiny_ckpt), load_checkpoint_tokenizer(tiny_ckpt)
    show_attention(model, tok, "abc", link)
    assert link.is_symlink()
    assert sorted(p.name for p in (tmp_path / "later" / "pics").iterdir()) == [
        "attention.html", "attention.png"]
