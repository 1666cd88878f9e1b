"""The native inference products (``csrc/row_product.h``, the tile kernel for more
rows) against ``F.linear``, and the decoders' ``logits_to_keep``.

One row is streamed (either storage of the weight, bias and residual folded in); more
rows with a float32 weight stored by columns (the packed ``(in, out)`` blocks) go
through the AVX-512 tile kernel where the CPU has it (up to 64 all at once, more in
chunks of 96 rows, with over 512 inputs from a copied panel); a float32 weight stored by
rows (an output layer past ``fused.COLUMNS_MAX_OUT``) through the rows loop up to 16
rows (F32_DOT_ROWS), four rows a pass over each band, and past that through the tile
kernel from panels transposed in registers; anything else is declined with None so that
the caller runs ``F.linear``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import _flash, _native
from attnlab.models import GPT, GPTConfig, ToyAttnLM
from attnlab.models.toy import ToyConfig

needs_native = pytest.mark.skipif(not _native.available(),
                                  reason=f"native kernel: {_native.unavailable_reason()}")


@needs_native
@settings(max_examples=100, deadline=None)
@given(n_in=st.sampled_from([1, 3, 16, 17, 64, 200]), n_out=st.sampled_from([1, 5, 16, 63, 130]),
       rows=st.sampled_from([0, 1, 2, 7, 16, 17, 64, 65, 97, 200]),
       layout=st.sampled_from(["rows", "columns", "rows of a wider block"]),
       bias=st.booleans(), residual=st.booleans(), big=st.booleans(),
       seed=st.integers(0, 2**16))
def test_linear_equals_f_linear_or_declines(n_in, n_out, rows, layout, bias, residual, big,
                                           seed):
    g = torch.Generator().manual_seed(seed)
    if big:  # two threads share the product; past 512 inputs a band is copied first
        n_in, n_out = n_in * 16, n_out * 8
    w = torch.randn(n_out, n_in, generator=g)
    if layout == "columns":  # stored (in, out), as modules.fused packs it, in a wider block
        block = torch.randn(n_in, n_out + 3, generator=g)
        block[:, :n_out] = w.t()
        w = block[:, :n_out].t()
    elif layout == "rows of a wider block":  # a row stride past n_in
        block = torch.randn(n_out, n_in + 5, generator=g)
        block[:, :n_in] = w
        w = block[:, :n_in]
    b = torch.randn(n_out, generator=g) if bias else None
    r = torch.randn(rows, n_out, generator=g) if residual else None
    x = torch.randn(rows, n_in, generator=g)
    got = _native.load().linear(x, w, b, r)
    want = F.linear(x, w, b) + (0 if r is None else r)
    columns = w.stride(0) == 1 and w.stride(1) >= n_out  # (a 1 x 1 weight is both)
    by_rows = w.stride(1) == 1 and (n_out <= 1 or w.stride(0) >= n_in)
    tiles = _flash.tile_kernel()
    takes = rows == 1 or (not residual and ((columns and tiles)
                                            or (by_rows and (rows <= 16 or tiles))))
    if not takes:
        assert got is None
        return
    torch.testing.assert_close(got, want, atol=1e-4 * n_in ** 0.5, rtol=1e-4)


@needs_native
def test_linear_declines_what_it_does_not_read():
    ops = _native.load()
    w = torch.randn(8, 4)
    assert ops.linear(torch.randn(1, 4).double(), w.double(), None, None) is None
    assert ops.linear(torch.randn(1, 4), w[:, ::2].t().t()[:, :2], None, None) is None  # strided
    assert ops.linear(torch.randn(2, 4), w, None, torch.randn(2, 8)) is None  # rows + residual
    assert ops.linear(torch.randn(3, 4), torch.randn(4), None, None) is None  # a 1-D weight
    assert ops.linear(torch.randn(1, 4), w, torch.randn(3), None) is None  # a bias of 3 for 8


@pytest.mark.parametrize("make", [
    lambda: GPT(GPTConfig(vocab_size=40, d_model=32, num_heads=4, num_layers=2)),
    lambda: ToyAttnLM(ToyConfig(vocab_size=40, d_model=16, context_length=32)),
])
def test_logits_to_keep_gives_the_last_positions(make):
    torch.manual_seed(0)
    model = make().eval()
    ids = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        full = model(ids)
        for keep in (1, 3, 9):
            torch.testing.assert_close(model(ids, logits_to_keep=keep), full[:, -keep:])
        torch.testing.assert_close(model(ids, logits_to_keep=0), full)
    with pytest.raises(ValueError, match="logits_to_keep must be an int >= 0, got -1"):
        model(ids, logits_to_keep=-1)


@needs_native
def test_no_input_features_give_the_bias_on_every_row():
    w, b = torch.randn(5, 0), torch.randn(5)
    got = _native.load().linear(torch.randn(3, 0), w, b, None)
    assert got is None or torch.equal(got, b.expand(3, 5))
    one = _native.load().linear(torch.randn(1, 0), w, b, None)
    assert torch.equal(one, b[None])


def test_inference_products_stand_aside_for_wrapped_or_watched_layers():
    """A layer in place of out_proj that is not a plain nn.Linear (a wrapper, a
    parametrisation), a global forward hook: under no_grad the module runs them as it
    does with gradients on, instead of multiplying the packed block."""
    from torch.nn.utils import parametrizations

    from attnlab.modules import MultiHeadAttention

    x = torch.randn(2, 5, 32)
    for change in ("wrapped", "weight_norm"):
        torch.manual_seed(0)
        mha = MultiHeadAttention(32, 32, 4, causal=True).eval()
        if change == "wrapped":
            mha.out_proj = torch.nn.Sequential(mha.out_proj)
        else:
            parametrizations.weight_norm(mha.out_proj)
        want = mha(x)
        with torch.no_grad():
            torch.testing.assert_close(mha(x), want.detach(), atol=1e-5, rtol=1e-5)
    mha = MultiHeadAttention(32, 32, 4, causal=True).eval()
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: seen.append(type(m).__name__))
    try:
        with torch.no_grad():
            mha(x[:1, :1])
    finally:
        handle.remove()
    assert seen.count("Linear") == 4


@needs_native
@pytest.mark.parametrize("op", ["silu_mul", "gelu_mul"])
def test_the_gated_activations_are_torchs_on_every_value(op):
    # The fused SwiGLU and GeGLU steps, act(gate) * up with up = 1, against torch's
    # function in float64: the tails too (gelu_tanh(-12) is 0, not -1.4e-6 from a tanh
    # that stops short of -1, and gelu_tanh(-3e38) not -3.6e31), NaN, signed zeros and
    # the infinities' limits.
    gate = torch.cat([torch.linspace(-12, 12, 2401), torch.tensor(
        [float("nan"), 0.0, -0.0, 1e-30, -1e-30, 3e38, -3e38, 1e-40, 1e-3])])
    got = getattr(_native.load(), op)(torch.stack([gate, torch.ones_like(gate)], 0).reshape(1, -1))
    act = F.silu if op == "silu_mul" else lambda g: F.gelu(g, approximate="tanh")
    torch.testing.assert_close(got[0], act(gate.double()).float(), rtol=2e-6, atol=3e-7,
                               equal_nan=True)
    if op == "gelu_mul":
        infinities = torch.tensor([[float("inf"), -float("inf"), 1.0, 1.0]])
        assert _native.load().gelu_mul(infinities).tolist() == [[float("inf"), 0.0]]
