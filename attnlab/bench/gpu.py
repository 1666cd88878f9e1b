"""``attnlab bench --suite gpu`` (named only; it needs a CUDA device): attnlab's
``attention`` on a GPU beside torch's SDPA and FlexAttention compiled for the GPU, which
trains there (its backward runs on CUDA, not on a CPU). B=1, 12 heads, head_dim 64,
T=4096 (quick: 1024), causal except prefix-LM; bf16 forward and forward+backward, and
float32 forward+backward.

Each step ends with ``torch.cuda.synchronize()``, so a sample is the GPU's time plus
the Python that launched it. attnlab has no GPU kernel of its own: on a GPU ``auto``
runs torch's (sdpa), or the textbook path where SDPA cannot state the variant (softcap),
so this suite shows what that costs against the GPU's own libraries rather than a
lead.
"""

from __future__ import annotations

import torch

from . import variants
from .runner import Case, Impl

OPT_IN = True  # only where named: it needs a GPU
BASELINE = "torch-flex"
DEVICE = "cuda"  # tests run the suite's machinery on "cpu"
CASES = ("causal", "softcap", "alibi", "documents", "prefix-lm")
PASSES = (("bfloat16", False), ("bfloat16", True), ("float32", True))


def make_step(**kwargs):
    """:func:`variants.make_step` on the device, each call waiting for the device."""
    step = variants.make_step(device=DEVICE, **kwargs)
    if DEVICE != "cuda":
        return step

    def synced():
        out = step()
        torch.cuda.synchronize()
        return out
    return synced


def cases(quick: bool = False) -> list[Case]:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise ValueError("suite 'gpu' needs a CUDA device, and torch sees none "
                         f"(torch {torch.__version__})")
    seq = 1024 if quick else 4096
    out = []
    for dtype, backward in PASSES:
        for variant in CASES:
            name = (f"{'bf16' if dtype == 'bfloat16' else 'fp32'} "
                    f"{'fwd+bwd' if backward else 'fwd'} T={seq} {variant}")
            impls = ["attnlab-auto", "torch-flex"]
            if variant in ("causal", "alibi", "documents", "prefix-lm"):
                impls.insert(1, "torch-sdpa")
            out.append(Case("gpu", name, [
                Impl(impl, ("attnlab.bench.gpu", "make_step", dict(
                    impl=impl, variant=variant, seq=seq, backward=backward, dtype=dtype,
                    case=name)), memory=False)
                for impl in impls], repeats=3 if quick else 7, memory=False))
    return out


def annotate(records: list[dict], log=print) -> None:
    """FlexAttention's compile time per case (its first forward), reported apart."""
    for r in records:
        if r["impl"] == "torch-flex" and r["case"] in variants.COMPILE_S:
            r["compile_s"] = variants.COMPILE_S.pop(r["case"])
            log(f"    torch-flex compile ({r['case']}): {r['compile_s']:.1f} s")
