"""``attnlab bench --suite attention``: the backends against torch's own kernels.

fp32, B=1, H=12, D=64 over sequence lengths, causal and not; sliding windows
against SDPA given the equivalent dense mask and against FlexAttention with a
sliding-window block mask (compiled by inductor; its compile time is reported
separately as ``compile_s``, its steps are timed warm); grouped-query attention
(12 query heads over 2 kv heads) against SDPA's ``enable_gqa``; forward+backward
at B=1, T=1024 and 4096, at B=4, T=1024, and on the window; and the memory cases
(forward at T=16384, forward+backward at T=8192, H=4). ``attnlab-flash`` is the
native kernel; where it cannot build its column says why.

Every record also says how fast that is for the machine: ``flop`` (see
:func:`attention_flops`), ``gflops`` (``flop`` over the median time) and
``peak_share`` (``gflops`` over ``peak_gflops``, the float32 ``torch.mm`` peak at the
bench's threads, measured quietly in the same run by :mod:`.machine`, before and
after the cases, the higher of the two), and ``cpu``. On a busy machine the peak and
the cases see different neighbours: a share above 100% says the run was noisy.
With ``--under-load`` a second table sets flash's time over SDPA's under load next
to its quiet ratio (target: within 1.15x of it, T=256 to 4096, forward and backward).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .. import masks
from ..functional import attention
from . import machine, variants
from .factory import attention_step
from .runner import Case, Impl

MOD = __name__
# The peer whose time the Markdown table divides by.
BASELINE = "torch-sdpa"
# The textbook path materialises (H, T, T) float32 scores several times over;
# beyond this length it would need many GB on this machine.
EAGER_MAX_T = 4096
# FlexAttention's compile time per (causal, window, seq), filled by _flex_step and
# added to its records by annotate(); the steps themselves are timed warm.
_FLEX_COMPILE_S: dict[tuple, float] = {}
# The machine measured by prologue() (or by annotate() when no prologue ran).
_MACHINE: dict = {}
# The under-load table's pair, and the most flash/SDPA under load may exceed the quiet
# ratio by (issue 27).
LOAD_PAIR = ("attnlab-flash", BASELINE)
LOAD_TARGET = 1.15


def allowed_pairs(q_len: int, k_len: int, causal: bool = False,
                  window: int | None = None) -> int:
    """How many (query, key) pairs the causal/window rule lets through (masks.py's rule:
    end-aligned position ``p = i + k_len - q_len`` sees ``j <= p`` if causal and
    ``p - window < j`` (and ``j < p + window`` when not causal) if windowed)."""
    total = 0
    for p in range(k_len - q_len, k_len):
        lo = 0 if window is None else max(0, p - window + 1)
        hi = p + 1 if causal else (k_len if window is None else p + window)
        total += max(0, min(hi, k_len) - lo)
    return total


def attention_flops(batch: int, heads: int, q_len: int, k_len: int, dim: int, *,
                    causal: bool = False, window: int | None = None,
                    backward: bool = False, pairs: int | None = None) -> int:
    """The useful FLOPs of one attention call, counted as FlashAttention's papers do.

    Forward: ``QK^T`` and ``PV`` are ``2 * dim`` FLOPs (a multiply and an add) per
    allowed (query, key) pair each, so ``4 * B * H * pairs * D``; dense has
    ``pairs = Lq * Lk``, causal ``Lq (Lq + 1) / 2`` (about half) at ``Lq = Lk``, a
    window ``about Lq * window``. Backward does five such products (``S`` again, ``dV``,
    ``dP``, ``dQ`` and ``dK``) against the forward's two:
    2.5x the forward, so forward+backward is 3.5x. Softmax and masking are not
    counted; a kernel that computes masked-out scores (eager) gets no credit for them.
    ``heads`` are the query heads (grouped-query attention does the same arithmetic).
    ``pairs``: the allowed pairs where another rule decides them (documents, a mask_mod).
    """
    if pairs is None:
        pairs = allowed_pairs(q_len, k_len, causal, window)
    forward = 4 * batch * heads * pairs * dim
    return forward * 7 // 2 if backward else forward


def _inputs(batch, heads, kv_heads, seq, dim, grad, seed=0):
    """q, k, v; the implementations of one case share them (the last case's are kept),
    so that none is timed on tensors that sit worse in the caches than another's."""
    key = (batch, heads, kv_heads, seq, dim, grad, seed)
    if _SHARED.get("key") != key:
        _SHARED.clear()
        g = torch.Generator().manual_seed(seed)
        _SHARED["key"] = key
        _SHARED["qkv"] = [torch.randn(batch, h, seq, dim, generator=g).requires_grad_(grad)
                          for h in (heads, kv_heads, kv_heads)]
    return _SHARED["qkv"]


_SHARED: dict = {}


def make_step(impl: str, batch: int, heads: int, seq: int, dim: int = 64,
              causal: bool = False, window: int | None = None, backward: bool = False,
              kv_heads: int | None = None):
    """Build inputs once and return a zero-argument step running ``impl`` on them."""
    kv_heads = heads if kv_heads is None else kv_heads
    q, k, v = _inputs(batch, heads, kv_heads, seq, dim, backward)
    if impl.startswith("attnlab-"):
        backend = impl.removeprefix("attnlab-")

        def fwd():
            return attention(q, k, v, causal=causal, window=window, backend=backend)
    elif impl == "torch-sdpa":
        # The peer as a user would call it: is_causal for causal, a dense bool mask
        # for a window (the "equivalent dense mask").
        dense = None
        if window is not None:
            dense = masks.combine(masks.causal(seq) if causal else None,
                                  masks.sliding_window(seq, seq, window))

        def fwd():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=dense,
                                                  is_causal=causal and dense is None,
                                                  enable_gqa=kv_heads != heads)
    elif impl == "torch-flex":
        fwd = _flex_step(q, k, v, seq, causal, window)
    else:
        raise ValueError(f"unknown impl {impl!r}")

    return attention_step(fwd, backward, (q, k, v))


