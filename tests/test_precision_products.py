"""The bf16 and int8 one-row products of decoding (csrc/row_product.h, dot_bf16.h,
int8_product.h) against float64 oracles, on both paths: the dot-product instructions
(vdpbf16ps, vpdpbusd) where this CPU has them, and the portable loops; the int8 layout
(attnlab.layouts.int8) against the gguf package's Q8_0 reference, bit for bit."""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import _native
from attnlab.layouts import int8 as layout

ops = _native.load()
needs_native = pytest.mark.skipif(ops is None, reason="native kernel not built")
PATHS = ["dot", "portable"]


@contextlib.contextmanager
def path(name: str):
    """Run the products on the dot-product instructions (where the CPU has them) or on the
    portable loops."""
    before = ops.set_dot_products(name == "dot")
    try:
        yield
    finally:
        ops.set_dot_products(before)


def bf16_oracle(x, w, bias=None, residual=None):
    """x rounded to bf16 times the bf16 weight, summed in float64."""
    y = x.to(torch.bfloat16).double() @ w.double().t()
    for t in (bias, residual):
        if t is not None:
            y = y + t.double().reshape(y.shape)
    return y


def q8_row(x: torch.Tensor) -> torch.Tensor:
    """A row quantised as the kernel does (llama.cpp's x86 quantize_row_q8_0: 127 / max,
    ties to even), back as floats."""
    n = x.shape[-1]
    blocks = -(-n // 32)
    xp = torch.zeros(*x.shape[:-1], blocks * 32)
    xp[..., :n] = x
    xb = xp.view(*x.shape[:-1], blocks, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    q = torch.round(xb * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    return (q * (amax / 127)).view(*x.shape[:-1], -1)[..., :n]


def magnitude(x, w):
    """The sum of |x| |w| per output: what rounding errors scale with."""
    return x.abs().double() @ w.abs().double().t()


@needs_native
@pytest.mark.parametrize("kind", PATHS)
@settings(max_examples=25, deadline=None)
@given(n_in=st.integers(1, 200), n_out=st.integers(1, 150), by_rows=st.booleans(),
       extras=st.booleans(), seed=st.integers(0, 2**31))
def test_bf16_one_row_equals_the_oracle(kind, n_in, n_out, by_rows, extras, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, n_in, generator=g).to(torch.bfloat16)
    if not by_rows:  # the packed (in, out) block of modules.fused
        w = w.t().contiguous().t()
    x = torch.randn(1, n_in, generator=g)
    bias = torch.randn(n_out, generator=g) if extras else None
    residual = torch.randn(1, n_out, generator=g) if extras else None
    with path(kind):
        y = ops.linear(x, w, bias, residual)
    assert y.dtype == torch.float32 and y.shape == (1, n_out)
    err = (y.double() - bf16_oracle(x, w, bias, residual)).abs()
    assert bool((err <= 1e-6 * (magnitude(x, w) + 1)).all()), float(err.max())


@needs_native
@pytest.mark.parametrize("layout", ["columns", "rows"])
def test_bf16_paths_agree_and_the_dot_path_is_there_where_the_cpu_has_it(layout):
    """Both paths compute bf16 x bf16 products summed in float32 (their sums differ in
    order only); the switch really switches where the CPU has the instruction. Columns:
    the packed (in, out) block; rows: the (out, in) rows modules.fused packs bf16 in."""
    torch.manual_seed(0)
    w = torch.randn(1536, 576).to(torch.bfloat16)
    if layout == "columns":
        w = w.t().contiguous().t()
    x = torch.randn(1, 576)
    with path("dot"):
        a = ops.linear(x, w, None, None)
        active = ops.dot_products_active()
    with path("portable"):
        b = ops.linear(x, w, None, None)
        assert not ops.dot_products_active()
    assert float((a - b).abs().max()) <= 1e-5 * float(magnitude(x, w).max())
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    if " avx512_bf16" in flags and " avx512_vnni" in flags:
        assert active


@needs_native
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(2, 200), half_in=st.integers(1, 150),
       n_out=st.integers(1, 150),
       x_bf16=st.booleans(), bias=st.booleans(), wide=st.booleans(),
       seed=st.integers(0, 2**31))
def test_bf16_many_rows_equal_the_oracle(rows, half_in, n_out, x_bf16, bias, wide, seed):
    """2 to BF16_DOT_ROWS rows times a bf16 weight packed by rows (a batch being decoded,
    a short prompt), or more (a prompt): the one-row loop four rows at a time or the bf16
    tile kernel where the CPU has the dot product, else torch's product (the op
    declines); either way x rounded to bf16 times the weight, summed in float32, in x's
    dtype."""
    n_in = 2 * half_in
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, n_in + (7 if wide else 0), generator=g).to(torch.bfloat16)
    w = w[:, :n_in]  # rows a stride apart, as a slice of a wider block
    x = torch.randn(rows, n_in, generator=g)
    if x_bf16:
        x = x.to(torch.bfloat16)
    b = torch.randn(n_out, generator=g) if bias else None
    y = ops.linear(x, w, b, None)
    if not ops.dot_products_active():
        assert y is None
        return
    assert y is not None and y.dtype == x.dtype and y.shape == (rows, n_out)
    want = bf16_oracle(x.float(), w) + (0 if b is None else b.double())
    err = (y.double() - want).abs()
    rounding = want.abs() * (2.0**-8 if x_bf16 else 0.0)  # the result rounded to bf16
    assert bool((err <= 1e-6 * (magnitude(x.float(), w) + 1) + rounding).all()), float(err.max())


@needs_native
@pytest.mark.parametrize("rows", [16, 17, 32, 64, 65])
def test_bf16_rows_past_the_loop_go_to_the_tile_kernel(rows):
    """Past BF16_DOT_ROWS every row count is attnlab's (a short prompt of 17-64 tokens went
    to torch's product before), equal to the oracle."""
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows + 1))
    y = ops.linear(x, w, None, None)
    if not ops.dot_products_active():
        assert y is None
        return
    assert y is not None and y.dtype == torch.float32
    err = (y.double() - bf16_oracle(x, w)).abs()
    assert bool((err <= 1e-6 * (magnitude(x, w) + 1)).all()), float(err.max())


