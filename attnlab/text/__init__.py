"""Tokenizers: text -> token ids and back.

``CharTokenizer`` (one id per character), ``WordTokenizer`` (words and
punctuation, with ``<pad>`` and ``<unk>``) and ``HFTokenizer`` (a Hugging Face
``tokenizer.json``). All have ``encode``, ``decode``, ``vocab_size``,
``save``/``load``; ``load_tokenizer(path)`` loads any saved one.
"""

from .hf_tokenizer import HFTokenizer  # also makes load_tokenizer know the "hf" kind
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
    "load_tokenizer",
    "WORD_PATTERN",
]
