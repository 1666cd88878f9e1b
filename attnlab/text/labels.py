"""Readable token labels: the text each token covers, for pictures of attention.

A tokenizer's own token strings are made for machines: byte-level BPE (GPT-2,
Llama 3, Qwen) writes "注意力" as ``æ³¨æĦıåĬĽ`` and a word-initial space as
``Ġ``; SentencePiece writes it as ``▁``. :func:`token_labels` turns every
token into what a reader expects:

- byte-level BPE: the token's bytes decoded as UTF-8; bytes that are only part
  of a character are shown as ``<0xE6>`` (honest: that token holds no whole
  character), never as mojibake;
- other Hugging Face tokenizers (WordPiece, Unigram, BPE with Metaspace): the
  slice of the original text the token covers (the encoding's offsets), with
  WordPiece continuations keeping their ``##`` and byte-fallback tokens
  (``<0xE6>``) kept as they are;
- special tokens (``[CLS]``, ``<s>``) and the unknown token as themselves;
- a SentencePiece space that is a token of its own (``▁`` before a character the
  vocabulary has no ``▁``-word for) as ``␣``, and a byte-level vocabulary's added tokens
  as the text they cover;
- everywhere: a word-initial space is shown as ``␣``, a control character as its code
  point (``U+001B``), and a token with nothing to draw (blanks, a zero-width space or
  joiner) as visible symbols (``␣``, ``⏎``, ``⇥``, ``U+200D``), so no label is empty and
  none asks the fonts for a glyph they lack.
"""

from __future__ import annotations

import codecs
import functools
import json
import re
import unicodedata
from collections import Counter
from typing import Any

__all__ = ["token_labels", "visible", "bytes_label", "unk_id", "unknown_note"]

SPACE_MARK = "\u2423"  # ␣ OPEN BOX
# (Symbols the label fonts draw: DejaVu Sans has no Control Pictures, so a carriage
# return or a control character is written as its code point.)
_BLANKS = {" ": SPACE_MARK, "\n": "\u23ce", "\t": "\u21e5"}
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _hex_bytes(err: UnicodeDecodeError) -> tuple[str, int]:
    bad = err.object[err.start:err.end]
    return "".join(f"<0x{b:02X}>" for b in bad), err.end


codecs.register_error("attnlab-hexbytes", _hex_bytes)


def _unseen(c: str) -> bool:
    """A character with nothing to draw: a blank, a control or a format character (a zero
    width space, a joiner)."""
    code = ord(c)
    return (not c.strip() or unicodedata.category(c) in ("Cc", "Cf")
            or 0xFE00 <= code <= 0xFE0F or 0xE0100 <= code <= 0xE01EF)  # variation selectors


def visible(label: str) -> str:
    """``label`` with a leading and a trailing space as ``␣`` (SentencePiece's ``▁Hello▁``
    reads ``␣Hello␣``, not ``␣Hello`` and an unseen space), control characters as their
    code points (``U+001B``), and, when it has nothing else to draw (blanks, a zero-width
    joiner), every character shown; so no label is empty and none asks a font for a glyph
    it lacks."""
    if label and all(_unseen(c) for c in label):
        return "".join(_BLANKS.get(c, f"U+{ord(c):04X}") for c in label)
    label = "".join(f"U+{ord(c):04X}" if unicodedata.category(c) == "Cc" and c not in "\n\t"
                    else c for c in label)
    if label.startswith(" "):
        label = SPACE_MARK + label[1:]
    if label.endswith(" "):  # (not the whole label: one of blanks only is drawn above)
        label = label[:-1] + SPACE_MARK
    return label


def bytes_label(data: bytes) -> str:
    """UTF-8 ``data`` as text; bytes that do not form a whole character become ``<0xNN>``."""
    return visible(data.decode("utf-8", errors="attnlab-hexbytes"))


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable stand-in character -> its byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def _has_type(node: Any, kind: str) -> bool:
    """Whether a tokenizer.json component (possibly a Sequence of them) is of ``kind``."""
    if isinstance(node, dict):
        if node.get("type") == kind:
            return True
        return any(_has_type(v, kind) for v in node.values() if isinstance(v, dict | list))
    if isinstance(node, list):
        return any(_has_type(v, kind) for v in node)
    return False