@needs_native
def test_bf16_rows_decline_what_the_kernels_do_not_take():
    w = torch.randn(8, 10).to(torch.bfloat16)
    x = torch.randn(100, 10)
    assert ops.linear(x, w, None, torch.randn(100, 8)) is None  # a residual
    assert ops.linear(torch.randn(100, 9), torch.randn(8, 9).to(torch.bfloat16), None,
                      None) is None  # odd inputs: A's last pair would reach past its row
    assert ops.linear(x, w.t().contiguous().t(), None, None) is None  # by columns
    with path("portable"):
        assert ops.linear(x, w, None, None) is None  # no dot product: torch's


@needs_native
def test_bf16_row_in_bf16_gives_bf16():
    w = torch.randn(64, 32).to(torch.bfloat16).t().contiguous().t()
    x = torch.randn(1, 32).to(torch.bfloat16)
    y = ops.linear(x, w, None, None)
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.double(), bf16_oracle(x.float(), w), rtol=1e-2, atol=1e-2)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), blocks=st.integers(1, 4), seed=st.integers(0, 2**31),
       scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_q8_0_equals_gguf_quantiser_bit_for_bit(rows, blocks, seed, scale):
    w = np.random.default_rng(seed).standard_normal((rows, blocks * 32)).astype(np.float32)
    w *= scale
    w[0, :32] = 0  # an all-zero block: scale 0
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    q, d = layout.q8_0(torch.from_numpy(w))
    want = torch.from_numpy(raw.reshape(rows, blocks, 34))
    assert torch.equal(d.view(torch.uint8).view(rows, blocks, 2), want[..., :2])
    assert torch.equal(q.view(torch.uint8).view(rows, blocks, 32), want[..., 2:])
    data, scales = layout.from_gguf_q8_0(want.reshape(rows, -1), rows, blocks * 32)
    assert torch.equal(data, layout.to_bands(q, d)[0])
    assert torch.equal(scales, layout.to_bands(q, d)[1])


@needs_native
@settings(max_examples=20, deadline=None)
@given(out=st.integers(1, 70), n=st.integers(1, 100), chunk=st.sampled_from([16, 32, 256]),
       bf16=st.booleans(), seed=st.integers(0, 2**31))
def test_the_native_quantiser_writes_the_reference_bits(out, n, chunk, bf16, seed):
    """What loading uses (csrc/products.cpp, a chunk of rows at a time, into buffers that
    held anything before) equals layouts.int8's q8_0 + to_bands, padding included."""
    w = torch.randn(out, n, generator=torch.Generator().manual_seed(seed)) * 3
    if bf16:
        w = w.to(torch.bfloat16)
    want_data, want_scales = layout.to_bands(*layout.q8_0(w))
    data, scales = torch.full_like(want_data, 7), torch.full_like(want_scales, 7)
    for a in range(0, out, chunk):
        ops.quantize_rows(w[a:a + chunk].contiguous(), data, scales, a, out)
    assert torch.equal(data, want_data) and torch.equal(scales, want_scales)


