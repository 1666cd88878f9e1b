"""A Hugging Face ``tokenizer.json`` (WordPiece, BPE, Unigram...) as an attnlab tokenizer.

The ``tokenizers`` package does the work; this wrapper reads the file once,
keeps its settings for :meth:`HFTokenizer.save`, and gives it the same
``encode``/``decode``/``vocab_size``/``save``/``load`` as the other tokenizers.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from ..checks import optional_positive_int
from ..io import CheckpointError
from ..io.reading import TOKENIZER_LIMIT, parse_json, read_text
from .tokenizers import _FORMAT_VERSION, PathLike, Tokenizer, _check_ids, _check_text

__all__ = ["HFTokenizer"]


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` (WordPiece, BPE, Unigram...) via ``tokenizers``.

    ``HFTokenizer(path)`` takes the path of a ``tokenizer.json`` (or of a file
    written by :meth:`save`, or of a folder holding a ``tokenizer.json``), or a
    ``tokenizers.Tokenizer``. :meth:`encode` returns the ids
    of one text, special tokens (e.g. ``[CLS] ... [SEP]``) included by default.
    As in ``transformers``, the padding and truncation settings stored in the
    file are not applied implicitly: :meth:`encode` never pads, and truncation
    happens only when ``max_length`` is given. :meth:`encode_batch` pads on the
    right with :attr:`pad_id` and returns 1/0 attention masks. The file's
    settings are kept as they are by :meth:`save`.
    """

    type_name: ClassVar[str] = "hf"
    # The model's end-of-text token, where the folder the tokenizer came with names one,
    # and every id transformers' generate stops at (what ``attnlab generate`` stops at);
    # none here.
    eos_id: int | None = None
    stop_ids: tuple[int, ...] = ()

    def __init__(self, source: PathLike | Any) -> None:
        from tokenizers import Tokenizer as _HFTok

        saved = None  # a file written by save(): its stop_ids too
        if isinstance(source, _HFTok):
            raw = _HFTok.from_str(source.to_str())
        elif isinstance(source, str | os.PathLike):
            raw, saved = _read_file(Path(source))
        else:
            raise TypeError(
                "source: expected a path to tokenizer.json or a tokenizers.Tokenizer, "
                f"got {type(source).__name__}"
            )
        self._json: str = raw.to_str()  # the file as given, settings included
        padding = raw.padding
        self._pad_id = self._find_pad_id(raw, padding)
        raw.no_padding()
        raw.no_truncation()
        self._tok = raw
        self._truncating: dict[int, Any] = {}  # max_length -> copy with truncation on
        if saved is not None:
            try:
                self._with_stop_ids(saved)
            except ValueError as exc:
                raise CheckpointError(f"{str(source)!r}: {exc}") from None

    @staticmethod
    def _find_pad_id(tok: Any, padding: dict[str, Any] | None) -> int:
        if padding is not None and padding.get("pad_id") is not None:
            return int(padding["pad_id"])
        for token in ("[PAD]", "<pad>"):
            i = tok.token_to_id(token)
            if i is not None:
                return int(i)
        return 0

    @classmethod
    def from_str(cls, json_str: str) -> HFTokenizer:
        """Build from the JSON text of a ``tokenizer.json``."""
        from tokenizers import Tokenizer as _HFTok

        _check_text(json_str, "json_str")
        try:
            raw = _HFTok.from_str(json_str)
        except BaseException as exc:  # a bare Exception for bad JSON, a Rust panic for worse
            _reraise_interrupts(exc)
            raise ValueError(f"json_str: not a valid Hugging Face tokenizer.json: {exc}") from exc
        return cls(raw)

    @classmethod
    def _from_file_data(cls, path: PathLike, data: Mapping[str, Any]) -> Tokenizer:
        """A file written by :meth:`save`, or a plain Hugging Face ``tokenizer.json``
        (no ``"type"``, a ``"model"``), as most people have it."""
        if data.get("type") is None and "model" in data:
            return cls._from_raw(path, data)
        return super()._from_file_data(path, data)

    @classmethod
    def _from_raw(cls, path: PathLike, data: Mapping[str, Any]) -> HFTokenizer:
        """Build from a raw ``tokenizer.json`` (no ``"type"``) that the caller has read.

        The object read is written back as JSON text for ``tokenizers``
        (``from_str``), so the file itself is not read a second time.
        """
        from tokenizers import Tokenizer as _HFTok

        try:
            raw = _HFTok.from_str(json.dumps(dict(data)))
        except BaseException as exc:  # pyo3's PanicException is not an Exception
            _reraise_interrupts(exc)
            raise CheckpointError(
                f"{str(path)!r}: not a valid Hugging Face tokenizer.json: {exc}"
            ) from exc
        return cls(raw)

    @functools.cached_property
    def spec(self) -> dict[str, Any]:
        """The ``tokenizer.json`` as a dict (``model``, ``pre_tokenizer``, ``decoder``...),
        parsed once: what :mod:`attnlab.text.labels` reads to label tokens."""
        return json.loads(self._json)

    @property
    def backend(self) -> Any:
        """The wrapped ``tokenizers.Tokenizer`` (padding and truncation off)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def pad_id(self) -> int:
        """Padding id: the file's padding config, else ``[PAD]``/``<pad>``, else 0."""
        return self._pad_id

    def token_to_id(self, token: str) -> int | None:
        """Id of ``token``, or None if it is not in the vocabulary."""
        return self._tok.token_to_id(_check_text(token, "token"))

    def id_to_token(self, i: int) -> str:
        """Token string of id ``i``."""
        return self._tok.id_to_token(_check_ids([i], self.vocab_size)[0])

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[str]:
        """Token strings of ``text``."""
        enc = self._tok.encode(_check_text(text), add_special_tokens=add_special_tokens)
        return list(enc.tokens)

    def _backend_for(self, max_length: int | None) -> Any:
        """The backend tokenizer, truncating to ``max_length`` when given (one copy per length)."""
        max_length = optional_positive_int("max_length", max_length)
        if max_length is None:
            return self._tok
        tok = self._truncating.get(max_length)
        if tok is None:
            from tokenizers import Tokenizer as _HFTok

            tok = _HFTok.from_str(self._tok.to_str())
            tok.enable_truncation(max_length)
            self._truncating[max_length] = tok
        return tok

    def encode(
        self, text: str, *, add_special_tokens: bool = True, max_length: int | None = None
    ) -> list[int]:
        """Ids of ``text``; with ``max_length``, truncated to at most that many
        (special tokens kept)."""
        _check_text(text)
        tok = self._backend_for(max_length)
        try:
            return list(tok.encode(text, add_special_tokens=add_special_tokens).ids)
        except Exception as exc:  # e.g. max_length shorter than the special tokens
            raise ValueError(f"cannot encode text with max_length={max_length}: {exc}") from exc

    def encode_batch(
        self,
        texts: Sequence[str],
        max_length: int | None = None,
        add_special_tokens: bool = True,
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Encode several texts; returns ``(ids, attention_mask)`` as lists of lists.

        Every row is padded on the right with :attr:`pad_id` to the longest row
        (after truncation to ``max_length`` when given); the mask is 1 for real
        tokens and 0 for padding.
        """
        if isinstance(texts, str) or not isinstance(texts, Sequence):
            raise TypeError(f"texts: expected a list of str, got {type(texts).__name__}")
        for pos, t in enumerate(texts):
            _check_text(t, f"texts[{pos}]")
        tok = self._backend_for(max_length)
        try:
            encs = tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        except Exception as exc:
            raise ValueError(f"cannot encode texts with max_length={max_length}: {exc}") from exc
        rows = [list(e.ids) for e in encs]
        width = max((len(r) for r in rows), default=0)
        ids = [r + [self._pad_id] * (width - len(r)) for r in rows]
        mask = [[1] * len(r) + [0] * (width - len(r)) for r in rows]
        return ids, mask

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped unless ``skip_special_tokens=False``."""
        return self._tok.decode(
            _check_ids(ids, self.vocab_size), skip_special_tokens=skip_special_tokens
        )

    def to_dict(self) -> dict[str, Any]:
        data = {"type": self.type_name, "version": _FORMAT_VERSION, "tokenizer": self._json}
        if self.stop_ids:  # kept with a checkpoint: generate --ckpt stops where it did
            data["stop_ids"] = list(self.stop_ids)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HFTokenizer:
        return cls.from_str(data["tokenizer"])._with_stop_ids(data)

    def _with_stop_ids(self, data: Mapping[str, Any]):
        """This tokenizer with ``data``'s ``stop_ids``, if any: the model's token ids
        (a model's vocabulary may be larger than its tokenizer's, GPT-2's 50256 beside a
        small one: generate drops those past the model's)."""
        ids = data.get("stop_ids", [])
        if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
            raise ValueError(f"stop_ids must be a list of non-negative token ids, got {ids!r}")
        self.stop_ids = tuple(ids)
        return self

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, pad_id={self.pad_id})"


