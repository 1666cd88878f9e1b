"""The output-folder policy of a checkpoint: attnlab replaces only folders it wrote.

:func:`check_out_dir` is the one rule for every writer (``attnlab train``, the demo,
:func:`save_checkpoint`); a checkpoint replaces its directory as a whole (atomically,
through :func:`attnlab.io.atomic_dir`), under the output lock.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from torch import nn

from ..io import (
    BEST_DIR,
    CONFIG_FILE,
    STATE_JSON,
    CheckpointError,
    atomic_dir,
    read_json,
    recover_dir,
)
from ..io.locks import output_lock
from ..io.outdir import check_writable, foreign_entries, holds_working_dir, refuse_foreign
from ..io.reading import CONFIG_LIMIT
from .format import FORMAT, write_model_files


def save_checkpoint(model: nn.Module, directory: str | os.PathLike, *, tokenizer=None,
                    **extra: Any) -> Path:
    """Save ``model`` (and ``tokenizer``) to ``directory``, replacing it atomically.

    ``extra`` keyword arguments (JSON-serialisable) are stored in ``config.json``.
    ``directory`` must be new, empty or an attnlab checkpoint (:func:`check_out_dir`,
    the rule ``--out`` follows too): a folder of other files is refused, not replaced.
    A run writing to it (``attnlab train``) holds its lock, and is not overwritten.
    """
    check_out_dir(directory, "directory")
    with output_lock(directory, "directory"), atomic_dir(directory, check=refuse_foreign) as tmp:
        write_model_files(tmp, model, tokenizer=tokenizer, **extra)
    return Path(directory)


def _not_ours(out: Path, why: str, name: str) -> ValueError:
    return ValueError(
        f"{name} {str(out)!r} is not an attnlab checkpoint ({why}); expected a new or empty "
        "directory or one attnlab wrote (a checkpoint replaces its directory as a whole)")


# Where Linux lists every mount point of this process, bind mounts included.
MOUNTINFO = "/proc/self/mountinfo"


def _is_mount_point(path: str) -> bool:
    """Whether ``path`` (a real path) is a mount point: ``os.path.ismount``, which compares
    devices and so misses a bind mount of a folder of the same file system, or a mount
    point that :data:`MOUNTINFO` lists."""
    if os.path.ismount(path):
        return True
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
            fields = [line.split() for line in f]
    except OSError:
        return False

    def unescaped(point: str) -> str:  # spaces and tabs come as \040, \011
        return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point)
    return any(len(f) > 4 and unescaped(f[4]) == path for f in fields)


def check_out_dir(out: str | os.PathLike, name: str = "--out") -> None:
    """Refuse an ``out`` that a checkpoint cannot be written to, before any work.

    The one rule for every writer of a checkpoint folder (training, the demo,
    :func:`save_checkpoint`). A checkpoint replaces its directory as a whole
    (atomically), so writing one into a folder of other files would delete them.
    A ``config.json`` alone proves nothing (a Hugging Face model has one too): it
    must be attnlab's, and every other entry a file attnlab writes there
    (:func:`attnlab.io.outdir.foreign_entries`). ``name`` is what the message
    calls ``out`` (the CLI option, or the API argument).
    """
    check_writable(out, name)
    if holds_working_dir(out):
        raise ValueError(f"{name} {str(out)!r} is the current directory or holds it; a "
                         "checkpoint replaces its folder as a whole: name a folder inside it")
    where = os.path.realpath(out)
    if _is_mount_point(where):
        raise ValueError(f"{name} {str(out)!r} is a mount point; a checkpoint replaces its "
                         "folder as a whole (a rename), which a mount point refuses: name a "
                         "folder inside it")
    try:  # the path as given is what safetensors later opens the files by
        os.fsencode(os.fspath(out)).decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{name} {str(out)!r} is not a UTF-8 path, and safetensors opens "
                         "only those (the checkpoint could not be read back): name a folder "
                         "whose path is UTF-8") from None
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"{name} {str(out)!r} is a file; expected a directory for the "
                         "checkpoint")
    entries = sorted(e.name for e in out.iterdir())
    if not entries:
        return
    if not (out / CONFIG_FILE).is_file():
        raise _not_ours(out, f"no {CONFIG_FILE}, but {entries[0]!r}", name)
    try:
        config = read_json(out / CONFIG_FILE, CONFIG_LIMIT)
    except CheckpointError as exc:
        raise _not_ours(out, f"{CONFIG_FILE}: {str(exc).split(': ', 1)[-1]}", name) from None
    if config.get("format") != FORMAT or not isinstance(config.get("model_type"), str):
        raise _not_ours(out, f"its {CONFIG_FILE} has no attnlab format/model_type", name)
    foreign = foreign_entries(out)
    best = out / BEST_DIR / CONFIG_FILE
    if BEST_DIR in foreign and best.is_file():  # the run's own best copy, whose config broke?
        try:
            read_json(best, CONFIG_LIMIT)
        except CheckpointError as exc:
            raise _not_ours(out, f"its {BEST_DIR}/{CONFIG_FILE} is damaged "
                            f"({str(exc).split(': ', 1)[-1]}), so {BEST_DIR}/ cannot be told for "
                            "attnlab's: restore it or move it out", name) from None
    if foreign:
        raise _not_ours(out, f"it also holds {', '.join(map(repr, foreign[:3]))}"
                        + (" ..." if len(foreign) > 3 else ""), name)


def has_checkpoint(out: str | os.PathLike) -> bool:
    out = Path(out)
    recover_dir(out)  # a writer killed between its two renames left the copy beside it
    return (out / STATE_JSON).exists() and (out / CONFIG_FILE).exists()
