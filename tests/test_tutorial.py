"""The tutorial family against the book's own classes (``llms_from_scratch.ch03``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from llms_from_scratch import ch03  # a test dependency: missing fails, it does not skip

from attnlab import reference as ref
from attnlab.modules import (
    CausalAttention,
    MultiHeadAttentionWrapper,
    SelfAttentionV1,
    SelfAttentionV2,
    SimplifiedSelfAttention,
)

# "Your journey starts with one step", the book's 6 x 3 embeddings.
INPUTS = torch.tensor([[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
                       [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]])
BATCH = torch.stack((INPUTS, INPUTS))  # (2, 6, 3)


def seeded(seed, cls, *args, **kwargs):
    torch.manual_seed(seed)
    return cls(*args, **kwargs)


def pair(ours_cls, book_cls, args, seed=123, **kwargs):
    ours = seeded(seed, ours_cls, *args, **kwargs).eval()
    book = seeded(seed, book_cls, *args, **kwargs).eval()
    return ours, book


def close(a, b, tol=1e-6):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


# --------------------------------------------------------------- against the book


def test_simplified_self_attention_matches_section_3_3():
    out = SimplifiedSelfAttention()(INPUTS)
    # The book's steps: scores = inputs @ inputs.T, softmax over rows, weighted sum.
    weights = torch.softmax(INPUTS @ INPUTS.T, dim=-1)
    close(out, weights @ INPUTS)
    close(out[1], torch.tensor([0.4419, 0.6515, 0.5683]), tol=1e-4)  # printed in the book
    batched = SimplifiedSelfAttention()(torch.stack((INPUTS, INPUTS.flip(0))))
    close(batched[0], out)
    close(batched[1], SimplifiedSelfAttention()(INPUTS.flip(0)))


@pytest.mark.parametrize(("ours_cls", "book_cls"), [(SelfAttentionV1, ch03.SelfAttention_v1),
                                                    (SelfAttentionV2, ch03.SelfAttention_v2)])
@pytest.mark.parametrize(("d_in", "d_out", "seq"), [(3, 2, 6), (64, 64, 32), (16, 5, 9)])
def test_self_attention_matches_book(ours_cls, book_cls, d_in, d_out, seq):
    ours, book = pair(ours_cls, book_cls, (d_in, d_out))
    x = INPUTS if d_in == 3 else torch.rand(3, seq, d_in)
    if x.ndim == 2:
        close(ours(x), book(x))
    else:  # the book's classes take one sequence at a time
        close(ours(x), torch.stack([book(xi) for xi in x]))


def test_book_printed_numbers():
    torch.manual_seed(789)
    close(SelfAttentionV2(3, 2)(INPUTS)[0], torch.tensor([-0.0739, 0.0713]), tol=1e-4)
    torch.manual_seed(123)
    close(SelfAttentionV1(3, 2)(INPUTS)[1], torch.tensor([0.3061, 0.8210]), tol=1e-4)


def test_parameters_have_the_books_names_and_shapes():
    for ours_cls, book_cls, args in [
        (SelfAttentionV1, ch03.SelfAttention_v1, (3, 2)),
        (SelfAttentionV2, ch03.SelfAttention_v2, (3, 2)),
        (CausalAttention, ch03.CausalAttention, (3, 2, 6, 0.0)),
        (MultiHeadAttentionWrapper, ch03.MultiHeadAttentionWrapper, (3, 2, 6, 0.0, 2)),
    ]:
        ours, book = pair(ours_cls, book_cls, args)
        assert [(n, p.shape) for n, p in ours.named_parameters()] == [
            (n, p.shape) for n, p in book.named_parameters()]
        # The book's checkpoints load (their causal mask buffers are simply not needed).
        missing, unexpected = ours.load_state_dict(book.state_dict(), strict=False)
        assert missing == [] and all(k.endswith("mask") for k in unexpected)


@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize(("d_in", "d_out", "seq", "batch"), [(3, 2, 6, 2), (64, 64, 32, 3)])
def test_causal_attention_matches_book(qkv_bias, d_in, d_out, seq, batch):
    ours, book = pair(CausalAttention, ch03.CausalAttention, (d_in, d_out, seq, 0.0),
                      qkv_bias=qkv_bias)
    x = BATCH if d_in == 3 else torch.randn(batch, seq, d_in)
    close(ours(x), book(x))
    close(ours(x[:, :4]), book(x[:, :4]))  # shorter than the context
    close(ours(x[0]), book(x[:1])[0])  # one unbatched sequence


@pytest.mark.parametrize(("d_in", "d_out", "seq", "heads"), [(3, 2, 6, 2), (64, 8, 32, 8)])
def test_wrapper_matches_book(d_in, d_out, seq, heads):
    ours, book = pair(MultiHeadAttentionWrapper, ch03.MultiHeadAttentionWrapper,
                      (d_in, d_out, seq, 0.0, heads))
    x = BATCH if d_in == 3 else torch.randn(3, seq, d_in)
    out = ours(x)
    assert out.shape == (x.shape[0], seq, heads * d_out)
    close(out, book(x))


@pytest.mark.parametrize("qkv_bias", [None, False, True])
@pytest.mark.parametrize(("d_in", "d_out", "seq", "heads"), [(3, 2, 6, 2), (64, 64, 32, 8)])
def test_multihead_attention_takes_the_books_call(qkv_bias, d_in, d_out, seq, heads):
    """``MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads[, qkv_bias])``,
    as the book calls it, is the book's causal module: same weights, same outputs."""
    from attnlab import MultiHeadAttention

    args = (d_in, d_out, seq, 0.0, heads) + (() if qkv_bias is None else (qkv_bias,))
    ours, book = pair(MultiHeadAttention, ch03.MultiHeadAttention, args)
    assert ours.causal and ours.context_length == seq and ours.num_heads == heads
    assert [(n, p.shape) for n, p in ours.named_parameters()] == [
        (n, p.shape) for n, p in book.named_parameters()]
    x = BATCH if d_in == 3 else torch.randn(3, seq, d_in)
    close(ours(x), book(x))
    close(ours(x[:, :4]), book(x[:, :4]))
    # one unbatched (seq, d_in) sequence, as CausalAttention takes it
    close(ours(x[0]), book(x[:1])[0])
    out, weights = ours(x[0], return_weights=True)
    assert out.shape == (seq, d_out) and weights.shape == (heads, seq, seq)
    assert not weights.triu(1).any()
    torch.manual_seed(0)
    assert MultiHeadAttention(d_in, d_out, seq, 0.25, heads).dropout == 0.25


