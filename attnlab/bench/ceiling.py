"""The one-row ceiling of the generate suite: per token, a row times every weight matrix of
the model once (random weights of the model's shapes, no prompt, no attention, no norms),
each by the fastest way this machine has, timed in the same rounds as the decoders. The
matrices lie one after another on huge pages, as a model's weights do once loaded
(:mod:`attnlab._pages`).

Decoding one sequence must at least do that, so a decoder's tokens/s over the loop's says
how much of this machine's speed it reaches (``of_ceiling`` in the records).
"""

from __future__ import annotations

import torch

from .. import _native, _pages
from .generate import NEW_TOKENS, matrix_shapes

# The ways to multiply a row by a matrix the ceiling chooses from: (product, layout).
# "torch" is torch's matmul (the BLAS it links); "attnlab" is the native streamed
# product (csrc/row_product.h) that attnlab's decoding uses where it is built.
WAYS = [(product, layout) for product in ("torch", "attnlab")
        for layout in ("(in, out)", "(out, in)")]


def _product(way: tuple[str, str], n_in: int, n_out: int):
    """A row times a new random ``n_in x n_out`` matrix, multiplied and stored ``way``."""
    import torch.nn.functional as F

    product, layout = way
    w = torch.randn(n_out, n_in) * 0.02
    if layout == "(in, out)":
        wt = _pages.empty((n_in, n_out), torch.float32).copy_(w.t())
        w = wt.t()  # the (out, in) weight as a view of the (in, out) storage
        if product == "torch":
            return lambda x: x @ wt
    else:
        w = _pages.empty((n_out, n_in), torch.float32).copy_(w)
    if product == "attnlab":
        ops = _native.load()
        return lambda x: ops.linear(x, w, None, None)
    return lambda x: F.linear(x, w)


def _faster(n_in: int, n_out: int, reps: int = 7) -> tuple[str, str]:
    """The product and layout that multiply a row by an ``n_in x n_out`` matrix fastest
    here, timed as decoding meets it: streamed from memory, not from a cache that holds
    it. Each way is timed over enough distinct matrices to exceed the caches (64 MB)."""
    import time

    count = max(2, min(64, (64 << 20) // (4 * n_in * n_out)))
    x = torch.randn(1, n_in)
    best = {}
    for way in WAYS:
        if way[0] == "attnlab" and not _native.available():
            continue
        products, ts = [_product(way, n_in, n_out) for _ in range(count)], []
        for _ in range(reps):
            start = time.perf_counter()
            for f in products:
                f(x)
            ts.append(time.perf_counter() - start)
        best[way] = sorted(ts)[reps // 2]
        del products
    return min(best, key=best.get)


def make_ceiling(shape: str, new_tokens: int = NEW_TOKENS, **_):
    """The one-row ceiling: per token, a row times every weight matrix (random weights
    of the model's shapes, one matrix each, each in its faster layout)."""
    shapes = matrix_shapes(shape)
    chosen = {s: _faster(*s) for s in dict.fromkeys(shapes)}
    # The matrices on huge pages, as attnlab loads a model's.
    with _pages.arena([4 * n_in * n_out for n_in, n_out in shapes]):
        products = [(_product(chosen[(n_in, n_out)], n_in, n_out), torch.randn(1, n_in))
                    for n_in, n_out in shapes]

    @torch.inference_mode()
    def step():
        for _ in range(new_tokens):
            for f, x in products:
                f(x)
    return step
