"""Folders written by transformers' save_pretrained load as they are: safetensors only,
sharded or not, never a pickle, never a download, and a mismatch is one clear error."""

from __future__ import annotations

import json
import os
import re
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers as T  # noqa: E402
from test_interop import gpt2, left_padded, llama  # noqa: E402

from attnlab.io import CheckpointError  # noqa: E402
from attnlab.models import GPT, Encoder  # noqa: E402


def _same_logits(hf, ours):
    ids, mask, positions = left_padded()
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=positions).logits
        got = ours(ids, attention_mask=mask, positions=positions)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", [gpt2, lambda: llama(True), lambda: llama(False, 1)],
                         ids=["gpt2", "llama-tied", "llama-mqa"])
def test_a_saved_folder_gives_the_models_logits(make, tmp_path):
    hf = make()
    hf.save_pretrained(tmp_path / "m")
    ours = GPT.from_hf(tmp_path / "m")
    _same_logits(hf, ours)
    if ours.config.tie_embeddings:
        assert ours.lm_head.weight is ours.tok_emb.weight
    assert not any(p.is_meta for p in ours.parameters())


def test_sharded_folders_load(tmp_path):
    hf = llama(False)
    hf.save_pretrained(tmp_path / "m", max_shard_size="20KB")
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    _same_logits(hf, GPT.from_hf(str(tmp_path / "m")))
    index = tmp_path / "m" / "model.safetensors.index.json"
    good = json.loads(index.read_text())
    for value, words in ((7, "got 7"), (["a.safetensors"], "got ['a.safetensors']"),
                         ("../x.safetensors", "names shards outside its folder")):
        name = next(iter(good["weight_map"]))
        index.write_text(json.dumps({**good, "weight_map": {**good["weight_map"],
                                                            name: value}}))
        with pytest.raises(ValueError, match=re.escape(words)):
            GPT.from_hf(tmp_path / "m")


def test_a_tied_config_beside_an_lm_head_of_its_own_is_refused_unless_they_are_equal(
        tmp_path):
    # config.json says tied, the file holds an output layer: attnlab used to tie silently
    # (its logits then differed from transformers' by up to 10).
    from safetensors.torch import load_file, save_file

    hf = llama(False)
    hf.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config,
                                                            "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="ties the output layer to the token embedding .* an "
                                         "lm_head.weight of their own that differs: set "
                                         "tie_word_embeddings to false"):
        GPT.from_hf(tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    ours = GPT.from_hf(tmp_path / "m")  # both saved, equal: the tie
    assert ours.lm_head.weight is ours.tok_emb.weight


def test_a_bert_folder_gives_the_hidden_states(tmp_path):
    torch.manual_seed(0)
    hf = T.BertModel(T.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=40)).eval()
    hf.save_pretrained(tmp_path / "b")
    ours = Encoder.from_hf(tmp_path / "b")
    ids = torch.randint(0, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).last_hidden_state
        got = ours(ids, attention_mask=mask)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=1e-5)


