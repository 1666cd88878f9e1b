"""Long inputs: the page and the picture hold each row's strongest keys, computed a block of
rows at a time from attnlab.attention(..., return_weights=rows), never a seq x seq matrix;
checked against the model's own output_attentions."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from attnlab import viz
from attnlab.models import GPT, GPTConfig
from attnlab.text import CharTokenizer
from attnlab.viz import long as long_mod

LETTERS = "abcdefghij"


def text_of(n: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    return "".join(rng.choice(list(LETTERS), size=n))


@pytest.fixture(scope="module")
def tiny():
    tok = CharTokenizer.from_text(LETTERS)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=2048, d_model=16,
                          num_layers=2, num_heads=2, positions="rope", window=None)).eval()
    with torch.no_grad():  # sharper rows, so the top keys hold most of the weight
        for block in model.blocks:
            block.attn.W_query.weight.mul_(20)
    return model, tok


@pytest.fixture
def no_picture(monkeypatch):
    """The page alone: the picture is drawn as an empty figure (test_the_picture_... draws)."""
    from matplotlib.figure import Figure

    from attnlab.viz import show

    monkeypatch.setattr(long_mod, "long_figure", lambda *a, **kw: Figure())
    monkeypatch.setattr(show, "figure_bytes", lambda *a, **kw: b"")


def payload_of(html: str) -> dict:
    return json.loads(html.split('id="attnlab-data">')[1].split("</script>")[0])


def test_the_top_keys_are_the_strongest_of_the_models_own_rows(tiny, tmp_path, monkeypatch,
                                                               no_picture):
    model, tok = tiny
    text = text_of(300)
    monkeypatch.setattr(long_mod, "DENSE_MAX_WEIGHTS", 1000)  # 300 tokens count as long
    monkeypatch.setattr(long_mod, "ROW_BLOCK", 64)  # several blocks, the last one short
    shown = viz.show_attention(model, tok, text, tmp_path / "o")
    page = payload_of(shown["html"].read_text())
    assert page["encoding"] == "topk-base64" and page["topk"] == long_mod.MAX_TOPK
    k, (n_l, n_h, q_len) = page["topk"], (page["layers"], page["heads"], page["q_len"])
    import base64

    index = np.frombuffer(base64.b64decode(page["index"]), "<u2").reshape(n_l, n_h, q_len, k)
    kept = np.frombuffer(base64.b64decode(page["weights"]), np.uint8).reshape(index.shape)
    with torch.no_grad():  # the peer: the whole matrices, as the model returns them
        _, full = model(torch.tensor([tok.encode(text)]), output_attentions=True)
    full = np.stack([w[0].numpy() for w in full])  # (L, H, T, T)
    strongest = -np.sort(-full, axis=-1)[..., :k]
    np.testing.assert_allclose(kept / 255, strongest, atol=0.5 / 255 + 1e-6)
    picked = np.take_along_axis(full, index.astype(np.int64), axis=-1)
    np.testing.assert_allclose(picked, strongest, atol=1e-6)  # the keys are those keys
    assert page["rules"] == [[True, None], [True, None]]
    assert np.allclose(page["kept"], strongest.sum(-1).mean(-1), atol=1e-4)
    assert "strongest keys" in page["left_out"] and f"{100 * np.mean(page['kept']):.0f}%" in \
        page["left_out"]


class Shapes(TorchFunctionMode):
    """Every tensor a torch function returns while active: its shape."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.seen.append(tuple(t.shape))
        return out


def test_a_long_text_is_never_held_as_a_seq_by_seq_matrix(tiny, tmp_path, monkeypatch,
                                                          no_picture):
    model, tok = tiny
    text = text_of(400)  # 2 layers x 2 heads x 400^2 = 640 000 weights: long below
    monkeypatch.setattr(long_mod, "DENSE_MAX_WEIGHTS", 100_000)
    calls = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda ids, **kw: calls.append(kw) or forward(ids, **kw))
    rows_asked = []
    attn = model.blocks[0].attn
    real_rows = type(attn).attention_rows

    def spy(self, q, k, v, rows):
        rows_asked.append(list(rows))
        return real_rows(self, q, k, v, rows)

    monkeypatch.setattr(type(attn), "attention_rows", spy)
    with Shapes() as shapes:
        viz.show_attention(model, tok, text, tmp_path / "o")
    assert calls == [{"output_attentions": False}]
    assert len(shapes.seen) > 50 and not [s for s in shapes.seen if s[-2:] == (400, 400)]
    assert max(len(r) for r in rows_asked) == long_mod.ROW_BLOCK
    assert sorted(r for rows in rows_asked for r in rows) == sorted(list(range(400)) * 2)
    # the check on the checker: the whole weights, as a short text's are captured, are seen
    with Shapes() as shapes:
        viz.capture(model, tok, text)
    assert (1, 2, 400, 400) in shapes.seen


