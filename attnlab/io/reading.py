"""Bounded reads: only regular files, never more than a stated size.

A FIFO, ``/dev/zero`` or a directory given where a file is expected would hang
a reader forever or fill the memory; a 100,000-level JSON nesting would end in
a ``RecursionError``. Every file attnlab reads as a whole (configs, tokenizers,
training state, ``--text``) goes through :func:`read_bytes` with a limit suited
to its kind, and every JSON file through :func:`parse_json`.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from .files import CheckpointError, PathLike

__all__ = ["read_bytes", "read_text", "parse_json", "read_json", "MiB", "CONFIG_LIMIT",
           "TOKENIZER_LIMIT", "STATE_LIMIT", "TEXT_LIMIT"]

MiB = 1 << 20
CONFIG_LIMIT = 1 * MiB  # a model's config.json is a few kilobytes
TOKENIZER_LIMIT = 64 * MiB  # the largest Hugging Face tokenizer.json files are ~20 MB
STATE_LIMIT = 256 * MiB  # the training state's JSON: settings and the loss history
TEXT_LIMIT = 256 * MiB  # a --text corpus, held in memory as one string


def _size(n: int) -> str:
    return f"{n / MiB:.0f} MiB" if n >= MiB else f"{n} bytes"


def _name(what: str, path: Path) -> str:
    return repr(str(path)) if what == "file" else f"{what} {str(path)!r}"


def read_bytes(path: PathLike, limit: int, what: str = "file") -> bytes:
    """The content of regular file ``path``, refused (CheckpointError naming it) when it
    is a FIFO, a device or a directory, or holds more than ``limit`` bytes.

    Opened non-blocking, so even opening a FIFO without a writer cannot hang.
    """
    path = Path(path)
    name = _name(what, path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{name} cannot be read: file not found") from None
    except OSError as exc:
        raise CheckpointError(f"{name} cannot be read: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = ("a directory" if stat.S_ISDIR(info.st_mode) else
                    "a FIFO" if stat.S_ISFIFO(info.st_mode) else
                    "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode)
                    else "not a regular file")
            raise CheckpointError(f"{name} is {kind}; expected a regular file")
        if info.st_size > limit:
            raise CheckpointError(f"{name} is {_size(info.st_size)}, over the "
                                  f"limit of {_size(limit)} for a {what}")
        chunks, total = [], 0
        while True:  # to the limit, even if the file grows while it is read
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise CheckpointError(f"{name} grew past the limit of "
                                      f"{_size(limit)} for a {what} while it was read")
        return b"".join(chunks)
    except OSError as exc:
        raise CheckpointError(f"{name} cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def read_text(path: PathLike, limit: int, what: str = "file") -> str:
    """:func:`read_bytes` decoded as UTF-8, BOM dropped and line ends made ``\\n`` (see
    ``_utf8``; CheckpointError naming the file where it is not UTF-8)."""
    return _utf8(read_bytes(path, limit, what), _name(what, Path(path)))


def read_stream_text(stream, limit: int, name: str) -> str:
    """A binary stream (standard input: ``--text -``) read to its end, at most ``limit``
    bytes, decoded as UTF-8; CheckpointError naming it (``name``) otherwise."""
    chunks, total = [], 0
    while True:
        want = min(1 << 20, limit + 1 - total)
        chunk = stream.read(want)  # a buffered read returns short only at the end
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise CheckpointError(f"{name} holds more than {_size(limit)}, the limit")
        if len(chunk) < want:  # the end: a terminal's Ctrl-D is not repeated on a 2nd read
            break
    return _utf8(b"".join(chunks), name)


def _utf8(data: bytes, name: str) -> str:
    """``data`` as text the way Python's own text files read it: UTF-8, a leading byte-order
    mark dropped (Windows editors write one), ``\\r\\n`` and ``\\r`` line ends as ``\\n`` (or
    a tokenizer trained on the text learns ``\\r`` and the BOM as characters, and generated
    text carries them)."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{name} is not UTF-8 text: {exc.reason} at byte "
                              f"{exc.start}{_utf16_hint(data) or _gb18030_hint(data)}") from None
    return normal_line_ends(text)


def _utf16_hint(data: bytes) -> str:
    """What to do if ``data`` is UTF-16 (Windows Notepad's "Unicode", PowerShell 5's ``>``),
    else "": a byte-order mark, or zero bytes (the high halves of ASCII characters: line
    ends, spaces) all in the even or all in the odd places of text that decodes so. UTF-8
    and GBK text holds no zero byte; a binary file holds them in both places."""
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        codec = "utf-16"
    else:
        head = data[:1 << 16]
        head = head[:len(head) // 2 * 2]
        even, odd = head[0::2].count(0), head[1::2].count(0)
        enough = max(1, len(head) // 200)  # (a line end every 100 characters or more)
        codec = ("utf-16le" if odd >= enough and not even else
                 "utf-16be" if even >= enough and not odd else "")
        if codec:
            try:
                head.decode(codec)
            except UnicodeDecodeError:
                codec = ""
    if not codec:
        return ""
    return (f"; it looks like {codec.upper().replace('LE', ' LE').replace('BE', ' BE')} "
            f"(Windows Notepad's \"Unicode\", PowerShell's > redirect): save it as UTF-8, "
            f"e.g. iconv -f {codec} -t utf-8 FILE > FILE.utf8")


def _gb18030_hint(data: bytes) -> str:
    """What to do if ``data`` reads as CJK text in GB18030 (GBK's superset: the encoding
    Chinese Windows saves text in), else "". Japanese (Shift-JIS) and Korean (EUC-KR)
    bytes read as Chinese there too, so the hint names them as well."""
    try:
        text = data.decode("gb18030")
    except UnicodeDecodeError:
        return ""
    wide = [c for c in text if ord(c) > 0x7F]
    chinese = sum("\u4e00" <= c <= "\u9fff" or "\u3000" <= c <= "\u303f"
                  or "\uff00" <= c <= "\uffef" for c in wide)
    if not wide or chinese < len(wide) * 0.8:  # Latin-1 bytes pair up as GBK too
        return ""
    return ("; it looks like an East Asian Windows encoding (GBK/GB18030 for Chinese, "
            "Shift-JIS for Japanese, EUC-KR for Korean): save it as UTF-8, e.g. for Chinese "
            "iconv -f gb18030 -t utf-8 FILE > FILE.utf8")


def normal_line_ends(text: str) -> str:
    """``\\r\\n`` and ``\\r`` line ends as ``\\n``, as Python's text files read them."""
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def parse_json(text: str | bytes, where: str) -> Any:
    """``json.loads`` whose every failure is one CheckpointError naming ``where``:
    invalid JSON, and nesting too deep for the parser (a RecursionError)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{where}: invalid JSON: {exc}") from None
    except RecursionError:
        raise CheckpointError(f"{where}: JSON nested too deeply to read") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{where}: not UTF-8 text: {exc.reason}") from None


def read_json(path: PathLike, limit: int = 16 * MiB, what: str = "file") -> dict[str, Any]:
    """Read a JSON object from ``path`` (a regular file of at most ``limit`` bytes).

    Raises :class:`CheckpointError` naming the path if the file is missing,
    unreadable, not a regular file (a FIFO or a device would hang the reader),
    too large, not valid JSON (or nested too deeply), or holds something other
    than a JSON object.
    """
    path = Path(path)
    obj = parse_json(read_text(path, limit, what), repr(str(path)))
    if not isinstance(obj, dict):
        raise CheckpointError(
            f"{str(path)!r}: expected a JSON object at the top level, got {type(obj).__name__}"
        )
    return obj