def test_pickle_only_folders_are_refused_without_unpickling(tmp_path):
    folder = tmp_path / "m"
    hf = gpt2()
    hf.save_pretrained(folder)  # transformers 5 writes safetensors only: make the old layout
    (folder / "model.safetensors").unlink()
    torch.save(hf.state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle.*never loads.*safe_serialization=True") as info:
        GPT.from_hf(folder)
    # the advice, followed to the letter, gives a folder attnlab loads (AutoModel, the
    # advice before, dropped the output layer and wrote a headless class into the config)
    import re

    import transformers

    loader = re.search(r"transformers\.(\w+)\.from_pretrained\(folder\)", str(info.value))
    assert loader and loader.group(1) == "GPT2LMHeadModel"
    getattr(transformers, loader.group(1)).from_pretrained(folder).save_pretrained(
        folder, safe_serialization=True)
    ids = torch.randint(0, 99, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(GPT.from_hf(folder)(ids), hf(ids).logits, atol=1e-5,
                                   rtol=1e-5)


def test_hub_names_and_files_are_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="hub name: attnlab never downloads"):
        GPT.from_hf("HuggingFaceTB/SmolLM-135M")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file, expected a folder"):
        GPT.from_hf(tmp_path / "f")
    with pytest.raises(TypeError, match="transformers model or a folder"):
        GPT.from_hf(42)


def test_a_config_that_does_not_fit_the_weights_is_refused_naming_both(tmp_path):
    folder = tmp_path / "m"
    gpt2().save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["n_embd"] = 64  # the weights are 48 wide
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"does not fit the GPT: .*shape"):
        GPT.from_hf(folder)
    del cfg["n_layer"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config has no 'n_layer'"):
        GPT.from_hf(folder)


@pytest.mark.parametrize("kind", ["qwen2", "gemma2", "gpt2"])
def test_a_layer_count_beyond_the_weights_is_refused_before_a_list_of_its_layers(tmp_path,
                                                                                 kind):
    """Qwen2's and Gemma's converters listed a type per declared layer before the layers
    were counted: num_hidden_layers of 2e8 took 19 s and 1.9 GB, 1e9 filled memory."""
    small = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    make = {"qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**small)),
            "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**small)),
            "gpt2": gpt2}[kind]
    folder = tmp_path / kind
    make().save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    key = "n_layer" if kind == "gpt2" else "num_hidden_layers"
    cfg[key] = 10**9
    cfg.pop("layer_types", None)  # (Qwen2.5's configs on the hub have none)
    (folder / "config.json").write_text(json.dumps(cfg))
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=rf"{key}=1000000000, but the weights hold "
                                              r"layers 0 \.\. 1 \(\d+ tensors"):
        GPT.from_hf(folder)
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("make", [gpt2, lambda: llama(False)], ids=["gpt2", "llama"])
def test_a_live_model_is_never_changed_by_training_the_loaded_one(make):
    """The loaded model owns its tensors: an optimizer step on it leaves every tensor of
    the transformers model as it was."""
    hf = make()
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    ours = GPT.from_hf(hf).train()
    opt = torch.optim.SGD(ours.parameters(), lr=1.0)
    ids = torch.randint(0, 120, (2, 9), generator=torch.Generator().manual_seed(0))
    ours(ids).logsumexp(-1).mean().backward()
    opt.step()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ours.parameters())
    after = hf.state_dict()
    assert sorted(after) == sorted(before)
    changed = [k for k in before if not torch.equal(after[k], before[k])]
    assert changed == []


_OWNS = """
import os, sys, torch
from attnlab.models import GPT
folder, other = sys.argv[1], sys.argv[2]
path = os.path.join(folder, "model.safetensors")
model = GPT.from_hf(folder)
ids = torch.tensor([[3, 17, 5, 99, 42]])
def outputs():
    with torch.no_grad():
        return model(ids), model.generate(ids, 12, temperature=0.0)
want = outputs()
def same(what):
    got = outputs()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), what
    print(what, "unchanged", flush=True)
with open(path, "r+b") as f:  # other weights written over the same file, in place
    f.write(open(other, "rb").read())
same("rewritten")
os.replace(other, path)
same("replaced")
os.truncate(path, 0)
same("truncated")
"""


@pytest.mark.parametrize("make", [gpt2, lambda: llama(False)], ids=["gpt2", "llama"])
def test_a_loaded_folder_owns_its_weights(make, tmp_path):
    """Nothing of the user's file stays in the model: rewriting it with other weights,
    replacing it, truncating it (a touched mapping would raise SIGBUS) leave the logits
    and the greedy tokens exactly as they were. Run in a child so a signal fails the
    test instead of killing pytest."""
    import subprocess
    import sys

    hf = make()
    hf.save_pretrained(tmp_path / "m")
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p))
    hf.save_pretrained(tmp_path / "other")
    out = subprocess.run([sys.executable, "-c", _OWNS, str(tmp_path / "m"),
                          str(tmp_path / "other" / "model.safetensors")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-2000:])
    assert out.stdout.split() == ["rewritten", "unchanged", "replaced", "unchanged",
                                  "truncated", "unchanged"]