def test_multihead_attention_book_call_errors_name_both_forms():
    from attnlab import MultiHeadAttention

    with pytest.raises(TypeError, match=r"the book's \(d_in, d_out, context_length, dropout, "
                                        r"num_heads, qkv_bias=False\); got 4 positional"):
        MultiHeadAttention(3, 2, 6, 0.0)
    with pytest.raises(TypeError, match="context_length and dropout"):
        MultiHeadAttention(3, 2, 6, 0.0, 2, context_length=6)
    with pytest.raises(ValueError, match="num_heads must be a positive int, got 0"):
        MultiHeadAttention(3, 2, 6, 0.0, 0)
    with pytest.raises(ValueError, match="context_length must be a positive int"):
        MultiHeadAttention(3, 2, 0, 0.0, 2)
    assert not MultiHeadAttention(3, 2, 2).causal  # the design's form is unchanged
    assert not MultiHeadAttention(3, 2, 6, 0.0, 2, causal=False).causal


def test_gradients_match_book():
    ours, book = pair(CausalAttention, ch03.CausalAttention, (16, 8, 10, 0.0))
    x = torch.randn(2, 10, 16)
    grad = torch.randn(2, 10, 8)
    ours(x).backward(grad)
    book(x).backward(grad)
    for (name, p), (_, q) in zip(ours.named_parameters(), book.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=name)


# --------------------------------------------------------------- teaching steps


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["simplified", "v1", "v2", "causal"]), batch=st.integers(0, 3),
       seq=st.integers(1, 9), d_in=st.integers(1, 8), d_out=st.integers(1, 8),
       seed=st.integers(0, 2**16))
