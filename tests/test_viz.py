"""attnlab.viz without a browser: heatmaps, the PNG grid and the explorer HTML file."""

from __future__ import annotations

import base64
import io
import json
import re
import subprocess
import sys
from html.parser import HTMLParser

import matplotlib.image as mpimg
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab import viz

TOKENS = ["The", "cat", "sat", "on", "the", "mat", "."]


def softmax_rows(shape, seed=0, causal=True):
    """Random attention weights of ``shape`` (..., q_len, k_len), rows summing to 1."""
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=shape) * 2.0
    q_len, k_len = shape[-2:]
    if causal:
        allowed = np.arange(k_len)[None, :] <= np.arange(q_len)[:, None] + (k_len - q_len)
        scores = np.where(allowed, scores, -np.inf)
    e = np.exp(scores - scores.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def layers(n_layers, n_heads, q_len, k_len, seed=0):
    return [softmax_rows((n_heads, q_len, k_len), seed + i) for i in range(n_layers)]


# --------------------------------------------------------------------------- heatmap


def tick_texts(labels):
    return [t.get_text() for t in labels]


def test_heatmap_labels_both_axes_with_the_tokens_and_has_a_colour_bar():
    w = softmax_rows((7, 7))
    fig = viz.heatmap(w, TOKENS)
    main = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(main) == 1 and len(bars) == 1
    ax = main[0]
    assert tick_texts(ax.get_xticklabels()) == TOKENS
    assert tick_texts(ax.get_yticklabels()) == TOKENS
    assert all(t.get_rotation() == 90 for t in ax.get_xticklabels())
    np.testing.assert_allclose(np.asarray(ax.images[0].get_array()), w)


def test_heatmap_decode_step_labels_queries_with_the_last_tokens():
    w = softmax_rows((2, 7))
    ax = viz.heatmap(w, TOKENS).axes[0]
    assert tick_texts(ax.get_xticklabels()) == TOKENS
    assert tick_texts(ax.get_yticklabels()) == TOKENS[-2:]


def test_heatmap_accepts_torch_tensors_and_draws_into_a_given_axes():
    from matplotlib.figure import Figure

    w = torch.tensor(softmax_rows((7, 7)), dtype=torch.bfloat16, requires_grad=True)
    fig = Figure()
    ax = fig.add_subplot()
    assert viz.heatmap(w, TOKENS, ax=ax) is fig
    np.testing.assert_allclose(np.asarray(ax.images[0].get_array()),
                               w.detach().float().numpy())


def test_heatmap_font_shrinks_with_token_count_and_tokens_are_not_tex():
    def size(n):
        toks = [f"t{i}" for i in range(n)]
        return viz.heatmap(softmax_rows((n, n)), toks).axes[0].get_xticklabels()[0].get_fontsize()

    assert size(5) > size(40) > size(128) >= 4
    ax = viz.heatmap(softmax_rows((2, 2)), ["$x$", "$"]).axes[0]
    assert tick_texts(ax.get_xticklabels()) == ["$x$", "$"]
    assert ax.get_xticklabels()[0].get_parse_math() is False


@pytest.mark.parametrize(
    ("weights", "tokens", "error", "pattern"),
    [
        (np.ones((2, 7, 7)) / 7, TOKENS, ValueError,
         r"weights: expected a 2-D .* got shape \(2, 7, 7\)"),
        (np.ones(7) / 7, TOKENS, ValueError, r"weights: .*2-D.*\(7,\)"),
        (np.ones((7, 7)) / 7, TOKENS[:5], ValueError, r"tokens: expected 7 tokens.*got 5"),
        (np.ones((8, 7)) / 7, TOKENS, ValueError,
         r"weights: expected 1 <= q_len <= k_len.*\(8, 7\)"),
        (np.full((7, 7), np.nan), TOKENS, ValueError, r"weights: expected finite"),
        (np.ones((3, 3)), "abc", TypeError,
         r"tokens: expected a sequence of token strings, got a str"),
        ("not numbers", TOKENS, TypeError, r"weights: expected a torch tensor or numpy array"),
    ],
)
def test_heatmap_rejects_bad_input_naming_the_argument(weights, tokens, error, pattern):
    with pytest.raises(error, match=pattern):
        viz.heatmap(weights, tokens)


# --------------------------------------------------------------------------- grid / PNG


def test_heatmap_grid_has_one_axes_per_layer_and_head_labelled():
    fig = viz.heatmap_grid(TOKENS, layers(3, 4, 7, 7))
    cells = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert len(cells) == 3 * 4
    assert sum(ax.get_label() == "<colorbar>" for ax in fig.axes) == 1
    assert [ax.get_title() for ax in cells[:4]] == [f"head {j}" for j in range(4)]
    assert [cells[4 * i].get_ylabel() for i in range(3)] == [f"layer {i}" for i in range(3)]
    # tokens label the left column and bottom row when they fit...
    assert tick_texts(cells[0].get_yticklabels()) == TOKENS
    assert tick_texts(cells[-1].get_xticklabels()) == TOKENS
    assert tick_texts(cells[5].get_xticklabels()) == []
    # ...and each cell shows its own head
    np.testing.assert_allclose(np.asarray(cells[6].images[0].get_array()),
                               layers(3, 4, 7, 7)[1][2])


def test_heatmap_grid_drops_unreadable_tick_labels_and_squeezes_batch_one():
    toks = [f"t{i}" for i in range(128)]
    atts = [torch.tensor(a)[None] for a in layers(2, 12, 128, 128)]  # (1, heads, q, k)
    fig = viz.heatmap_grid(toks, atts)
    cells = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert len(cells) == 2 * 12
    assert all(not ax.get_xticklabels() and not ax.get_yticklabels() for ax in cells)


def test_masked_cells_are_grey_not_a_weight_of_zero():
    """circuitsvis greys the cells a query may not see; a weight of 0 is viridis' darkest."""
    from attnlab.viz.heatmap import MASKED_COLOUR

    w = softmax_rows((7, 7))
    causal = np.tril(np.ones((7, 7), bool))
    for fig in (viz.heatmap(w, TOKENS, mask=causal),
                viz.heatmap_grid(TOKENS, layers(2, 3, 7, 7), mask=causal)):
        cells = [ax for ax in fig.axes if ax.get_label() != "<colorbar>" and ax.images]
        for ax in cells:
            image = ax.images[0]
            rgba = image.to_rgba(image.get_array())  # what is drawn, cell by cell
            grey = np.all(np.abs(rgba[..., :3] - np.array(
                [int(MASKED_COLOUR[i:i + 2], 16) / 255 for i in (1, 3, 5)])) < 1e-6, axis=-1)
            assert np.array_equal(grey, ~causal)
        bar = next(ax for ax in fig.axes if ax.get_label() == "<colorbar>")
        assert "grey: masked" in bar.get_ylabel()
    # without a mask nothing is grey, as before
    plain = viz.heatmap(w, TOKENS).axes[0].images[0]
    assert not np.ma.is_masked(plain.get_array())
    with pytest.raises(ValueError, match=r"mask: expected shape \(7, 7\)"):
        viz.heatmap(w, TOKENS, mask=causal[:3])
    with pytest.raises(TypeError, match="mask: expected a boolean array"):
        viz.heatmap(w, TOKENS, mask=causal.astype(int))


def test_grid_draws_the_rollout_once_and_labels_query_and_key():
    atts = layers(2, 4, 7, 7)
    flow = viz.rollout(atts)
    fig = viz.heatmap_grid(TOKENS, atts, rollout=flow, mask=np.tril(np.ones((7, 7), bool)))
    drawn = [ax for ax in fig.axes if ax.get_label() != "<colorbar>" and ax.images]
    assert len(drawn) == 2 * 4 + 1  # four heads per layer, the rollout once
    rows = [ax.get_ylabel() for ax in drawn if ax.get_ylabel()]
    assert rows == ["layer 0", "layer 1", "rollout"]
    np.testing.assert_allclose(np.ma.getdata(drawn[-1].images[0].get_array()), flow, atol=1e-12)
    texts = [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]
    assert "query \u2193" in texts
    assert [ax.get_xlabel() for ax in drawn if ax.get_xlabel()] == ["key"] * 4


def test_long_labels_are_cut_to_fit_and_nothing_leaves_the_figure():
    toks = ["The", "internationalization", "supercalifragilisticexpialidocious_token",
            "注意力机制是深度学习中的重要概念", "a"]
    atts = layers(2, 4, 5, 5)
    for fig in (viz.heatmap(softmax_rows((5, 5)), toks),
                viz.heatmap_grid(toks, atts, rollout=viz.rollout(atts))):
        ax = [a for a in fig.axes if a.get_yticklabels()][0]
        labels = tick_texts(ax.get_yticklabels())
        assert labels[:2] == toks[:2]  # short enough: whole
        assert labels[2].endswith("\u2026") and toks[2].startswith(labels[2][:-1])
        assert labels[3].endswith("\u2026") and toks[3].startswith(labels[3][:-1])
        fig.canvas.draw()  # as savefig does: the layout is made at draw time
        box = fig.get_tightbbox(fig.canvas.get_renderer())  # inches
        w, h = fig.get_size_inches()
        assert box.x0 >= -0.01 and box.y0 >= -0.01 and box.x1 <= w + 0.01 and box.y1 <= h + 0.01


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    image = mpimg.imread(io.BytesIO(data), format="png")
    assert image.std() > 0.05  # something was drawn
    return image.shape[1], image.shape[0]


def test_save_heatmaps_writes_a_png_that_grows_with_layers_and_heads(tmp_path):
    small = viz.save_heatmaps(tmp_path / "small.png", TOKENS, layers(1, 1, 7, 7))
    wide = viz.save_heatmaps(tmp_path / "wide.png", TOKENS, layers(1, 4, 7, 7))
    big = viz.save_heatmaps(tmp_path / "sub" / "big.png", TOKENS, layers(3, 4, 7, 7))
    assert small == tmp_path / "small.png" and big.exists()
    (w1, h1), (w2, h2), (w3, h3) = png_size(small), png_size(wide), png_size(big)
    assert w2 > w1 and h2 == h1
    assert w3 == w2 and h3 > h2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.png", "sub", "wide.png"]


def test_save_heatmaps_replaces_atomically_and_keeps_the_old_file_on_error(tmp_path):
    target = tmp_path / "grid.png"
    target.write_bytes(b"old")
    with pytest.raises(ValueError, match="tokens: expected 7 tokens"):
        viz.save_heatmaps(target, TOKENS[:3], layers(1, 2, 7, 7))
    assert target.read_bytes() == b"old"
    viz.save_heatmaps(target, TOKENS, layers(1, 2, 7, 7))
    assert target.read_bytes()[:4] == b"\x89PNG"
    assert [p.name for p in tmp_path.iterdir()] == ["grid.png"]  # no temp file left


@pytest.mark.parametrize(
    ("attentions", "pattern"),
    [
        ([], r"attentions: expected at least one layer"),
        ([np.ones((7, 7)) / 7],
         r"attentions\[0\]: expected shape \(heads, q_len, k_len\), got shape \(7, 7\)"),
        ([np.ones((2, 2, 7, 7)) / 7], r"attentions\[0\]: expected batch size 1.*\(2, 2, 7, 7\)"),
        ([np.ones((2, 7, 7)) / 7, np.ones((3, 7, 7)) / 7],
         r"attentions\[1\]: expected the same shape as layer 0 \(2, 7, 7\), got \(3, 7, 7\)"),
        ([np.ones((2, 7, 5)) / 5], r"tokens: expected 5 tokens .*got 7"),
        ([np.full((2, 7, 7), 3.0)], r"attentions: expected attention weights in \[0, 1\]"),
        ([np.full((2, 7, 7), np.inf)], r"attentions: expected finite weights"),
    ],
)
def test_grid_and_html_reject_bad_attentions(tmp_path, attentions, pattern):
    with pytest.raises(ValueError, match=pattern):
        viz.heatmap_grid(TOKENS, attentions)
    with pytest.raises(ValueError, match=pattern):
        viz.write_html(tmp_path / "x.html", TOKENS, attentions)
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------- explorer HTML


class PageScan(HTMLParser):
    """Tags, attributes and script bodies, split the way a browser splits them."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags, self.scripts, self.title = [], [], ""
        self._script, self._in_title = None, False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "script":
            self._script = (dict(attrs), [])
        self._in_title = tag == "title"

    def handle_data(self, data):
        if self._script is not None:
            self._script[1].append(data)
        if self._in_title:
            self.title += data

    def handle_endtag(self, tag):
        if tag == "script" and self._script is not None:
            self.scripts.append((self._script[0], "".join(self._script[1])))
            self._script = None
        self._in_title = False


def scan(text):
    page = PageScan()
    page.feed(text)
    page.close()
    return page


def data_script(text):
    page = scan(text)
    bodies = [body for attrs, body in page.scripts if attrs.get("id") == "attnlab-data"]
    assert len(bodies) == 1
    assert dict(page.scripts[0][0]) == {"type": "application/json", "id": "attnlab-data"}
    return bodies[0]


def decode(text):
    """Tokens and dequantised (layers, heads, q_len, k_len) weights, read as a browser would."""
    payload = json.loads(data_script(text))
    raw = np.frombuffer(base64.b64decode(payload["weights"]), dtype=np.uint8)
    shape = (payload["layers"], payload["heads"], payload["q_len"], payload["k_len"])
    return payload, raw.reshape(shape).astype(np.float64) / payload["scale"]


# CSS's url(...) (not the canvas's toDataURL, which the page's exports use: data: URLs only)
NETWORK = [r"https?:", r"//cdn", r"<link\b", r"\bsrc\s*=", r"\bhref\s*=", r"\burl\(", r"@import",
           r"\bfetch\(", r"XMLHttpRequest", r"WebSocket", r"EventSource", r"sendBeacon",
           r"\bimport\(", r"<iframe", r"<object", r"<embed", r"<img", r"<base\b"]


def test_write_html_is_self_contained_with_no_network_reference(tmp_path):
    path = viz.write_html(tmp_path / "out" / "explorer.html", TOKENS, layers(2, 3, 7, 7))
    assert path == tmp_path / "out" / "explorer.html"
    text = path.read_text("utf-8")
    page = scan(text)
    for tag, attrs in page.tags:
        assert tag not in {"link", "iframe", "object", "embed", "img", "base"}
        bad = {"src", "href", "srcset", "action", "formaction", "poster", "background"} & set(attrs)
        assert not bad, (tag, attrs)
    assert [attrs.get("type") for attrs, _ in page.scripts] == ["application/json", None]
    code = text.replace(data_script(text), "")
    for pattern in NETWORK:
        assert not re.search(pattern, code, re.IGNORECASE), pattern
    ids = {attrs.get("id") for _, attrs in page.tags}
    assert {"layer-select", "matrix", "head-view", "overview", "attnlab-data"} <= ids
    assert [p.name for p in path.parent.iterdir()] == ["explorer.html"]  # atomic: no temp left


def test_write_html_round_trips_tokens_and_weights_within_quantisation(tmp_path):
    atts = [torch.tensor(a, dtype=torch.float32) for a in layers(3, 2, 4, 7)]  # decode: q < k
    text = viz.write_html(tmp_path / "e.html", TOKENS, atts, title="cats").read_text("utf-8")
    payload, weights = decode(text)
    assert payload["tokens"] == TOKENS and payload["title"] == "cats"
    assert weights.shape == (3, 2, 4, 7)
    expected = np.stack([a.numpy() for a in atts])
    assert np.abs(weights - expected).max() <= 0.5 / 255 + 1e-9
    assert scan(text).title == "cats"


def test_tokens_and_title_cannot_break_out_of_the_page():
    evil = ["</script><script>alert(1)</script>", "<img src=x onerror=alert(1)>", "<!--",
            "a & b", "\u2028", "\u2029", "</SCRIPT >", "\ud800"]
    title = "</title><script>alert('t')</script> & co"
    text = viz.render_html(evil, layers(1, 1, 8, 8), title=title)
    for raw in ["<script>alert", "<img", "onerror=alert(1)>", "\u2028", "\u2029", "</SCRIPT",
                "<!--"]:
        assert raw not in text, raw
    page = scan(text)
    assert len(page.scripts) == 2
    assert not any(tag == "img" for tag, _ in page.tags)
    assert page.title == title  # escaped in the markup, exact as text
    assert decode(text)[0]["tokens"] == evil


def test_big_model_explorer_is_compact(tmp_path):
    toks = [f"token{i}" for i in range(128)]
    path = viz.write_html(tmp_path / "big.html", toks, layers(6, 12, 128, 128))
    size = path.stat().st_size
    assert size < 5 * 1024 * 1024
    assert size < 6 * 12 * 128 * 128 * 1.4 + 100_000  # ~4/3 byte per weight plus the page
    _, weights = decode(path.read_text("utf-8"))
    assert weights.shape == (6, 12, 128, 128)


token_text = st.text(
    alphabet=st.one_of(st.sampled_from(list("<>&\"'/\\ \n\t\u2028\u2029\x00")), st.characters()),
    max_size=12,
) | st.sampled_from(["</script>", "<script>", "<!--", "-->", "</scrIpt\n>", "]]>", "&amp;"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.lists(token_text, min_size=1, max_size=6), title=token_text,
       seed=st.integers(0, 9))
def test_any_tokens_round_trip_through_the_escaped_json(tokens, title, seed):
    n = len(tokens)
    atts = layers(1, 2, n, n, seed=seed)
    text = viz.render_html(tokens, atts, title=title)
    body = data_script(text)
    for ch in "<>&\u2028\u2029":
        assert ch not in body
    payload, weights = decode(text)
    assert payload["tokens"] == tokens
    assert payload["title"] == title
    assert np.abs(weights - np.stack(atts)).max() <= 0.5 / 255 + 1e-9
    assert len(scan(text).scripts) == 2


def test_importing_viz_does_not_import_matplotlib():
    code = "import sys, attnlab.viz; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- attnlab show


SHOW_TEXT = "abc ab"


@pytest.fixture(scope="module")
def gpt_ckpt(tmp_path_factory):
    """A 2-layer x 3-head GPT checkpoint: enough to tell layers and heads apart."""
    from attnlab.checkpoint import save_checkpoint
    from attnlab.models import GPT, GPTConfig
    from attnlab.text import CharTokenizer

    torch.manual_seed(0)
    tok = CharTokenizer.from_text("abc xyz")
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=16, d_model=24,
                          num_layers=2, num_heads=3))
    with torch.no_grad():  # sharpen, so that heads differ visibly
        for block in model.blocks:
            block.attn.W_query.weight.mul_(6)
    out = tmp_path_factory.mktemp("ckpt") / "gpt"
    save_checkpoint(model, out, tokenizer=tok)
    return out


def png_pixels(path_or_fig):
    if hasattr(path_or_fig, "savefig"):
        buf = io.BytesIO()
        path_or_fig.savefig(buf, format="png")
        buf.seek(0)
        return mpimg.imread(buf, format="png")
    return mpimg.imread(str(path_or_fig))


def run_show(capsys, *args):
    from attnlab.cli import main

    try:
        code = main(["show", SHOW_TEXT, *map(str, args)])
    except SystemExit as exc:  # refused while parsing (a negative --layer), before any work
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("layer, head", [(None, None), (1, None), (None, 2), (1, 2), (0, 0)])
def test_show_layer_and_head_restrict_the_png(gpt_ckpt, tmp_path, capsys, layer, head):
    from attnlab.checkpoint import load_checkpoint, load_checkpoint_tokenizer

    args = ["--ckpt", gpt_ckpt, "--out", tmp_path]
    args += ["--layer", layer] if layer is not None else []
    args += ["--head", head] if head is not None else []
    code, out, err = run_show(capsys, *args)
    assert code == 0, err
    # both output paths are printed
    assert out.splitlines() == [f"wrote {tmp_path / 'attention.png'}",
                                f"wrote {tmp_path / 'attention.html'}"]
    tokens, attentions = viz.capture(load_checkpoint(gpt_ckpt),
                                     load_checkpoint_tokenizer(gpt_ckpt), SHOW_TEXT)
    layers_ = range(2) if layer is None else [layer]
    heads = list(range(3)) if head is None else [head]
    causal = np.tril(np.ones((len(tokens), len(tokens)), bool))  # the future is drawn grey
    if layer is not None and head is not None:  # one head, titled with its layer and head
        fig = viz.heatmap(attentions[layer][head], tokens, mask=causal)
        fig.axes[0].set_title(f"layer {layer}, head {head}", fontsize=10)
        want = png_pixels(fig)
    else:
        viz.save_heatmaps(tmp_path / "want.png", tokens, [attentions[i][heads] for i in layers_],
                          layer_ids=list(layers_), head_ids=heads,  # rows say which layer
                          mask=causal)
        want = png_pixels(tmp_path / "want.png")
    got = png_pixels(tmp_path / "attention.png")
    assert got.shape == want.shape and np.array_equal(got, want)
    # the explorer keeps every layer and head whatever the PNG shows
    _, weights = decode((tmp_path / "attention.html").read_text("utf-8"))
    assert weights.shape == (2, 3, len(tokens), len(tokens))


def test_show_single_head_png_is_that_head(gpt_ckpt, tmp_path, capsys):
    """--layer 1 --head 2 draws layer 1's head 2, not some other head."""
    for head in (1, 2):
        code, _, err = run_show(capsys, "--ckpt", gpt_ckpt, "--out", tmp_path / str(head),
                                "--layer", 1, "--head", head)
        assert code == 0, err
    a, b = (png_pixels(tmp_path / str(h) / "attention.png") for h in (1, 2))
    assert a.shape == b.shape and not np.array_equal(a, b)


@pytest.mark.parametrize("args, option, valid", [
    (["--layer", 2], "--layer", "[0, 1]"),
    (["--layer", -1], "--layer", ">= 0"),  # refused at parse time, before the model loads
    (["--head", 3], "--head", "[0, 2]"),
    (["--layer", 0, "--head", 7], "--head", "[0, 2]"),
])
def test_show_out_of_range_layer_or_head_is_a_one_line_error(gpt_ckpt, tmp_path, capsys,
                                                             args, option, valid):
    code, out, err = run_show(capsys, "--ckpt", gpt_ckpt, "--out", tmp_path / "o", *args)
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert option in err and valid in err and str(args[-1]) in err
    assert err.startswith("attnlab show: error:")
    assert not (tmp_path / "o").exists()  # nothing half-written
