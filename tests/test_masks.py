"""attnlab.masks: builders, conversions and combination, checked element by element."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab import masks


@given(q_len=st.integers(1, 12), k_len=st.integers(1, 12))
def test_causal_end_aligned(q_len, k_len):
    m = masks.causal(q_len, k_len)
    for i in range(q_len):
        for j in range(k_len):
            assert bool(m[i, j]) == (j <= i + k_len - q_len)


@given(q_len=st.integers(1, 10), k_len=st.integers(1, 10), window=st.integers(1, 6))
def test_sliding_window_band_and_causal_window(q_len, k_len, window):
    band = masks.sliding_window(q_len, k_len, window)
    both = masks.combine(band, masks.causal(q_len, k_len))
    for i in range(q_len):
        p = i + k_len - q_len
        for j in range(k_len):
            assert bool(band[i, j]) == (p - window < j < p + window)
            assert bool(both[i, j]) == (p - window < j <= p)


def test_padding_and_from_attention_mask_agree():
    pad = masks.padding([2, 4, 0], 4)
    assert pad.shape == (3, 1, 1, 4)
    assert pad[:, 0, 0].int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    tok = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert torch.equal(masks.from_attention_mask(tok), pad)
    torch_style = ~pad[:, 0, 0]  # nn.MultiheadAttention: True = ignore
    assert torch.equal(masks.from_attention_mask(torch_style, masked_is_true=True), pad)


def test_combine_bool_and_float():
    a = torch.tensor([[True, False], [True, True]])
    b = torch.tensor([[True, True], [False, True]])
    assert masks.combine(a, b).tolist() == [[True, False], [False, True]]
    f = torch.tensor([[0.5, 0.0], [1.0, 2.0]])
    got = masks.combine(a, None, f)
    assert got.tolist() == [[0.5, float("-inf")], [1.0, 2.0]]
    assert masks.combine(None, None) is None


def test_describe_draws_the_mask():
    text = masks.describe(masks.causal(3))
    assert text.splitlines() == [
        "mask 3x3: 6/9 allowed (# = may attend)", "q0  #..", "q1  ##.", "q2  ###"]


@pytest.mark.parametrize("call, exc, words", [
    (lambda: masks.causal(0), ValueError, ["q_len", "positive", "0"]),
    (lambda: masks.sliding_window(4, 4, 0), ValueError, ["window", "0"]),
    (lambda: masks.padding([5], 4), ValueError, ["lengths", "seq_len=4", "[5]"]),
    (lambda: masks.from_attention_mask(torch.tensor([[0, 2]])), ValueError, ["0 and 1", "2"]),
    (lambda: masks.from_attention_mask(torch.ones(2, 3)), TypeError, ["float"]),
    (lambda: masks.combine(torch.ones(2, dtype=torch.int32)), TypeError, ["int32"]),
])
def test_bad_input(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for w in words:
        assert w in str(info.value)