def test_steps_agree_with_forward(kind, batch, seq, d_in, d_out, seed):
    torch.manual_seed(seed)
    module = {"simplified": lambda: SimplifiedSelfAttention(),
              "v1": lambda: SelfAttentionV1(d_in, d_out),
              "v2": lambda: SelfAttentionV2(d_in, d_out, qkv_bias=True),
              "causal": lambda: CausalAttention(d_in, d_out, 9)}[kind]()
    shape = (seq, d_in) if batch == 0 else (batch, seq, d_in)
    x = torch.randn(shape)
    s = module.steps(x)
    out, weights = module(x, return_weights=True)
    close(s["context"], out)
    close(s["weights"], weights)
    torch.testing.assert_close(s["weights"].sum(-1), torch.ones(shape[:-1]))
    if kind == "causal":  # nothing above the diagonal
        assert not s["weights"].triu(1).any()
    # And both against the NumPy float64 oracle.
    q, k, v = (s[n].detach().double().unsqueeze(-3).numpy()  # one head: (..., 1, T, d)
               for n in ("queries", "keys", "values"))
    expect = ref.attention(q, k, v, causal=kind == "causal",
                           scale=1.0 if kind == "simplified" else None)
    torch.testing.assert_close(out.detach().double(), torch.from_numpy(expect).squeeze(-3),
                               atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------- dropout and errors


def test_dropout_only_in_training():
    torch.manual_seed(0)
    m = CausalAttention(8, 8, 16, dropout=0.5)
    x = torch.randn(2, 16, 8)
    m.eval()
    close(m(x), m(x))
    m.train()
    torch.manual_seed(1)
    a = m(x)
    torch.manual_seed(2)
    b = m(x)
    assert not torch.allclose(a, b)
    m.eval()
    assert not torch.allclose(a, m(x))


@pytest.mark.parametrize(("module", "x", "needle"), [
    (SelfAttentionV2(3, 2), torch.rand(6, 4), "has 4 features"),
    (SelfAttentionV1(3, 2), torch.rand(6, 4), "d_in=3"),
    (SelfAttentionV2(3, 2), torch.rand(6), "(seq, d_in=3) or (batch, seq, d_in=3), got (6,)"),
    (SimplifiedSelfAttention(), torch.rand(1, 2, 3, 4), "got (1, 2, 3, 4)"),
    (CausalAttention(3, 2, 6), torch.rand(2, 7, 3), "7 tokens is longer than context_length=6"),
    (MultiHeadAttentionWrapper(3, 2, 4, 0.0, 2), torch.rand(1, 5, 3), "context_length=4"),
])
def test_bad_input_names_the_problem(module, x, needle):
    with pytest.raises(ValueError) as err:
        module(x)
    assert needle in str(err.value)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="context_length must be a positive int, got 0"):
        CausalAttention(3, 2, 0)
    with pytest.raises(ValueError, match=r"dropout must be a number in \[0, 1\], got 1.5"):
        CausalAttention(3, 2, 6, dropout=1.5)
    with pytest.raises(ValueError, match="num_heads must be a positive int, got 0"):
        MultiHeadAttentionWrapper(3, 2, 6, 0.0, 0)


def test_every_forward_goes_through_attnlab_attention(monkeypatch):
    from attnlab.modules import tutorial

    calls = []
    real = tutorial.attention

    def spy(q, k, v, **kwargs):
        calls.append((q.shape, kwargs.get("causal", False)))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(tutorial, "attention", spy)
    SimplifiedSelfAttention()(INPUTS)
    SelfAttentionV1(3, 2)(INPUTS)
    SelfAttentionV2(3, 2)(BATCH)
    CausalAttention(3, 2, 6)(BATCH)
    MultiHeadAttentionWrapper(3, 2, 6, 0.0, 3)(BATCH)
    assert [c[0] for c in calls] == [(1, 1, 6, 3), (1, 1, 6, 2), (2, 1, 6, 2)] + [
        (2, 1, 6, 2)] * 4
    assert [c[1] for c in calls] == [False] * 3 + [True] * 4
