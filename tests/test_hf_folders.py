"""Folders written by transformers' save_pretrained load as they are: safetensors only,
sharded or not, never a pickle, never a download, and a mismatch is one clear error."""

from __future__ import annotations

import json
import os

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
    with pytest.raises(ValueError, match="pickle.*never loads.*safe_serialization=True"):
        GPT.from_hf(folder)


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


def test_a_live_model_is_not_copied(tmp_path):
    """Where the layouts agree the tensors move across: no second copy of the weights."""
    hf = llama(False)
    ours = GPT.from_hf(hf)
    assert ours.tok_emb.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


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
