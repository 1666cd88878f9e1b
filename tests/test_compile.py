"""torch.compile over the native ops: a fake (meta) kernel for each, and the flash backend
traced whole (fullgraph=True) and equal to eager, forward and backward.

The fakes live in ``attnlab/_native.py`` (``_fakes``); each is checked here against
its real op: shapes, dtypes and strides of every output, None where the op declines.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

import attnlab
from attnlab import _flash, _native

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not _native.available(),
                                reason=f"native kernel: {_native.unavailable_reason()}")


def _ops():
    return getattr(torch.ops, _native.LIBRARY)


def _meta(t):
    return None if t is None else (tuple(t.shape), t.dtype, t.stride())


def _fake_equals_real(op, args) -> None:
    """The op's outputs and its fake's agree in None-ness, shape, dtype and strides."""
    mode = FakeTensorMode()
    fake_args = tree_map(lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a,
                         args)
    with mode:
        fake = op(*fake_args)
    real = op(*args)
    fake, real = (o if isinstance(o, tuple) else (o,) for o in (fake, real))
    assert [_meta(t) for t in fake] == [_meta(t) for t in real]


def _flash_args(causal: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g).to(dtype)
    k = torch.randn(2, 2, 7, 8, generator=g).to(dtype)
    v = torch.randn(2, 2, 7, 6, generator=g).to(dtype)  # v_dim != head_dim: out takes v's
    # offset 2: end-aligned; then no softcap, ALiBi, sinks, documents or block mask
    variants = (0.0, None, None, None, None, None, None)  # none of them
    return (q, k, v, None, causal, 0, 7 - 5, 0.35, 0.0, 0, 4, 4, *variants)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_fakes_give_the_real_outputs_and_log_sum_exp(causal, dtype):
    ops = _ops()
    args = _flash_args(causal, dtype)
    torch.library.opcheck(ops.flash_forward.default, args)
    _fake_equals_real(ops.flash_forward.default, args)
    q, k, v, mask, *settings = args
    out, lse = ops.flash_forward(*args)
    grad = torch.randn_like(out)
    back = (q, k, v, mask, out, lse, grad, *settings)
    torch.library.opcheck(ops.flash_backward.default, back)
    _fake_equals_real(ops.flash_backward.default, back)


def test_row_op_fakes_give_the_real_outputs():
    ops = _ops()
    x = torch.randn(3, 1, 10)
    odd = torch.randn(1, 1, 10).as_strided((1, 1, 10), (5, 7, 1))  # dense, odd unit strides
    for args in ((x, torch.randn(10), 1e-6), (x, None, 1e-5), (odd, None, 1e-5)):
        torch.library.opcheck(ops.rms_norm.default, args)
        _fake_equals_real(ops.rms_norm.default, args)
    torch.library.opcheck(ops.silu_mul.default, (torch.randn(2, 3, 8),))
    _fake_equals_real(ops.silu_mul.default, (torch.randn(2, 3, 8),))
    from attnlab.layouts import int8
    table = (*int8.quantize(torch.randn(20, 40)), torch.tensor([[3, 19]]), 20, 40)
    torch.library.opcheck(ops.int8_rows.default, table)
    _fake_equals_real(ops.int8_rows.default, table)


def test_linear_fake_takes_and_declines_as_the_op_does():
    ops = _ops()
    w = torch.randn(6, 10)
    packed = torch.randn(10, 6).t()  # stored by columns, the packed blocks' layout
    cases = [
        (torch.randn(1, 1, 10), w, torch.randn(6), torch.randn(6)),  # one row: taken
        (torch.randn(1, 10), packed, None, None),
        (torch.randn(3, 10), packed, torch.randn(6), None),  # a few rows: the tile kernel
        (torch.randn(100, 10), packed, None, None),  # many rows: the tile kernel too
        (torch.randn(3, 10), w, None, None),  # a few rows by rows: the rows loop
        (torch.randn(40, 10), w, None, None),  # more by rows: transposed panels, tiles
        (torch.randn(100, 10), w, torch.randn(6), None),  # many by rows: the same
        (torch.randn(3, 10), torch.randn(10), None, None),  # a 1-D weight: declined
        (torch.randn(3, 10), w, None, torch.randn(3, 6)),  # a residual: declined
        (torch.randn(1, 10).double(), w.double(), None, None),  # float64: declined
        (torch.randn(1, 20)[:, ::2], w, None, None),  # not contiguous: declined
        (torch.randn(100, 10), w.bfloat16(), torch.randn(6), None),  # bf16 by rows: tiles
        (torch.randn(2, 50, 10).bfloat16(), w.bfloat16(), None, None),  # in bf16, out bf16
        (torch.randn(64, 10), w.bfloat16(), None, None),  # few rows: declined
        (torch.randn(100, 9), torch.randn(6, 9).bfloat16(), None, None),  # odd: declined
    ]
    for args in cases:
        _fake_equals_real(ops.linear.default, args)
    torch.library.opcheck(ops.linear.default, cases[0])


def test_linear_fake_without_the_tile_kernel_takes_only_the_portable_loops():
    """On a CPU without AVX-512 (no tile kernel) the op takes one row, and 2 to
    F32_DOT_ROWS rows times a float32 weight by rows (its portable rows loop); a weight by
    columns or more rows by rows go to F.linear. The fake says so from metadata alone."""
    from attnlab import _fakes

    linear = _fakes.fakes(tiles=False)["linear"]
    mode = FakeTensorMode()
    fake = mode.from_tensor
    w, packed = fake(torch.empty(6, 10)), fake(torch.empty(10, 6).t())
    x = {n: fake(torch.empty(n, 10)) for n in (1, 3, _fakes.F32_DOT_ROWS, _fakes.F32_DOT_ROWS + 1)}
    rows = _fakes.F32_DOT_ROWS
    with mode:
        assert linear(x[1], packed, None, None).shape == (1, 6)
        assert linear(x[rows], w, None, None).shape == (rows, 6)
        assert linear(x[rows + 1], w, None, None) is None
        assert linear(x[3], packed, None, None) is None
        with_tiles = _fakes.fakes(tiles=True)["linear"]
        assert with_tiles(x[rows + 1], w, None, None).shape == (rows + 1, 6)


def test_decode_step_fake_gives_the_real_output():
    ops = _ops()
    heads, kv_heads, dim = 4, 2, 8
    qkv = torch.randn(2, 1, (heads + 2 * kv_heads) * dim)
    cache = (torch.zeros(2, kv_heads, 6, dim), torch.zeros(2, kv_heads, 6, dim))
    cos, sin = torch.randn(6, dim), torch.randn(6, dim)
    args = (qkv, cos, sin, *cache, 3, 0, heads, kv_heads, 0.35)
    torch.library.opcheck(ops.decode_step.default, args)
    _fake_equals_real(ops.decode_step.default, args)


def _flash_graph_ops(fn, *args) -> list[str]:
    """The attnlab ops in the graphs dynamo captures of ``fn(*args)`` with fullgraph=True."""
    seen: list[str] = []

    def backend(gm, example_inputs):
        for sub in gm.modules():  # the autograd.Function's body is a subgraph
            if isinstance(sub, torch.fx.GraphModule):
                seen.extend(str(n.target) for n in sub.graph.nodes
                            if "attnlab" in str(n.target))
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    return seen


@pytest.mark.slow  # inductor's first compile on two busy cores: ~50 s
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_flash_module_matches_eager_forward_and_backward(causal):
    torch.manual_seed(0)
    module = attnlab.MultiHeadAttention(16, 16, 2, causal=causal, backend="flash").eval()
    x = torch.randn(2, 12, 16)
    # Traced whole: the autograd.Function's forward and backward, each one native call.
    assert _flash_graph_ops(module, x) == ["attnlab_native.flash_forward",
                                           "attnlab_native.flash_backward"]

    def run(fn):
        xg = x.clone().requires_grad_(True)
        out = fn(xg)
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
        grads = [xg.grad] + [p.grad.clone() for p in module.parameters()]
        module.zero_grad(set_to_none=True)
        return out.detach(), grads

    want, want_grads = run(module)
    got, got_grads = run(torch.compile(module, fullgraph=True))
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_auto_choosing_flash_traces_whole(monkeypatch):
    """auto asks whether the CPU has the tile kernel (a native op returning a bool, which
    dynamo cannot put in a graph): the answer is a constant, so a first call under
    torch.compile still traces whole and picks flash as eager does."""
    monkeypatch.setattr(_flash, "_tiles", None)  # not yet asked in this process
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 128, 8, generator=g) for _ in range(3))

    def causal(q, k, v):
        return attnlab.attention(q, k, v, causal=True)

    assert _flash_graph_ops(causal, q, k, v) == ["attnlab_native.flash_forward"]
    torch.testing.assert_close(torch.compile(causal, backend="eager", fullgraph=True)(q, k, v),
                               causal(q, k, v), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


def test_a_first_load_under_the_meta_device_and_float64_still_loads():
    """Registering the fakes asks the real op one question on two tiny tensors: they must
    be CPU float32 whatever default device and dtype the first load runs under."""
    _first_load_keeps_the_kernel("import torch; torch.set_default_dtype(torch.float64)\n"
                                 "from attnlab import _native\n"
                                 "with torch.device('meta'):\n"
                                 "    _native.available()\n")


def _first_load_keeps_the_kernel(code: str) -> None:
    """``code`` run first in a fresh process leaves the native kernel on."""
    code += ("from attnlab import _native\n"
             "print(_native.available(), _native.unavailable_reason())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.strip() == "True None", done.stderr
    assert "unavailable" not in done.stderr, done.stderr


@pytest.mark.skipif(_native.unavailable_reason() is not None, reason="native kernel not built")
def test_a_first_load_under_torch_export_keeps_the_kernel():
    """The first call of a process inside torch.export (a FakeTensorMode): the question the
    fakes ask of the real op runs outside it, so the kernel stays on (it was reported as a
    failed build and switched off for the whole process) and the export equals eager."""
    _first_load_keeps_the_kernel(
        "import torch, attnlab\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, q): return attnlab.attention(q, q, q, causal=True)\n"
        "q = torch.randn(1, 2, 16, 8)\n"
        "ep = torch.export.export(M(), (q,))\n"
        "torch.testing.assert_close(ep.module()(q), M()(q))\n")


@pytest.mark.parametrize("backend", ["auto", "eager"])
def test_per_head_variants_and_a_gpt_compile_whole(backend):
    """ALiBi slopes and sinks (values a call checks: finite) and a GPT's token ids (in the
    vocabulary) are not read while torch.compile traces, so fullgraph holds and the
    compiled call equals eager. (Documents and mask_mod build their block mask from the
    data: built ahead, as FlexAttention's create_block_mask is, they compile too.)"""
    from attnlab.models import GPT, GPTConfig

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 40, 16) for _ in range(3))
    slopes, sinks = torch.rand(4), torch.randn(4)

    bias = torch.randn(2, 1, 40, 40)  # a float mask: its values are checked outside traces

    def call(q, k, v):
        return attnlab.attention(q, k, v, causal=True, alibi_slopes=slopes, sinks=sinks,
                                 softcap=20.0, mask=bias, backend=backend)

    torch.testing.assert_close(torch.compile(call, backend="eager", fullgraph=True)(q, k, v),
                               call(q, k, v), atol=1e-5, rtol=1e-5)
    model = GPT(GPTConfig(vocab_size=50, context_length=32, d_model=32, num_layers=1,
                          num_heads=2, positions="alibi", sinks=True, backend=backend)).eval()
    ids = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="eager", fullgraph=True)(ids),
                                   model(ids), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("rule", [dict(causal=True), dict(window=3),
                                  dict(causal=True, window=5)])
