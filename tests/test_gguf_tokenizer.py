"""The tokenizer a GGUF file describes: byte-level BPE (``gpt2``, with the split regexes
of Llama 3 and Qwen2) and SentencePiece-style (``llama``, merges recovered from the
scores, byte fallback) give transformers' GGUF tokenizer's ids on Chinese, Japanese,
Korean, emoji and English, decode back to the text, keep the chat template (rendered as
transformers renders it) and survive save/load."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers as T  # noqa: E402
from gguf_files import (  # noqa: E402
    CORPUS,
    SPLIT_PROBE_TEXTS,
    byte_level_metadata,
    sentencepiece_metadata,
    split_probe_metadata,
    write_gguf,
)

from attnlab.cli import main  # noqa: E402
from attnlab.models import GPT  # noqa: E402
from attnlab.text import GGUFTokenizer, HFTokenizer, load_tokenizer  # noqa: E402
from attnlab.text.chat import render_chat  # noqa: E402

TEXTS = [*CORPUS, "注意力 😀🚀 mixed 混合 text", "digits 12345 and it's 'll",
         "tabs\tand\nnew\n\nlines", "👩‍👩‍👧 family emoji and 中文标点，。！"]
KINDS = {"bpe": lambda: byte_level_metadata("gpt-2"),
         "bpe-llama3": lambda: byte_level_metadata("llama-bpe", add_bos=True),
         "bpe-qwen2": lambda: byte_level_metadata("qwen2", add_bos=None),
         "sentencepiece": sentencepiece_metadata}


def _tiny(vocab: int):
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)).eval()


@pytest.fixture(scope="module", params=sorted(KINDS))
def pair(request, tmp_path_factory):
    """(attnlab's tokenizer, transformers' tokenizer, file) of one GGUF file."""
    meta = KINDS[request.param]()
    path = tmp_path_factory.mktemp("tok") / f"{request.param}.gguf"
    write_gguf(path, _tiny(len(meta["tokens"])), tokenizer=meta)
    peer = T.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return GGUFTokenizer.from_gguf(path), peer, path


def test_ids_equal_transformers_gguf_tokenizer(pair):
    ours, peer, _ = pair
    assert ours.vocab_size == len(peer)
    for text in TEXTS:
        assert ours.encode(text) == peer(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == peer(
            text, add_special_tokens=False)["input_ids"], text


def test_decode_gives_the_text_back(pair):
    ours, peer, path = pair
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids) == text, text
        assert ours.decode(ids) == peer.decode(ids, skip_special_tokens=True)
    if "sentencepiece" in path.name:  # the CJK and emoji there are byte-fallback tokens
        assert any(t.startswith("<0x") for t in ours.tokenize("😀 注意力"))


def test_the_file_says_whether_bos_is_added(pair):
    ours, _, path = pair
    ids = ours.encode("the cat")
    adds = "llama3" in path.name or "sentencepiece" in path.name
    assert (ids[0] == ours.bos_id) == adds
    assert ours.encode("the cat", add_special_tokens=False)[0] != ours.bos_id


def test_chat_template_renders_as_transformers(pair):
    ours, peer, _ = pair
    for chat in ("你好 😀", [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "What is attention?"},
                            {"role": "assistant", "content": "A weighted average."},
                            {"role": "user", "content": "注意力是什么？"}]):
        messages = [{"role": "user", "content": chat}] if isinstance(chat, str) else chat
        want = peer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours.apply_chat(chat) == want
        ids = ours.encode(ours.apply_chat(chat), add_special_tokens=False)
        assert ids == peer.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)


def test_save_and_load_keep_vocabulary_template_and_special_ids(pair, tmp_path):
    ours, _, _ = pair
    ours.save(tmp_path / "tok.json")
    back = load_tokenizer(tmp_path / "tok.json")
    assert type(back) is GGUFTokenizer and back == ours
    assert (back.chat_template, back.bos_id, back.eos_id, back.pad_id) == (
        ours.chat_template, ours.bos_id, ours.eos_id, ours.pad_id)
    assert back.encode(TEXTS[-1]) == ours.encode(TEXTS[-1])


def test_a_template_is_sandboxed_and_errors_are_one_line():
    with pytest.raises(ValueError, match="chat template cannot be applied"):
        render_chat("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="no roles"):
        render_chat("{{ raise_exception('no roles') }}", [{"role": "user", "content": "x"}])
    with pytest.raises(TypeError, match="chat"):
        GGUFTokenizer.from_metadata(byte_level_metadata_as_keys()).apply_chat([{"role": 1}])


def byte_level_metadata_as_keys(**changes) -> dict:
    meta = byte_level_metadata()
    keys = {"tokenizer.ggml.model": meta["model"], "tokenizer.ggml.pre": meta["pre"],
            "tokenizer.ggml.tokens": meta["tokens"], "tokenizer.ggml.merges": meta["merges"],
            "tokenizer.ggml.token_type": meta["types"],
            "tokenizer.ggml.bos_token_id": meta["bos"],
            "tokenizer.ggml.eos_token_id": meta["eos"],
            "tokenizer.chat_template": meta["chat_template"]}
    return {**keys, **changes}


def _with_tokens(*extra: str, **changes) -> dict:
    """The tests' byte-level metadata with ``extra`` control tokens appended."""
    meta = byte_level_metadata_as_keys(**changes)
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], *extra]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], *[3] * len(extra)]
    return meta


