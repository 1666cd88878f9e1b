"""Readable token labels for every tokenizer, and the note on unknown tokens.

The tokenizers are built here with the `tokenizers` package (tests/hf_tokenizers.py).
"""

from __future__ import annotations

import re

import pytest
import torch
from hf_tokenizers import byte_level_bpe, wordpiece
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import viz
from attnlab.text import CharTokenizer, HFTokenizer, WordTokenizer
from attnlab.text.labels import token_labels, unknown_note, visible

# Characters of GPT-2's byte-level alphabet that stand for bytes: any of them in a label
# is mojibake (æ³¨ for 注) or a raw space marker (Ġ).
MOJIBAKE = re.compile("[\u0100-\u0143\u00c0-\u00ff\u00a1-\u00ac\u00ae-\u00bf]")
HEX = re.compile(r"<0x([0-9A-F]{2})>")


def label_bytes(labels: list[str]) -> bytes:
    """Undo the labels of a byte-level BPE: ␣ (first or last) is a space, <0xNN> is byte NN."""
    out = b""
    for label in labels:
        label = " " + label[1:] if label.startswith("\u2423") else label
        label = label[:-1] + " " if label.endswith("\u2423") else label
        pos = 0
        for m in HEX.finditer(label):
            out += label[pos:m.start()].encode() + bytes([int(m.group(1), 16)])
            pos = m.end()
        out += label[pos:].encode()
    return out


@pytest.fixture(scope="module")
def bpe():
    return HFTokenizer(byte_level_bpe())


def test_byte_level_bpe_labels_are_the_characters_not_mojibake(bpe):
    text = "注意力机制让模型学会关注重要的词。 The cat sat 😀"
    ids, labels = token_labels(bpe, text)
    assert ids == bpe.encode(text)
    raw = bpe.backend.encode(text).tokens
    assert any(MOJIBAKE.search(t) for t in raw)  # the tokenizer's own strings are mojibake
    assert not any(MOJIBAKE.search(label) for label in labels)
    assert "注意力机制让模型学会关注重要的词" in labels  # a merged Chinese word reads as itself
    assert "\u2423cat" in labels and "\u2423sat" in labels  # Ġcat -> ␣cat
    assert "\u2423😀" in labels
    assert label_bytes(labels) == text.encode()


def test_a_token_holding_part_of_a_character_shows_its_bytes(bpe):
    text = "關注🚀"  # rare here: split inside characters
    labels = token_labels(bpe, text)[1]
    assert any(HEX.search(label) for label in labels)
    assert all("\ufffd" not in label for label in labels)
    assert label_bytes(labels) == text.encode()


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="注意力机制學會關日本語カナ한국어😀🚀 abcdeTheé\n", max_size=24))
def test_byte_level_labels_always_spell_out_the_text_exactly(bpe, text):
    ids, labels = token_labels(bpe, text)
    assert ids == bpe.encode(text)
    assert label_bytes([lab.replace("\u23ce", "\n") for lab in labels]) == text.encode()
    assert all(label for label in labels) and not any(MOJIBAKE.search(x) for x in labels)


def test_wordpiece_labels_are_the_text_covered_with_continuations_marked():
    tok = HFTokenizer(wordpiece())
    ids, labels = token_labels(tok, "The cats sat 😀 on mats 注意")
    assert ids == tok.encode("The cats sat 😀 on mats 注意")
    # original case (the text covered, not the lowercased vocabulary entry), ## kept
    assert labels == ["[CLS]", "The", "cat", "##s", "sat", "😀", "on", "mat", "##s", "注", "意",
                      "[SEP]"]


def test_tokens_sharing_one_characters_offsets_show_what_each_holds():
    # Helper-found: BERT's normalizer splits a Hangul syllable into jamo tokens that share
    # its offsets, and each was labelled with the whole syllable (한 ##한 ##한 ...).
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["[UNK]", "[CLS]", "[SEP]", "\u1112", "##\u1161",
                                          "##\u11ab", "##\u1100", "##\u116e", "##\u11a8"])}
    raw = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    raw.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    raw.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    ids, labels = token_labels(HFTokenizer(raw), "한국")
    assert labels == ["\u1112", "##\u1161", "##\u11ab", "##\u1100", "##\u116e", "##\u11a8"]
    assert ids == [3, 4, 5, 6, 7, 8]


