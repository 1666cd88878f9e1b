"""Every script in every picture: CJK, kana, hangul, emoji and Latin labels draw real glyphs.

Needs a CJK font (Debian: fonts-noto-cjk) and a monochrome emoji font (fonts-symbola),
which .ci/install-chromium installs; without them the tests are skipped, unless CI is
set, where a missing font is a failure.
"""

from __future__ import annotations

import io
import os
import warnings

import matplotlib
import matplotlib.image as mpimg
import numpy as np
import pytest

from attnlab import viz
from attnlab.viz import fonts
from attnlab.viz.heatmap import png_bytes

SENTENCE = list("注意力机制让模型学会关注重要的词。")
MIXED = ["注意", "機制", "日本語", "カタカナ", "한국어", "😀", "🚀", "cat", "␣dog", "<0xE6>"]
NO_GLYPH = "\U0010fffd"  # a private-use code point no font draws: its picture is the empty box


def _need(names):
    have = fonts.label_fonts()
    if not any(n in have for n in names):
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but none of {names} is installed; run .ci/install-chromium")
        pytest.skip(f"none of {names} installed (Debian: apt install fonts-noto-cjk fonts-symbola)")


@pytest.fixture
def cjk_fonts():
    _need(fonts._CJK)
    _need(fonts._EMOJI)


def weights(n):
    w = np.tril(np.ones((n, n)))
    return w / w.sum(1, keepdims=True)


def render(text: str) -> np.ndarray:
    """``text`` drawn alone with attnlab's label fonts: a grey image, ink = 1."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with fonts.font_context([text]), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the NO_GLYPH reference warns by design
        fig = Figure(figsize=(1.2, 0.5), dpi=100)
        canvas = FigureCanvasAgg(fig)
        fig.text(0.05, 0.5, text, fontsize=20, va="center")
        canvas.draw()
        rgba = np.asarray(canvas.buffer_rgba())
    return 1.0 - rgba[..., :3].mean(-1) / 255.0


def glyph_warnings(record):
    return [str(w.message) for w in record if "missing from font" in str(w.message)]


def test_a_chinese_heatmap_draws_every_label_without_glyph_warnings(cjk_fonts):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fig = viz.heatmap(weights(len(SENTENCE)), SENTENCE)
        png = png_bytes(fig)
    assert glyph_warnings(record) == []
    assert mpimg.imread(io.BytesIO(png), format="png").std() > 0.05
    assert fonts.missing_characters(SENTENCE) == []


@pytest.mark.parametrize("label", MIXED + SENTENCE[:4])
def test_each_label_is_ink_and_not_the_empty_box(cjk_fonts, label):
    tofu = render(NO_GLYPH)
    for ch in label:
        drawn = render(ch)
        assert drawn.sum() > 5, f"{ch!r} drew nothing"
        assert np.abs(drawn - tofu).sum() > 0.1 * tofu.sum(), f"{ch!r} is drawn as the empty box"


def test_the_grid_of_every_script_has_no_glyph_warning(cjk_fonts, tmp_path):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        viz.save_heatmaps(tmp_path / "g.png", MIXED, [np.stack([weights(len(MIXED))] * 2)])
    assert glyph_warnings(record) == []
    assert (tmp_path / "g.png").stat().st_size > 1000


def test_the_comparison_of_two_chinese_sentences_has_no_glyph_warning(cjk_fonts):
    """Its axes were made before the fonts were set, so their tick labels and titles
    kept DejaVu Sans alone: 50 warnings and empty boxes for every Chinese label."""
    from attnlab.viz.compare import compare_figure

    a, b = list("我喜欢蓝色的天空"), [*"我喜欢红色的天空", "😀"]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fig = compare_figure(a, weights(len(a))[None, None], b, weights(len(b))[None, None],
                             layer=0, head=0, titles=("".join(a), "".join(b)))
        png_bytes(fig)
    assert glyph_warnings(record) == []


def test_the_reference_box_really_is_what_a_missing_glyph_looks_like():
    """A check on the check: with DejaVu Sans alone a Chinese character is the box."""
    dejavu = fonts._charmap("DejaVu Sans")
    assert ord("注") not in dejavu and fonts.missing_characters(["注"], ["DejaVu Sans"]) == ["注"]


def test_the_callers_rcparams_are_left_as_they_were():
    before = list(matplotlib.rcParams["font.family"])
    viz.heatmap(weights(3), ["注", "意", "a"])
    assert list(matplotlib.rcParams["font.family"]) == before


def test_without_a_cjk_font_one_line_names_the_package_and_the_picture_is_written(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fonts, "label_fonts", lambda: ("DejaVu Sans",))
    monkeypatch.setattr(fonts, "_hinted", False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        viz.save_heatmaps(tmp_path / "a.png", SENTENCE, [weights(len(SENTENCE))[None]])
        viz.save_heatmaps(tmp_path / "b.png", SENTENCE, [weights(len(SENTENCE))[None]])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1  # once per process, not once per glyph or per picture
    assert "fonts-noto-cjk" in err[0] and "macOS" in err[0] and "Windows" in err[0]
    assert glyph_warnings(record) == []
    assert (tmp_path / "a.png").stat().st_size > 1000


def test_a_grid_of_one_chosen_layer_is_numbered_as_that_layer_with_readable_labels():
    fig = viz.heatmap_grid(SENTENCE, [np.stack([weights(len(SENTENCE))] * 2)],
                           layer_ids=[3], head_ids=[1, 2])
    cells = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert cells[0].get_ylabel() == "layer 3"
    assert [ax.get_title() for ax in cells] == ["head 1", "head 2"]
    sizes = {t.get_fontsize() for t in cells[0].get_yticklabels()}
    assert min(sizes) >= 7.0  # 18 CJK labels stay legible
    with pytest.raises(ValueError, match="layer_ids: expected 1 numbers"):
        viz.heatmap_grid(SENTENCE, [weights(len(SENTENCE))[None]], layer_ids=[1, 2])


def test_single_character_labels_stand_upright_and_words_turn():
    ax = next(a for a in viz.heatmap(weights(4), list("注意力机")).axes
              if a.get_label() != "<colorbar>")
    assert {t.get_rotation() for t in ax.get_xticklabels()} == {0.0}
    ax = next(a for a in viz.heatmap(weights(2), ["注意力", "cat"]).axes
              if a.get_label() != "<colorbar>")
    assert {t.get_rotation() for t in ax.get_xticklabels()} == {90.0}


def test_an_english_lesson_picture_asks_for_no_cjk_font(monkeypatch, capsys):
    """A lesson's heatmap asked for the Chinese axis names whatever its language: English
    lessons told the user to install CJK fonts their pictures do not need."""
    from attnlab.lessons import kit

    monkeypatch.setattr(fonts, "label_fonts", lambda: ("DejaVu Sans",))
    monkeypatch.setattr(fonts, "_hinted", False)
    monkeypatch.setitem(kit._STATE, "lang", "en")
    kit.heatmap(weights(3), ["a", "b", "c"], title="three")
    assert capsys.readouterr().err == ""
    monkeypatch.setitem(kit._STATE, "lang", "zh")
    kit.heatmap(weights(3), ["a", "b", "c"], title="three")
    assert "fonts-noto-cjk" in capsys.readouterr().err