def test_generation_ends_where_llama_cpp_ends_it(tmp_path):
    """EOS first, the file's end-of-turn and end-of-message ids, a code model's
    fill-in-the-middle tokens and the tokens llama.cpp ends a generation at by their
    spelling (Gemma's <end_of_turn>: its files name <eos> as EOS); kept with a saved
    tokenizer."""
    base = byte_level_metadata_as_keys()
    n, eos = len(base["tokenizer.ggml.tokens"]), base["tokenizer.ggml.eos_token_id"]
    text = base["tokenizer.ggml.tokens"].index("<|endoftext|>")  # (0: a spelled one too)
    assert GGUFTokenizer.from_metadata(base).stop_ids == (eos, text)
    gemma = GGUFTokenizer.from_metadata(_with_tokens("<start_of_turn>", "<end_of_turn>"))
    assert gemma.stop_ids == (eos, text, n + 1)
    gemma.save(tmp_path / "tok.json")
    back = load_tokenizer(tmp_path / "tok.json")
    assert back.stop_ids == gemma.stop_ids and back == gemma
    plain = HFTokenizer(tmp_path / "tok.json")  # the tokenizer.json inside, stop ids too
    assert plain.stop_ids == gemma.stop_ids and plain.encode("hi") == gemma.encode("hi")
    # a spelling twice in a vocabulary: both ids end a generation
    twice = GGUFTokenizer.from_metadata(_with_tokens("<end_of_turn>", "x", "<end_of_turn>"))
    assert twice.stop_ids == (eos, text, n, n + 2)
    named = GGUFTokenizer.from_metadata(_with_tokens(
        "<|eom_id|>", "<|python_tag|>", **{"tokenizer.ggml.eot_token_id": n + 1,
                                          "tokenizer.ggml.eom_token_id": 10 ** 6}))
    assert named.stop_ids == (eos, n + 1, text, n)  # an id past the vocabulary: ignored
    # Qwen2.5-Coder: one of each fill-in-the-middle kind, the file's id before a spelling
    qwen = GGUFTokenizer.from_metadata(_with_tokens(
        "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|fim_middle|>", "<PAD>",
        **{"tokenizer.ggml.fim_pad_token_id": n + 4}))
    assert qwen.stop_ids == (eos, n + 4, n + 1, n + 2, text)
    # gpt-oss ends a reply at <|return|> or <|call|>; its <|end|> closes a message inside
    # it, also when the file names it its end of turn
    harmony = GGUFTokenizer.from_metadata(_with_tokens(
        "<|end|>", "<|return|>", "<|call|>", **{"tokenizer.ggml.eot_token_id": n}))
    assert harmony.stop_ids == (eos, text, n + 1, n + 2)
    assert GGUFTokenizer.from_metadata(_with_tokens("<|end|>")).stop_ids == (eos, text, n)
    # beside <|tool_response>, </s> is no end
    tools = GGUFTokenizer.from_metadata(_with_tokens("</s>", "<|tool_response>"))
    assert tools.stop_ids == (eos, text, n + 1)