def test_a_joint_qkv_of_the_wrong_width_is_refused_naming_it(tmp_path):
    """GPT-2's c_attn is sliced into q, k, v: a (d, 4d) one would load with a column
    block ignored. Every tensor is checked against the config before allocation."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    gpt2().save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    state["transformer.h.1.attn.c_attn.weight"] = torch.zeros(48, 4 * 48)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        GPT.from_hf(folder)
    message = str(info.value)
    assert message == (f"{str(folder)!r} does not fit the GPT: "
                       "'transformer.h.1.attn.c_attn.weight' has shape (48, 192), "
                       "expected (48, 144) (from the config)")


@pytest.mark.parametrize(("make", "key"), [(gpt2, "n_head"), (gpt2, "n_layer"),
                                           (lambda: llama(False), "num_attention_heads"),
                                           (lambda: llama(False), "num_key_value_heads")])
def test_a_size_of_zero_is_one_line_naming_the_key(make, key, tmp_path):
    folder = tmp_path / "m"
    make().save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg[key] = 0
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as info:
        GPT.from_hf(folder)
    assert str(info.value) == f"config {key}=0 is not valid (expected a positive int)"


_LOAD_AND_MEASURE = """
import sys, torch
from attnlab.models import GPT, Encoder
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
before = rss_mb()
model = {cls}.from_hf(sys.argv[1])
weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
print(rss_mb() - before - weights)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc (Linux)")
@pytest.mark.parametrize("cls, make", [("GPT", lambda: llama(False)), ("Encoder", None)])
def test_loading_a_folder_adds_little_beside_the_weights(cls, make, tmp_path):
    """Built on the meta device, a model runs no random initialisation: torch's meta
    ``normal_`` would import its Python decompositions (about 70 MB) into the process."""
    import subprocess
    import sys

    hf = make() if make else T.BertModel(T.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64))
    hf.save_pretrained(tmp_path / "m")
    out = subprocess.run([sys.executable, "-c", _LOAD_AND_MEASURE.format(cls=cls),
                          str(tmp_path / "m")], capture_output=True, text=True, check=True)
    assert float(out.stdout.split()[-1]) < 25, out.stdout


QWEN_STYLE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
              "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% endif %}")


@pytest.mark.parametrize("where", ["jinja", "config"])
def test_a_folders_chat_template_is_used_as_transformers_uses_it(tmp_path, where):
    """``save_pretrained`` puts the chat template in chat_template.jinja (or, from older
    versions, tokenizer_config.json): --chat renders it as transformers' apply_chat_template
    does, and the reply ends at the tokenizer's eos_token."""
    from hf_tokenizers import byte_level_bpe
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    from attnlab.interop.auto import load_hf_folder

    raw = Tokenizer.from_str(byte_level_bpe().to_str())  # a copy: the cached one stays
    raw.add_special_tokens([AddedToken("<|im_start|>", special=True),
                            AddedToken("<|im_end|>", special=True)])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>")
    hf_tok.chat_template = QWEN_STYLE
    folder = tmp_path / "chat"
    T.Qwen2ForCausalLM(T.Qwen2Config(vocab_size=raw.get_vocab_size(), hidden_size=32,
                                     intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1)
                       ).save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    if where == "config":  # the older layout: the template inside tokenizer_config.json
        (folder / "chat_template.jinja").unlink(missing_ok=True)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                  "chat_template": QWEN_STYLE}))
    _, tok = load_hf_folder(folder)
    message = [{"role": "user", "content": "床前明月光 🌙"}]
    want = hf_tok.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat(message) == want
    assert tok.encode(tok.apply_chat(message), add_special_tokens=False) == \
        hf_tok(want, add_special_tokens=False)["input_ids"]
    assert tok.eos_id == hf_tok.eos_token_id


@pytest.mark.parametrize("config", ["[]", "{not json", "x" * (2 << 20)])
def test_a_tokenizer_config_that_cannot_be_read_leaves_the_folder_loadable(tmp_path, config):
    """tokenizer_config.json is read for the chat template only: a large one (thousands of
    added tokens), or one that is not a JSON object, loads the model and tokenizer as
    before, without a template."""
    from hf_tokenizers import byte_level_bpe

    from attnlab.interop.auto import load_hf_folder
    from attnlab.text import HFTokenizer

    folder = tmp_path / "m"
    T.Qwen2ForCausalLM(T.Qwen2Config(vocab_size=byte_level_bpe().get_vocab_size(),
                                     hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1)).save_pretrained(folder)
    byte_level_bpe().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(config)
    model, tok = load_hf_folder(folder)
    assert type(tok) is HFTokenizer and tok.encode("注意力") == byte_level_bpe().encode(
        "注意力").ids
