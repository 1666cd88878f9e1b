"""The explorer's diff mode, head labels, exports and a 2,000-token page, in a real headless
Chromium (the fixtures of test_explorer_browser: the system chromium, every request recorded,
anything off disk refused)."""

from __future__ import annotations

import base64
import math
import statistics
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch
from test_explorer_browser import browser, decode_png, matrix_pixel, open_page  # noqa: F401

from attnlab import viz
from attnlab.models import GPT, GPTConfig
from attnlab.text import CharTokenizer, WordTokenizer
from attnlab.viz.align import difference

pytestmark = pytest.mark.slow

WORDS = ["the", "cat", "dog", "sat", "on", "a", "mat", "big"]
LABELS = [["previous-token 0.98", "sink 0.71", "other (self 0.12)", "induction 0.55"],
          ["duplicate-token 0.40", "self 0.93", "sink 0.88", "previous-token 0.61"]]


@pytest.fixture(scope="module")
def compared():
    tok = WordTokenizer(WORDS)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=16, d_model=32,
                          num_layers=2, num_heads=4)).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.W_query.weight.mul_(8)
    return viz.compare(model, tok, "the big cat sat on the mat", "the dog sat on a mat",
                       head_labels=LABELS)


def quantised_diff(found) -> np.ndarray:
    """A - B as the page holds it: each weight a byte, the difference of the bytes."""
    return difference(np.rint(found.a * 255), np.rint(found.b * 255), found.align)


def test_diff_mode_draws_a_minus_b_where_the_tokens_align(tmp_path, open_page, compared):  # noqa: F811
    o = open_page(compared.explorer.save(tmp_path / "c.html"))
    page = o.page
    layer, head = compared.layer, compared.head
    assert page.evaluate("document.body.dataset.mode") == "a"
    assert page.is_visible("#compare") and page.is_visible("#mode-select")
    page.click(f'.thumb[data-layer="{layer}"][data-head="{head}"]')
    before = page.evaluate("document.querySelector('.thumb').toDataURL()")
    page.select_option("#mode-select", "diff")
    assert page.evaluate("document.body.dataset.mode") == "diff"
    caption = f"layer {layer} \u00b7 head {head} \u00b7 A \u2212 B"
    assert page.text_content("#matrix-caption") == caption
    assert page.evaluate("document.querySelector('.thumb').toDataURL()") != before
    d = quantised_diff(compared)[layer, head]
    hi = tuple(int(x) for x in np.unravel_index(np.nanargmax(d), d.shape))
    lo = tuple(int(x) for x in np.unravel_index(np.nanargmin(d), d.shape))
    red, blue = matrix_pixel(page, *hi), matrix_pixel(page, *lo)
    assert d[hi] > 0 > d[lo] and red[0] > red[2] and blue[2] > blue[0]
    assert matrix_pixel(page, 3, 1) == [232, 232, 232]  # "big" (key 1) has no partner
    assert matrix_pixel(page, 0, 4) == [200, 200, 200]  # the future: masked
    # hovering a cell reads A, B and their difference, as the page holds them
    page.locator("#matrix").scroll_into_view_if_needed()
    box = page.evaluate("(() => { const c = document.getElementById('matrix'), d = c.dataset,"
                        " r = c.getBoundingClientRect(); return [r.left + +d.left, r.top + +d.top,"
                        " +d.cell]; })()")
    i, j = hi
    page.mouse.move(box[0] + (j + 0.5) * box[2], box[1] + (i + 0.5) * box[2])
    said = page.text_content("#info")
    a_byte = np.rint(compared.a[layer, head, i, j] * 255)
    assert f"A{a_byte / 255:.3f}" in said and f"A \u2212 B+{d[hi] / 255:.3f}" in said
    # the head view: a query's lines coloured by sign, red where A attends more
    page.hover(f'#head-view .tok.q[data-i="{i}"]')
    strokes = page.evaluate("[...document.querySelectorAll('#head-view g.row.on line')]"
                            ".map(l => [+l.dataset.k, l.getAttribute('stroke')])")
    assert (int(j), "#b2182b") in [tuple(s) for s in strokes]
    # side by side: A and B each on its own tokens, the difference on A's
    sizes = page.evaluate("['#cmp-a', '#cmp-b', '#cmp-diff'].map(s => "
                          "[document.querySelector(s).width, document.querySelector(s).height])")
    assert sizes == [[7, 7], [6, 6], [7, 7]]
    page.locator("body").press("d")
    assert page.evaluate("document.body.dataset.mode") == "a"
    assert o.errors == [] and o.off_disk == []


def test_each_head_is_labelled_with_what_it_does(tmp_path, open_page, compared):  # noqa: F811
    page = open_page(compared.explorer.save(tmp_path / "c.html")).page
    page.click('.thumb[data-layer="1"][data-head="2"]')
    assert page.text_content("#head-label") == "L1 H2: sink 0.88"
    assert page.get_attribute('.head-toggle[data-head="3"]', "title").startswith(
        "L1 H3: previous-token 0.61")
    kinds = page.eval_on_selector_all("#overview .kind", "ks => ks.map(k => k.textContent)")
    assert kinds == ["prev 0.98", "sink 0.71", "other", "ind 0.55",
                     "dup 0.40", "self 0.93", "sink 0.88", "prev 0.61"]


