"""attnlab.masks: builders, conversions and combination, checked element by element."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab import mask_shift, masks


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


def test_shift_rows_takes_the_maximum_over_allowed_keys_in_float32():
    """The shift is each row's maximum over the keys the rule allows (a key the rule
    forbids may hold anything), computed in float32 even for a bf16 mask, and a mask
    whose row maxima the rule leaves alone keeps its broadcast shape."""
    bias = (0.3 * torch.arange(8.0)).to(torch.bfloat16)[None, None, None, :]
    shifted = mask_shift.shift_rows(bias, 8, 8, causal=True)
    assert shifted.dtype == torch.float32 and shifted.shape == (1, 1, 8, 8)
    want = bias.float() - bias.float()[..., :8].reshape(8, 1)  # row i: max at key i
    rule = masks.causal(8)
    assert torch.equal(shifted[0, 0][rule], want[0, 0][rule])
    assert (shifted <= 0).all()  # forbidden keys clamped: no +inf from finite values
    padding = torch.zeros(2, 1, 1, 8)
    padding[0, ..., 5:] = torch.finfo(torch.float32).min
    assert mask_shift.shift_rows(padding, 8, 8, causal=True).shape == (2, 1, 1, 8)
    huge = torch.zeros(3, 3)
    huge[0, 2] = 3e38  # forbidden; the allowed entries keep their values exactly
    huge[0, 0] = -3e38  # allowed alone in row 0: 3e38 - (-3e38) would overflow
    huge[1, 0] = -3e38
    out = mask_shift.shift_rows(huge, 3, 3, causal=True)
    assert torch.isfinite(out).all() and out[1, 1] == 0 and out[2].eq(0).all()
