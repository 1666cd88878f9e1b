"""attnlab on a CUDA device, against the NumPy oracle, the CPU and FlexAttention's own
GPU backward: the backends that run there (eager, sdpa, tiled and auto's choice among
them) with every variant, forward and backward; bf16/fp16 through torch's fused kernels
with attnlab's end-aligned causal rule; the FlashAttention drop-in; a decoder with every option
and the encoder's packed rows; a checkpoint's CUDA generator state.

CI has no GPU, so these skip there. ``ATTNLAB_TEST_DEVICE=cpu`` runs them on the CPU
(except the FlexAttention peer, whose compiled backward needs a GPU), which checks the
file itself. The log-sum-exp block steps (ring attention's local step) run on the
device in ``test_backend_table.py``, where torch sees one.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gpt_variants import EVERYTHING, model_with
from test_variants import _claims, _inputs, _oracle, _torch_variants, problems

import attnlab
from attnlab import reference as ref
from attnlab.blockmask import BlockMask, block_mask
from attnlab.models import Encoder, EncoderConfig

DEVICE = torch.device(os.environ.get("ATTNLAB_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(),
                                reason="no CUDA device (ATTNLAB_TEST_DEVICE=cpu runs these)")
ON_DEVICE = ["eager", "sdpa", "tiled", "auto"]


def _to_device(kw: dict) -> dict:
    out = {}
    for name, value in kw.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().to(DEVICE).requires_grad_(value.requires_grad)
        elif isinstance(value, tuple):
            value = tuple(x.to(DEVICE) for x in value)
        elif isinstance(value, BlockMask):  # evaluated again on the device
            value = block_mask(value.mask_mod, *value.shape, block_q=value.block_q,
                               block_k=value.block_k, device=DEVICE)
        out[name] = value
    return out


def _leaf(t: torch.Tensor, dtype=None) -> torch.Tensor:
    return t.detach().to(DEVICE, dtype or t.dtype).requires_grad_(t.requires_grad)


@pytest.mark.parametrize("backend", ON_DEVICE)
@settings(max_examples=40, deadline=None)
@given(p=problems(), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_variants_match_the_oracle_on_the_device(backend, p, dtype):
    if not _claims(backend, p):
        return  # refusals are the same on every device: test_variants
    (q, k, v), mask = _inputs(p, dtype)
    kw = _to_device(dict(mask=mask, **_torch_variants(p, dtype)))
    out = attnlab.attention(_leaf(q), _leaf(k), _leaf(v), causal=p["causal"],
                            window=p["window"], backend=backend, **kw)
    assert out.device.type == DEVICE.type
    tol = 1e-9 if dtype == torch.float64 else 1e-4
    np.testing.assert_allclose(out.double().cpu().numpy(), _oracle(p, q, k, v, mask),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", ["sdpa", "tiled", "auto"])
@settings(max_examples=30, deadline=None)
@given(p=problems())
def test_gradients_on_the_device_match_float64_eager_on_the_cpu(backend, p):
    if not _claims(backend, p):
        return
    (q, k, v), mask = _inputs(p, torch.float64, grad=True)
    kw = _torch_variants(p, torch.float64, grad=True)
    out = attnlab.attention(q, k, v, mask=mask, causal=p["causal"], window=p["window"],
                            backend="eager", **kw)
    g_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(p["seed"]),
                        dtype=torch.float64)
    leaves = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    want = torch.autograd.grad(out, leaves, g_out)
    kw32 = _to_device({n: (x.float() if isinstance(x, torch.Tensor) and x.is_floating_point()
                           else x) for n, x in dict(mask=mask, **kw).items()})
    q32, k32, v32 = (_leaf(t, torch.float32) for t in (q, k, v))
    out32 = attnlab.attention(q32, k32, v32, causal=p["causal"], window=p["window"],
                              backend=backend, **kw32)
    leaves32 = [q32, k32, v32] + ([kw32["sinks"]] if "sinks" in kw32 else [])
    got = torch.autograd.grad(out32, leaves32, g_out.to(DEVICE, torch.float32))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double().cpu(), w, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ON_DEVICE)
@pytest.mark.parametrize("q_len, k_len, causal, window, kv_heads", [
    (64, 64, True, None, 4),     # torch's is_causal, on its flash kernel where it runs
    (16, 80, True, None, 2),     # end-aligned: the queries are the last 16 positions
    (1, 80, True, None, 1),      # one decoded token sees every key
    (48, 48, True, 7, 4),        # a sliding window
    (48, 48, False, None, 2),    # dense, GQA
])
def test_half_precision_on_the_device_keeps_attnlabs_rule(dtype, backend, q_len, k_len,
                                                         causal, window, kv_heads):
    g = torch.Generator().manual_seed(q_len * 7 + k_len)
    q = torch.randn(2, 4, q_len, 64, generator=g)
    k, v = (torch.randn(2, kv_heads, k_len, 64, generator=g) for _ in range(2))
    out = attnlab.attention(*(t.to(DEVICE, dtype) for t in (q, k, v)), causal=causal,
                            window=window, backend=backend)
    assert out.dtype == dtype
    want = ref.attention(*(t.to(dtype).double().numpy() for t in (q, k, v)), None,
                         causal=causal, window=window)
    np.testing.assert_allclose(out.double().cpu().numpy(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="FlexAttention's backward runs on a GPU")
@pytest.mark.parametrize("variant", ["softcap", "alibi", "documents", "prefix_lm"])
def test_forward_and_backward_equal_flexattention_on_the_gpu(variant):
    """The peer that trains only on a GPU: torch's compiled FlexAttention with the same
    score_mod / mask_mod, float32, B=1, 4 heads, T=256, head_dim 64, causal."""
    from torch.nn.attention import flex_attention as flex

    seq, heads = 256, 4
    g = torch.Generator().manual_seed(11)
    base = [torch.randn(1, heads, seq, 64, generator=g) for _ in range(3)]
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(heads)], device=DEVICE)
    docs = (torch.arange(seq, device=DEVICE) * 5 // seq)  # five documents

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask_mod, score_mod, kw = causal, None, {"causal": True}
    if variant == "softcap":
        def score_mod(s, b, h, q_idx, kv_idx):
            return 20.0 * torch.tanh(s / 20.0)
        kw["softcap"] = 20.0
    elif variant == "alibi":
        def score_mod(s, b, h, q_idx, kv_idx):
            return s - slopes[h] * (q_idx - kv_idx)
        kw["alibi_slopes"] = slopes
    elif variant == "documents":
        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (docs[q_idx] == docs[kv_idx])
        kw["document_ids"] = docs[None]
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) | (kv_idx < 64)
        kw = {"mask_mod": mask_mod}

    block = flex.create_block_mask(mask_mod, 1, 1, seq, seq, device=DEVICE)
    compiled = torch.compile(flex.flex_attention, dynamic=False)
    grads = []
    for run in ("flex", "attnlab"):
        q, k, v = (t.to(DEVICE).requires_grad_() for t in base)
        if run == "flex":
            out = compiled(q, k, v, score_mod=score_mod, block_mask=block)
        else:
            out = attnlab.attention(q, k, v, **kw)
        out.backward(torch.ones_like(out))
        grads.append((out.detach(), q.grad, k.grad, v.grad))
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flash_attn_drop_in_on_the_device(dtype):
    from attnlab.compat import flash_attn_func, flash_attn_varlen_func

    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 40, 4, 32, generator=g)
    k, v = (torch.randn(2, 40, 2, 32, generator=g) for _ in range(2))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    out = flash_attn_func(*(t.to(DEVICE, dtype) for t in (q, k, v)), causal=True,
                          window_size=(5, 0), softcap=8.0)
    want = flash_attn_func(q.double(), k.double(), v.double(), causal=True,
                           window_size=(5, 0), softcap=8.0)
    torch.testing.assert_close(out.double().cpu(), want, atol=tol, rtol=tol)
    # Two sequences of 15 and 25 tokens packed into one of 40.
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    flat = [t[0].to(DEVICE, dtype) for t in (q, k, v)]
    out = flash_attn_varlen_func(*flat, cu.to(DEVICE), cu.to(DEVICE), 25, 25, causal=True)
    for lo, hi in ((0, 15), (15, 40)):
        alone = flash_attn_func(*(t[:1, lo:hi].double() for t in (q, k, v)), causal=True)
        torch.testing.assert_close(out[lo:hi].double().cpu(), alone[0], atol=tol, rtol=tol)


def test_a_decoder_with_every_option_runs_on_the_device_as_on_the_cpu():
    """Gemma 2 / BLOOM / gpt-oss options together: logits, the training gradient and the
    greedy tokens (KV cache) equal the CPU's."""
    cpu = model_with(**EVERYTHING)
    gpu = model_with(**EVERYTHING).to(DEVICE)
    ids = torch.randint(0, cpu.config.vocab_size, (2, 20), generator=torch.Generator()
                        .manual_seed(0))
    for model in (cpu, gpu):
        model.train(False)
        model.zero_grad()
        logits = model(ids.to(next(model.parameters()).device))
        logits.float().logsumexp(-1).mean().backward()
    want, got = cpu(ids).detach(), gpu(ids.to(DEVICE)).detach().cpu()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for (name, p_cpu), p_gpu in zip(cpu.named_parameters(), gpu.parameters()):
        torch.testing.assert_close(p_gpu.grad.cpu(), p_cpu.grad, atol=1e-4, rtol=1e-3,
                                   msg=name)
    prompt = ids[:1, :6]
    tokens = gpu.generate(prompt, max_new_tokens=12, temperature=0.0)
    assert tokens.device.type == DEVICE.type
    assert tokens.cpu().tolist() == cpu.generate(prompt, max_new_tokens=12,
                                                 temperature=0.0).tolist()