def _decoded(url: str) -> bytes:
    head, body = url.split(",", 1)
    if head.endswith(";base64"):
        return base64.b64decode(body)
    from urllib.parse import unquote

    return unquote(body).encode("utf-8")


def test_every_view_exports_as_png_and_svg(tmp_path, open_page, compared):  # noqa: F811
    o = open_page(compared.explorer.save(tmp_path / "c.html"))
    page = o.page
    for view in ("head", "matrix", "overview", "compare"):
        for fmt in ("png", "svg"):
            url = page.evaluate(f"window.attnlabExport('{view}', '{fmt}')")
            data = _decoded(url)
            if fmt == "png":
                assert url.startswith("data:image/png;base64,")
                img = decode_png(data)
                assert img.shape[0] > 20 and img.shape[1] > 20 and img.std() > 0.02, view
            else:
                assert url.startswith("data:image/svg+xml")
                root = ET.fromstring(data)
                assert root.tag.endswith("svg"), view
                texts = "".join(root.itertext())
                assert {"head": "mat", "matrix": "layer", "overview": "prev 0.98",
                        "compare": "the dog sat on a mat"}[view] in texts, view
    with page.expect_download() as download:  # the button saves the same picture as a file
        page.click('.export[data-view="matrix"] button[data-format="png"]')
    saved = download.value
    assert saved.suggested_filename == "attnlab-matrix-L0-H0.png"
    assert saved.path().read_bytes()[:4] == b"\x89PNG"
    assert o.errors == [] and o.off_disk == []


# --------------------------------------------------------------- a long input: 2,000 tokens

HOVER = """async ([sel, event]) => {  // ms from the event to the second frame after it
    const target = document.querySelector(sel);
    const frame = () => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
    const t0 = performance.now();
    target.dispatchEvent(new MouseEvent(event));
    await frame();
    const ms = performance.now() - t0;
    target.dispatchEvent(new MouseEvent('mouseleave'));
    await frame();
    return ms;
}"""


def test_a_2000_token_page_is_under_10_mb_and_answers_a_hover_in_200_ms(tmp_path, open_page):  # noqa: F811
    letters = "abcdefghij"
    text = "".join(np.random.default_rng(0).choice(list(letters), size=2000))
    tok = CharTokenizer.from_text(letters)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=2048, d_model=32,
                          num_layers=2, num_heads=4, positions="rope")).eval()
    with torch.no_grad():  # sharp rows: the 16 kept keys hold about 80% of their weight
        for block in model.blocks:
            block.attn.W_query.weight.mul_(20)
            block.attn.W_key.weight.mul_(20)
    shown = viz.show_attention(model, tok, text, tmp_path / "long")
    size = shown["html"].stat().st_size
    assert size < 10 * 1024 * 1024
    o = open_page(shown["html"])
    page = o.page
    assert "each row's 16 strongest keys" in page.text_content("#meta")
    assert page.text_content("#left-out").startswith("Left out of this page: each of the 2,000")
    assert "hold 80% of a row's weight on average" in page.text_content("#left-out")
    times = {"query": [], "key": [], "cell": []}
    for n in (3, 700, 1400, 1999, 1000):
        times["query"].append(page.evaluate(HOVER, [f'#head-view .tok.q[data-i="{n}"]',
                                                    "mouseenter"]))
        times["key"].append(page.evaluate(HOVER, [f'#head-view .tok.k[data-j="{n}"]',
                                                  "mouseenter"]))
    box = page.evaluate("(() => { const c = document.getElementById('matrix'), d = c.dataset,"
                        " r = c.getBoundingClientRect(); return [r.left + +d.left,"
                        " r.top + +d.top, +d.cell]; })()")
    for i, j in ((10, 5), (900, 450), (1990, 1000)):
        times["cell"].append(page.evaluate(
            """async ([x, y]) => { const c = document.getElementById('matrix');
               const frame = () => new Promise(r => requestAnimationFrame(() =>
                   requestAnimationFrame(r)));
               const t0 = performance.now();
               c.dispatchEvent(new MouseEvent('mousemove', {clientX: x, clientY: y}));
               await frame(); return performance.now() - t0; }""",
            # whole pixels, as a mouse gives them: the first one inside the cell
            [math.ceil(box[0] + j * box[2]), math.ceil(box[1] + i * box[2])]))
        assert f"query #{i}" in page.text_content("#info") and f"key #{j}" in \
            page.text_content("#info")
    print(f"\n2,000 tokens, 2 layers x 4 heads: page {size / 1e6:.2f} MB; hover ms (to the "
          "second frame after the event): " + ", ".join(
              f"{k} median {statistics.median(v):.0f} max {max(v):.0f}" for k, v in times.items()))
    assert max(max(v) for v in times.values()) < 200
    # the hovered row's lines are the kept keys it has (those above ~1%)
    page.hover('#head-view .tok.q[data-i="1500"]')
    assert "query #1500" in page.text_content("#info")
    lines = page.evaluate("[...document.querySelectorAll('#head-view line')]"
                          ".map(l => +l.dataset.k)")
    assert 0 < len(lines) <= 16 * len(page.evaluate("document.body.dataset.heads").split(","))
    assert all(k <= 1500 for k in lines)  # causal: nothing after the query
    assert o.errors == [] and o.off_disk == []