@pytest.mark.parametrize("changes,message", [
    ({"tokenizer.ggml.model": "t5"}, "tokenizer.ggml.model='t5' is not supported"),
    ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens is missing"),
    ({"tokenizer.ggml.merges": ["a b c"]}, "not two tokens"),
    ({"tokenizer.ggml.merges": ["Ġ zzz"]}, "cannot be built"),
    ({"tokenizer.ggml.eos_token_id": 10 ** 6}, "eos_token_id=1000000 is not a token id"),
    ({"tokenizer.ggml.bos_token_id": "1"}, "bos_token_id is a str"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.merges": None}, "scores"),
])
def test_bad_tokenizer_metadata_is_one_line(changes, message):
    with pytest.raises(ValueError, match=message) as info:
        GGUFTokenizer.from_metadata(byte_level_metadata_as_keys(**changes), "'x.gguf'")
    assert "'x.gguf'" in str(info.value) and "\n" not in str(info.value)


def test_generate_chat_applies_the_template_and_stops_at_the_end_of_turn(tmp_path, capsys):
    meta = byte_level_metadata()
    hf = _tiny(len(meta["tokens"]))
    path = tmp_path / "chat.gguf"
    write_gguf(path, hf, tokenizer=meta)
    tok = GGUFTokenizer.from_gguf(path)
    prompt = tok.encode(tok.apply_chat("注意力 😀"), add_special_tokens=False)
    with torch.no_grad():  # the end of turn made the third greedy token
        ids = torch.tensor([prompt])
        for _ in range(2):
            ids = torch.cat([ids, hf(ids).logits[:, -1:].argmax(-1)], dim=1)
        third = int(hf(ids).logits[0, -1].argmax())
        w = hf.lm_head.weight
        w[[third, tok.eos_id]] = w[[tok.eos_id, third]].clone()
    write_gguf(path, hf, tokenizer=meta)
    ours = GPT.from_gguf(path)
    want = ours.generate(torch.tensor([prompt]), 6, temperature=0)[0, len(prompt):].tolist()
    assert want[2] == tok.eos_id and ids[0, len(prompt):].tolist() == want[:2]
    assert main(["generate", "--model", str(path), "--chat", "注意力 😀", "--temperature", "0",
                 "--max-new-tokens", "6"]) == 0
    # the template's text unshown; no U+FFFD of a character the end cut (see test_text_stream)
    assert capsys.readouterr().out == tok.decode(want[:2]).rstrip("\ufffd") + "\n"
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(path), "--prompt", "the cat", "--chat", "x"])
    assert "not allowed with" in capsys.readouterr().err
    for empty in ("", " \n"):  # (helper-found: the template around no message ran)
        assert main(["generate", "--model", str(path), "--chat", empty]) == 2
        captured = capsys.readouterr()
        assert "--chat is empty" in captured.err and captured.out == ""



@pytest.mark.parametrize("precision", [None, "bfloat16", "int8"])
def test_generate_holds_a_q8_0_file_at_the_precision_asked(tmp_path, capsys, precision):
    """--precision int8 keeps a Q8_0 file's bytes (GPT.from_gguf(quantize="int8")), bf16
    holds its matrices in bf16, none expands them to float32; the printed text is that
    model's greedy continuation."""
    from attnlab.interop.auto import load_gguf
    from attnlab.modules.quantized import Int8Linear

    meta = byte_level_metadata()
    path = tmp_path / "q8.gguf"
    write_gguf(path, _tiny(len(meta["tokens"])), tokenizer=meta, kind="Q8_0")
    model, tok = load_gguf(path, precision)
    fc = model.blocks[0].mlp.proj
    if precision == "int8":
        want = GPT.from_gguf(path, quantize="int8").blocks[0].mlp.proj
        assert isinstance(fc, Int8Linear) and torch.equal(fc.data, want.data)
        assert torch.equal(fc.scales, want.scales)
    else:
        assert fc.weight.dtype == (torch.bfloat16 if precision else torch.float32)
    ids = tok.encode("the cat 注意力", add_special_tokens=False)
    greedy = model.generate(torch.tensor([ids]), 5, temperature=0)[0, len(ids):].tolist()
    argv = ["generate", "--model", str(path), "--prompt", "the cat 注意力", "--temperature",
            "0", "--max-new-tokens", "5"] + (["--precision", precision] if precision else [])
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.rstrip("\n") == tok.decode(ids + greedy).rstrip("\n")

