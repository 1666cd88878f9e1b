"""Atomic checkpoint directories: write a whole folder, swap it in with renames.

See :mod:`attnlab.io` for the steps and the crash windows.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .files import ATOMIC_MARKER, PathLike, _fsync_dir, fsync_path
from .outdir import holds_working_dir

try:  # POSIX only; on other systems the directory lock is a no-op.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]


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


_SUFFIX = r"(\d+-[0-9a-f]{8})"


def _mark(folder: Path, final: Path, suffix: str) -> None:
    """Write the marker that proves ``folder`` is an attnlab copy of ``final``.

    A sibling named like a leftover proves nothing (a user's ``run.old-1/`` is
    not ours); only a folder holding this marker, naming ``final`` and the same
    suffix as its own name, is ever renamed or deleted by recovery.
    """
    # Never through a link: a ``.attnlab-atomic`` link planted in the live folder would
    # have the marker written over the file it points to.
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(folder / ATOMIC_MARKER, flags, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(f"{final.name}\n{suffix}\n")  # (a name's bytes as they are, UTF-8 or not)


def _proven(folder: Path, final: Path, suffix: str) -> bool:
    marker = folder / ATOMIC_MARKER
    try:
        if folder.is_symlink() or not folder.is_dir() or marker.is_symlink() or \
                not marker.is_file() or marker.stat().st_size > 4096:
            return False
        return marker.read_text(encoding="utf-8", errors="surrogateescape") == \
            f"{final.name}\n{suffix}\n"
    except (OSError, UnicodeDecodeError):
        return False


def _leftovers(final: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """(old copies, complete ready copies, partial temp copies) next to ``final``
    that attnlab provably wrote (see :func:`_mark`); anything else is left alone."""
    name = re.escape(final.name)
    patterns = (
        re.compile(rf"{name}\.old-{_SUFFIX}"),
        re.compile(rf"\.{name}\.ready-{_SUFFIX}"),
        re.compile(rf"\.{name}\.tmp-{_SUFFIX}"),
    )
    old: list[Path] = []
    ready: list[Path] = []
    tmp: list[Path] = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in final.parent.iterdir():
            for pattern, bucket in zip(patterns, (old, ready, tmp)):
                match = pattern.fullmatch(entry.name)
                if match and _proven(entry, final, match.group(1)):
                    bucket.append(entry)

    def newest_first(paths: list[Path]) -> list[Path]:
        return sorted(paths, key=lambda p: p.lstat().st_mtime_ns, reverse=True)

    return newest_first(old), newest_first(ready), tmp


def _remove(path: Path) -> None:
    """Delete ``path``; a folder's marker last, so that a delete cut short (Ctrl-C, a kill)
    leaves a folder still proven attnlab's, which the next write or recovery removes
    (``rmtree`` may take the marker first and leave the rest unowned for ever)."""
    if path.is_dir() and not path.is_symlink():
        # attnlab's own copy: a folder in it made read-only (a user's chmod 555 carried
        # over) is made writable again, or its files could not be removed
        _owner_may_empty(path)
        for folder, dirs, _ in os.walk(path):  # (each folder before the walk reads it)
            for name in dirs:
                _owner_may_empty(Path(folder) / name)
        with contextlib.suppress(OSError):
            for entry in os.scandir(path):
                if entry.name == ATOMIC_MARKER:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
        # The marker and the folder go only once all else has: a delete that failed (a file
        # it may not remove, a busy NFS file) stays marked, and the next write retries it.
        with contextlib.suppress(OSError):
            if set(os.listdir(path)) <= {ATOMIC_MARKER}:
                shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _owner_may_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):
        info = os.lstat(folder)
        if stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_IRWXU != stat.S_IRWXU:
            os.chmod(folder, stat.S_IMODE(info.st_mode) | stat.S_IRWXU)


def _keep_modes(new: Path, live: Path) -> None:
    """Give ``new`` (a copy about to replace ``live``) the permission bits of ``live`` and
    of each of its entries that ``live`` holds under the same name: a user's ``chmod 700``
    folder or ``600`` file stays private across checkpoints. Folders keep their owner's
    read, write and search bits (a ``555`` folder could not be emptied when its copy is
    set aside and deleted)."""
    for folder, dirs, files in os.walk(new):
        for name in ("", *dirs, *files):
            there = live / os.path.relpath(os.path.join(folder, name), new)
            try:
                info = os.lstat(there)
            except OSError:
                continue
            if not stat.S_ISLNK(info.st_mode):
                mode = stat.S_IMODE(info.st_mode)
                if stat.S_ISDIR(info.st_mode):  # always attnlab's to empty when set aside
                    mode |= stat.S_IRWXU
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(folder, name), mode)


def _discard(path: Path, final: Path) -> None:
    """Delete a complete copy without ever leaving a half-deleted "complete" copy:
    it is first renamed to the partial-temp pattern, which is never restored. The
    suffix (and so the marker) is kept, so a crash mid-delete is still cleaned up."""
    suffix = path.name.rsplit("-", 2)
    trash = final.parent / f".{final.name}.tmp-{suffix[-2]}-{suffix[-1]}"
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
                with contextlib.suppress(OSError):
                    (final / ATOMIC_MARKER).unlink()
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
    are then removed. Only folders holding attnlab's marker for ``final_dir``
    count: a user's own ``<name>.old-1/`` is never renamed or deleted. Cheap
    when there is nothing to do (no lock is taken); safe to call while another
    process writes (it waits for the writer's lock).
    """
    final = Path(os.path.abspath(final_dir))
    if final.is_symlink():
        final = Path(os.path.realpath(final))
    old, ready, tmp = _leftovers(final)
    if not (old or ready or tmp):
        return False
    with _parent_lock(final.parent):
        return _recover_locked(final)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        for fn in filenames:
            p = os.path.join(dirpath, fn)
            if not os.path.islink(p):
                fsync_path(p)
        _fsync_dir(dirpath)


