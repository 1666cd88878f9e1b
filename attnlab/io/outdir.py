"""Which files are attnlab's: the one rule for every writer.

Folders: attnlab writes into a folder only the files named in :data:`OWN_FILES`, the
lesson pictures ``lesson-NN-<name>.png`` (and the temp files an atomic write killed by
SIGKILL leaves beside them, the marker :func:`attnlab.io.atomic_dir` puts in the folders
it builds, and training's ``best/`` checkpoint of such files). The pictures, pages and
summaries among them (:data:`SIGNED_FILES`, the lesson pictures) count only where they
carry attnlab's signature, as single files do. A folder holding anything else is the
user's, and no writer (a checkpoint, ``show``, the demo) may replace or fill it.

Single files (``--json FILE``, ``--png FILE``): whatever their name, attnlab signs what it
writes (:data:`SIGNATURE`: a JSON document's first key ``"written_by"``, in a list of
records every record's; a PNG's ``Software`` text chunk; an SVG's creator; an HTML page's
``generator``) and replaces an existing file only where that signature is found
(:func:`is_signed`). Anything else there is the user's.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

from .._version import __version__
from .files import (
    ATOMIC_MARKER,
    BEST_DIR,
    CONFIG_FILE,
    OWN_FILES,
    SIGNED_FILES,
    SUMMARY_FILE,
    PathLike,
)

__all__ = ["foreign_entries", "make_dir", "refuse_foreign", "holds_working_dir", "check_own_dir",
           "check_writable", "check_out_file", "SIGNATURE", "signed", "figure_metadata",
           "is_signed", "drop_stale"]

#: What attnlab writes into a single output file to show, when it meets the file again,
#: that the file is its own (see the module's docstring).
SIGNATURE = f"attnlab {__version__}"
# A file is read this far to find the signature: a JSON's first key, a PNG's chunks
# before its pixels, an SVG's metadata all come first.
_SIGNATURE_BYTES = 64 * 1024
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_JSON_SIGNED = re.compile(rb'\s*(\[\s*)?\{\s*"written_by"\s*:\s*"attnlab[ "]')
_SVG_SIGNED = re.compile(rb"<dc:creator>\s*<cc:Agent>\s*<dc:title>attnlab[ <]")
_HTML_SIGNED = re.compile(rb'<meta name="generator" content="attnlab[ "]')

# ".<name>.<random>.tmp": what atomic_write_bytes leaves when killed mid-write.
_OWN_TEMP = re.compile(r"\.(" + "|".join(map(re.escape, sorted(OWN_FILES))) + r")\..+\.tmp")
# The pictures of ``attnlab learn N`` (attnlab.lessons.kit.show), and their temp files.
_LESSON_FIGURE = re.compile(r"(\.)?lesson-\d\d-[a-z0-9]+(-[a-z0-9]+)*\.png(?(1)\..+\.tmp)")


def _is_own_file(entry: Path) -> bool:
    """A file of attnlab's names; the pictures, pages and summaries it signs count only
    where they carry the signature (a user's own ``attention.png`` in the folder is theirs,
    and would be overwritten)."""
    if not entry.is_file() or entry.is_symlink():
        return False
    figure = _LESSON_FIGURE.fullmatch(entry.name) is not None
    if entry.name in SIGNED_FILES or (figure and not entry.name.startswith(".")):
        return is_signed(entry)
    if entry.name == CONFIG_FILE:  # a Hugging Face folder has one too
        return _attnlab_config(entry)
    return (entry.name in OWN_FILES or entry.name == ATOMIC_MARKER or figure  # a temp file
            or _OWN_TEMP.fullmatch(entry.name) is not None)


def _attnlab_config(path: Path) -> bool:
    """Whether ``config.json`` is an attnlab checkpoint's: a ``format`` number and a
    ``model_type`` (a Hugging Face config has the latter only)."""
    from .reading import CONFIG_LIMIT, read_json

    try:
        config = read_json(path, CONFIG_LIMIT)
    except (OSError, ValueError):
        return False
    return isinstance(config.get("format"), int) and isinstance(config.get("model_type"), str)


def _is_own(entry: Path) -> bool:
    """An own file, or the ``best/`` checkpoint training keeps inside its folder (a real
    folder holding only own files)."""
    if entry.name == BEST_DIR and entry.is_dir() and not entry.is_symlink():
        return all(_is_own_file(e) for e in entry.iterdir())
    return _is_own_file(entry)


def foreign_entries(out: PathLike) -> list[str]:
    """Sorted names of the entries in folder ``out`` that attnlab did not write. Beside an
    attnlab checkpoint's ``config.json`` a ``summary.json`` is the run's by its name too:
    attnlab versions before the summary was signed wrote it unsigned (a resumed run, a
    demo run again into its folder)."""
    entries = list(Path(out).iterdir())
    checkpoint = any(e.name == CONFIG_FILE and _is_own_file(e) for e in entries)
    return sorted(e.name for e in entries if not _is_own(e) and not (
        checkpoint and e.name == SUMMARY_FILE and e.is_file() and not e.is_symlink()))


def make_dir(out: PathLike) -> Path:
    """The output folder ``out``, made where missing; a symlink to a missing folder makes
    its target (as a checkpoint follows one), where ``mkdir`` would stop at the link."""
    path = Path(out)
    Path(os.path.realpath(path) if path.is_symlink() else path).mkdir(parents=True,
                                                                     exist_ok=True)
    return path


def refuse_foreign(folder: PathLike) -> None:
    """Raise, naming them, where ``folder`` holds entries attnlab did not write: the check a
    checkpoint makes of its live folder right before replacing it (:func:`attnlab.io.atomic_dir`'s
    ``check``), since a long run's folder may have gained the user's files since the run's
    first check."""
    foreign = foreign_entries(folder)
    if foreign:
        names = ", ".join(map(repr, foreign[:3])) + (" ..." if len(foreign) > 3 else "")
        raise ValueError(
            f"{str(folder)!r} holds {names}, which attnlab did not write; a checkpoint "
            "replaces its folder as a whole, so it was not written: move them out and save "
            "again (a training run: --resume)")


def holds_working_dir(folder: PathLike) -> bool:
    """Whether ``folder`` is the working directory or one of its parents (``--out .``): a
    folder replaced as a whole would be renamed away under the process and the user's
    shell, and its copy set aside deleted."""
    try:
        here = Path.cwd().resolve()
    except OSError:  # the working directory was deleted
        return False
    there = Path(os.path.realpath(folder))
    return here == there or there in here.parents


def check_writable(out: PathLike, name: str = "--out") -> None:
    """Refuse, before any work, an output folder ``out`` that cannot be written, or a run
    would fail only at its end. Output is built beside ``out`` and renamed into place, so
    the nearest existing folder above it must accept the longest name put there
    (``.<name>.ready-<pid>-<8 hex>``: a name near the file system's limit passes a shorter
    probe and fails at the first checkpoint); an existing ``out`` must accept new entries
    (the files written into it, a checkpoint's marker). Nothing is created: the writer
    makes the missing folders."""
    out_path = Path(os.path.abspath(out))
    if out_path.is_symlink():  # written where it points (atomic_dir), so checked there
        out_path = Path(os.path.realpath(out_path))
    parent = out_path.parent
    existing = next((p for p in (parent, *parent.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"{name} {str(out)!r} cannot be written: {str(existing)!r} is a file, "
                         "expected a directory")
    probes = [(existing or parent, f".{out_path.name}.ready-{'0' * 8}")]
    if out_path.is_dir():
        probes.append((out_path, ".probe-"))
    for folder, prefix in probes:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=prefix, dir=folder))
        except OSError as exc:
            raise ValueError(f"{name} {str(out)!r} cannot be written: {exc.strerror or exc} "
                             f"(in {str(folder)!r})") from None


def check_own_dir(out: PathLike, name: str = "--out") -> None:
    """Refuse an output folder ``out`` that holds anything attnlab did not write.

    ``out`` may be missing (it is created), empty, or hold only attnlab's own
    files; a symlink to such a folder is followed. Raises ValueError naming
    ``name`` (the option or argument ``out`` came from) and the first foreign
    entries.
    """
    check_writable(out, name)
    path = Path(out)
    if not path.exists():
        return
    if not path.is_dir():
        raise ValueError(f"{name} {str(out)!r} is a file; expected a directory")
    foreign = foreign_entries(path)
    if foreign:
        raise ValueError(
            f"{name} {str(out)!r} holds files attnlab did not write ("
            f"{', '.join(map(repr, foreign[:3]))}{' ...' if len(foreign) > 3 else ''}); "
            "expected a new or empty directory or one attnlab wrote")


def signed(document: Any) -> Any:
    """A JSON document as attnlab writes it to a file: an object with ``"written_by":
    SIGNATURE`` as its first key, or a list with every object in it so signed."""
    if isinstance(document, dict):
        return {"written_by": SIGNATURE, **{k: v for k, v in document.items()
                                             if k != "written_by"}}
    if isinstance(document, list):
        return [signed(item) if isinstance(item, dict) else item for item in document]
    raise TypeError(f"document must be a JSON object or list, got {type(document).__name__}")


def figure_metadata(fmt: str) -> dict[str, str]:
    """The ``metadata=`` that signs a figure matplotlib saves as ``fmt`` ("png", "svg")."""
    return {"Software": SIGNATURE} if fmt == "png" else {"Creator": SIGNATURE}


def _png_signed(head: bytes) -> bool:
    at = len(_PNG_MAGIC)
    while at + 8 <= len(head):
        size = int.from_bytes(head[at:at + 4], "big")
        kind, data = head[at + 4:at + 8], head[at + 8:at + 8 + size]
        if kind == b"IDAT":
            return False
        if kind == b"tEXt" and data.startswith(b"Software\x00attnlab"):
            return True
        at += 12 + size
    return False


def is_signed(path: PathLike) -> bool:
    """Whether the regular file at ``path`` carries attnlab's :data:`SIGNATURE` (only its
    first 64 KiB are read; a FIFO or device is never opened)."""
    target = Path(path)
    if target.is_symlink() or not target.is_file():
        return False
    try:
        with open(target, "rb") as f:
            head = f.read(_SIGNATURE_BYTES)
    except OSError:
        return False
    if head.startswith(_PNG_MAGIC):
        return _png_signed(head)
    if _SVG_SIGNED.search(head) or _HTML_SIGNED.search(head):
        return True
    if _JSON_SIGNED.match(head) is None:
        return False
    return not head.lstrip().startswith(b"[") or _every_record_signed(target)


# A list of records is read whole to see every record's signature; attnlab's are far smaller.
_JSON_LIST_BYTES = 64 * 1024 * 1024


def drop_stale(path: PathLike) -> bool:
    """Remove ``path`` where it is a picture or page attnlab signed (the other format's
    picture of an earlier run into the same folder: ``attention.png`` beside a new
    ``attention.svg`` would show another text); anything else is left as it is. Call it
    holding the folder's :func:`~attnlab.io.locks.output_lock`. Returns whether it
    removed the file."""
    if not is_signed(path):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _every_record_signed(path: Path) -> bool:
    """Whether every object in the JSON list at ``path`` starts with attnlab's signature
    (a user's file that begins with one signed record and goes on with their own is theirs)."""
    import json

    try:
        if path.stat().st_size > _JSON_LIST_BYTES:
            return False
        with open(path, "rb") as f:
            records = json.loads(f.read(_JSON_LIST_BYTES + 1))
    except (OSError, ValueError):
        return False
    # attnlab's lists hold records only; a string or number among them is the user's
    return isinstance(records, list) and bool(records) and all(
        isinstance(r, dict) and next(iter(r), None) == "written_by"
        and str(r["written_by"]).startswith("attnlab") for r in records)


def check_out_file(path: PathLike, name: str = "--json") -> None:
    """Refuse an output file ``path`` (``--json``, ``--png``) that cannot be written,
    before any work: a run must not train or measure for minutes and then fail on its
    last line.

    ``path`` may be new or a file attnlab wrote (:func:`is_signed`; replaced atomically,
    as :func:`attnlab.io.atomic_write_bytes` does). Refused, with ValueError naming
    ``name``: an existing file without attnlab's signature (the user's), a symlink, a
    directory, a FIFO or device (``/dev/stdout`` would be replaced, not written to), a
    parent folder that does not exist (unlike an output folder, whose
    parents are created: a file's folder missing is a typo more often than a wish),
    a parent that is a file, and a parent that takes no new entries (the temp file
    of the atomic write goes there).
    """
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{name} {str(path)!r} is a directory; expected a file path")
    if target.is_symlink():
        raise ValueError(f"{name} {str(path)!r} is a symlink; expected a new file or one "
                         "attnlab wrote (the link would be replaced, not followed)")
    if target.exists() and not target.is_file():
        raise ValueError(f"{name} {str(path)!r} is not a regular file; expected a new file "
                         "or one attnlab wrote")
    if target.exists() and not is_signed(target):
        raise ValueError(f"{name} {str(path)!r} is a file attnlab did not write (it carries "
                         "no attnlab signature), so it is left as it is; expected a new file "
                         "or one attnlab wrote: choose another name or move that file")
    parent = Path(os.path.abspath(path)).parent
    if not parent.is_dir():
        blocker = next((p for p in (parent, *parent.parents) if p.exists()), None)
        why = (f"{str(blocker)!r} is a file, expected a directory"
               if blocker is not None and not blocker.is_dir()
               else f"its folder {str(parent)!r} does not exist")
        raise ValueError(f"{name} {str(path)!r} cannot be written: {why}")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"{name} {str(path)!r} cannot be written: {exc.strerror or exc} "
                         f"(in {str(parent)!r})") from None