def _reraise_interrupts(exc: BaseException) -> None:
    """The ``tokenizers`` library panics (a BaseException) on some hostile files: those
    become one error naming the file, but a Ctrl-C or an exit stays what it is."""
    if isinstance(exc, KeyboardInterrupt | SystemExit | GeneratorExit):
        raise exc


def _read_file(path: Path) -> tuple[Any, dict | None]:
    """The ``tokenizers.Tokenizer`` of a ``tokenizer.json``, of a file written by
    :meth:`HFTokenizer.save` (and then that file's fields), or of a folder holding a
    ``tokenizer.json``.

    The file is read once; ``tokenizers`` parses the text read (``from_str``)
    rather than opening the file again. Every failure after the file is found
    is a :class:`CheckpointError` naming the file.
    """
    from tokenizers import Tokenizer as _HFTok

    if path.is_dir():
        path = path / "tokenizer.json"  # the Hugging Face folder layout
    if not path.exists():
        raise CheckpointError(f"{str(path)!r}: tokenizer file not found")
    # A regular file within the limit (a FIFO or /dev/zero would hang or fill memory).
    text = read_text(path, TOKENIZER_LIMIT, "tokenizer file")
    data = parse_json(text, repr(str(path)))
    # (a GGUF tokenizer's saved file holds the same tokenizer.json beside its extras)
    saved = isinstance(data, dict) and data.get("type") in (HFTokenizer.type_name, "gguf")
    try:
        if saved:
            text = data["tokenizer"]  # a file written by HFTokenizer.save
        return _HFTok.from_str(text), (data if saved else None)
    except BaseException as exc:  # pyo3's PanicException is not an Exception
        _reraise_interrupts(exc)
        raise CheckpointError(
            f"{str(path)!r}: not a valid Hugging Face tokenizer.json: {exc}"
        ) from exc