def test_char_and_word_tokenizer_labels_show_blanks():
    ids, labels = token_labels(CharTokenizer.from_text("ab c\n"), "a b\nc")
    assert labels == ["a", "\u2423", "b", "\u23ce", "c"] and len(ids) == 5
    assert token_labels(WordTokenizer.from_text("the cat"), "the dog")[1] == ["the", "<unk>"]
    assert visible(" x") == "\u2423x" and visible("\t") == "\u21e5"
    # (helper-found: SentencePiece's "▁Hello▁" read "␣Hello " with its last space unseen)
    assert visible(" Hello ") == "\u2423Hello\u2423" and visible("x ") == "x\u2423"


def test_control_and_format_characters_get_labels_a_font_can_draw():
    # a control character would ask the fonts for a glyph none has (matplotlib's "Glyph 27
    # missing" warning, and an empty tick); a zero-width space or joiner alone is empty
    text = "a\x1bb\x00\x7f\u200b\u200d\r"
    ids, labels = token_labels(CharTokenizer.from_text(text), text)
    assert labels == ["a", "U+001B", "b", "U+0000", "U+007F", "U+200B", "U+200D", "U+000D"]
    assert visible("x\x07y") == "xU+0007y" and visible("\u200d\u200d") == "U+200DU+200D"
    assert visible("👩\u200d👧") == "👩\u200d👧"  # a joiner inside an emoji stays
    assert visible("\ufe0f") == "U+FE0F" and visible("❤\ufe0f") == "❤\ufe0f"  # (SmolLM2
    # makes the emoji variation selector of "I ❤️ you" a token of its own)


def test_a_sentencepiece_space_token_and_added_tokens_are_labelled_as_they_read():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(["<unk>", "\u2581", "注", "意", "力", "a", "b"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    # the prepended ▁ is a token of its own here, with the first character's offsets
    assert token_labels(HFTokenizer(tok), "注意力")[1] == ["\u2423", "注", "意", "力"]
    bpe = byte_level_bpe()
    bpe.add_tokens(["café", "naïve"])  # an added token is spelled as its text, not in bytes
    labels = token_labels(HFTokenizer(bpe), "café naïve")[1]
    assert "café" in labels and "naïve" in labels and not any("<0x" in x for x in labels)


def test_a_lowercased_word_vocabulary_reads_its_own_text():
    for text in ("İstanbul İzmir", "İSTANBUL'A GİDİYORUM", "ΚΑΛΗΣ'ΑΣ"):
        tok = WordTokenizer.from_text(text, lowercase=True)
        assert tok.unk_id not in tok.encode(text), text


def test_unknown_tokens_are_reported_in_one_line_naming_the_script():
    tok = HFTokenizer(wordpiece(with_chinese=False))
    text = "注意力机制让模型学会关注重要的词。"
    ids = tok.encode(text)
    note = unknown_note(tok, ids, text)
    assert note is not None and "\n" not in note
    assert note.startswith("17 of 19 tokens are the unknown token")
    assert "vocabulary does not cover" in note and "CJK" in note
    assert unknown_note(tok, tok.encode("the cat sat"), "the cat sat") is None
    assert unknown_note(CharTokenizer.from_text("ab"), [0, 1], "ab") is None


def tiny_encoder(vocab_size):
    from attnlab.models import Encoder
    from attnlab.models.encoder import EncoderConfig

    torch.manual_seed(0)
    return Encoder(EncoderConfig(vocab_size=vocab_size, context_length=64, d_model=16,
                                 num_layers=1, num_heads=2))


def test_show_attention_labels_and_notes_unknown_tokens(tmp_path, capsys):
    tok = HFTokenizer(wordpiece(with_chinese=False))
    text = "注意力机制让模型 cats"
    paths = viz.show_attention(tiny_encoder(tok.vocab_size), tok, text, tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "8 of 11 tokens are the unknown token" in err[0]
    page = paths["html"].read_text("utf-8")
    assert '"tokens":["[CLS]","[UNK]"' in page and '"cats","[SEP]"' in page
    assert paths["png"].stat().st_size > 1000


def test_show_attention_with_byte_level_bpe_puts_characters_in_the_explorer(bpe, tmp_path):
    text = "注意力机制让模型学会关注重要的词。 The cat"
    paths = viz.show_attention(tiny_encoder(bpe.vocab_size), bpe, text, tmp_path)
    page = paths["html"].read_text("utf-8")
    assert '"注意力机制让模型学会关注重要的词"' in page and '"\u2423cat"' in page
    assert not MOJIBAKE.search(page[page.index('"tokens"'):page.index('"layers"')])
