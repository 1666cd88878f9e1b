"""One writer per output: a lock held on an output folder for a whole run.

Two ``attnlab train --out shared`` at once would each replace the folder in turn
and both report success, one run silently lost. A run therefore holds an
exclusive ``flock`` on ``.<name>.lock`` beside its output (beside, not inside:
the folder itself is swapped out by every checkpoint) from its first check to
its last write. The file holds ``attnlab lock <pid>``, so a refused run can say
who holds it. The kernel drops an ``flock`` when its process dies, so a lock left
by a killed run is simply taken over by the next one.

A file of that name that attnlab did not write (the user's own, a link, a fifo) is
never written, truncated or removed: the run is refused and says so. A lock file is
attnlab's when this run created it, or when it holds ``attnlab lock <pid>`` or, as
earlier versions wrote it, the pid alone.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from .files import PathLike

try:  # POSIX only; elsewhere the lock is a no-op.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = ["output_lock", "lock_path"]

_HELD: dict[str, int] = {}  # lock path -> depth, for re-entry within this process
_GUARD = threading.Lock()


def lock_path(out: PathLike) -> Path:
    """The lock file of output ``out`` (a symlinked ``out`` is locked where it points)."""
    final = Path(os.path.abspath(out))
    if final.is_symlink():
        final = Path(os.path.realpath(final))
    return final.parent / f".{final.name}.lock"


SIGNATURE = "attnlab lock"


def _pid_in(text: str) -> str | None:
    """The pid an attnlab lock file's text names, or None where attnlab did not write it."""
    text = text.strip()
    if text.startswith(SIGNATURE):
        text = text[len(SIGNATURE):].strip()
    return text if text.isdigit() else None


def _holder(path: Path) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return _pid_in(f.read(64)) or "unknown"
    except OSError:
        return "unknown"


def _open(path: Path, out: PathLike, name: str) -> tuple[int, bool]:
    """The lock file opened for writing, and whether this call created it; a path that is
    not a regular file (a link, a fifo, a folder) is refused."""
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        pass
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:  # the holder before us removed it meanwhile: create it
        return _open(path, out, name)
    except OSError as exc:
        if exc.errno in (13, 30):  # EACCES, EROFS: handled by the caller
            raise
        raise _not_ours(path, out, name) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_ours(path, out, name)
    return fd, False


def _not_ours(path: Path, out: PathLike, name: str) -> ValueError:
    return ValueError(
        f"{name} {str(out)!r}: {str(path)!r} beside it is not a lock file attnlab wrote "
        f"(expected {SIGNATURE!r} and a pid in it, or nothing there); it is left as it is: "
        f"move it away or choose another {name}")


def _acquire(path: Path, out: PathLike, name: str) -> int:
    while True:
        fd, created = _open(path, out, name)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(
                f"{name} {str(out)!r} is in use by another attnlab run (pid {_holder(path)}); "
                f"wait for it to finish or choose another {name}") from None
        except BaseException:
            os.close(fd)
            raise
        try:  # the holder before us may have unlinked the file we opened: lock the live one
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        if not created and _pid_in(os.pread(fd, 64, 0).decode("ascii", "replace")) is None:
            os.close(fd)  # the user's file (or an empty one): never written or removed
            raise _not_ours(path, out, name)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{SIGNATURE} {os.getpid()}\n".encode("ascii"), 0)
        return fd


@contextlib.contextmanager
def output_lock(out: PathLike, name: str = "--out") -> Iterator[Path]:
    """Hold the lock of output ``out`` for the block; yields the lock file's path.

    Refused at once (ValueError naming ``name`` and the holder's pid) when another
    process holds it; re-entrant within a process (a CLI command that locks, then
    calls ``train``, which locks too). The lock file is removed on release.
    """
    path = lock_path(out)
    key = str(path)
    with _GUARD:
        if _HELD.get(key):
            _HELD[key] += 1
            nested = True
        else:
            nested = False
    if nested:
        try:
            yield path
        finally:
            with _GUARD:
                _HELD[key] -= 1
        return
    fd = None
    if fcntl is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = _acquire(path, out, name)
        except OSError as exc:  # a read-only parent: nobody else can write there either
            if exc.errno not in (13, 30):  # EACCES, EROFS
                raise
    with _GUARD:
        _HELD[key] = 1
    try:
        yield path
    finally:
        with _GUARD:
            _HELD.pop(key, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)  # still locked by us: nobody can be waiting on this inode
            os.close(fd)
