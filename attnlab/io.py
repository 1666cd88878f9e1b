"""Checkpoint file primitives: atomic writes, safetensors, JSON, atomic directories.

Everything here is model-agnostic and never uses pickle. Tensors go through
safetensors, configuration through JSON.

Atomic files
    :func:`atomic_write_bytes` (and the text/JSON variants) write to a temp file
    in the same directory, flush, ``fsync``, ``os.replace`` it over the target and
    ``fsync`` the directory. A reader therefore sees either the old file or the
    new one, never a mix, even if the writer is killed or the machine loses power.
    If the write fails the temp file is removed and the old file is untouched. A
    writer killed by SIGKILL cannot clean up: a stale ``.<name>.*.tmp`` file may
    then remain next to the target (the target itself is intact).

Atomic directories
    :func:`atomic_dir` writes a whole checkpoint directory at once. POSIX has no
    atomic "replace a non-empty directory", so the swap takes two renames:

    1. contents are written to ``.<name>.tmp-<pid>-<rand>`` and fsynced;
    2. that folder is renamed ``.<name>.ready-<pid>-<rand>`` (complete, not live);
    3. an existing ``<name>`` is renamed ``<name>.old-<pid>``;
    4. the ready folder is renamed ``<name>``;
    5. ``<name>.old-<pid>`` is renamed to a temp name and removed (so a crash
       while deleting never leaves a half-deleted copy that looks complete).

    A crash before 3 leaves the old ``<name>`` in place. A crash between 3 and 4
    leaves no ``<name>`` at all, but both the old copy and the complete new copy
    still exist; :func:`recover_dir` then puts the new (ready) copy in place, or
    the old one if there is no ready copy. A crash after 4 leaves only
    leftovers, which :func:`recover_dir` deletes. Loaders should call
    :func:`recover_dir` before reading a checkpoint directory. Writers and
    recovery take an exclusive ``flock`` on the parent directory (POSIX), so a
    recovery never touches the folders of a writer that is still running, and
    two writers to the same parent are serialised.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:  # POSIX only; on other systems the directory lock is a no-op.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:
    import torch

__all__ = [
    "CheckpointError",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "save_tensors",
    "load_tensors",
    "load_metadata",
    "read_json",
    "atomic_dir",
    "recover_dir",
]

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
EXPLORER_FILE = "attention.html"
OWN_FILES = frozenset({MODEL_FILE, CONFIG_FILE, TOKENIZER_FILE, STATE_TENSORS, STATE_JSON,
                       SUMMARY_FILE, HEATMAP_FILE, EXPLORER_FILE})


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


def _fsync_dir(directory: PathLike) -> None:
    """fsync a directory so that renames and new entries in it are durable."""
    if os.name != "posix":  # pragma: no cover - Windows cannot open directories
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def read_json(path: PathLike) -> dict[str, Any]:
    """Read a JSON object from ``path``.

    Raises :class:`CheckpointError` naming the path if the file is missing,
    unreadable, not valid JSON, or holds something other than a JSON object.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{str(path)!r}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{str(path)!r}: cannot read: {exc}") from exc
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{str(path)!r}: invalid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise CheckpointError(
            f"{str(path)!r}: expected a JSON object at the top level, got {type(obj).__name__}"
        )
    return obj


# ------------------------------------------------------------------------- tensors


def _prepare_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detach, make contiguous, and un-share storage so safetensors accepts the dict."""
    import torch

    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors: expected a dict of str -> Tensor, got {type(tensors).__name__}")
    out: dict[str, torch.Tensor] = {}
    seen_storages: set[tuple[str, int]] = set()
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensors: keys must be str, got {type(name).__name__} ({name!r})")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{name!r}]: expected a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise ValueError(f"tensors[{name!r}]: expected a dense tensor, got layout {t.layout}")
        t = t.detach()
        key = (str(t.device), t.untyped_storage().data_ptr())
        # Tied weights, views and transposes share storage; safetensors refuses that.
        if key in seen_storages or not t.is_contiguous() or t.numel() == 0:
            t = t.clone(memory_format=torch.contiguous_format)
        else:
            seen_storages.add(key)
        out[name] = t
    return out


def save_tensors(
    path: PathLike,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Save a dict of tensors to a safetensors file, atomically.

    Tensors that share storage (tied weights), views and non-contiguous tensors
    are copied first, so each name gets its own data in the file. ``metadata``
    must map str to str; read it back with :func:`load_metadata`.
    """
    from safetensors.torch import save

    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise TypeError(
                f"metadata: expected a dict of str -> str, got {type(metadata).__name__}"
            )
        bad = {k: v for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))}
        if bad:
            raise TypeError(f"metadata: keys and values must be str, got {bad!r}")
        metadata = dict(metadata)
    data = save(_prepare_tensors(tensors), metadata=metadata)
    atomic_write_bytes(path, data)


def _check_file(path: Path) -> None:
    if not path.exists():
        raise CheckpointError(f"{str(path)!r}: file not found")
    if not path.is_file():
        raise CheckpointError(f"{str(path)!r}: not a regular file")


