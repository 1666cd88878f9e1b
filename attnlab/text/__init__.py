"""Tokenizers: text -> token ids and back.

``CharTokenizer`` (one id per character), ``WordTokenizer`` (words and
punctuation, with ``<pad>`` and ``<unk>``), ``HFTokenizer`` (a Hugging Face
``tokenizer.json``) and ``GGUFTokenizer`` (the tokenizer a GGUF file describes, with its
chat template). All have ``encode``, ``decode``, ``vocab_size``,
``save``/``load``; ``load_tokenizer(path)`` loads any saved one (and a plain
Hugging Face ``tokenizer.json``). :func:`token_labels` gives readable labels
for pictures and :class:`TextStream` streams decoded text without U+FFFD.
"""

from .gguf_tokenizer import GGUFTokenizer  # also makes load_tokenizer know the "gguf" kind
from .hf_tokenizer import HFTokenizer  # also makes load_tokenizer know the "hf" kind
from .labels import token_labels
from .stream import TextStream
from .tokenizers import (
    WORD_PATTERN,
    CharTokenizer,
    Tokenizer,
    WordTokenizer,
    load_tokenizer,
)

__all__ = [
    "Tokenizer",
    "CharTokenizer",
    "WordTokenizer",
    "HFTokenizer",
    "GGUFTokenizer",
    "load_tokenizer",
    "WORD_PATTERN",
    "token_labels",
    "TextStream",
]
