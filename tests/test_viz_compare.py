"""Two sentences side by side: how tokens pair up (fewest edits), the difference where they
do (against the weights of each sentence captured on its own), the picture, and `attnlab show
--compare` on a folder written by transformers' save_pretrained."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from attnlab import viz  # noqa: E402
from attnlab.cli import main  # noqa: E402
from attnlab.models import GPT, GPTConfig  # noqa: E402
from attnlab.text import WordTokenizer  # noqa: E402
from attnlab.viz.align import align_tokens, difference  # noqa: E402

WORDS = ["the", "cat", "dog", "sat", "on", "a", "mat", "big", "ran"]


def test_tokens_pair_up_by_the_fewest_edits():
    assert align_tokens(["the", "cat", "sat"], ["the", "dog", "sat"]) == [0, 1, 2]
    assert align_tokens(["the", "big", "cat", "sat"], ["the", "cat", "sat"]) == [0, -1, 1, 2]
    assert align_tokens(["the", "cat", "sat"], ["the", "big", "cat", "sat"]) == [0, 2, 3]
    # two for one: the later one is the substitute (cat for dog), the earlier has no partner
    assert align_tokens(["the", "big", "cat", "sat"], ["the", "dog", "sat"]) == [0, -1, 1, 2]
    assert align_tokens(["a"], ["b"]) == [0] and align_tokens(["a", "b"], ["c"]) == [-1, 0]
    # an insertion and a deletion cost less than three substitutions
    down = ["the", "cat", "sat", "down"]
    assert align_tokens(["the", "big", "cat", "sat"], down) == [0, -1, 1, 2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from("abcd"), min_size=1, max_size=10),
       st.lists(st.sampled_from("abcd"), min_size=1, max_size=10), st.data())
def test_pairs_keep_the_order_and_one_word_swapped_pairs_everything(a, b, data):
    pairs = [(i, p) for i, p in enumerate(align_tokens(a, b)) if p >= 0]
    assert all(p1 < p2 for (_, p1), (_, p2) in zip(pairs, pairs[1:]))  # order is kept
    assert align_tokens(a, a) == list(range(len(a)))
    swapped = list(a)  # "the cat sat" / "the dog sat": one token for a new one
    swapped[data.draw(st.integers(0, len(a) - 1))] = "z"
    assert align_tokens(a, swapped) == list(range(len(a)))
    paired = sum(p >= 0 for p in align_tokens(a, b))  # edits = unpaired + substituted
    substituted = sum(p >= 0 and a[i] != b[p] for i, p in enumerate(align_tokens(a, b)))
    edits = (len(a) - paired) + (len(b) - paired) + substituted
    assert edits == levenshtein(a, b)


def levenshtein(a, b) -> int:
    """The edit distance, recursively (an independent statement of the same number)."""
    import functools

    @functools.cache
    def d(i, j):
        if not i or not j:
            return i + j
        return min(d(i - 1, j - 1) + (a[i - 1] != b[j - 1]), d(i - 1, j) + 1, d(i, j - 1) + 1)

    return d(len(a), len(b))


def test_the_difference_is_a_minus_its_partners_cells_and_nan_without_one():
    a = np.arange(16, dtype=float).reshape(1, 1, 4, 4) / 16
    b = np.arange(9, dtype=float).reshape(1, 1, 3, 3) / 9
    d = difference(a, b, [0, -1, 1, 2])[0, 0]  # token 1 of a has no partner
    assert np.isnan(d[1]).all() and np.isnan(d[:, 1]).all()
    for i, pi in ((0, 0), (2, 1), (3, 2)):
        for j, pj in ((0, 0), (2, 1), (3, 2)):
            assert d[i, j] == pytest.approx(a[0, 0, i, j] - b[0, 0, pi, pj])
    with pytest.raises(ValueError, match="align: expected 4 partner"):
        difference(a, b, [0, 1])


@pytest.fixture(scope="module")
def small():
    tok = WordTokenizer(WORDS)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=16, d_model=32,
                          num_layers=2, num_heads=4)).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.W_query.weight.mul_(6)
    return model, tok


def test_compare_holds_each_texts_own_weights_and_picks_the_head_that_differs_most(small):
    model, tok = small
    found = viz.compare(model, tok, "the big cat sat on the mat", "the dog sat on a mat")
    _, a = viz.capture(model, tok, "the big cat sat on the mat")
    _, b = viz.capture(model, tok, "the dog sat on a mat")
    a, b = np.stack([x.numpy() for x in a]), np.stack([x.numpy() for x in b])
    np.testing.assert_allclose(found.a, a, atol=1e-6)
    np.testing.assert_allclose(found.b, b, atol=1e-6)
    assert found.align == [0, -1, 1, 2, 3, 4, 5]  # "big" has none, "cat" pairs with "dog"
    assert found.diff[1, 2, 6, 3] == pytest.approx(a[1, 2, 6, 3] - b[1, 2, 5, 2], abs=1e-6)
    mean_abs = np.nanmean(np.abs(found.diff), axis=(-2, -1))
    assert (found.layer, found.head) == np.unravel_index(np.argmax(mean_abs), mean_abs.shape)
    fig = found.figure(1, 3)
    assert [ax.get_title() for ax in fig.axes[:3]] == [
        "the big cat sat on the mat", "the dog sat on a mat",
        "the big cat sat on the mat \u2212 the dog sat on a mat (light grey: no partner)"]
    html = found._repr_html_()
    assert html.startswith("<iframe") and "&quot;compare&quot;:{" in html
    assert viz.compare(model, tok, "the cat", "the dog", layer=1).layer == 1
    # a head asked for: the layer where that head differs most (helper-found: the layer
    # came from every head's difference)
    for head in range(mean_abs.shape[1]):
        found = viz.compare(model, tok, "the big cat sat on the mat", "the dog sat on a mat",
                            head=head)
        assert (found.layer, found.head) == (int(np.argmax(mean_abs[:, head])), head)


def payload_of(path) -> dict:
    return json.loads(path.read_text().split('id="attnlab-data">')[1].split("</script>")[0])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    import transformers as T
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("hf") / "llama"
    vocab = ["<unk>", *WORDS]
    torch.manual_seed(0)
    T.LlamaForCausalLM(T.LlamaConfig(vocab_size=len(vocab), hidden_size=32,
                                     intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=32)).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_show_compare_writes_the_picture_and_a_page_with_both_inputs(llama_dir, tmp_path,
                                                                      capsys):
    out = tmp_path / "c"
    assert main(["show", "the cat sat", "--compare", "the dog sat", "--model", str(llama_dir),
                 "--layer", "1", "--head", "2", "--format", "svg", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "the picture shows layer 1, head 2\n" in printed
    assert (out / "attention.svg").read_text().startswith("<?xml")
    page = payload_of(out / "attention.html")
    assert page["compare"]["tokens"] == ["the", "dog", "sat"]
    assert page["compare"]["align"] == [0, 1, 2] and page["compare"]["title"] == "the dog sat"
    assert page["compare"]["label"] == "the cat sat"
    assert main(["show", "the cat sat", "--compare", "the dog sat", "--model", str(llama_dir),
                 "--out", str(out)]) == 0
    assert "(the one whose weights differ most)" in capsys.readouterr().out
    assert main(["show", "the cat sat", "--compare", "the dog sat", "--model", str(llama_dir),
                 "--head", "1", "--out", str(out)]) == 0
    assert "head 1 (the layer where that head's weights differ most)" in capsys.readouterr().out
    assert main(["show", "the cat", "--compare", "the dog", "--rollout", "--model",
                 str(llama_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["attnlab show: error: --rollout and --compare: one at a time"]


def test_a_character_the_tokenizer_lacks_is_named_in_the_text_it_came_from():
    from attnlab.text import CharTokenizer

    tok = CharTokenizer.from_text("abc ")
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=16, d_model=16,
                          num_layers=1, num_heads=2)).eval()
    with pytest.raises(ValueError, match=r"^--compare: .*'z'"):
        viz.compare(model, tok, "ab c", "ab z")
    with pytest.raises(ValueError, match=r"^(?!--compare).*'z'"):
        viz.compare(model, tok, "ab z", "ab c")


def test_one_head_drawn_alone_says_which_it_is(small):
    # Helper-found: `show --layer 1 --head 2` drew one matrix with no layer or head on it.
    from attnlab.viz.show import _show

    model, tok = small
    fig, _ = _show(model, tok, "the dog sat on a mat", 1, 2, "t", False, None, None, None)
    assert fig.axes[0].get_title() == "layer 1, head 2"


def test_a_long_texts_page_is_titled_with_its_start_only():
    # Helper-found: an 891-token text was the whole <h1> and <title> of its page.
    from attnlab.viz.show import _heading

    assert _heading("the cat sat") == "the cat sat"
    long = "注意力 " * 100
    assert _heading(long) == ("注意力 " * 20)[:79].rstrip() + "\u2026" and len(_heading(long)) <= 80