@pytest.mark.parametrize("backend", ["flash", "auto", "sdpa", "eager"])
def test_an_additive_mask_with_a_causal_or_window_rule_compiles_whole(backend, rule):
    """The mask's shift, taken over the keys the rule allows, compared the rows' shifts to
    keep one: a data-dependent branch that stopped the fullgraph trace."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 1, 8, 8)
    bias[..., 0, 5:] = 30.0  # a large entry the rule forbids: the shift must ignore it

    def call(q, k, v):
        return attnlab.attention(q, k, v, mask=bias, backend=backend, **rule)

    got = torch.compile(call, backend="eager", fullgraph=True)(q, k, v)
    want = call(q, k, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    for g, w in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v))):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


def test_a_padding_mask_keeps_its_shape_where_values_cannot_be_read():
    """Under a trace or vmap the shift could not compare the rows' maxima, and a key
    padding mask (one row for every query) grew to q_len x k_len: flash and tiled lost
    their O(seq) memory under the default torch.compile and vmap."""
    from attnlab.mask_shift import shift_rows

    pad = torch.zeros(3, 1, 1, 64)
    pad[..., -10:] = -1e9
    eager = shift_rows(pad[0], 64, 64, causal=True)
    mapped = torch.func.vmap(lambda m: shift_rows(m, 64, 64, causal=True))(pad)
    assert mapped.shape == (3, 1, 1, 64) and eager.shape == (1, 1, 64)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))

    def call(q, k, v):
        return attnlab.attention(q, k, v, mask=pad[:1], causal=True, backend="flash")

    torch.testing.assert_close(torch.compile(call, backend="eager", fullgraph=True)(q, k, v),
                               call(q, k, v), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


def test_a_tiled_score_mod_with_gradients_compiles_whole():
    """The check that a score_mod's tensors did not change before the backward read
    tensor versions, which a trace cannot."""
    rel = torch.linspace(0.5, 2.0, 40)

    def scaled(score, b, h, q_idx, kv_idx):
        return score * rel[kv_idx]

    q, k, v = (torch.randn(1, 2, 40, 8, requires_grad=True) for _ in range(3))

    def call(q, k, v):
        return attnlab.attention(q, k, v, causal=True, score_mod=scaled, backend="tiled")

    got = torch.compile(call, backend="eager", fullgraph=True)(q, k, v)
    want = call(q, k, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v)),
                    torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


def test_a_block_mask_with_a_score_mod_and_a_flashattention_band_compile_whole():
    """A block mask built ahead together with a score_mod (the tiled path asks the block
    mask about each tile), and FlashAttention's windows that are no attnlab rule (a band
    mask_mod), trace without reading a value: fullgraph holds and equals eager."""
    from attnlab.compat import create_block_mask, flash_attn_func, flex_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    block = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, 40, 40, BLOCK_SIZE=16)

    def biased(score, b, h, qi, ki):
        return score + (qi - ki) * 0.01

    def flex(q, k, v):
        return flex_attention(q, k, v, block_mask=block, score_mod=biased)

    torch.testing.assert_close(torch.compile(flex, backend="eager", fullgraph=True)(q, k, v),
                               flex(q, k, v))
    for window in ((8, 2), (5, 9)):
        def band(q, k, v, window=window):
            return flash_attn_func(q, k, v, window_size=window)
        ql, kl, vl = (t.transpose(1, 2) for t in (q, k, v))
        torch.testing.assert_close(
            torch.compile(band, backend="eager", fullgraph=True)(ql, kl, vl), band(ql, kl, vl))
    torch._dynamo.reset()
