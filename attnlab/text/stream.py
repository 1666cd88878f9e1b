"""Streaming text out of a token stream without inventing replacement characters.

A byte-level BPE token may hold part of a character: "注" is three bytes, and
GPT-2 style vocabularies often split them over two tokens. Decoding each token
on its own prints ``U+FFFD`` for each piece; decoding everything so far and
printing the new part prints ``U+FFFD`` while the character is incomplete.
:class:`TextStream` decodes all ids so far and emits only the part that can
no longer change: it holds back a trailing run of ``U+FFFD`` (an incomplete
UTF-8 sequence, which the next token may complete) until a real character
follows it or the stream ends. So the pieces, joined, are exactly
``tokenizer.decode(all ids)``, and a ``U+FFFD`` is emitted only where the
whole decode has one too.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable
from typing import Any

__all__ = ["TextStream"]

_REPLACEMENT = "\ufffd"


class TextStream:
    """Incremental text of a growing id sequence: ``push`` ids, get the new stable text.

    Example::

        stream = TextStream(tokenizer)
        for tok in model.stream(ids, 50):
            print(stream.push([int(tok[0])]), end="", flush=True)
        print(stream.flush())

    Decoding is of all ids so far (``tokenizer.decode``), so what is emitted is
    what the tokenizer would decode as a whole, merges across tokens included.
    For the rare decoder whose output for a prefix is not a prefix of the output
    for more ids (a cleanup rule that rewrites text already emitted), the
    stream goes on after as many characters as it emitted, the best it can do
    once text has been printed.

    An id at or past the tokenizer's ``vocab_size`` decodes to nothing, as transformers'
    tokenizers decode an id they do not have: models pad their vocabulary past their
    tokenizer's (Qwen2: 151936 ids for about 151665 tokens), and a model that is not
    trained (or not trained long) may emit those ids.
    """

    def __init__(self, tokenizer: Any, context: Iterable[int] = ()) -> None:
        """``context``: ids already there (a prompt), decoded with the new ones but never
        emitted, so a word-initial space or a character begun in the prompt comes out right."""
        if not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(
                f"tokenizer: expected an object with decode(ids), got {type(tokenizer).__name__}"
            )
        self.tokenizer = tokenizer
        self._known = getattr(tokenizer, "vocab_size", None)
        self.ids: list[int] = self._known_ids(context)
        # Text handed out so far, after the context's own stable text.
        self._context = tokenizer.decode(self.ids) if self.ids else ""
        self.emitted = self._context.rstrip(_REPLACEMENT)
        self._start = len(self.emitted)

    def _new(self, final: bool) -> str:
        text = self.tokenizer.decode(self.ids)
        if len(self._context) > self._start and (final or text != self._context):
            # The context's trailing U+FFFD was held back as a character the next ids might
            # complete. What of it is still there after them (or at the end) is the
            # context's own text (a U+FFFD the user typed, a byte the prompt left broken):
            # not new text.
            kept = os.path.commonprefix([text, self._context])  # what stayed as it was
            if len(kept) > self._start:
                self.emitted = kept
                self._start = len(kept)
            self._context = self._context[:self._start]
        if not final:
            # An incomplete UTF-8 sequence decodes to trailing U+FFFD; the next token
            # may complete it, so that run is not stable yet.
            text = text.rstrip(_REPLACEMENT)
        # Normally ``text`` starts with what was emitted; if the decoder rewrote that
        # part, going on after as many characters is the best left to do.
        new = text[len(self.emitted):]
        self.emitted += new
        return new

    def _known_ids(self, ids: Iterable[int]) -> list[int]:
        ids = [operator.index(i) for i in ids]
        return ids if self._known is None else [i for i in ids if i < self._known]

    def push(self, ids: int | Iterable[int]) -> str:
        """Add one id or several; return the text that became stable (maybe "")."""
        self.ids.extend(self._known_ids(ids if hasattr(ids, "__iter__") else [ids]))
        return self._new(final=False)

    def flush(self) -> str:
        """The rest of the text, held-back ``U+FFFD`` included: call once at the end."""
        return self._new(final=True)

    @property
    def text(self) -> str:
        """Everything emitted so far (the context's text not included)."""
        return self.emitted[self._start:]
