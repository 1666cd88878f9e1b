"""The read bandwidth of this machine, measured in the same run as the decoders, and the
bound it puts on decoding one sequence.

Decoding one token must read every weight matrix once, so at ``B`` bytes of weights per
token and a read bandwidth of ``W`` bytes/s no engine exceeds ``W / B`` tokens/s. The
probe is a plain read: ``torch.sum`` over a float32 buffer as large as the model's
float32 weights (far beyond the caches), on huge pages as the weights are
(:mod:`attnlab._pages`), at the bench's thread count (torch's), a few passes per round,
timed in the same rounds as the engines. An engine's share of the bound is its tokens/s
times its bytes per token over the bandwidth; each precision has its own bytes per token
(float32 4 bytes a weight, bf16 and f16 2, llama.cpp's Q8_0 34 per 32, int8 1 plus its
per-channel scale), so each has its own bound.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from .. import _pages

# Passes per round: about 0.15 s of SmolLM-sized reads at one thread. Three passes caught
# this shared machine's load at one instant: 5.9 GB/s in one case of a loaded run, 22.5 in
# the next case.
PASSES = 6


def make_read(nbytes: int, passes: int = PASSES):
    """A step that sums a float32 buffer of ``nbytes`` ``passes`` times (``passes *
    nbytes`` bytes read)."""
    if not isinstance(nbytes, int) or nbytes < 4:
        raise ValueError(f"nbytes must be an int >= 4, got {nbytes!r}")
    with _pages.arena([nbytes // 4 * 4]):  # on huge pages, as a loaded model's weights
        buf = _pages.empty((nbytes // 4,), torch.float32).fill_(1.0)  # every page resident

    def step():
        for _ in range(passes):
            buf.sum()
    return step


def gb_per_s(nbytes: int, passes: int, ms: float) -> float:
    """Read bandwidth in GB/s (1e9 bytes) of ``passes`` reads of ``nbytes`` in ``ms``."""
    return nbytes * passes / (ms / 1000.0) / 1e9


def share(tokens_per_s: float, bytes_per_token: float, bytes_per_s: float) -> float:
    """``tokens_per_s`` as a share of the bound ``bytes_per_s / bytes_per_token``."""
    if bytes_per_token <= 0 or bytes_per_s <= 0:
        raise ValueError(f"bytes_per_token and bytes_per_s must be > 0, got "
                         f"{bytes_per_token!r} and {bytes_per_s!r}")
    return tokens_per_s * bytes_per_token / bytes_per_s


def paired_share(read_ms: Sequence[float], read_bytes: float, step_ms: Sequence[float],
                 tokens: float, bytes_per_token: float) -> float:
    """The median over rounds of each round's share: ``tokens`` in ``step_ms[i]`` against
    ``read_bytes`` read in ``read_ms[i]`` in the same round (this machine's speed drifts
    over minutes; a round pairs two timings a second apart). Rounds that do not pair up
    (different counts) fall back to the ratio of the medians."""
    if len(read_ms) != len(step_ms) or not read_ms:
        read_ms, step_ms = [statistics.median(read_ms)], [statistics.median(step_ms)]
    return statistics.median(
        share(tokens / (t / 1000.0), bytes_per_token, read_bytes / (r / 1000.0))
        for r, t in zip(read_ms, step_ms))
