"""Tokenizers: the common interface, characters and words, and loading any saved one.

All tokenizers share one interface: ``encode(text) -> list[int]``,
``decode(ids) -> str``, ``vocab_size``, ``save(path)`` and ``load(path)``.
A saved tokenizer is one JSON file with a ``"type"`` field (``"char"``,
``"word"`` or ``"hf"``); :func:`load_tokenizer` reads that field and returns the
right class. Files are written atomically (temp file, fsync, rename).
The Hugging Face wrapper, :class:`~attnlab.text.hf_tokenizer.HFTokenizer`,
lives in its own module and registers itself here by its ``type_name``.

This module does not need torch: ids and masks are plain Python lists.
"""

from __future__ import annotations

import operator
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

from ..checks import boolean, positive_int
from ..io import CheckpointError, atomic_write_json, read_json
from ..io.reading import TOKENIZER_LIMIT

__all__ = ["Tokenizer", "CharTokenizer", "WordTokenizer", "load_tokenizer", "WORD_PATTERN"]

PathLike = str | os.PathLike[str]

# CJK ideographs, as BERT's BasicTokenizer lists them: each a token (a run is a clause).
_IDEOGRAPHS = ("\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002a6df"
               "\U0002a700-\U0002ceaf\U0002f800-\U0002fa1f")
#: How :class:`WordTokenizer` splits text: one CJK ideograph, a run of other word
#: characters, or any one other non-space character. "don't" -> ["don", "'", "t"];
#: "3.5" -> ["3", ".", "5"]; "我喜欢AI" -> ["我", "喜", "欢", "AI"].
WORD_PATTERN = rf"[{_IDEOGRAPHS}]|(?:(?![{_IDEOGRAPHS}])\w)+|[^\w\s]"
_PUNCT = re.compile(r"[^\w\s]")
_IDEOGRAPH = re.compile(f"[{_IDEOGRAPHS}]")
_CJK_TEXT = re.compile(f"[{_IDEOGRAPHS}\u3000-\u303f\uff00-\uffef]")  # written unspaced
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
    #: ``type_name`` -> class, for :func:`load_tokenizer`. Each subclass that names its own
    #: ``type_name`` enters itself when it is defined, so this module can load an
    #: ``"hf"`` file without importing the Hugging Face wrapper (which imports this module).
    _kinds: ClassVar[dict[str, type[Tokenizer]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("type_name"):
            Tokenizer._kinds[cls.type_name] = cls

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
        """Read a tokenizer written by :meth:`save` (``CheckpointError`` if unreadable).

        On ``Tokenizer`` itself this is :func:`load_tokenizer` (any kind); on a
        subclass the file must hold that kind.
        """
        data = read_json(path, TOKENIZER_LIMIT)  # the one read; the rest works on data
        if cls is Tokenizer:
            return _from_any(path, data)
        return cls._from_file_data(path, data)

    @classmethod
    def _from_file_data(cls, path: PathLike, data: Mapping[str, Any]) -> Tokenizer:
        """Build ``cls`` from ``data``, the JSON object read from ``path`` (named in errors)."""
        kind = data.get("type")
        if kind != cls.type_name:
            raise CheckpointError(
                f"{str(path)!r}: holds a tokenizer of type {kind!r}, "
                f"expected {cls.type_name!r} for {cls.__name__}"
            )
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

    Splitting uses :data:`WORD_PATTERN` (a CJK ideograph, else ``\\w+|[^\\w\\s]``: each
    ideograph on its own, as BERT splits them): "how are you?" -> ["how", "are", "you",
    "?"], "don't" -> ["don", "'", "t"], "你好，世界" -> ["你", "好", "，", "世", "界"]. Vocabulary
    entries that pattern would split (such as ``<pad>``, ``<unk>``, ``[CLS]``)
    are matched whole when they appear in the text.

    ``vocab`` is a list of tokens (id = position) or a dict token -> id whose ids are
    exactly ``0 .. n-1``. ``<pad>`` and ``<unk>`` are appended at the end when missing, so
    the ids you gave stay as they are (:meth:`from_text` puts them first instead:
    ``<pad>`` = 0, ``<unk>`` = 1). Unknown words map to ``<unk>``. With ``lowercase=True``
    words are lowercased before lookup (vocabulary tokens matched whole are not).

    :meth:`decode` joins tokens with spaces but puts none before a punctuation mark or
    between CJK characters, so ``tokenize(decode(encode(s)))`` equals ``tokenize(s)`` when
    every word of ``s`` is in the vocabulary; the exact spacing of ``s`` is not kept
    ("don't" decodes as "don' t").
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
        boolean("lowercase", lowercase)
        for special in (self.PAD, self.UNK):
            if special not in tokens:
                tokens.append(special)
        self.lowercase = lowercase
        self._itos: list[str] = tokens
        self._stoi: dict[str, int] = {t: i for i, t in enumerate(tokens)}
        # Tokens the plain pattern would not produce whole are matched literally first (not
        # inside a longer word; an ideograph ends a word where it stands).
        literals = sorted((t for t in tokens if not re.fullmatch(WORD_PATTERN, t)), key=len,
                          reverse=True)
        alternatives = [re.escape(t) + (r"(?!\w)" if re.search(r"\w$", t)
                                        and not _IDEOGRAPH.match(t[-1]) else "")
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
        min_freq = positive_int("min_freq", min_freq)
        # Split, then lowercase each token, as tokenize() does: lowercasing first changes the
        # split where a character's lower case is not a word character ('İ' -> 'i' + U+0307)
        # or depends on its neighbours (a final 'Σ').
        words = [w.lower() if lowercase else w for w in re.findall(WORD_PATTERN, text)]
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
        """Join tokens with spaces, without a space before punctuation marks or between
        CJK ideographs and CJK punctuation (Chinese writes none)."""
        parts: list[str] = []
        for i in _check_ids(ids, self.vocab_size):
            tok = self._itos[i]
            if skip_pad and tok == self.PAD:
                continue
            if parts and not _PUNCT.fullmatch(tok) and not (
                    _CJK_TEXT.match(tok) and _CJK_TEXT.match(parts[-1][-1:])):
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



def load_tokenizer(path: PathLike) -> Tokenizer:
    """Load any tokenizer saved by ``save`` (dispatching on its ``"type"``).

    A raw Hugging Face ``tokenizer.json`` (no ``"type"``, but a ``"model"``)
    is loaded as an :class:`~attnlab.text.HFTokenizer`. The file is read once.
    """
    return _from_any(path, read_json(path, TOKENIZER_LIMIT))


def _from_any(path: PathLike, data: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer of whatever kind ``data`` (read from ``path``) describes."""
    kind = data.get("type")
    kinds = Tokenizer._kinds
    if kind is None and "model" in data:
        return kinds["hf"]._from_raw(path, data)  # type: ignore[attr-defined]
    if not isinstance(kind, str) or kind not in kinds:  # ["char"] is no type name
        raise CheckpointError(
            f"{str(path)!r}: unknown tokenizer type {kind!r}, expected one of {sorted(kinds)}"
        )
    return kinds[kind]._from_file_data(path, data)
