"""Tokenizers: characters, words, and Hugging Face ``tokenizer.json`` files.

All three share one interface: ``encode(text) -> list[int]``,
``decode(ids) -> str``, ``vocab_size``, ``save(path)`` and ``load(path)``.
A saved tokenizer is one JSON file with a ``"type"`` field (``"char"``,
``"word"`` or ``"hf"``); :func:`load_tokenizer` reads that field and returns the
right class. Files are written atomically (temp file, fsync, rename).

This module does not need torch: ids and masks are plain Python lists.
"""

from __future__ import annotations

import operator
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from ..io import CheckpointError, atomic_write_json, read_json
from ..io.reading import TOKENIZER_LIMIT, parse_json, read_text

__all__ = [
    "Tokenizer",
    "CharTokenizer",
    "WordTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "WORD_PATTERN",
]

PathLike = str | os.PathLike[str]

#: How :class:`WordTokenizer` splits text: runs of word characters, or any one
#: other non-space character. "don't" -> ["don", "'", "t"]; "3.5" -> ["3", ".", "5"].
WORD_PATTERN = r"\w+|[^\w\s]"
_PUNCT = re.compile(r"[^\w\s]")
_FORMAT_VERSION = 1


def _check_text(text: Any, name: str = "text") -> str:
    if not isinstance(text, str):
        raise TypeError(f"{name}: expected str, got {type(text).__name__}")
    return text


def _check_ids(ids: Any, vocab_size: int) -> list[int]:
    """ids as a list of ints in [0, vocab_size); accepts tensors/arrays via tolist()."""
    if isinstance(ids, str | bytes):
        raise TypeError(f"ids: expected a sequence of ints, got {type(ids).__name__}")
    if hasattr(ids, "tolist"):  # torch tensors and numpy arrays, without importing either
        ids = ids.tolist()
    if isinstance(ids, int):
        raise TypeError("ids: expected a sequence of ints, got a single int")
    if not isinstance(ids, Iterable):
        raise TypeError(f"ids: expected a sequence of ints, got {type(ids).__name__}")
    out = []
    for pos, i in enumerate(ids):
        if isinstance(i, bool):
            raise TypeError(f"ids[{pos}]: expected int, got bool")
        try:
            i = operator.index(i)
        except TypeError:
            raise TypeError(f"ids[{pos}]: expected int, got {type(i).__name__} ({i!r})") from None
        if not 0 <= i < vocab_size:
            raise ValueError(f"ids[{pos}]: id {i} is out of range, expected 0 <= id < {vocab_size}")
        out.append(i)
    return out


