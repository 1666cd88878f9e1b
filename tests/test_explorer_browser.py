"""The HTML explorer in a real headless Chromium (Playwright driving the system chromium).

Skipped only when no chromium binary exists and CI is unset; under CI a missing
browser fails (install it with .ci/install-chromium).
"""

from __future__ import annotations

import io
import os
import pathlib
import shutil
from dataclasses import dataclass, field

import matplotlib.image as mpimg
import numpy as np
import pytest

from attnlab import viz

pytestmark = pytest.mark.slow

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
TOKENS = ["The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "because", "it",
          "was"]
XSS_TOKENS = ["<s>", "<img src=x onerror=window.__xss=1>",
              "</script><script>window.__xss=2</script>", "<script>window.__xss=3</script>",
              "a & b", "\u2028", " ", "\n"]
XSS_TITLE = "</title><script>window.__xss=4</script> <b>bold</b>"


def chromium_path() -> str | None:
    found = shutil.which("chromium")
    if found:
        return found
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None


@pytest.fixture(scope="module")
def browser():
    exe = chromium_path()
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but no chromium binary was found; run .ci/install-chromium")
        pytest.skip("no chromium binary (PATH or /usr/bin/chromium); install it with "
                    ".ci/install-chromium to run the browser tests")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        yield b
        b.close()


