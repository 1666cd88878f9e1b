"""Streamed text never invents U+FFFD: TextStream, GPT.stream(tokenizer=...), `generate`."""

from __future__ import annotations

import pytest
import torch
from hf_tokenizers import byte_level_bpe
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.text import HFTokenizer
from attnlab.text.stream import TextStream

SENTENCE = "注意力机制让模型学会关注重要的词。"


@pytest.fixture(scope="module")
def small_bpe():
    """Few merges: most Chinese characters are split over two or three byte tokens."""
    return HFTokenizer(byte_level_bpe(300))


def split_ids(tok):
    ids = tok.encode(SENTENCE)
    # the premise: one token at a time gives U+FFFD although the whole decodes cleanly
    assert "\ufffd" in "".join(tok.decode([i]) for i in ids)
    assert tok.decode(ids) == SENTENCE
    return ids


def test_a_split_character_is_held_back_until_it_is_whole(small_bpe):
    stream = TextStream(small_bpe)
    pieces = [stream.push(i) for i in split_ids(small_bpe)]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) + stream.flush() == SENTENCE
    assert "" in pieces  # some steps had only part of a character to show


def test_ids_past_the_tokenizer_decode_to_nothing_as_transformers_decode_them(small_bpe):
    # A model's vocabulary padded past its tokenizer's (Qwen2's, many GGUF files'): an
    # untrained model emits those ids, and `generate` stopped mid-line on them.
    ids = split_ids(small_bpe)
    past = small_bpe.vocab_size
    stream = TextStream(small_bpe, context=[past + 3])
    mixed = [past, *ids[:3], past + 63, *ids[3:], past + 1]
    text = "".join(stream.push(i) for i in mixed) + stream.flush()
    assert text == SENTENCE


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_every_prefix_of_random_byte_level_ids_streams_to_its_decode(small_bpe, data):
    ids = data.draw(st.lists(st.integers(1, small_bpe.vocab_size - 1), max_size=30))
    stream = TextStream(small_bpe)
    for n, i in enumerate(ids, start=1):
        stream.push(i)
        whole = small_bpe.decode(ids[:n])
        # what was emitted is the decode of the ids so far, minus at most a held-back
        # incomplete character at the end (which decodes as U+FFFD for now)
        assert whole.startswith(stream.text)
        assert set(whole[len(stream.text):]) <= {"\ufffd"}
    stream.flush()
    assert stream.text == small_bpe.decode(ids)


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet="注意力机制學會關日本語カナ한국어😀🚀 abcé", max_size=20))
def test_text_encoded_and_streamed_back_is_the_text_with_no_replacement_character(small_bpe,
                                                                                   text):
    stream = TextStream(small_bpe)
    pieces = [stream.push(i) for i in small_bpe.encode(text)] + [stream.flush()]
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)


def test_the_prompt_is_context_not_output(small_bpe):
    ids = small_bpe.encode("the cat sat")
    stream = TextStream(small_bpe, context=ids[:2])
    out = "".join(stream.push(i) for i in ids[2:]) + stream.flush()
    assert out == small_bpe.decode(ids)[len(small_bpe.decode(ids[:2])):]


def tiny_gpt(vocab_size):
    from attnlab.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab_size, context_length=64, d_model=16, num_layers=1,
                         num_heads=2))


def test_gpt_stream_with_a_tokenizer_yields_the_decode_of_what_generate_makes(small_bpe):
    gpt = tiny_gpt(small_bpe.vocab_size)
    prompt = small_bpe.encode("注意")
    out = gpt.generate([prompt], 30, generator=torch.Generator().manual_seed(3))[0].tolist()
    pieces = list(gpt.stream([prompt], 30, generator=torch.Generator().manual_seed(3),
                             tokenizer=small_bpe))
    assert all(isinstance(p, str) and p for p in pieces)
    whole = small_bpe.decode(out)
    assert "".join(pieces) == whole[len(small_bpe.decode(prompt)):]
    with pytest.raises(ValueError, match="one prompt"):
        gpt.stream([prompt, prompt], 3, tokenizer=small_bpe)