@contextlib.contextmanager
def atomic_dir(final_dir: PathLike,
               check: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """Write a whole directory atomically: ``with atomic_dir(d) as tmp: <write into tmp>``.

    Yields a fresh temp directory next to ``final_dir`` (same parent, so the
    renames stay on one file system). A ``final_dir`` that is a symlink is
    followed: the folder it points to is replaced, never the user's link. When
    the block ends normally, every file is fsynced and the temp directory
    replaces ``final_dir`` (see the module docstring for the exact steps and
    crash windows). When the block raises, the temp directory is removed and
    an existing ``final_dir`` is untouched.
    ``check``: called with the live ``final_dir`` under the lock, right before it is set
    aside, and with the copy set aside after the swap; it raises to keep that folder (a
    checkpoint's :func:`~attnlab.io.outdir.refuse_foreign`: a file the user put into the
    live folder since the writer's first check would otherwise be deleted with it). Before
    the swap the new copy is then discarded; after it, the set-aside copy is kept, no longer
    marked as attnlab's.
    Not for several writers of the same ``final_dir`` without the POSIX lock.
    """
    final = Path(os.path.abspath(final_dir))
    if final.is_symlink():  # replace what the link points to, keep the link
        final = Path(os.path.realpath(final))
    if not final.name or final.name in (".", ".."):
        raise ValueError(f"final_dir: expected a directory path with a name, got {final_dir!r}")
    if final.exists() and not final.is_dir():
        raise ValueError(f"final_dir: {str(final)!r} exists and is not a directory")
    if holds_working_dir(final):
        raise ValueError(f"final_dir: {str(final)!r} is the current directory or holds it; "
                         "expected a folder inside it (it is replaced as a whole)")
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    with _parent_lock(parent):
        _recover_locked(final)
        suffix = f"{pid}-{secrets.token_hex(4)}"
        tmp = parent / f".{final.name}.tmp-{suffix}"
        ready = parent / f".{final.name}.ready-{suffix}"
        old_suffix = f"{pid}-{secrets.token_hex(4)}"
        old = parent / f"{final.name}.old-{old_suffix}"
        tmp.mkdir()
        moved_aside = marked_live = False
        try:
            _mark(tmp, final, suffix)
            yield tmp
            if final.is_dir():
                _keep_modes(tmp, final)
            _fsync_tree(tmp)
            os.rename(tmp, ready)
            _fsync_dir(parent)
            if final.exists():
                if check is not None:
                    check(final)
                _mark(final, final, old_suffix)  # so the copy set aside is provably ours
                marked_live = True
                os.rename(final, old)
                moved_aside = True
            os.rename(ready, final)
            _fsync_dir(parent)
            with contextlib.suppress(OSError):  # the live copy needs no proof
                (final / ATOMIC_MARKER).unlink()
        except BaseException:
            if moved_aside and not final.exists() and old.exists():
                os.rename(old, final)  # roll back: the old copy goes back in place
                _fsync_dir(parent)
            if marked_live and final.is_dir():  # the live folder as it was, unmarked
                with contextlib.suppress(OSError):
                    (final / ATOMIC_MARKER).unlink()
            _remove(tmp)
            if ready.exists():
                _discard(ready, final)
            raise
        if moved_aside:
            if check is not None:
                try:
                    check(old)  # again: something may have come between check and rename
                except ValueError:
                    with contextlib.suppress(OSError):
                        (old / ATOMIC_MARKER).unlink()  # no longer provably ours: kept
                    raise ValueError(
                        f"{str(final)!r} holds the new copy, but files attnlab did not write "
                        f"came into the old one while it was being replaced; the old one is "
                        f"kept, with them, as {str(old)!r}") from None
            _discard(old, final)
