"""Atomic file writes and JSON: the primitives every writer in attnlab uses.

See :mod:`attnlab.io` for the guarantees.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

PathLike = str | os.PathLike[str]


class CheckpointError(ValueError):
    """A checkpoint file or directory is missing, unreadable or corrupt."""


# The names of every file attnlab writes into a directory of its own (a
# checkpoint, the demo's or ``show``'s output). Writers take their names from
# here, and the output-directory rules (checkpoint.check_out_dir) recognise
# exactly these as attnlab's.
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
STATE_TENSORS = "training_state.safetensors"  # written by training, for --resume
STATE_JSON = "training_state.json"
SUMMARY_FILE = "summary.json"
HEATMAP_FILE = "attention.png"
HEATMAP_SVG = "attention.svg"  # ``attnlab show --format svg``
EXPLORER_FILE = "attention.html"
HEADS_JSON = "heads.json"  # ``attnlab heads``: the table, and its picture
HEADS_PNG = "heads.png"
HEADS_SVG = "heads.svg"
# Inside the folders attnlab.io.atomic_dir builds: proves a leftover is attnlab's.
ATOMIC_MARKER = ".attnlab-atomic"
OWN_FILES = frozenset({MODEL_FILE, CONFIG_FILE, TOKENIZER_FILE, STATE_TENSORS, STATE_JSON,
                       SUMMARY_FILE, HEATMAP_FILE, HEATMAP_SVG, EXPLORER_FILE, HEADS_JSON,
                       HEADS_PNG, HEADS_SVG})
# The files of an output folder that attnlab signs as it writes them: one of these counts
# as attnlab's only where it carries the signature (io.outdir). A checkpoint's own files
# are proven by its attnlab config.json (checkpoint.check_out_dir).
SIGNED_FILES = frozenset({SUMMARY_FILE, HEATMAP_FILE, HEATMAP_SVG, EXPLORER_FILE, HEADS_JSON,
                          HEADS_PNG, HEADS_SVG})
# The checkpoint of a run's lowest held-out loss, a folder inside its checkpoint folder.
BEST_DIR = "best"


# --------------------------------------------------------------------------- files


def _default_mode() -> int:
    """File mode a plain ``open(path, "w")`` would get (0o666 minus the umask)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def fsync_path(path: PathLike) -> None:
    """fsync a file, or a directory (so that renames and new entries in it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: PathLike) -> None:
    if os.name != "posix":  # pragma: no cover - Windows cannot open directories
        return
    fsync_path(directory)


def atomic_write_bytes(path: PathLike, data: bytes | bytearray | memoryview) -> None:
    """Write ``data`` to ``path`` atomically and durably.

    The bytes go to a temp file in the same directory, which is flushed,
    fsynced and ``os.replace``-d over ``path``; then the directory is fsynced.
    On any failure the temp file is removed and an existing ``path`` keeps its
    old content. An existing file's permission bits are kept.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"data: expected bytes, got {type(data).__name__}")
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"path: {str(path)!r} is a directory, expected a file path")
    directory = path.parent
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = _default_mode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            if hasattr(os, "fchmod"):
                os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def atomic_write_text(path: PathLike, text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_write_bytes`)."""
    if not isinstance(text, str):
        raise TypeError(f"text: expected str, got {type(text).__name__}")
    atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: PathLike, obj: Any, *, indent: int | None = 2) -> None:
    """Serialise ``obj`` as JSON (UTF-8, trailing newline) and write it atomically.

    Raises ``TypeError`` naming ``path`` if ``obj`` is not JSON-serialisable;
    nothing is written then.
    """
    try:
        text = json.dumps(obj, indent=indent, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"obj: cannot be written as JSON to {str(path)!r}: {exc}") from exc
    atomic_write_text(path, text + "\n")