@settings(max_examples=10, deadline=None)
@given(out=st.integers(1, 40), n=st.integers(1, 100), seed=st.integers(0, 2**31))
def test_bands_round_trip_and_dequantise_within_half_a_step(out, n, seed):
    w = torch.randn(out, n, generator=torch.Generator().manual_seed(seed))
    data, scales = layout.quantize(w)
    assert (data.shape, scales.shape) == layout.shapes(out, n)
    q, d = layout.from_bands(data, scales, out)
    assert torch.equal(layout.to_bands(q, d)[0], data)
    back = layout.dequantize(data, scales, out, n)
    # Half a step of the row's largest block, and the float16 rounding of its scale
    # (2**-11 relative, over up to 127 steps).
    step = w.abs().view(out, -1).amax(1, keepdim=True) / 127
    assert bool(((back - w).abs() <= step * (0.5 + 127 * 2**-11) + 1e-6).all())


@needs_native
@settings(max_examples=15, deadline=None)
@given(out=st.integers(1, 40), n=st.integers(1, 100), seed=st.integers(0, 2**31))
def test_int8_embedding_rows_are_the_dequantised_weights(out, n, seed):
    """An int8 table's rows (tied embeddings, one native call) are dequantize's rows, bit
    for bit, in the ids' shape; the ATen path gives the same; a bad id is named."""
    from attnlab.modules.quantized import Int8Embedding, Int8Linear

    g = torch.Generator().manual_seed(seed)
    data, scales = layout.quantize(torch.randn(out, n, generator=g))
    ids = torch.randint(0, out, (2, 3), generator=g)
    want = layout.dequantize(data, scales, out, n)[ids]
    assert torch.equal(ops.int8_rows(data, scales, ids, out, n), want.view(6, n))
    table = Int8Embedding(Int8Linear.of(data, scales, None, n, out))
    assert torch.equal(table(ids), want)
    with mock.patch.dict(os.environ, {_native.ENV_SWITCH: "0"}):
        assert _native.load() is None and torch.equal(table(ids), want)
    with pytest.raises(RuntimeError, match=f"id {out} is not a row"):
        ops.int8_rows(data, scales, torch.tensor([out]), out, n)
    assert torch.equal(table(ids.int()), want)
    for dtype in (torch.float32, torch.bool, torch.uint8):  # as nn.Embedding refuses them
        with pytest.raises(TypeError, match=f"ids must be an int64 or int32 tensor, got {dtype}"):
            table(ids.to(dtype))


@needs_native
@pytest.mark.parametrize("kind", PATHS)
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 5), n_in=st.integers(1, 130), n_out=st.integers(1, 90),
       extras=st.booleans(), seed=st.integers(0, 2**31))
def test_int8_product_equals_the_oracle(kind, rows, n_in, n_out, extras, seed):
    """Products of the quantised row and the int8 weight, summed in float64: what the
    kernel computes exactly in int32 per block, to float32 rounding across blocks."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, n_in, generator=g)
    data, scales = layout.quantize(w)
    x = torch.randn(rows, n_in, generator=g)
    bias = torch.randn(n_out, generator=g) if extras else None
    residual = torch.randn(rows, n_out, generator=g) if extras else None
    with path(kind):
        y = ops.int8_linear(x, data, scales, n_out, bias, residual)
    wd = layout.dequantize(data, scales, n_out, n_in).double()
    want = q8_row(x).double() @ wd.t()
    for t in (bias, residual):
        if t is not None:
            want = want + t.double()
    err = (y.double() - want).abs()
    assert bool((err <= 1e-6 * (magnitude(x, w) + 1)).all()), float(err.max())


@needs_native
def test_int8_paths_give_the_same_bits_and_nan_reaches_the_outputs():
    torch.manual_seed(1)
    w = torch.randn(200, 300)
    data, scales = layout.quantize(w)
    for n in (9, 10, 11):  # the dot path takes rows four at a time: 4 + 4 + 1, 2 or 3
        x = torch.randn(n, 300)
        with path("dot"):
            a = ops.int8_linear(x, data, scales, 200, None, None)
        with path("portable"):
            b = ops.int8_linear(x, data, scales, 200, None, None)
        assert torch.equal(a, b)
        for r in range(n):  # each row alone: the bits of the rows side by side
            one = ops.int8_linear(x[r:r + 1], data, scales, 200, None, None)
            assert torch.equal(one, a[r:r + 1])
    x = torch.randn(9, 300)
    x[1, 7] = float("nan")
    x[6, 299] = float("inf")
    y = ops.int8_linear(x, data, scales, 200, None, None)
    finite = [r for r in range(9) if r not in (1, 6)]
    assert bool(y[finite].isfinite().all()) and bool(y[[1, 6]].isnan().all())
