"""The machine a benchmark ran on: its CPU, and the float32 FMA peak measured in the same run.

A time means little without the hardware: the same kernel ran at 0.40-0.61x SDPA's
time on a Zen 5 (two 512-bit FMAs a cycle) and 0.74-0.88x on a Zen 4 (one). So the
attention suite prints the CPU (``/proc/cpuinfo``) and measures the peak it reads
each case against, rather than trusting a data sheet.

The peak is a microbenchmark, not a theory: the best of 40 short rounds (about 2
ms each) of float32 products on matrices small enough to stay in the caches
(n=256 on one thread, n=512 on all), counted as ``2 n^3`` FLOPs a product: the
better of ``torch.mm`` and attnlab's own AVX-512 tile product (``linear`` on more than
64 rows) where it is built. One of them reaches close to the FMA units' limit there
(on AMD CPUs MKL takes its AVX2 path, half the 512-bit units' rate on a Zen 5, where
the kernel's cases then read 164% "of the peak"), so this is a slight *under*-estimate
of the true peak: a share of it is an upper bound on the share of the hardware's.
Rounds are short and many because on a busy machine only the best of them sees the
cores free (measured at load 11 on two cores: 7 rounds of 30 ms found 16 GFLOP/s on
two threads, 40 rounds of 2 ms found 333).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

# The ISA flags the native kernel's speed depends on (in the order we print them).
FLAGS = ("avx512f", "avx512_bf16", "avx512_vnni", "avx2", "fma")


def describe_cpu(text: str | None = None) -> dict:
    """Parse ``/proc/cpuinfo`` text (read from the file when None) into a small dict.

    ``{"model": str, "vendor": str, "family": int | None, "model_id": int | None,
    "flags": [the FLAGS present], "logical_cpus": int}``. Unknown fields stay
    empty/None (other OSes, containers that hide cpuinfo): the bench runs anyway.
    """
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            text = ""
    first: dict[str, str] = {}
    processors = 0
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key == "processor":
            processors += 1
        first.setdefault(key, value.strip())  # the first processor speaks for all
    present = set(first.get("flags", "").split())
    return {
        "model": first.get("model name", "unknown CPU"),
        "vendor": first.get("vendor_id", ""),
        "family": _int(first.get("cpu family")),
        "model_id": _int(first.get("model")),
        "flags": [f for f in FLAGS if f in present],
        "logical_cpus": processors,
    }


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def cpu_line(cpu: dict) -> str:
    """One line: ``Intel(R) Xeon(R) ... (family 6 model 167, 2 CPUs; avx512f avx2 fma)``."""
    ident = []
    if cpu.get("family") is not None:
        ident.append(f"family {cpu['family']} model {cpu['model_id']}")
    if cpu.get("logical_cpus"):
        ident.append(f"{cpu['logical_cpus']} CPUs")
    flags = " ".join(cpu.get("flags", [])) or "none of " + " ".join(FLAGS)
    return f"{cpu['model']} ({', '.join(ident)}; {flags})"


def fma_peak(threads: int, *, rounds: int = 40, size: int | None = None,
             seconds: float = 0.002) -> float:
    """Float32 GFLOP/s of an ``size x size`` product at ``threads`` threads: the best of
    ``rounds`` for each of :func:`_products`, the better of them.

    Each round repeats the product for about ``seconds``; the thread count of torch is
    restored afterwards.
    """
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    n = size or (256 if threads == 1 else 512)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return max(_best_rate(product, n, rounds, seconds) for product in _products(n))
    finally:
        torch.set_num_threads(before)


def _products(n: int) -> list:
    """``torch.mm`` of two ``n x n`` float32 matrices, and attnlab's tile product of the
    same size where the native kernel has it (``linear`` takes more than 64 rows times a
    weight stored by columns only on its AVX-512 tiles)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    out = torch.empty(n, n)
    products = [lambda: torch.mm(a, b, out=out)]
    from .. import _native

    ops = _native.load()
    weight = b.t()  # a @ b as x W^T, W stored by columns as modules.fused packs float32
    if ops is not None and n > 64 and ops.linear(a, weight, None, None) is not None:
        products.append(lambda: ops.linear(a, weight, None, None))
    return products


def _best_rate(product, n: int, rounds: int, seconds: float) -> float:
    product()  # warm: thread pool, dispatch, caches
    start = time.perf_counter()
    product()
    reps = max(1, math.ceil(seconds / max(time.perf_counter() - start, 1e-6)))
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            product()
        elapsed = time.perf_counter() - start
        best = max(best, 2.0 * n ** 3 * reps / elapsed / 1e9)
    return best


def measure(log=print) -> dict:
    """The CPU and its peak at one thread and at the threads the bench uses; logs both."""
    cpu = describe_cpu()
    threads = torch.get_num_threads()
    one = fma_peak(1)
    # All threads can do at least what one does (a busy machine can hide that from a
    # multi-threaded product: one descheduled thread holds up the others).
    every = one if threads == 1 else max(one, fma_peak(threads))
    if log:
        log(f"CPU: {cpu_line(cpu)}")
        log(f"float32 FMA peak (torch.mm or attnlab's tile product, best of 40, measured "
            f"in this run): {one:.0f} "
            f"GFLOP/s on 1 thread, {every:.0f} GFLOP/s on the bench's {threads} threads")
    return {"cpu": cpu, "threads": threads, "peak_gflops_1": one, "peak_gflops": every}


def best(a: dict, b: dict) -> dict:
    """Two measurements of :func:`measure` (before and after the cases): the higher peaks."""
    return {**a, "peak_gflops_1": max(a["peak_gflops_1"], b["peak_gflops_1"]),
            "peak_gflops": max(a["peak_gflops"], b["peak_gflops"])}
