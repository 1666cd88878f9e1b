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
attnlab's when this run created it, or when it holds ``attnlab lock <pid>`` (digits alone,
as versions before the signature wrote them, may be a user's file: refused, named).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import uuid
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
_MAX_BYTES = 64  # a lock file attnlab wrote is never longer


def _content() -> bytes:
    return f"{SIGNATURE} {os.getpid()}\n".encode("ascii")


def _pid_in(data: bytes) -> str | None:
    """The pid an attnlab lock file's bytes name (``attnlab lock <pid>``), or None where
    attnlab did not write them: a user's ``.results.json.lock`` holding ``2024`` is theirs."""
    if len(data) > _MAX_BYTES:
        return None
    text = data.decode("ascii", "replace").strip()
    if not text.startswith(SIGNATURE + " "):
        return None
    text = text[len(SIGNATURE):].strip()
    return text if text.isdigit() and len(text) <= 10 else None


def _holder(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            return _pid_in(f.read(_MAX_BYTES + 1)) or "unknown"
    except OSError:
        return "unknown"


def _create(path: Path) -> int | None:
    """The lock file created with attnlab's content already in it (written to a file of
    this process's own, then linked to the name, which fails where the name exists: a run
    killed at any point leaves either no lock file or a whole one), opened; None where the
    name exists."""
    part = path.with_name(f"{path.name}.{uuid.uuid4().hex[:12]}")
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                 0o644)
    try:
        os.write(fd, _content())
        try:
            os.link(part, path)
        except FileExistsError:
            os.close(fd)
            return None
        return fd
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(part)


def _open(path: Path, out: PathLike, name: str) -> tuple[int, bool]:
    """The lock file opened for writing, and whether this call created it. An existing path
    that is not a regular file attnlab may open (a link, a fifo, a folder, the file of a
    user this process may not write) is refused."""
    while True:
        fd = _create(path)  # EACCES, EROFS here (a folder nobody may write): the caller's
        if fd is not None:
            return fd, True
        flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:  # the holder before us removed it meanwhile: create it
            continue
        except OSError:
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


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


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
        # The holder before us may have unlinked the file we opened: lock the live one.
        if not _same_file(fd, path):
            os.close(fd)
            continue
        if created:
            return fd
        if _pid_in(os.pread(fd, _MAX_BYTES + 1, 0)) is None:
            os.close(fd)  # the user's file (or an empty one): never written or removed
            raise _not_ours(path, out, name)
        # A killed run's lock, taken over: written before it is cut to length, so it is
        # never without a pid in it.
        content = _content()
        os.pwrite(fd, content, 0)
        os.ftruncate(fd, len(content))
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
            if exc.errno not in (errno.EACCES, errno.EROFS):
                raise
    with _GUARD:
        _HELD[key] = 1
    try:
        yield path
    finally:
        with _GUARD:
            _HELD.pop(key, None)
        if fd is not None:
            # Still locked by us: nobody can be waiting on this inode. Removed only while
            # the name is still our file (whatever was put there meanwhile stays).
            if _same_file(fd, path):
                with contextlib.suppress(OSError):
                    os.unlink(path)
            os.close(fd)
