"""Small Hugging Face tokenizers built in the tests with the `tokenizers` package (no files,
no hub): a byte-level BPE (GPT-2 / Llama 3 / Qwen style) and a WordPiece (BERT style),
trained on Chinese, Japanese, Korean, emoji and English."""

from __future__ import annotations

import functools

CORPUS = [
    "注意力机制让模型学会关注重要的词。",
    "模型学会了注意力。注意力很重要。",
    "機制與注意力",
    "日本語のテキストです。",
    "한국어 문장입니다.",
    "The cat sat on the mat 😀 and the dog ran 🚀.",
    "cats and dogs sat on mats",
    "hello world, attention is all you need",
]


@functools.cache
def byte_level_bpe(vocab_size: int = 600):
    """A byte-level BPE with merges for frequent Chinese words and English words with Ġ."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


@functools.cache
def wordpiece(with_chinese: bool = True):
    """A BERT-style WordPiece with [CLS] ... [SEP]; without Chinese in its corpus,
    Chinese text maps to [UNK]."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    corpus = CORPUS if with_chinese else [t for t in CORPUS if t.isascii() or "😀" in t]
    trainer = trainers.WordPieceTrainer(vocab_size=120,
                                        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    tok.train_from_iterator(corpus * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return tok
