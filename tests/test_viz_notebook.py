"""The explorer in notebooks: an object Jupyter shows inline, one isolated frame per explorer."""

from __future__ import annotations

import html
import re

import numpy as np
import pytest
from test_explorer_browser import browser, model  # noqa: F401  (a fixture)

from attnlab import viz

TOKENS = ["注意", "力", "让", "模型", "␣cat", "😀"]
SRCDOC = re.compile(r'<iframe srcdoc="([^"]*)" sandbox="allow-scripts allow-downloads"')


def test_explorer_object_displays_as_an_isolated_offline_frame():
    e = viz.explorer(TOKENS, model(2, 3, 6, 6), title="<b>t</b>")
    frame = e._repr_html_()
    m = SRCDOC.match(frame)
    assert m is not None  # the whole page is in the attribute, escaped
    assert html.unescape(m.group(1)) == e.html == viz.render_html(TOKENS, model(2, 3, 6, 6),
                                                                     title="<b>t</b>")
    assert "http://" not in frame and "https://" not in frame
    assert "<script" not in frame.replace(m.group(0), "")  # nothing runs outside the frame


def test_explorer_checks_its_input_at_once():
    with pytest.raises(ValueError, match="tokens: expected 6 tokens"):
        viz.explorer(TOKENS[:5], model(1, 1, 6, 6))


def test_show_attention_result_displays_as_the_explorer(tmp_path):
    import torch

    from attnlab.models import GPT, GPTConfig
    from attnlab.text import CharTokenizer

    tok = CharTokenizer.from_text("注意力 cat")
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=16, d_model=16, num_layers=1,
                        num_heads=2))
    result = viz.show_attention(gpt, tok, "注意力 cat", tmp_path)
    assert set(result) == {"png", "html"}  # still the dict of paths
    assert html.unescape(SRCDOC.match(result._repr_html_()).group(1)) == \
        result["html"].read_text("utf-8")


STATE = "[document.body.dataset.layer, document.body.dataset.head, document.title]"


@pytest.mark.slow
def test_two_explorers_on_one_page_each_answer_their_own_clicks(tmp_path, notebook_page):
    atts = model(2, 3, 6, 6)
    atts[1][2] = np.eye(6)
    cells = [viz.explorer(TOKENS, atts, title="first"), viz.explorer(TOKENS, atts, title="second")]
    path = tmp_path / "notebook.html"  # what Jupyter does: the reprs, one after the other
    path.write_text("<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>"
                    + "".join(f"<div class='cell'>{c._repr_html_()}</div>" for c in cells)
                    + "</body></html>", encoding="utf-8")
    page, (one, two), errors, requests = notebook_page(path)
    assert one.evaluate(STATE) == ["0", "0", "first"]
    assert two.evaluate(STATE) == ["0", "0", "second"]
    one.click('.thumb[data-layer="1"][data-head="2"]')
    assert one.evaluate(STATE) == ["1", "2", "first"]
    assert two.evaluate(STATE) == ["0", "0", "second"]  # untouched by the other's click
    two.click('.thumb[data-layer="0"][data-head="1"]')
    assert two.evaluate(STATE) == ["0", "1", "second"] and one.evaluate(STATE)[:2] == ["1", "2"]
    # each frame drew its own matrix: the identity (layer 1, head 2) only in the first
    shots = [f.evaluate("document.getElementById('matrix').toDataURL()") for f in (one, two)]
    assert shots[0] != shots[1]
    assert one.locator("#head-view line").count() == 6  # one line per query, i -> i
    labels = one.evaluate("[...document.querySelectorAll('#head-view .tok.k text')]"
                          ".map(t => t.firstChild.nodeValue)")
    assert labels == TOKENS
    assert errors == []
    assert [u for u in requests if not u.startswith(("file:", "data:", "about:"))] == []


@pytest.fixture
def notebook_page(browser):  # noqa: F811
    contexts = []

    def open_(path):
        context = browser.new_context(viewport={"width": 1280, "height": 1800})
        contexts.append(context)
        page = context.new_page()
        errors, requests = [], []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        context.on("request", lambda r: requests.append(r.url))
        page.goto(path.as_uri())
        frames = [f for f in page.frames if f is not page.main_frame]
        for f in frames:
            f.wait_for_function("document.body.dataset.ready === '1'", timeout=20_000)
        return page, frames, errors, requests

    yield open_
    for c in contexts:
        c.close()