def _flex_step(q, k, v, seq, causal, window):
    from torch.nn.attention.flex_attention import create_block_mask

    def rule(b, h, qi, ki):
        allowed = (qi - ki < window) & (ki - qi < window)
        return allowed & (ki <= qi) if causal else allowed

    block_mask = create_block_mask(rule, None, None, seq, seq, device="cpu")
    compiled = variants.compiled_flex()
    start = time.perf_counter()
    with torch.no_grad():  # the first call compiles (forward only: no CPU backward)
        compiled(q, k, v, block_mask=block_mask)
    _FLEX_COMPILE_S[(causal, window, seq)] = time.perf_counter() - start
    return lambda: compiled(q, k, v, block_mask=block_mask)


def prologue(log=print, quick: bool = False) -> None:
    """Measure the CPU's peak before the cases run (quietly: no busy processes yet)."""
    _MACHINE.clear()
    _MACHINE.update(machine.measure(log=log))


def annotate(records: list[dict], log=print) -> None:
    """Add FlexAttention's compile time (seconds, first call) to its records, and to
    every record its GFLOP/s and share of the peak (and flash's under-load ratio)."""
    if records:
        after = machine.measure(log=None)
        _MACHINE.update(machine.best(_MACHINE, after) if _MACHINE else after)
        if log:
            log(f"float32 FMA peak, the better of before and after the cases: "
                f"{_MACHINE['peak_gflops_1']:.0f} GFLOP/s on 1 thread, "
                f"{_MACHINE['peak_gflops']:.0f} on {_MACHINE['threads']}")
    for r in records:
        if r.get("median_ms") and r.get("flop"):
            r["gflops"] = r["flop"] / (r["median_ms"] / 1000.0) / 1e9
            r["peak_gflops"] = _MACHINE["peak_gflops"]
            r["peak_share"] = r["gflops"] / _MACHINE["peak_gflops"]
        if _MACHINE:
            r["cpu"] = machine.cpu_line(_MACHINE["cpu"])
        quiet, loaded = r.get("ratio_to", {}), r.get("ratio_to_under_load", {})
        if BASELINE in quiet and BASELINE in loaded:
            r["load_over_quiet"] = loaded[BASELINE] / quiet[BASELINE]
    compile_s = iter(_FLEX_COMPILE_S.values())
    for r in records:
        if r["impl"] == "torch-flex" and r.get("median_ms") is not None:
            r["compile_s"] = (variants.COMPILE_S.pop(r["case"]) if r["case"] in variants.COMPILE_S
                              else next(compile_s, None))
            if r["compile_s"] is not None:
                log(f"    torch-flex compile ({r['case']}): {r['compile_s']:.1f} s")
    _FLEX_COMPILE_S.clear()