# What llama.cpp (llama-cpp-python 0.3.36, vocab only) gives for SPLIT_PROBE_TEXTS under
# each kind of tokenizer.ggml.pre, as tokens: the splits differ in digits, "'M", "/t",
# CamelCase and punctuation runs, and attnlab's must be llama.cpp's (a file's ids are).
LLAMA_CPP_PIECES = {
    "default": ["I n Ġ 202 4 Ġ w e Ġ s o l d Ġ 123 456 7 Ġ u n i t s",
                "I ' M Ġ i ' m Ġ DON ' T Ġ d o n ' t",
                "p a t h / t o / f i l e Ġ $ 5 + 3 <= 4 Ġx !!",
                "H e l l o W o r l d Ġ XML Ht tpRe q u e s t ĠĠ Ġx Ġ 12"],
    "gpt-2": ["I n Ġ 202 4 Ġ w e Ġ s o l d Ġ 123 456 7 Ġ u n i t s",
              "I ' M Ġ i 'm Ġ DON ' T Ġ d o n ' t",
              "p a t h / t o / f i l e Ġ$ 5 + 3 <= 4 Ġx !!",
              "H e l l o W o r l d Ġ XML Ht tpRe q u e s t ĠĠ Ġx Ġ 12"],
    "llama-bpe": ["I n Ġ 202 4 Ġ w e Ġ s o l d Ġ 123 456 7 Ġ u n i t s",
                  "I 'M Ġ i 'm Ġ DON ' T Ġ d o n ' t",
                  "p a t h /t o / f i l e Ġ$ 5 + 3 <= 4 Ġx !!",
                  "H e l l o W o r l d Ġ XML Ht tpRe q u e s t ĠĠ Ġx Ġ 12"],
    "falcon": ["I n Ġ 202 4 Ġ w e Ġ s o l d Ġ 123 456 7 Ġ u n i t s",
               "I ' M Ġ i ' m Ġ DON ' T Ġ d o n ' t",
               "p a t h / t o / f i l e Ġ $ 5 + 3 <= 4 Ġx !!",
               "H e l l o W o r l d Ġ XML Ht tpRe q u e s t ĠĠ Ġx Ġ 12"],
    "smollm": ["I n Ġ 2 0 2 4 Ġ w e Ġ s o l d Ġ 1 2 3 4 5 6 7 Ġ u n i t s",
               "I ' M Ġ i 'm Ġ DON ' T Ġ d o n ' t",
               "p a t h / t o / f i l e Ġ$ 5 + 3 <= 4 Ġx !!",
               "H e l l o W o r l d Ġ XML Ht tpRe q u e s t ĠĠ Ġx Ġ 1 2"],
    "qwen2": ["I n Ġ 2 0 2 4 Ġ w e Ġ s o l d Ġ 1 2 3 4 5 6 7 Ġ u n i t s",
              "I 'M Ġ i 'm Ġ DON ' T Ġ d o n ' t",
              "p a t h /t o / f i l e Ġ$ 5 + 3 <= 4 Ġx !!",
              "H e l l o W o r l d Ġ XML Ht tpRe q u e s t ĠĠ Ġx Ġ 1 2"],
    "tekken": ["I n Ġ 2 0 2 4 Ġ w e Ġ s o l d Ġ 1 2 3 4 5 6 7 Ġ u n i t s",
               "I 'M Ġ i 'm Ġ DON ' T Ġ d o n ' t",
               "p a t h /t o / f i l e Ġ$ 5 + 3 <= 4 Ġx !!",
               "H e l l o W o r l d Ġ XML Http R e q u e s t ĠĠ Ġx Ġ 1 2"],
    "gpt-4o": ["I n Ġ 202 4 Ġ w e Ġ s o l d Ġ 123 456 7 Ġ u n i t s",
               "I 'M Ġ i 'm Ġ DON ' T Ġ d o n ' t",
               "p a t h /t o / f i l e Ġ$ 5 + 3 <= 4 Ġx !!",
               "H e l l o W o r l d Ġ XML Http R e q u e s t ĠĠ Ġx Ġ 12"],
}


@pytest.mark.parametrize("pre", sorted(LLAMA_CPP_PIECES))
def test_each_pre_tokenizer_splits_as_llama_cpp(tmp_path, pre):
    meta = split_probe_metadata(pre)
    path = tmp_path / f"{pre}.gguf"
    write_gguf(path, _tiny(len(meta["tokens"])), tokenizer=meta)
    tok = GGUFTokenizer.from_gguf(path)
    got = [" ".join(meta["tokens"][i] for i in tok.encode(t)) for t in SPLIT_PROBE_TEXTS]
    assert got == LLAMA_CPP_PIECES[pre]


@pytest.mark.parametrize("pre", ["deepseek-coder", "a-name-nobody-knows"])
def test_a_pre_tokenizer_attnlab_does_not_have_is_refused(tmp_path, pre):
    # llama.cpp has DeepSeek's split and refuses a name it does not know; attnlab refuses
    # both rather than split another way
    meta = split_probe_metadata(pre)
    path = tmp_path / "ds.gguf"
    write_gguf(path, _tiny(len(meta["tokens"])), tokenizer=meta)
    with pytest.raises(ValueError, match=f"tokenizer.ggml.pre='{pre}' is not a split attnlab "
                                         "has"):
        GGUFTokenizer.from_gguf(path)


@pytest.mark.parametrize(("pre", "bos"), [("llama-bpe", True), ("tekken", True),
                                          ("qwen2", False), ("gpt-2", False)])
def test_bos_by_default_where_llama_cpp_adds_it(tmp_path, pre, bos):
    # a byte-level file with no add_bos_token key: llama.cpp adds BOS for the Llama 3 and
    # Tekken splits; and its contractions are spelt case by case, so the long s is no 's
    meta = {**split_probe_metadata(pre), "add_bos": None}
    path = tmp_path / "nobos.gguf"
    write_gguf(path, _tiny(len(meta["tokens"])), tokenizer=meta)
    tok = GGUFTokenizer.from_gguf(path)
    assert (tok.encode("hi")[0] == 0) is bos
    pieces = [meta["tokens"][i] for i in tok.encode("x'\u017ft", add_special_tokens=False)]
    assert pieces == ["x", "'", "Å¿t"]  # 'ſt one piece, 'ſ not a contraction as (?i:'s) took it