def test_the_picture_of_a_long_text_max_pools_the_kept_keys(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    monkeypatch.setattr(long_mod, "DENSE_MAX_WEIGHTS", 1000)
    shown = viz.show_attention(model, tok, text_of(300), tmp_path / "svg", fmt="svg", layer=1)
    picture = shown["svg"].read_text()
    assert picture.startswith("<?xml") and "300 tokens: each pixel is the strongest" in picture
    top = long_mod.TopKeys(index=np.array([[[[1, 0], [1, 0], [2, 1]]]], np.uint16),
                           weight=np.array([[[[0.9, 0.1], [0.6, 0.4], [0.7, 0.2]]]], np.float32),
                           k_len=3, layer_ids=(0,), n_layers=1, rules=((True, None),),
                           kept=np.ones((1, 1)))
    pooled, allowed = long_mod.pooled(top, size=3)  # one pixel per cell: the kept weights
    np.testing.assert_allclose(pooled[0, 0], [[0.1, 0.9, 0], [0.4, 0.6, 0], [0, 0.2, 0.7]],
                               atol=1e-7)
    assert allowed[0].tolist() == [[True, False, False], [True, True, False], [True] * 3]
    pooled, allowed = long_mod.pooled(top, size=1)  # one pixel: the strongest of all
    assert pooled[0, 0].tolist() == [[pytest.approx(0.9)]] and allowed.all()


def test_rollout_and_compare_of_a_long_text_are_refused_in_one_line(tiny, tmp_path,
                                                                     monkeypatch):
    model, tok = tiny
    monkeypatch.setattr(long_mod, "DENSE_MAX_WEIGHTS", 1000)
    with pytest.raises(ValueError, match="rollout"):
        viz.show_attention(model, tok, text_of(300), tmp_path / "r", rollout=True)
    with pytest.raises(ValueError, match="--compare is 300 tokens"):
        viz.show_attention(model, tok, "abc", tmp_path / "c", compare=text_of(300))
    monkeypatch.setattr(long_mod, "MAX_TOKENS", 200)

    def no_forward(*args, **kwargs):  # (helper-found: refused after 35 s of forward)
        raise AssertionError("the text's length is known before the forward")

    monkeypatch.setattr("attnlab.viz.show.run", no_forward)
    with pytest.raises(ValueError, match="up to 200"):
        viz.show_attention(model, tok, text_of(300), tmp_path / "m")


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 128), st.integers(1, 4096), st.integers(1, 80))
def test_a_long_page_holds_at_most_its_budget(heads, seq, layers):
    k, kept = long_mod.plan(heads, seq, list(range(layers)))
    assert 1 <= k <= min(long_mod.MAX_TOPK, seq) and 1 <= len(kept) <= layers
    assert kept == list(range(len(kept)))
    assert 3 * len(kept) * heads * seq * k <= long_mod.TOPK_BUDGET  # 8 MB once in base64
    if len(kept) < layers:
        assert k == min(long_mod.MIN_TOPK, seq)


def test_a_page_that_keeps_some_layers_says_which(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    monkeypatch.setattr(long_mod, "DENSE_MAX_WEIGHTS", 1000)
    monkeypatch.setattr(long_mod, "TOPK_BUDGET", 3 * 2 * 300 * 2)  # one layer at k = 2
    shown = viz.show_attention(model, tok, text_of(300), tmp_path / "o", layer=1)
    page = payload_of(shown["html"].read_text())
    assert page["layer_ids"] == [1] and page["model_layers"] == 2 and page["topk"] == 2
    assert "1 of the model's 2 layers are kept (1)" in page["left_out"]
    # the step-by-step view says why it is empty (helper-found: "made from the weights
    # alone", of a page attnlab show made)
    assert "a long text's page of its strongest keys" in page["steps"]["note"]


def test_a_file_of_the_users_that_comes_while_show_computes_is_kept(tiny, tmp_path,
                                                                   monkeypatch):
    """--out was checked for files of the user's only before the model ran: an
    attention.png dropped into it meanwhile was replaced."""
    from attnlab.viz import show as show_mod

    model, tok = tiny
    out = tmp_path / "o"
    real = show_mod._show

    def slow_show(*args, **kwargs):
        out.mkdir(exist_ok=True)
        (out / "attention.png").write_bytes(b"the user's own picture")
        return real(*args, **kwargs)

    monkeypatch.setattr(show_mod, "_show", slow_show)
    with pytest.raises(ValueError, match="holds files attnlab did not write"):
        viz.show_attention(model, tok, "abc", out)
    assert (out / "attention.png").read_bytes() == b"the user's own picture"


def test_a_picture_in_the_other_format_replaces_the_earlier_one(tiny, tmp_path):
    """Helper-found: show --format svg into a folder of an earlier PNG run left that run's
    attention.png (of another text) beside the new attention.svg and page."""
    model, tok = tiny
    out = tmp_path / "shown"
    assert viz.show_attention(model, tok, "abc", out)["png"].exists()
    shown = viz.show_attention(model, tok, "cab", out, fmt="svg")
    assert shown["svg"].exists() and not (out / "attention.png").exists()
    assert sorted(p.name for p in out.iterdir()) == ["attention.html", "attention.svg"]