def test_packed_encoder_rows_on_the_device_equal_the_cpu():
    torch.manual_seed(0)
    cpu = Encoder(EncoderConfig(vocab_size=50, context_length=32, d_model=32, num_layers=2,
                                num_heads=4)).eval()
    gpu = Encoder(cpu.config).to(DEVICE).eval()
    gpu.load_state_dict(cpu.state_dict())
    ids = torch.randint(0, 50, (1, 30), generator=torch.Generator().manual_seed(1))
    docs = torch.tensor([[0] * 12 + [1] * 18])
    with torch.no_grad():
        want = cpu(ids, document_ids=docs)
        got = gpu(ids.to(DEVICE), document_ids=docs.to(DEVICE))
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the CUDA generator's state")
def test_a_checkpoint_keeps_the_cuda_generator(tmp_path):
    from attnlab.checkpoint.state import restore_training_state, save_training_state

    model = model_with().to(DEVICE)
    opt = torch.optim.AdamW(model.parameters())
    gen = torch.Generator().manual_seed(0)
    torch.cuda.manual_seed(1234)
    save_training_state(tmp_path / "ckpt", model, opt, gen, 0, {"steps": 10}, [])
    want = torch.rand(8, device=DEVICE)
    torch.rand(100, device=DEVICE)
    restore_training_state(tmp_path / "ckpt", model, opt, gen, {"steps": 10})
    torch.testing.assert_close(torch.rand(8, device=DEVICE), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("poisoned", ["query", "key"])
@pytest.mark.parametrize("backend", ["sdpa", "auto"])
def test_nan_is_kept_on_the_device_forward_and_backward(backend, poisoned, dtype):
    """Off the CPU nothing checks the inputs (that would sync the device): the NaN that
    torch's fused kernels drop is carried back, and the other kv head is untouched."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 64, 32, generator=g)
    k, v = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(2))
    (q[0, 1, 40, 3] if poisoned == "query" else k[0, 0, 2, 1]).fill_(float("nan"))
    ins = [t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v)]
    out = attnlab.attention(*ins, causal=True, backend=backend)
    dq, dk, dv = torch.autograd.grad(out, ins, torch.ones_like(out))
    nan_rows = out[0, 1, 40] if poisoned == "query" else out[0, :2, 2:]
    assert nan_rows.isnan().all()
    assert dk[0, 0].isnan().any() and dv[0, 0].isnan().any()
    for t in (out[0, 2:], dq[0, 2:], dk[0, 1], dv[0, 1]):
        assert torch.isfinite(t).all()