def softmax_rows(shape, seed=0):
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=shape) * 2.0
    q_len, k_len = shape[-2:]
    allowed = np.arange(k_len)[None, :] <= np.arange(q_len)[:, None] + (k_len - q_len)
    e = np.exp(np.where(allowed, scores, -np.inf) - scores.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def model(n_layers, n_heads, q_len, k_len):
    return [softmax_rows((n_heads, q_len, k_len), seed=i) for i in range(n_layers)]


@dataclass
class Opened:
    page: object
    errors: list[str] = field(default_factory=list)  # console errors and uncaught exceptions
    requests: list[str] = field(default_factory=list)  # every URL the page asked for

    @property
    def off_disk(self) -> list[str]:
        return [u for u in self.requests if not u.startswith(("file:", "data:", "about:"))]


@pytest.fixture
def open_page(browser):
    contexts = []

    def open_(path: pathlib.Path, width: int = 1280) -> Opened:
        context = browser.new_context(viewport={"width": width, "height": 900},
                                      device_scale_factor=1)
        contexts.append(context)
        page = context.new_page()
        opened = Opened(page)
        page.on("console", lambda m: m.type == "error" and opened.errors.append(m.text))
        page.on("pageerror", lambda e: opened.errors.append(f"pageerror: {e}"))
        page.on("request", lambda r: opened.requests.append(r.url))

        def route(r):  # let local files through, refuse (and so record) anything else
            if r.request.url.startswith(("file:", "data:")):
                r.continue_()
            else:
                r.abort()

        context.route("**/*", route)
        page.goto(path.as_uri())
        page.wait_for_function("document.body.dataset.ready === '1'", timeout=20_000)
        return opened

    yield open_
    for c in contexts:
        c.close()


def decode_png(data: bytes) -> np.ndarray:
    return mpimg.imread(io.BytesIO(data), format="png")[..., :3]


def matrix_pixel(page, i: int, j: int) -> list[int]:
    """RGB at the centre of matrix cell (query i, key j), using the canvas's own geometry."""
    return page.evaluate(
        """([i, j]) => { const c = document.getElementById('matrix'), d = c.dataset;
            const x = +d.left + (j + .5) * +d.cell, y = +d.top + (i + .5) * +d.cell;
            return Array.from(c.getContext('2d').getImageData(x, y, 1, 1).data.slice(0, 3)); }""",
        [i, j])


@pytest.mark.parametrize(("shape"), [(2, 4, 12, 12), (2, 3, 1, 12)], ids=["prefill", "decode"])
def test_explorer_loads_offline_without_errors_and_draws(tmp_path, open_page, shape):
    n_layers, n_heads, q_len, k_len = shape
    path = viz.write_html(tmp_path / "e.html", TOKENS, model(*shape), title="fox")
    o = open_page(path)
    page = o.page
    assert o.errors == [] and o.off_disk == []
    assert o.requests == [path.as_uri()]
    assert page.title() == "fox"
    assert page.locator(".thumb").count() == n_layers * n_heads
    assert page.locator(".head-toggle").count() == n_heads
    assert page.locator("#layer-select option").count() == n_layers
    assert page.locator("#head-view .tok.q").count() == q_len
    assert page.locator("#head-view .tok.k").count() == k_len
    assert page.locator("#head-view line").count() > 0
    assert page.evaluate("document.body.dataset.layer") == "0"
    assert page.evaluate("document.body.dataset.head") == "0"
    shot = decode_png(page.screenshot(full_page=True))
    colours = np.unique((shot * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 200 and shot.std() > 0.05
    matrix = decode_png(page.locator("#matrix").screenshot())
    assert matrix.std() > 0.05


def test_clicking_a_thumbnail_selects_layer_and_head_and_redraws(tmp_path, open_page):
    atts = model(2, 4, 12, 12)
    atts[1][2] = np.eye(12)  # layer 1, head 2: every token attends to itself
    o = open_page(viz.write_html(tmp_path / "e.html", TOKENS, atts))
    page = o.page
    before = page.evaluate("document.getElementById('matrix').toDataURL()")
    before_shot = page.locator("#matrix").screenshot()
    page.click('.thumb[data-layer="1"][data-head="2"]')
    assert page.evaluate("[document.body.dataset.layer, document.body.dataset.head]") == ["1", "2"]
    assert page.evaluate("document.getElementById('matrix').toDataURL()") != before
    assert page.locator("#matrix").screenshot() != before_shot
    assert page.input_value("#layer-select") == "1"
    pressed = [page.get_attribute(f'.head-toggle[data-head="{h}"]', "aria-pressed")
               for h in range(4)]
    assert pressed == ["false", "false", "true", "false"]
    assert "selected" in page.get_attribute('.thumb[data-layer="1"][data-head="2"]', "class")
    assert page.locator("#matrix-caption").text_content() == "layer 1 \u00b7 head 2"
    # the matrix shows the identity: diagonal at the top of viridis, the rest at the bottom
    assert matrix_pixel(page, 5, 5) == [253, 231, 37]
    assert matrix_pixel(page, 5, 4) == [68, 1, 84]
    # the head view now has exactly one line per query, query i -> key i, all from head 2
    lines = page.evaluate("""[...document.querySelectorAll('#head-view line')]
        .map(l => [l.dataset.q, l.dataset.k, l.dataset.h])""")
    assert lines == [[str(i), str(i), "2"] for i in range(12)]
    assert o.errors == [] and o.off_disk == []


def test_layer_select_head_toggles_and_keys_change_the_state(tmp_path, open_page):
    page = open_page(viz.write_html(tmp_path / "e.html", TOKENS, model(3, 4, 12, 12))).page
    state = "[document.body.dataset.layer, document.body.dataset.head, document.body.dataset.heads]"
    assert page.evaluate(state) == ["0", "0", "0,1,2,3"]
    page.click("#heads-solo")
    assert page.evaluate(state) == ["0", "0", "0"]
    assert {ln for ln in page.evaluate(
        "[...document.querySelectorAll('#head-view line')].map(l => l.dataset.h)")} == {"0"}
    page.select_option("#layer-select", "2")
    page.click('.head-toggle[data-head="3"]')
    assert page.evaluate(state) == ["2", "3", "0,3"]
    page.locator("body").press("ArrowUp")
    page.locator("body").press("ArrowLeft")
    assert page.evaluate(state) == ["1", "2", "2"]


def test_hovering_a_token_shows_only_its_lines(tmp_path, open_page):
    atts = model(1, 2, 12, 12)
    page = open_page(viz.write_html(tmp_path / "e.html", TOKENS, atts)).page
    visible = """[...document.querySelectorAll('#head-view line')]
        .filter(l => l.getClientRects().length > 0).map(l => [+l.dataset.q, +l.dataset.k])"""
    everything = page.evaluate(visible)
    page.hover('#head-view .tok.q[data-i="7"]')
    shown = page.evaluate(visible)
    quantised = np.rint(np.stack(atts)[0, :, 7] * 255)  # (heads, keys) of query 7
    assert len(shown) == int((quantised >= 3).sum()) > 0
    assert {q for q, _ in shown} == {7} and len(everything) > len(shown)
    assert "query #7" in page.locator("#info").text_content()
    page.hover('#head-view .tok.k[data-j="0"]')  # a key: the lines of every query into it
    assert {k for _, k in page.evaluate(visible)} == {0}
    page.mouse.move(0, 0)
    assert page.evaluate(visible) == everything


def test_tokens_and_title_stay_text(tmp_path, open_page):
    n = len(XSS_TOKENS)
    o = open_page(viz.write_html(tmp_path / "e.html", XSS_TOKENS, model(1, 2, n, n),
                                 title=XSS_TITLE))
    page = o.page
    page.click('.thumb[data-layer="0"][data-head="1"]')
    page.hover('#head-view .tok.q[data-i="1"]')
    assert page.evaluate("document.querySelectorAll('img').length") == 0
    assert page.evaluate("document.querySelectorAll('script').length") == 2
    assert page.evaluate("typeof window.__xss") == "undefined"
    assert page.title() == XSS_TITLE
    assert page.locator("h1").text_content() == XSS_TITLE
    head_text = page.locator("#head-view").text_content()
    for token in XSS_TOKENS[:5]:
        assert token in head_text  # shown verbatim, as text
    assert o.errors == [] and o.off_disk == []


def test_the_request_recorder_catches_a_network_request(tmp_path, open_page):
    """A check on the checker: an off-disk request does show up as a failure."""
    o = open_page(viz.write_html(tmp_path / "e.html", TOKENS, model(1, 1, 12, 12)))
    o.page.evaluate("""new Promise(done => { const i = new Image(); i.onerror = i.onload = done;
        i.src = 'http' + '://192.0.2.1/probe.png'; })""")
    assert o.off_disk == ["http://192.0.2.1/probe.png"]


def test_a_large_model_renders(tmp_path, open_page):
    toks = [f"tok{i}" for i in range(128)]
    o = open_page(viz.write_html(tmp_path / "big.html", toks, model(6, 12, 128, 128)))
    page = o.page
    assert page.locator(".thumb").count() == 72
    page.click('.thumb[data-layer="5"][data-head="11"]')
    assert page.evaluate("[document.body.dataset.layer, document.body.dataset.head]") == ["5", "11"]
    assert decode_png(page.locator("#matrix").screenshot()).std() > 0.02
    assert o.errors == [] and o.off_disk == []


# --------------------------------------------------------------- step by step: one score

ZH = "注意力就是一切。"


@pytest.fixture(scope="module")
def zh_model():
    """A GPT with grouped-query heads (4 query heads, 2 key/value heads) and RoPE, so the
    page's q, k must be what attention received, with the head groups mapped right."""
    import torch

    from attnlab.models import GPT, GPTConfig
    from attnlab.text import CharTokenizer

    torch.manual_seed(0)
    tok = CharTokenizer.from_text(ZH)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=16, d_model=32,
                          num_layers=2, num_heads=4, num_kv_heads=2, positions="rope")).eval()
    with torch.no_grad():  # sharper weights, so rows differ visibly
        for block in model.blocks:
            block.attn.W_query.weight.mul_(4)
    return model, tok


def python_view(model, tok, text):
    """q, k (as attention received them), the weights and the heads' outputs, from Python."""
    import torch

    from attnlab.experiments import ablated

    record: dict = {}
    with torch.no_grad(), ablated(model, None, record):
        _, weights = model(torch.tensor([tok.encode(text)]), output_attentions=True)
    return record, [w[0].double().numpy() for w in weights]


def test_step_by_step_view_shows_q_dot_k_times_scale_and_the_softmax_row(tmp_path, open_page,
                                                                         zh_model):
    model, tok = zh_model
    shown = viz.show_attention(model, tok, ZH, tmp_path / "zh")
    o = open_page(shown["html"])
    page = o.page
    record, weights = python_view(model, tok, ZH)
    for layer, head, i, j in [(1, 3, 6, 2), (0, 1, 7, 7), (1, 0, 3, 0)]:
        page.click(f'.thumb[data-layer="{layer}"][data-head="{head}"]')
        page.select_option("#steps-query", str(i))
        page.select_option("#steps-key", str(j))
        assert page.evaluate("[document.body.dataset.sq, document.body.dataset.sk]") == [
            str(i), str(j)]
        q = record["q"][layer][0, head].double().numpy()  # (seq, head_dim)
        k = record["k"][layer][0, head // 2].double().numpy()  # its key/value head
        scale = 1 / np.sqrt(q.shape[-1])
        dot = float(q[i] @ k[j])

        def number(sel):
            return float(page.get_attribute(sel, "data-value"))

        np.testing.assert_allclose(number("#steps-dot"), dot, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(number("#steps-score"), dot * scale, rtol=1e-9, atol=1e-12)
        assert page.text_content("#steps-score") == f"{dot * scale:.4f}"
        assert page.text_content("#steps-scale") == f"{scale:.4f}"
        np.testing.assert_allclose(
            [float(x) for x in page.eval_on_selector_all(
                "#steps-prod td", "tds => tds.map(t => t.dataset.value)")], q[i] * k[j],
            rtol=1e-9, atol=1e-12)
        # the softmax row is the model's row of weights; masked (future) keys are -inf
        row = page.eval_on_selector_all("#steps-row td.weight",
                                        "tds => tds.map(t => [+t.dataset.value, t.textContent])")
        np.testing.assert_allclose([v for v, _ in row], weights[layer][head, i], atol=2e-6)
        for (_, text), want in zip(row, weights[layer][head, i]):
            assert abs(float(text) - want) <= 0.5e-4 + 2e-6
        scores = page.eval_on_selector_all("#steps-row td.score",
                                           "tds => tds.map(t => t.textContent)")
        assert all((s == "\u2212\u221e") == (jj > i) for jj, s in enumerate(scores))
        np.testing.assert_allclose(number("#steps-weight"), weights[layer][head, i, j],
                                   atol=2e-6)
        # the weighted sum of the values is the head's output for that query
        D = q.shape[-1]
        out = record["context"][layer][0, i, head * D:(head + 1) * D].double().numpy()
        np.testing.assert_allclose([float(x) for x in page.eval_on_selector_all(
            "#steps-out td", "tds => tds.map(t => t.dataset.value)")], out, atol=2e-6)
    # a future key: the mask step says so
    page.select_option("#steps-query", "2")
    page.select_option("#steps-key", "5")
    assert "masked" in page.text_content("#steps-mask")
    assert float(page.get_attribute("#steps-weight", "data-value")) == 0.0
    # clicking a matrix cell picks that (query, key)
    page.click('.thumb[data-layer="0"][data-head="2"]')
    box = page.evaluate("(() => { const d = document.getElementById('matrix').dataset;"
                        " return [+d.left, +d.top, +d.cell]; })()")
    page.click("#matrix", position={"x": box[0] + 1.5 * box[2], "y": box[1] + 4.5 * box[2]})
    assert page.evaluate("[document.body.dataset.sq, document.body.dataset.sk]") == ["4", "1"]
    assert page.text_content("#steps-caption") == ("layer 0 \u00b7 head 2 \u00b7 query #4 "
                                                   "\u2192 key #1")
    assert o.errors == [] and o.off_disk == []


def test_step_by_step_view_says_why_when_the_vectors_are_missing(tmp_path, open_page):
    page = open_page(viz.write_html(tmp_path / "e.html", TOKENS, model(1, 2, 12, 12))).page
    assert "made from the weights alone" in page.text_content("#steps-body")
    assert page.evaluate("document.getElementById('steps-query').disabled")
    toks = [f"t{i}" for i in range(70)]
    q = [np.zeros((2, 70, 4))]
    page = open_page(viz.write_html(tmp_path / "long.html", toks, model(1, 2, 70, 70),
                                    steps={"q": q, "k": q, "v": q, "scale": [0.5]})).page
    assert "up to 64 tokens; this one has 70" in page.text_content("#steps-body")


def test_step_by_step_view_takes_the_models_own_scale_and_names_what_it_cannot_redo(
        tmp_path, open_page):
    # Gemma 2's query_pre_attn_scalar is a scale of the model's own: the page's softmax
    # row is the model's weights with it. ALiBi, softcapping and sinks are not recomputed
    # by the page: it says so instead of showing a softmax that contradicts the weights.
    import torch

    from attnlab.models import GPT, GPTConfig
    from attnlab.text import CharTokenizer

    tok = CharTokenizer.from_text(ZH)
    cfg = dict(vocab_size=tok.vocab_size, context_length=16, d_model=32, num_layers=1,
               num_heads=4)
    torch.manual_seed(0)
    scaled = GPT(GPTConfig(**cfg, positions="rope", attn_scale=0.6)).eval()
    o = open_page(viz.show_attention(scaled, tok, ZH, tmp_path / "scaled")["html"])
    page = o.page
    _, weights = python_view(scaled, tok, ZH)
    page.click('.thumb[data-layer="0"][data-head="1"]')
    page.select_option("#steps-query", "6")
    row = page.eval_on_selector_all("#steps-row td.weight", "tds => tds.map(t => +t.dataset.value)")
    np.testing.assert_allclose(row, weights[0][1, 6], atol=2e-6)
    assert page.text_content("#steps-scale") == "0.6000"
    assert "this model's own" in page.text_content("#steps-body")
    for extra, named in ((dict(positions="alibi"), ["ALiBi"]),
                         (dict(positions="rope", attn_softcap=5.0, sinks=True),
                          ["softcapping", "sinks"])):
        model = GPT(GPTConfig(**cfg, **extra)).eval()
        page = open_page(viz.show_attention(model, tok, ZH, tmp_path / named[0])["html"]).page
        assert all(n in page.text_content("#steps-body") for n in named)
        assert page.evaluate("document.getElementById('steps-query').disabled")
    assert o.errors == []


def test_masked_cells_are_grey_and_the_rollout_is_one_row_not_a_layer(tmp_path, open_page,
                                                                      zh_model):
    model, tok = zh_model
    shown = viz.show_attention(model, tok, ZH, tmp_path / "r", rollout=True)
    o = open_page(shown["html"])
    page = o.page
    assert page.text_content("#meta").startswith("2 layers + the rollout \u00b7 4 heads")
    assert page.locator("#layer-select option").count() == 3
    assert page.locator(".thumb").count() == 2 * 4 + 1  # the rollout drawn once
    # a future key is grey, not the colour of a weight of 0 (viridis' darkest)
    assert matrix_pixel(page, 1, 5) == [200, 200, 200]
    assert matrix_pixel(page, 5, 1) != [200, 200, 200]
    page.click('.thumb[data-layer="2"][data-head="0"]')
    assert page.locator("#matrix-caption").text_content() == "rollout"
    assert matrix_pixel(page, 1, 5) == [200, 200, 200]
    heads = {ln for ln in page.evaluate(
        "[...document.querySelectorAll('#head-view line')].map(l => l.dataset.h)")}
    assert heads == {"0"}  # one set of lines, not one per head
    assert "pick a layer" in page.text_content("#steps-body")
    assert o.errors == [] and o.off_disk == []


def test_long_labels_are_cut_to_fit_not_clipped(tmp_path, open_page):
    toks = ["supercalifragilisticexpialidocious", "注意力机制是深度学习中的重要概念"] + TOKENS[:4]
    n = len(toks)
    page = open_page(viz.write_html(tmp_path / "e.html", toks, model(1, 1, n, n))).page
    # every head-view label lies inside the svg
    inside = page.evaluate("""(() => { const s = document.getElementById('head-svg')
        .getBoundingClientRect(); return [...document.querySelectorAll('#head-svg .tok text')]
        .every(t => { const r = t.getBoundingClientRect();
                      return r.left >= s.left - 0.5 && r.right <= s.right + 0.5; }); })()""")
    assert inside
    labels = page.evaluate("[...document.querySelectorAll('#head-svg .tok.k text')]"
                           ".map(t => t.firstChild.textContent)")
    assert labels[0].endswith("\u2026") and labels[2] == "The"


def test_a_thumbnail_of_a_narrow_window_shows_its_band_not_grey(tmp_path, open_page):
    # Helper-found: a pooled thumbnail pixel was grey whenever the corner cell of its block
    # was masked, so a window narrower than a block painted every thumbnail grey.
    n, window = 900, 3  # blocks of about 7 tokens a pixel side
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    band = (j <= i) & (j > i - window)
    rng = np.random.default_rng(0)
    scores = np.where(band, rng.normal(size=(n, n)), -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    toks = [f"t{k}" for k in range(n)]
    page = open_page(viz.write_html(tmp_path / "e.html", toks, [weights[None]], mask=band)).page
    pixels = page.evaluate("""(() => { const c = document.querySelector('.thumb');
        return Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data); })()""")
    rgb = np.array(pixels, dtype=np.uint8).reshape(-1, 4)[:, :3]
    side = int(np.sqrt(len(rgb)))
    assert side < n  # pooled
    grey = (rgb == 200).all(axis=1).reshape(side, side)
    # the band is coloured along the whole diagonal; far from it stays grey
    assert not grey[np.arange(side), np.arange(side)].any()
    assert grey[side - 1, 0] and grey[0, side - 1]
