"""GGUF files (llama.cpp's format) load as GPTs: Llama, Mistral and Qwen2 files written in
the test with gguf's writer, in F32, F16, BF16, Q8_0, Q4_1 and Q5_0 (K-quants: gguf has
no quantiser for them), give the logits and greedy tokens
of transformers' own GGUF loading, and an F32 file gives back the logits of the model it
was written from. Damaged and unsupported files are one line naming the file."""

from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers as T  # noqa: E402
from gguf_files import byte_level_metadata, llamacpp_permute, write_gguf  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from attnlab.cli import main  # noqa: E402
from attnlab.io.gguf import GGUFFile  # noqa: E402
from attnlab.layouts.gguf import unpermute_rows  # noqa: E402
from attnlab.models import GPT  # noqa: E402

META = byte_level_metadata()
VOCAB = len(META["tokens"])
# Row lengths a multiple of 32 (a Q8_0 block): hidden 64, 4 heads of 16, 2 KV heads.
_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              tie_word_embeddings=False)


def _sharpened(hf):
    """Random weights give near-ties in greedy decoding: sharpen the output layer so the
    greedy tokens compare the models, not rounding."""
    with torch.no_grad():
        hf.lm_head.weight.mul_(8)
        for name, p in hf.named_parameters():
            if name.endswith("bias"):  # random init leaves biases at zero: make them count
                p.normal_(0, 0.5)
            elif "q_norm" in name or "k_norm" in name:  # (Qwen3's) ones: make them count
                p.normal_(1, 0.5)
            elif "norm" in name and "Gemma" in type(hf).__name__:  # (1 + weight) zeros
                p.normal_(0, 0.5)
    return hf.eval()


_GEMMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=2,
              num_key_value_heads=1, head_dim=256, max_position_embeddings=64, sliding_window=4,
              attn_implementation="eager")
MODELS = {
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**_SMALL)),
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**_SMALL, sliding_window=None)),
    "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**_SMALL)),
    # heads of their own width (4 x 32 over 64, as Mistral NeMo's 32 x 128 over 5120)
    "mistral-wide-heads": lambda: T.MistralForCausalLM(T.MistralConfig(
        **_SMALL, sliding_window=None, head_dim=32)),
    # (head_dim 128, Qwen3's own: transformers' GGUF reader takes no other for qwen3)
    "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**_SMALL, head_dim=128)),
    # Gemma's heads of 256 (its own; transformers' GGUF reader scales queries by 256,
    # llama.cpp by the head size), a window of 4, Gemma 3's five local layers to one
    "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**_GEMMA, num_hidden_layers=3)),
    "gemma3": lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(**_GEMMA, num_hidden_layers=7)),
}
# llama.cpp writes Mistral as llama
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "mistral-wide-heads": "llama",
        "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3"}
CASES = [("llama", "F32"), ("llama", "F16"), ("llama", "BF16"), ("llama", "Q8_0"),
         ("llama", "Q4_1"), ("llama", "Q5_0"), ("mistral", "F32"), ("qwen2", "F32"),
         ("qwen2", "Q8_0"), ("mistral-wide-heads", "F32"), ("mistral-wide-heads", "Q8_0"),
         ("qwen3", "F32"), ("qwen3", "Q8_0"), ("gemma2", "F32"), ("gemma2", "Q8_0"),
         ("gemma3", "F32"), ("gemma3", "Q8_0")]


@pytest.fixture(scope="module")
def originals():
    out = {}
    for name, make in MODELS.items():
        torch.manual_seed(0)
        out[name] = _sharpened(make())
    return out


def _write(folder, hf, name, kind, **kw):
    path = folder / f"{name}-{kind}.gguf"
    write_gguf(path, hf, arch=ARCH[name], name=f"{name}-tiny", kind=kind, tokenizer=META, **kw)
    return path


