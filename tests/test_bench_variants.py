"""The variants' bench cases: every implementation of a case computes the same attention
(a ratio between two different computations would mean nothing), forward and backward,
and --quick keeps to its two small cases without a compiled peer."""

from __future__ import annotations

import pytest
import torch

from attnlab.bench import attention as bench
from attnlab.bench import variants


def test_the_cases_follow_the_issues_targets():
    full = {c.name: [i.name for i in c.impls] for c in bench._variant_cases(quick=False)}
    assert "fwd T=8192 causal, 8 documents" in full
    assert {"fwd T=4096 causal softcap", "fwd T=4096 causal alibi", "fwd T=4096 causal sinks",
            "fwd T=4096 prefix-LM mask_mod"} <= set(full)
    assert all("torch-flex" in impls for name, impls in full.items() if name.startswith("fwd "))
    assert full["fwd+bwd T=4096 causal alibi"] == ["attnlab-auto", "attnlab-tiled", "torch-sdpa"]
    assert full["fwd+bwd T=4096 causal softcap"][-1] == "torch-eager"
    quick = {c.name: [i.name for i in c.impls] for c in bench._variant_cases(quick=True)}
    assert list(quick) == ["fwd T=1024 causal softcap", "fwd T=2048 causal, 8 documents"]
    assert not any("torch-flex" in impls for impls in quick.values())


@pytest.mark.parametrize("variant", variants.VARIANTS)
@pytest.mark.parametrize("backward", [False, True])
def test_every_implementation_computes_the_same_attention(variant, backward):
    impls = ["attnlab-tiled", "attnlab-auto", *variants.peers(variant, backward=True)]
    small = dict(variant=variant, heads=2, seq=64, dim=16)
    want = variants.make_step("attnlab-eager", **small)()
    for impl in impls:
        if not backward:
            torch.testing.assert_close(variants.make_step(impl, **small)(), want,
                                       atol=2e-5, rtol=2e-5)
        else:
            variants.make_step(impl, backward=True, **small)()  # runs, and frees its grads


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["sinks", "documents"])
def test_the_compiled_flexattention_peer_computes_the_same_attention(variant):
    small = dict(variant=variant, heads=2, seq=128, dim=16, case=f"test {variant}")
    want = variants.make_step("attnlab-eager", **small)()
    torch.testing.assert_close(variants.make_step("torch-flex", **small)(), want,
                               atol=2e-5, rtol=2e-5)
    assert variants.COMPILE_S.pop(f"test {variant}") > 0


def test_each_flex_case_compiles_from_a_fresh_dynamo_cache(monkeypatch):
    """Past dynamo's recompile_limit (8 frames of flex_attention) FlexAttention falls back
    to its unfused path, 10-20x slower: a full run would time that for its later cases.
    Every case's compile starts from a reset cache, the window cases' as the variants'."""
    import torch._dynamo

    resets, compiled = [], []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(len(compiled)))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn) or fn)
    variants.compiled_flex()
    variants.compiled_flex()
    assert resets == [0, 1] and len(compiled) == 2  # a reset before each compile
    monkeypatch.setattr(bench.variants, "compiled_flex",
                        lambda: compiled.append("window") or (lambda *a, **kw: None))
    bench._flex_step(*(torch.zeros(1, 1, 128, 8),) * 3, 128, True, 16)
    assert compiled[-1] == "window"  # the window cases compile through it too


def test_the_gpu_suite_refuses_in_one_line_without_a_gpu(monkeypatch):
    from attnlab.bench import run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="suite 'gpu' needs a CUDA device") as info:
        run(["gpu"], memory=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("variant", ["causal", "alibi", "documents", "prefix-lm"])
def test_the_gpu_suites_implementations_compute_the_same_attention(monkeypatch, variant,
                                                                   dtype):
    """Its steps on the CPU (the suite's device switched): attnlab on the device and
    torch's SDPA with its mask (or is_causal) give the same output, in the case's dtype."""
    from attnlab.bench import gpu

    monkeypatch.setattr(gpu, "DEVICE", "cpu")
    small = dict(variant=variant, heads=2, seq=64, dim=16, dtype=dtype)
    got = gpu.make_step(impl="attnlab-auto", **small)()
    want = gpu.make_step(impl="torch-sdpa", **small)()
    assert got.dtype == want.dtype == getattr(torch, dtype)
    tol = 2e-2 if dtype == "bfloat16" else 2e-5
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    names = {c.name: [i.name for i in c.impls] for c in gpu.cases()}
    assert names["bf16 fwd+bwd T=4096 softcap"] == ["attnlab-auto", "torch-flex"]
    assert names["fp32 fwd+bwd T=4096 documents"] == ["attnlab-auto", "torch-sdpa", "torch-flex"]