def _spec(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer.json of an HFTokenizer as a dict (cached on it when it can be)."""
    spec = getattr(tokenizer, "spec", None)
    return spec if isinstance(spec, dict) else json.loads(tokenizer.backend.to_str())


def _hf_labels(tokenizer: Any, text: str) -> tuple[list[int], list[str]]:
    spec = _spec(tokenizer)
    byte_level = _has_type(spec.get("pre_tokenizer"), "ByteLevel") or _has_type(
        spec.get("decoder"), "ByteLevel")
    prefix = (spec.get("model") or {}).get("continuing_subword_prefix") or ""
    enc = tokenizer.backend.encode(text)
    unk = unk_id(tokenizer)
    decoder = _byte_decoder()
    added = tokenizer.backend.get_added_tokens_decoder()  # id -> AddedToken
    labels = []
    # Tokens that share one character's offsets (a normalizer that splits a Hangul
    # syllable into its jamo) hold part of it: each shows what it holds, its own text.
    shared = Counter(enc.offsets)
    for i, tok, (start, end), special in zip(enc.ids, enc.tokens, enc.offsets,
                                             enc.special_tokens_mask, strict=True):
        if special or i == unk or start == end or _BYTE_TOKEN.fullmatch(tok):
            labels.append(tok)  # [CLS], [UNK], <0xE6>: the model sees exactly this
        elif tok and set(tok) == {"\u2581"}:  # SentencePiece's space, a token of its own
            labels.append(SPACE_MARK * len(tok))  # (its offsets are the next character's)
        elif byte_level and i not in added and all(c in decoder for c in tok):
            # (an added token is spelled as the text itself, not in the byte alphabet)
            labels.append(bytes_label(bytes(decoder[c] for c in tok)))
        elif shared[start, end] > 1:
            labels.append(visible(tok))
        else:
            mark = prefix if prefix and tok.startswith(prefix) else ""
            labels.append(mark + visible(text[start:end]))
    return list(enc.ids), labels


def token_labels(tokenizer: Any, text: str) -> tuple[list[int], list[str]]:
    """The ids of ``text`` and one readable label per id (see the module docstring).

    Works with every attnlab tokenizer; the ids are exactly ``tokenizer.encode(text)``.
    """
    if hasattr(tokenizer, "backend"):  # HFTokenizer: offsets and token strings from `tokenizers`
        return _hf_labels(tokenizer, text)
    ids = tokenizer.encode(text)
    return ids, [visible(tokenizer.decode([i])) for i in ids]


def unk_id(tokenizer: Any) -> int | None:
    """Id of the tokenizer's unknown token, or None when it has none (characters, bytes)."""
    if hasattr(tokenizer, "backend"):
        token = (_spec(tokenizer).get("model") or {}).get("unk_token")
        return None if token is None else tokenizer.backend.token_to_id(token)
    return getattr(tokenizer, "unk_id", None)


#: Report unknown tokens when at least this share of a text's tokens is unknown.
UNKNOWN_SHARE = 0.1


def unknown_note(tokenizer: Any, ids: list[int], text: str) -> str | None:
    """One line when a notable share (>= 10%) of ``ids`` is the unknown token, else None."""
    unk = unk_id(tokenizer)
    if unk is None or not ids:
        return None
    n = sum(1 for i in ids if i == unk)
    if n == 0 or n / len(ids) < UNKNOWN_SHARE:
        return None
    script = _script_of([c for c in text if not c.isascii()]) or "this text"
    return (f"{n} of {len(ids)} tokens are the unknown token: the model's vocabulary does "
            f"not cover {script}, so their attention says little")


def _script_of(chars: list[str]) -> str | None:
    """A name for the main non-ASCII script of ``chars`` (from Unicode names), if any."""
    import unicodedata

    counts: dict[str, int] = {}
    for c in chars:
        name = unicodedata.name(c, "")
        word = name.split(" ")[0] if name else ""
        if word:
            counts[word] = counts.get(word, 0) + 1
    if not counts:
        return None
    top = max(counts, key=counts.__getitem__)
    return {"CJK": "Chinese/Japanese characters (CJK)", "HANGUL": "Korean (Hangul)",
            "HIRAGANA": "Japanese kana", "KATAKANA": "Japanese kana"}.get(
        top, f"this script ({top.title()})")