def _greedy(forward, ids: torch.Tensor, steps: int) -> list[int]:
    out = ids
    for _ in range(steps):
        out = torch.cat([out, forward(out)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("name,kind", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_logits_and_greedy_tokens_equal_transformers_gguf_loading(originals, tmp_path, name,
                                                                  kind):
    path = _write(tmp_path, originals[name], name, kind)
    peer = T.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).eval()
    ours = GPT.from_gguf(path, dtype=torch.float32)  # expanded as transformers expands it
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = peer(ids).logits
        got = ours(ids)
        assert float((got - want).abs().max()) < 1e-4
        assert _greedy(ours, ids[:1], 8) == _greedy(lambda x: peer(x).logits, ids[:1], 8)
        if kind == "F32":  # the round trip: the model the file was written from
            assert float((got - originals[name](ids).logits).abs().max()) < 1e-4


@pytest.mark.parametrize("key_length", [False, True])
def test_a_qwen3_file_of_heads_hidden_over_heads_wide_loads(tmp_path, key_length):
    # llama.cpp's head width is key_length, else n_embd / n_head; attnlab passed it on only
    # where it differed from hidden / heads, and the Qwen3 converter then took
    # transformers' default of 128: a file of 4 heads of 16 over 64 was refused.
    torch.manual_seed(0)
    hf = _sharpened(T.Qwen3ForCausalLM(T.Qwen3Config(**_SMALL, head_dim=16)))
    extra = (("add_uint32", "qwen3.attention.key_length", 16),
             ("add_uint32", "qwen3.attention.value_length", 16)) if key_length else ()
    ours = GPT.from_gguf(_write(tmp_path, hf, "qwen3", "F32", extra=extra),
                         dtype=torch.float32)
    assert ours.config.head_dim == 16
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert float((ours(ids) - hf(ids).logits).abs().max()) < 1e-4


def test_a_llama_file_with_biases_reads_them_as_llama_cpp_does(tmp_path):
    # llama.cpp takes a Llama layer's q/k/v/output and MLP biases where a file has them;
    # attnlab refused such a file ("has no place in the model its metadata describes").
    torch.manual_seed(0)
    hf = _sharpened(T.LlamaForCausalLM(T.LlamaConfig(**_SMALL, attention_bias=True,
                                                     mlp_bias=True)))
    ours = GPT.from_gguf(_write(tmp_path, hf, "llama", "F32"), dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert float((ours(ids) - hf(ids).logits).abs().max()) < 1e-4


def test_quantised_weights_differ_from_the_original_as_their_type_says(originals, tmp_path):
    """The types are really written and read: F16 and Q8_0 move the logits by a little
    (more for Q8_0), and not at all for F32 (so the equality above is not vacuous)."""
    hf = originals["llama"]
    ids = torch.arange(12).unsqueeze(0)
    with torch.no_grad():
        want = hf(ids).logits
        err = {k: float((GPT.from_gguf(_write(tmp_path, hf, "llama", k), dtype=torch.float32)(ids)
                         - want).abs().max()) for k in ("F32", "F16", "Q8_0")}
    assert err["F32"] < 1e-5 < err["F16"] < err["Q8_0"] < 0.5
    types = GGUFFile(tmp_path / "llama-Q8_0.gguf")
    assert types.type_name("blk.0.attn_q.weight") == "Q8_0"
    assert types.type_name("blk.0.attn_norm.weight") == "F32"


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(["Q8_0", "Q4_0", "Q4_1"]), rows=st.integers(1, 5),
       blocks=st.integers(1, 4), seed=st.integers(0, 2 ** 32 - 1))
def test_block_types_expand_bit_for_bit_as_gguf_does(kind, rows, blocks, seed):
    """attnlab's torch expansion of the commonest block types equals gguf's NumPy code,
    on any bytes (scales of every float16 value, NaN and infinities included)."""
    import gguf

    from attnlab.io.gguf import dequantize

    qtype = gguf.GGMLQuantizationType[kind]
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = np.random.default_rng(seed).integers(0, 256, (rows, blocks * size), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 in NaN-scaled blocks
        want = gguf.quants.dequantize(raw, qtype)

    class Tensor:  # what gguf's reader hands over
        name, tensor_type, data = "t", qtype, raw
        shape = np.array([blocks * 32, rows], dtype=np.uint64)

    got = dequantize(Tensor()).numpy()
    assert got.shape == want.shape == (rows, blocks * 32)
    np.testing.assert_array_equal(got, want)  # NaN where gguf has NaN


@settings(max_examples=30, deadline=None)
@given(heads=st.integers(1, 4), half=st.integers(1, 4), cols=st.integers(0, 3))
def test_unpermute_undoes_llamacpp_permute(heads, half, cols):
    shape = (heads * 2 * half, *([cols + 1] if cols else []))
    w = np.random.default_rng(heads * 100 + half * 10 + cols).standard_normal(shape)
    permuted = torch.from_numpy(llamacpp_permute(w, heads))
    back = unpermute_rows(permuted, heads)
    assert torch.equal(back, torch.from_numpy(w))
    if half > 1:  # a permutation that moves rows: the test can tell the two orders apart
        assert not torch.equal(permuted, back)


def test_a_llama_file_read_without_unpermuting_gives_other_logits(originals, tmp_path,
                                                                  monkeypatch):
    """The q/k rows matter: skipping the inverse permutation changes the logits."""
    import attnlab.layouts.gguf as layout

    path = _write(tmp_path, originals["llama"], "llama", "F32")
    ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        right = GPT.from_gguf(path)(ids)
        monkeypatch.setattr(layout, "unpermute_rows", lambda w, heads: w)
        wrong = GPT.from_gguf(path)(ids)
    assert float((right - wrong).abs().max()) > 1e-2


def test_a_tied_file_shares_its_embedding(tmp_path):
    torch.manual_seed(0)
    hf = T.LlamaForCausalLM(T.LlamaConfig(**{**_SMALL, "tie_word_embeddings": True})).eval()
    path = _write(tmp_path, hf, "llama", "F32")
    assert "output.weight" not in GGUFFile(path).tensors
    ours = GPT.from_gguf(path)
    assert ours.lm_head.weight is ours.tok_emb.weight
    ids = torch.arange(9).unsqueeze(0)
    with torch.no_grad():
        assert float((ours(ids) - hf(ids).logits).abs().max()) < 1e-4


# ----------------------------------------------------------------- bad files, one line


@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("gguf")
    return _write(folder, T.LlamaForCausalLM(T.LlamaConfig(**_SMALL)).eval(), "llama", "Q8_0")


def _refused(path, *parts: str) -> str:
    with pytest.raises(ValueError) as info:
        GPT.from_gguf(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    for part in parts:
        assert part in message, message
    return message


@pytest.mark.parametrize("keep", [0, 3, 10, 30, 2000, 0.5, -40])
def test_a_truncated_file_is_one_line(good_file, tmp_path, keep):
    data = good_file.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else (keep if keep >= 0
                                                                 else len(data) + keep)
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    _refused(path)


def test_bad_magic_fifo_directory_and_missing_file_are_one_line(good_file, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + good_file.read_bytes()[4:])
    _refused(bad, "not a GGUF file", "GGML")
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    _refused(fifo, "not a regular file")  # and it returns: a FIFO is never opened blocking
    folder = tmp_path / "dir.gguf"
    folder.mkdir()
    _refused(folder, "not a regular file")
    _refused(tmp_path / "none.gguf", "not found")


def test_a_damaged_count_is_refused_not_looped_over(good_file, tmp_path):
    """The metadata count (bytes 16..24) set to 2**60: the reader stops at the file's end."""
    data = bytearray(good_file.read_bytes())
    data[16:24] = (2 ** 60).to_bytes(8, "little")
    path = tmp_path / "count.gguf"
    path.write_bytes(bytes(data))
    _refused(path, "not a valid GGUF file")


def test_a_layer_count_beyond_the_file_is_refused_before_a_list_of_its_layers(originals,
                                                                             tmp_path):
    """block_count (a uint32) of 10**6 over two layers: every layer's names were listed
    before the file's were compared (5 s and 1.4 GB here; 4e9 filled memory)."""
    for name in ("llama", "gemma3"):
        path = _write(tmp_path, originals[name], name, "F32",
                      extra=(("add_uint32", f"{ARCH[name]}.block_count", 10**6),))
        start = time.perf_counter()
        with pytest.raises(ValueError, match=r"block_count=1000000, but the file holds \d+ "
                                             "tensors; every layer needs some"):
            GPT.from_gguf(path)
        assert time.perf_counter() - start < 2.0


def test_a_llama_31_file_scales_rope_by_its_rope_freqs(tmp_path):
    # llama.cpp writes Llama 3.1-3.3's RoPE scaling as rope_freqs.weight (a divisor per
    # frequency); such files were refused. The logits are those of the model written.
    torch.manual_seed(0)
    scaling = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}
    hf = _sharpened(T.LlamaForCausalLM(T.LlamaConfig(**{**_SMALL, "rope_parameters": scaling})))
    with torch.no_grad():  # scores of several units: the rotation's frequencies count
        for name, p in hf.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(6)
    path = _write(tmp_path, hf, "llama", "F32")
    ours = GPT.from_gguf(path, dtype=torch.float32)
    assert ours.config.rope_scaling["rope_type"] == "factors"
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        assert float((ours(ids) - want).abs().max()) < 1e-4
        plain = GPT.from_hf(T.LlamaForCausalLM(T.LlamaConfig(**_SMALL)).eval())
        plain.load_state_dict(ours.state_dict())
        assert float((plain(ids) - want).abs().max()) > 1e-2  # unscaled: other logits
    assert _greedy(ours, ids[:1], 8) == _greedy(lambda x: hf(x).logits, ids[:1], 8)
    # the linear scaling, which llama.cpp writes as metadata
    hf = T.LlamaForCausalLM(T.LlamaConfig(**{**_SMALL, "rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(6)
    path = tmp_path / "linear.gguf"
    write_gguf(path, hf.eval(), tokenizer=META, extra=[
        ("add_string", "llama.rope.scaling.type", "linear"),
        ("add_float32", "llama.rope.scaling.factor", 4.0)])
    ours = GPT.from_gguf(path, dtype=torch.float32)
    assert ours.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    with torch.no_grad():
        assert float((ours(ids) - hf(ids).logits).abs().max()) < 1e-4


def test_a_files_rope_scaling_is_read_as_llama_cpp_reads_it(tmp_path):
    # a linear factor without its type, or under the older key, is linear (llama.cpp's
    # default); rope_freqs of the wrong length, beside a linear factor or in a qwen2 file
    # is refused naming the file
    torch.manual_seed(0)
    hf = T.LlamaForCausalLM(T.LlamaConfig(**{**_SMALL, "rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}})).eval()
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    for i, key in enumerate(("llama.rope.scaling.factor", "llama.rope.scale_linear")):
        path = tmp_path / f"linear{i}.gguf"
        write_gguf(path, hf, tokenizer=META, extra=[("add_float32", key, 4.0)])
        ours = GPT.from_gguf(path, dtype=torch.float32)
        assert ours.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}, key
        with torch.no_grad():
            assert float((ours(ids) - hf(ids).logits).abs().max()) < 1e-4, key
    scaling = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}
    hf = T.LlamaForCausalLM(T.LlamaConfig(**{**_SMALL, "rope_parameters": scaling})).eval()
    path = tmp_path / "both.gguf"
    write_gguf(path, hf, tokenizer=META, extra=[("add_float32", "llama.rope.scaling.factor",
                                                 2.0)])
    _refused(path, "rope_freqs.weight beside a linear scaling factor")
    qwen = T.Qwen2ForCausalLM(T.Qwen2Config(**{**_SMALL, "rope_parameters": scaling})).eval()
    path = tmp_path / "qwen.gguf"
    write_gguf(path, qwen, arch="qwen2", tokenizer=META)
    _refused(path, "rope_freqs.weight is not read for this architecture")


def test_gemma_files_without_their_window_are_read_as_llama_cpp_reads_them(tmp_path,
                                                                          monkeypatch):
    # llama.cpp: a Gemma 2 file without attention.sliding_window slides over 4096 (the
    # first conversions wrote none); a Gemma 3 file without one has no sliding layer (the
    # converter leaves it out when every layer is global); a Gemma 2 output.weight is
    # refused (llama.cpp ties Gemma 2's output layer)
    import gguf

    monkeypatch.setattr(gguf.GGUFWriter, "add_sliding_window", lambda self, value: None)
    torch.manual_seed(0)
    hf = _sharpened(MODELS["gemma2"]())
    ours = GPT.from_gguf(_write(tmp_path, hf, "gemma2", "F32"), dtype=torch.float32)
    assert ours.config.window == 4096 and ours.config.window_layers == (0, 2)
    glob = _sharpened(T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        **_GEMMA, num_hidden_layers=7, layer_types=["full_attention"] * 7)))
    ours = GPT.from_gguf(_write(tmp_path, glob, "gemma3", "F32"), dtype=torch.float32)
    assert ours.config.window is None
    ids = torch.randint(0, VOCAB, (1, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert float((ours(ids) - glob(ids).logits).abs().max()) < 1e-4
    untied = _sharpened(T.Gemma2ForCausalLM(T.Gemma2Config(**_GEMMA, num_hidden_layers=3,
                                                           tie_word_embeddings=False)))
    path = tmp_path / "untied.gguf"
    write_gguf(path, untied, arch="gemma2", tokenizer=META)
    _refused(path, "output.weight has no place in a gemma2 file")


def test_unsupported_architecture_type_and_options_are_named(tmp_path):
    torch.manual_seed(0)
    hf = T.LlamaForCausalLM(T.LlamaConfig(**_SMALL)).eval()
    path = tmp_path / "phi.gguf"
    write_gguf(path, hf, arch="phi3", tokenizer=META)
    _refused(path, "architecture 'phi3' is not supported")
    path = tmp_path / "moe.gguf"
    write_gguf(path, hf, tokenizer=META, extra=[("add_uint32", "llama.expert_count", 8)])
    _refused(path, "mixture of experts")
    path = tmp_path / "rope.gguf"
    write_gguf(path, hf, tokenizer=META, extra=[("add_string", "llama.rope.scaling.type",
                                                 "yarn"),
                                                ("add_float32", "llama.rope.scaling.factor",
                                                 4.0)])
    _refused(path, "rope.scaling.type='yarn'")
    path = tmp_path / "partial-rotary.gguf"  # a rotation over part of each head
    write_gguf(path, hf, tokenizer=META, extra=[("add_uint32", "llama.rope.dimension_count",
                                                 8)])
    _refused(path, "llama.rope.dimension_count=8 is not the heads' width 16")


def test_an_unsupported_tensor_type_is_named_before_anything_is_read(tmp_path, monkeypatch):
    import gguf

    import attnlab.io.gguf as reading

    torch.manual_seed(0)
    hf = T.LlamaForCausalLM(T.LlamaConfig(**_SMALL)).eval()
    path = tmp_path / "iq.gguf"
    write_gguf(path, hf, tokenizer=META, skip=("blk.1.ffn_up.weight",))
    # the same file with one more tensor in a type attnlab does not read (IQ4_NL: 18 bytes
    # a block of 32)
    w = gguf.GGUFWriter(str(tmp_path / "iq2.gguf"), "llama")
    reader = GGUFFile(path)
    for key, value in reader.metadata.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        field = reader._reader.fields[key]
        w.add_key_value(key, value, field.types[0],
                        field.types[-1] if len(field.types) > 1 else None)
    for name, t in reader.tensors.items():
        w.add_tensor(name, np.array(t.data), raw_dtype=t.tensor_type)
    w.add_tensor("blk.1.ffn_up.weight", np.zeros((128, 2 * 18), np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    monkeypatch.setattr(reading, "dequantize", lambda *a: pytest.fail("read a tensor"))
    _refused(tmp_path / "iq2.gguf", "'blk.1.ffn_up.weight' is of type IQ4_NL")


def test_shapes_are_checked_against_the_config_before_anything_is_read(tmp_path,
                                                                       monkeypatch):
    import attnlab.io.gguf as reading

    torch.manual_seed(0)
    hf = T.LlamaForCausalLM(T.LlamaConfig(**_SMALL)).eval()
    path = tmp_path / "wide.gguf"
    write_gguf(path, hf, tokenizer=META, feed_forward_length=96)
    monkeypatch.setattr(reading, "dequantize", lambda *a: pytest.fail("read a tensor"))
    _refused(path, "does not fit the GPT", "has shape (128, 64), expected (96, 64)")
    path = tmp_path / "short.gguf"
    write_gguf(path, hf, tokenizer=META, skip=("blk.1.ffn_up.weight",))
    _refused(path, "tensor 'blk.1.ffn_up.weight' is missing")


def test_the_command_line_says_one_line_and_exits_2(good_file, tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good_file.read_bytes()[:100])
    for argv in (["show", "the cat", "--model", str(bad), "--out", str(tmp_path / "o")],
                 ["generate", "--model", str(bad), "--prompt", "hi"],
                 ["generate", "--model", str(tmp_path / "missing.gguf"), "--prompt", "hi"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and ".gguf" in err, err


def test_q8_0_weights_move_a_few_bands_at_a_time_to_the_same_bytes(tmp_path):
    """A Q8_0 file's weights are moved into attnlab's int8 layout a few bands (and whole
    heads) at a time: the same bytes as converting each whole tensor at once, across
    several chunks, heads of 48 rows and a last band that is padded."""
    from attnlab.layouts import int8
    from attnlab.modules.quantized import Int8Linear

    torch.manual_seed(0)
    hf = T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=600, hidden_size=64, intermediate_size=800, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=2, head_dim=48,
        max_position_embeddings=64, tie_word_embeddings=False)).eval()
    path = tmp_path / "q8.gguf"
    write_gguf(path, hf, kind="Q8_0", tokenizer=byte_level_metadata())
    model = GPT.from_gguf(path)
    file = GGUFFile(path)
    layers = {"blk.0.attn_q.weight": (model.blocks[0].attn.W_query, 8),  # 2 chunks
              "blk.0.attn_k.weight": (model.blocks[0].attn.W_key, 2),
              "blk.0.ffn_up.weight": (model.blocks[0].mlp.fc, None),
              "blk.0.ffn_down.weight": (model.blocks[0].mlp.proj, None),
              "output.weight": (model.lm_head, None)}
    for name, (layer, heads) in layers.items():
        assert type(layer) is Int8Linear, name
        raw = file.raw(name)
        out, n = file.shape(name)
        data, scales = int8.from_gguf_q8_0(unpermute_rows(raw, heads) if heads else raw, out, n)
        assert torch.equal(layer.data, data) and torch.equal(layer.scales, scales), name