def load_tensors(path: PathLike, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Load all tensors of a safetensors file (never unpickles anything).

    Raises :class:`CheckpointError` naming the path if the file is missing,
    truncated or otherwise not a valid safetensors file.
    """
    from safetensors.torch import load_file

    path = Path(path)
    _check_file(path)
    try:
        return load_file(path, device=device)
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(
            f"{str(path)!r}: not a valid safetensors file (truncated or corrupt?): {exc}"
        ) from exc


def load_metadata(path: PathLike) -> dict[str, str]:
    """The string metadata stored in a safetensors file's header ({} if none)."""
    from safetensors import safe_open

    path = Path(path)
    _check_file(path)
    try:
        with safe_open(path, framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as exc:
        raise CheckpointError(f"{str(path)!r}: not a valid safetensors file: {exc}") from exc


# --------------------------------------------------------------------- directories


_LOCKS: dict[str, list[Any]] = {}  # parent -> [RLock, depth, fd or None]
_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def _parent_lock(parent: Path) -> Iterator[None]:
    """Exclusive lock on ``parent``: a thread lock within this process, plus an
    ``flock`` on the directory across processes (released when the process dies).

    Re-entrant within one thread, so a nested :func:`atomic_dir` for a sibling
    directory does not deadlock. Without fcntl, or if the directory cannot be
    opened, only the in-process lock is taken.
    """
    with _LOCKS_GUARD:
        entry = _LOCKS.setdefault(str(parent), [threading.RLock(), 0, None])
    with entry[0]:
        if entry[1] == 0 and fcntl is not None:
            try:
                fd = os.open(parent, os.O_RDONLY)
            except OSError:
                fd = None
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except BaseException:
                    os.close(fd)
                    raise
            entry[2] = fd
        entry[1] += 1
        try:
            yield
        finally:
            entry[1] -= 1
            if entry[1] == 0 and entry[2] is not None:
                os.close(entry[2])  # closing the descriptor releases the flock
                entry[2] = None


def _leftovers(final: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """(old copies, complete ready copies, partial temp copies) next to ``final``."""
    name = re.escape(final.name)
    patterns = (
        re.compile(rf"{name}\.old-\d+"),
        re.compile(rf"\.{name}\.ready-\d+-[0-9a-f]{{8}}"),
        re.compile(rf"\.{name}\.tmp-\d+-[0-9a-f]{{8}}"),
    )
    old: list[Path] = []
    ready: list[Path] = []
    tmp: list[Path] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in final.parent.iterdir():
            for pattern, bucket in zip(patterns, (old, ready, tmp)):
                if pattern.fullmatch(entry.name):
                    bucket.append(entry)

    def newest_first(paths: list[Path]) -> list[Path]:
        return sorted(paths, key=lambda p: p.lstat().st_mtime_ns, reverse=True)

    return newest_first(old), newest_first(ready), tmp


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _discard(path: Path, final: Path) -> None:
    """Delete a complete copy without ever leaving a half-deleted "complete" copy:
    it is first renamed to the partial-temp pattern, which is never restored."""
    trash = final.parent / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.rename(path, trash)
    except OSError:
        trash = path
    _remove(trash)


def _recover_locked(final: Path) -> bool:
    old, ready, tmp = _leftovers(final)
    restored = False
    if not final.exists():
        for candidate in ready + old:  # newest complete copy first
            if candidate.is_dir():
                os.rename(candidate, final)
                _fsync_dir(final.parent)
                restored = True
                break
    for p in old + ready:
        if p.exists():
            _discard(p, final)
    for p in tmp:
        _remove(p)
    return restored


def recover_dir(final_dir: PathLike) -> bool:
    """Repair what an interrupted :func:`atomic_dir` left behind; True if it restored.

    If ``final_dir`` is missing but a complete copy exists next to it (a
    ``.<name>.ready-*`` new copy, else a ``<name>.old-*`` old copy), that copy
    is renamed to ``final_dir``. Leftover old, ready and partial temp folders
    are then removed. Cheap when there is nothing to do (no lock is taken);
    safe to call while another process writes (it waits for the writer's lock).
    """
    final = Path(os.path.abspath(final_dir))
    old, ready, tmp = _leftovers(final)
    if not (old or ready or tmp):
        return False
    with _parent_lock(final.parent):
        return _recover_locked(final)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        for fn in filenames:
            p = os.path.join(dirpath, fn)
            if os.path.islink(p):
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(dirpath)


@contextlib.contextmanager
def atomic_dir(final_dir: PathLike) -> Iterator[Path]:
    """Write a whole directory atomically: ``with atomic_dir(d) as tmp: <write into tmp>``.

    Yields a fresh temp directory next to ``final_dir`` (same parent, so the
    renames stay on one file system). When the block ends normally, every file
    is fsynced and the temp directory replaces ``final_dir`` (see the module
    docstring for the exact steps and crash windows). When the block raises,
    the temp directory is removed and an existing ``final_dir`` is untouched.
    Not for several writers of the same ``final_dir`` without the POSIX lock.
    """
    final = Path(os.path.abspath(final_dir))
    if not final.name or final.name in (".", ".."):
        raise ValueError(f"final_dir: expected a directory path with a name, got {final_dir!r}")
    if final.exists() and not final.is_dir():
        raise ValueError(f"final_dir: {str(final)!r} exists and is not a directory")
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    with _parent_lock(parent):
        _recover_locked(final)
        suffix = f"{pid}-{secrets.token_hex(4)}"
        tmp = parent / f".{final.name}.tmp-{suffix}"
        ready = parent / f".{final.name}.ready-{suffix}"
        old = parent / f"{final.name}.old-{pid}"
        tmp.mkdir()
        moved_aside = False
        try:
            yield tmp
            _fsync_tree(tmp)
            os.rename(tmp, ready)
            _fsync_dir(parent)
            if final.exists():
                if old.exists():
                    _discard(old, final)
                os.rename(final, old)
                moved_aside = True
            os.rename(ready, final)
            _fsync_dir(parent)
        except BaseException:
            if moved_aside and not final.exists() and old.exists():
                os.rename(old, final)  # roll back: the old copy goes back in place
                _fsync_dir(parent)
            _remove(tmp)
            if ready.exists():
                _discard(ready, final)
            raise
        if moved_aside:
            _discard(old, final)