def test_cli_generate_prints_whole_characters(small_bpe, tmp_path, capsys, monkeypatch):
    from attnlab.checkpoint import save_checkpoint
    from attnlab.cli import main
    from attnlab.models.generation import GenerationMixin

    ckpt = tmp_path / "ckpt"
    save_checkpoint(tiny_gpt(small_bpe.vocab_size), ckpt, tokenizer=small_bpe)
    ids = split_ids(small_bpe)

    def scripted(self, *args, **kwargs):  # the model "generates" SENTENCE, token by token
        for i in ids:
            yield torch.tensor([i])

    monkeypatch.setattr(GenerationMixin, "_stream_ids", scripted)
    code = main(["generate", "--ckpt", str(ckpt), "--prompt", "我说:", "--max-new-tokens",
                 str(len(ids))])
    out = capsys.readouterr().out
    assert code == 0 and out == "我说:" + SENTENCE + "\n"


def test_cli_generate_cut_inside_a_character_prints_no_broken_one(small_bpe, tmp_path,
                                                                   capsys, monkeypatch):
    """--max-new-tokens running out inside a character of several tokens: the whole ones
    are printed, the incomplete one is not (the decode would end in U+FFFD), and stderr
    says so in one line."""
    from attnlab.checkpoint import save_checkpoint
    from attnlab.cli import main
    from attnlab.models.generation import GenerationMixin

    ckpt = tmp_path / "ckpt"
    save_checkpoint(tiny_gpt(small_bpe.vocab_size), ckpt, tokenizer=small_bpe)
    ids = split_ids(small_bpe)
    cut = next(n for n in range(1, len(ids)) if small_bpe.decode(ids[:n]).endswith("\ufffd"))
    whole = small_bpe.decode(ids[:cut]).rstrip("\ufffd")

    def scripted(self, *args, **kwargs):
        for i in ids[:cut]:
            yield torch.tensor([i])

    monkeypatch.setattr(GenerationMixin, "_stream_ids", scripted)
    code = main(["generate", "--ckpt", str(ckpt), "--prompt", "我说:", "--max-new-tokens",
                 str(cut)])
    captured = capsys.readouterr()
    assert code == 0 and captured.out == "我说:" + whole + "\n"
    assert "\ufffd" not in captured.out and "inside a character" in captured.err


@pytest.mark.parametrize("tail", ["\ufffd", "\ufffd\ufffd", "\ufffda\ufffd"])
def test_a_prompt_ending_in_a_real_replacement_character_is_not_emitted_again(small_bpe, tail):
    # Helper-found: the prompt's trailing U+FFFD was held back as an unfinished character
    # and then handed out as new text, so `generate` printed it twice.
    prompt = small_bpe.encode("你好" + tail)
    new = split_ids(small_bpe)[:5]
    stream = TextStream(small_bpe, context=prompt)
    pieces = [stream.push(i) for i in new] + [stream.flush()]
    assert "你好" + tail + "".join(pieces) == small_bpe.decode(prompt + new)
    assert stream.text == "".join(pieces)
    # nothing generated: nothing to show, not the prompt's U+FFFD
    assert TextStream(small_bpe, context=prompt).flush() == ""


def test_a_character_the_prompt_began_is_still_completed_by_the_next_ids(small_bpe):
    ids = split_ids(small_bpe)
    cut = next(n for n in range(1, len(ids)) if small_bpe.decode(ids[:n]).endswith("\ufffd"))
    stream = TextStream(small_bpe, context=ids[:cut])
    text = "".join(stream.push(i) for i in ids[cut:]) + stream.flush()
    assert small_bpe.decode(ids[:cut]).rstrip("\ufffd") + text == SENTENCE


def test_a_typed_replacement_character_before_a_begun_one_is_not_emitted_again(small_bpe):
    # Review-found: a prompt of raw ids ending in a typed U+FFFD and then the first bytes
    # of a character: completing it printed the typed U+FFFD again.
    char = next(c for c in SENTENCE if len(small_bpe.encode(c)) > 1
                and small_bpe.decode(small_bpe.encode(c)[:1]).endswith("\ufffd"))
    parts = small_bpe.encode(char)
    typed = small_bpe.encode("你好\ufffd")
    assert small_bpe.decode(typed + parts) == "你好\ufffd" + char
    stream = TextStream(small_bpe, context=typed + parts[:1])
    assert "".join(stream.push(i) for i in parts[1:]) + stream.flush() == char