def _flash_skip() -> str | None:
    from .. import _native

    return None if _native.available() else f"native kernel: {_native.unavailable_reason()}"


def _variant_cases(quick: bool) -> list[Case]:
    """Issue 22's cases: each variant at B=1, 12 heads, head_dim 64, fp32, causal T=4096
    (documents: 8 in T=8192), forward against FlexAttention compiled with the same
    score_mod/mask_mod and SDPA given the materialised bias or mask, forward+backward
    against the PyTorch paths that train (SDPA with the mask, the textbook path).
    --quick: softcap and documents forward at T=1024/2048, no compiled peer."""
    out = []
    for backward in (False, True):
        for variant in variants.VARIANTS:
            if quick and (backward or variant not in ("softcap", "documents")):
                continue
            seq = (2048 if quick else 8192) if variant == "documents" else (
                1024 if quick else 4096)
            peers = [p for p in variants.peers(variant, backward)  # T x T buffers: not
                     if not (quick and p == "torch-flex")  # beyond EAGER_MAX_T
                     and not (p == "torch-eager" and seq > EAGER_MAX_T)]
            impls = ["attnlab-auto", "attnlab-tiled", *peers]
            if seq <= EAGER_MAX_T and not backward:
                impls.append("attnlab-eager")
            what = {"documents": f"causal, {variants.DOCUMENTS} documents",
                    "prefix-lm": "prefix-LM mask_mod"}.get(variant, f"causal {variant}")
            name = f"{'fwd+bwd' if backward else 'fwd'} T={seq} {what}"
            kw = dict(variant=variant, seq=seq, backward=backward, case=name)
            flop = attention_flops(1, 12, seq, seq, 64, backward=backward,
                                   pairs=variants.pairs(variant, seq))
            out.append(Case("attention", name,
                            [Impl(i, ("attnlab.bench.variants", "make_step", {"impl": i, **kw}))
                             for i in impls], repeats=3, extra={"flop": flop}))
    return out


def _case(name, impls, repeats, **kw):
    skip = _flash_skip() if "attnlab-flash" in impls else None
    flop = attention_flops(kw["batch"], kw["heads"], kw["seq"], kw["seq"], kw.get("dim", 64),
                           causal=kw.get("causal", False), window=kw.get("window"),
                           backward=kw.get("backward", False))
    return Case("attention", name,
                [Impl(i, (MOD, "make_step", {"impl": i, **kw}),
                      skip=skip if i == "attnlab-flash" else None) for i in impls],
                repeats=repeats, extra={"flop": flop})