class Tokenizer:
    """Common base: ``encode``, ``decode``, ``vocab_size``, ``save``, ``load``."""

    type_name: ClassVar[str] = ""

    @property
    def vocab_size(self) -> int:
        """Number of ids; valid ids are ``0 .. vocab_size - 1``."""
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable description, including ``"type"``; inverse of ``from_dict``."""
        raise NotImplementedError

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Tokenizer:
        """Rebuild a tokenizer from :meth:`to_dict` output."""
        raise NotImplementedError

    def save(self, path: PathLike) -> None:
        """Write this tokenizer to one JSON file, atomically."""
        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: PathLike) -> Tokenizer:
        """Read a tokenizer written by :meth:`save` (``CheckpointError`` if unreadable)."""
        data = read_json(path, TOKENIZER_LIMIT)
        kind = data.get("type")
        if cls is not Tokenizer and kind != cls.type_name:
            raise CheckpointError(
                f"{str(path)!r}: holds a tokenizer of type {kind!r}, "
                f"expected {cls.type_name!r} for {cls.__name__}"
            )
        if cls is Tokenizer:
            return load_tokenizer(path)
        try:
            return cls.from_dict(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{str(path)!r}: invalid {cls.__name__} file: {exc}") from exc

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.to_dict() == other.to_dict()  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]


class CharTokenizer(Tokenizer):
    """One id per character; ids are positions in ``chars``.

    ``CharTokenizer.from_text(text)`` uses the sorted unique characters of
    ``text``. Characters outside the vocabulary make :meth:`encode` raise a
    ``ValueError`` that lists them (there is no unknown token).
    """

    type_name: ClassVar[str] = "char"

    def __init__(self, chars: str | Iterable[str]) -> None:
        if not isinstance(chars, Iterable):
            raise TypeError(
                f"chars: expected a str or list of characters, got {type(chars).__name__}"
            )
        chars = list(chars)
        if not chars:
            raise ValueError("chars: expected at least one character, got an empty vocabulary")
        for c in chars:
            if not isinstance(c, str) or len(c) != 1:
                raise ValueError(f"chars: every entry must be a single character, got {c!r}")
        dupes = sorted({c for c, n in Counter(chars).items() if n > 1})
        if dupes:
            raise ValueError(f"chars: characters must be unique, got duplicates {dupes!r}")
        self._itos: list[str] = chars
        self._stoi: dict[str, int] = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """Vocabulary of the sorted unique characters of ``text``."""
        _check_text(text)
        if not text:
            raise ValueError("text: expected a non-empty string to build a vocabulary from, got ''")
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self._itos)

    @property
    def chars(self) -> list[str]:
        """The vocabulary, in id order."""
        return list(self._itos)

    def encode(self, text: str) -> list[int]:
        _check_text(text)
        stoi = self._stoi
        try:
            return [stoi[c] for c in text]
        except KeyError:
            unknown = list(dict.fromkeys(c for c in text if c not in stoi))
            shown = ", ".join(repr(c) for c in unknown[:20])
            more = f" (and {len(unknown) - 20} more)" if len(unknown) > 20 else ""
            raise ValueError(
                f"text has characters not in the tokenizer's vocabulary: {shown}{more}"
            ) from None

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self._itos[i] for i in _check_ids(ids, self.vocab_size))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type_name, "version": _FORMAT_VERSION, "chars": self._itos}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CharTokenizer:
        return cls(data["chars"])

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


class WordTokenizer(Tokenizer):
    """Word-level tokenizer: words and punctuation marks are tokens.

    Splitting uses :data:`WORD_PATTERN` (``\\w+|[^\\w\\s]``): "how are you?" ->
    ["how", "are", "you", "?"], "don't" -> ["don", "'", "t"]. Vocabulary
    entries that pattern would split (such as ``<pad>``, ``<unk>``, ``[CLS]``)
    are matched whole when they appear in the text.

    ``vocab`` is a list of tokens (id = position) or a dict token -> id whose
    ids are exactly ``0 .. n-1``. ``<pad>`` and ``<unk>`` are appended at the
    end when missing, so the ids you gave stay as they are
    (:meth:`from_text` puts them first instead: ``<pad>`` = 0, ``<unk>`` = 1).
    Unknown words map to ``<unk>``. With ``lowercase=True`` words are
    lowercased before lookup (vocabulary tokens matched whole are not).

    :meth:`decode` joins tokens with spaces but puts no space before a
    punctuation mark, so ``tokenize(decode(encode(s)))`` equals
    ``tokenize(s)`` when every word of ``s`` is in the vocabulary; the exact
    spacing of ``s`` is not kept ("don't" decodes as "don' t").
    """

    type_name: ClassVar[str] = "word"
    PAD: ClassVar[str] = "<pad>"
    UNK: ClassVar[str] = "<unk>"

    def __init__(self, vocab: Sequence[str] | Mapping[str, int], *, lowercase: bool = False):
        if isinstance(vocab, Mapping):
            tokens = self._tokens_from_mapping(vocab)
        elif isinstance(vocab, Sequence) and not isinstance(vocab, str):
            tokens = list(vocab)
        else:
            raise TypeError(
                "vocab: expected a list of tokens or a dict token -> id, "
                f"got {type(vocab).__name__}"
            )
        for t in tokens:
            if not isinstance(t, str) or not t:
                raise ValueError(f"vocab: every token must be a non-empty str, got {t!r}")
        dupes = sorted({t for t, n in Counter(tokens).items() if n > 1})
        if dupes:
            raise ValueError(f"vocab: tokens must be unique, got duplicates {dupes!r}")
        if not isinstance(lowercase, bool):
            raise TypeError(f"lowercase: expected bool, got {type(lowercase).__name__}")
        for special in (self.PAD, self.UNK):
            if special not in tokens:
                tokens.append(special)
        self.lowercase = lowercase
        self._itos: list[str] = tokens
        self._stoi: dict[str, int] = {t: i for i, t in enumerate(tokens)}
        # Tokens the plain pattern would not produce whole are matched literally first.
        literals = sorted(
            (t for t in tokens if not re.fullmatch(WORD_PATTERN, t)), key=len, reverse=True
        )
        alternatives = [re.escape(t) + (r"(?!\w)" if re.search(r"\w$", t) else "")
                        for t in literals]
        lit = f"(?P<lit>{'|'.join(alternatives)})|" if alternatives else ""
        self._pattern = re.compile(lit + WORD_PATTERN)

    @staticmethod
    def _tokens_from_mapping(vocab: Mapping[str, int]) -> list[str]:
        ids = sorted(vocab.values()) if all(isinstance(i, int) for i in vocab.values()) else None
        if ids is None or ids != list(range(len(vocab))):
            raise ValueError(
                f"vocab: a dict vocabulary must map tokens to the ids 0..{len(vocab) - 1} "
                f"exactly once each, got ids {sorted(vocab.values(), key=repr)[:10]!r}..."
            )
        return [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]

    @classmethod
    def from_text(cls, text: str, *, lowercase: bool = False, min_freq: int = 1) -> WordTokenizer:
        """Vocabulary of the tokens of ``text`` seen at least ``min_freq`` times.

        Ids: ``<pad>`` = 0, ``<unk>`` = 1, then tokens by decreasing frequency
        (ties alphabetically).
        """
        _check_text(text)
        if isinstance(min_freq, bool) or not isinstance(min_freq, int) or min_freq < 1:
            raise ValueError(f"min_freq: expected an int >= 1, got {min_freq!r}")
        words = re.findall(WORD_PATTERN, text.lower() if lowercase else text)
        if not words:
            raise ValueError(
                f"text: expected text with at least one word or punctuation mark, got {text[:50]!r}"
            )
        counts = Counter(words)
        kept = [w for w, n in counts.items() if n >= min_freq]
        kept.sort(key=lambda w: (-counts[w], w))
        if not kept:
            raise ValueError(
                f"min_freq: no token occurs {min_freq} times or more "
                f"(the most frequent occurs {max(counts.values())} times)"
            )
        specials = [cls.PAD, cls.UNK]
        return cls(specials + [w for w in kept if w not in specials], lowercase=lowercase)

    @property
    def vocab_size(self) -> int:
        return len(self._itos)

    @property
    def pad_id(self) -> int:
        """Id of ``<pad>``."""
        return self._stoi[self.PAD]

    @property
    def unk_id(self) -> int:
        """Id of ``<unk>``."""
        return self._stoi[self.UNK]

    @property
    def vocab(self) -> dict[str, int]:
        """A copy of the token -> id mapping."""
        return dict(self._stoi)

    def tokenize(self, text: str) -> list[str]:
        """Split ``text`` into tokens (lowercased when ``lowercase=True``)."""
        _check_text(text)
        out = []
        for m in self._pattern.finditer(text):
            tok = m.group(0)
            if self.lowercase and not m.groupdict().get("lit"):
                tok = tok.lower()
            out.append(tok)
        return out

    def encode(self, text: str) -> list[int]:
        unk = self.unk_id
        return [self._stoi.get(t, unk) for t in self.tokenize(text)]

    def decode(self, ids: Iterable[int], *, skip_pad: bool = False) -> str:
        """Join tokens with spaces, without a space before punctuation marks."""
        parts: list[str] = []
        for i in _check_ids(ids, self.vocab_size):
            tok = self._itos[i]
            if skip_pad and tok == self.PAD:
                continue
            if parts and not _PUNCT.fullmatch(tok):
                parts.append(" ")
            parts.append(tok)
        return "".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.type_name,
            "version": _FORMAT_VERSION,
            "lowercase": self.lowercase,
            "vocab": self._itos,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WordTokenizer:
        return cls(data["vocab"], lowercase=data.get("lowercase", False))

    def __repr__(self) -> str:
        return f"WordTokenizer(vocab_size={self.vocab_size}, lowercase={self.lowercase})"


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

    def __init__(self, source: PathLike | Any) -> None:
        from tokenizers import Tokenizer as _HFTok

        if isinstance(source, _HFTok):
            raw = _HFTok.from_str(source.to_str())
        elif isinstance(source, str | os.PathLike):
            path = Path(source)
            if path.is_dir():
                path = path / "tokenizer.json"
            if not path.exists():
                raise CheckpointError(f"{str(path)!r}: tokenizer file not found")
            text = read_text(path, TOKENIZER_LIMIT, "tokenizer file")
            data = parse_json(text, repr(str(path)))
            try:
                if isinstance(data, dict) and data.get("type") == self.type_name:
                    text = data["tokenizer"]  # a file written by HFTokenizer.save
                raw = _HFTok.from_str(text)
            except BaseException as exc:  # a Rust panic is a BaseException (PanicException)
                if isinstance(exc, KeyboardInterrupt | SystemExit | GeneratorExit):
                    raise
                raise CheckpointError(
                    f"{str(path)!r}: not a valid Hugging Face tokenizer.json: {exc}"
                ) from exc
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
        except BaseException as exc:  # a bare Exception for bad JSON, a panic for worse
            if isinstance(exc, KeyboardInterrupt | SystemExit | GeneratorExit):
                raise
            raise ValueError(f"json_str: not a valid Hugging Face tokenizer.json: {exc}") from exc
        return cls(raw)

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
        if max_length is None:
            return self._tok
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length: expected an int >= 1 or None, got {max_length!r}")
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
        return {"type": self.type_name, "version": _FORMAT_VERSION, "tokenizer": self._json}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HFTokenizer:
        return cls.from_str(data["tokenizer"])

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, pad_id={self.pad_id})"


def load_tokenizer(path: PathLike) -> Tokenizer:
    """Load any tokenizer saved by ``save`` (dispatching on its ``"type"``).

    A raw Hugging Face ``tokenizer.json`` (no ``"type"``, but a ``"model"``)
    is loaded as an :class:`HFTokenizer`.
    """
    data = read_json(path, TOKENIZER_LIMIT)
    kind = data.get("type")
    classes: dict[str, type[Tokenizer]] = {
        c.type_name: c for c in (CharTokenizer, WordTokenizer, HFTokenizer)
    }
    if kind is None and "model" in data:
        return HFTokenizer(path)
    if not isinstance(kind, str) or kind not in classes:  # ["char"] is not a type name
        raise CheckpointError(
            f"{str(path)!r}: unknown tokenizer type {kind!r}, expected one of {sorted(classes)}"
        )
    return classes[kind].load(path)