def summary_table(records: list[dict]) -> str:
    """With ``--under-load``: flash's time over SDPA's, quiet and under load, and the
    milliseconds a call of each gains under load. (The CPU and the peak are in the log,
    and in every record.)

    The ratio's target compares a fast kernel with a slow one: a thread that the OS
    hands to a busy neighbour during a call delays that call by about one time slice,
    whichever kernel it runs, and that delay is a larger share of the faster call. The
    added milliseconds show which kernel loses more time to the load."""
    flash, peer = LOAD_PAIR
    peers = {r["case"]: r for r in records
             if r["impl"] == peer and r.get("median_ms_under_load") is not None}
    lines = [f"| case | {flash} / {peer} quiet | under load | under load / quiet "
             f"(target <= {LOAD_TARGET}) | {flash}: ms added under load | "
             f"{peer}: ms added under load |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in records:
        if r["impl"] != flash or r.get("load_over_quiet") is None:
            continue
        x, other = r["load_over_quiet"], peers.get(r["case"])
        added = [f"{p['median_ms_under_load'] - p['median_ms']:+.2f}" if p else "-"
                 for p in (r, other)]
        lines.append(f"| {r['case']} | {r['ratio_to'][peer]:.2f}x | "
                     f"{r['ratio_to_under_load'][peer]:.2f}x | {x:.2f}"
                     f"{'' if x <= LOAD_TARGET else ' (over)'} | {added[0]} | {added[1]} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def cases(quick: bool = False) -> list[Case]:
    # --quick keeps to two minutes: no dense T=4096 (the textbook path's 1.6 GB of
    # scores); the window case below still runs at T=4096.
    lengths = [256, 1024] if quick else [256, 512, 1024, 2048, 4096, 8192, 16384]
    out: list[Case] = []
    for seq in lengths:
        for causal in (False, True):
            impls = ["attnlab-auto", "attnlab-flash", "attnlab-tiled", "torch-sdpa"]
            if seq <= EAGER_MAX_T:
                impls.append("attnlab-eager")
            repeats = 3 if seq >= 8192 or quick else 7
            name = f"fwd T={seq}" + (" causal" if causal else "")
            out.append(_case(name, impls, repeats, batch=1, heads=12, seq=seq, causal=causal))
    windows = [(4096, 256)] if quick else [(4096, 256), (8192, 256), (8192, 1024)]
    for seq, window in windows:
        impls = ["attnlab-auto", "attnlab-flash", "attnlab-tiled", "torch-sdpa"]
        if not quick:
            impls.append("torch-flex")
        out.append(_case(f"fwd T={seq} causal window={window}", impls, 3 if quick else 5,
                         batch=1, heads=12, seq=seq, causal=True, window=window))
    gqa_seq = 1024 if quick else 4096
    out.append(_case(f"fwd T={gqa_seq} causal GQA 12q/2kv",
                     ["attnlab-auto", "attnlab-flash", "attnlab-tiled", "torch-sdpa",
                      "attnlab-eager"],
                     3 if quick else 7, batch=1, heads=12, kv_heads=2, seq=gqa_seq, causal=True))
    fb = ["attnlab-auto", "attnlab-flash", "attnlab-tiled", "torch-sdpa", "attnlab-eager"]
    for seq in [1024] if quick else [1024, 4096]:
        out.append(_case(f"fwd+bwd T={seq} causal", fb if seq <= 1024 else fb[:-1],
                         3 if quick or seq > 1024 else 5, batch=1, heads=12, seq=seq,
                         causal=True, backward=True))
    if not quick:
        out.append(_case("fwd+bwd B=4 T=1024 causal", fb, 5, batch=4, heads=12, seq=1024,
                         causal=True, backward=True))
        # FlexAttention has no backward on CPU: its column records the error.
        out.append(_case("fwd+bwd T=8192 causal window=256",
                         ["attnlab-auto", "attnlab-flash", "attnlab-tiled", "torch-sdpa",
                          "torch-flex"], 3, batch=1, heads=12, seq=8192, causal=True,
                         window=256, backward=True))
        out.append(_case("fwd+bwd H=4 T=8192 causal", fb, 3, batch=1, heads=4, seq=8192,
                         causal=True, backward=True))
    return out + _variant_cases(quick)
