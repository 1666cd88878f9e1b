"""Decoding on a busy machine (``csrc/busy.h``): after a parallel region saw a worker start
late or two workers share a core, the one-row products, a prompt's products and the
decoding step's attention run on one thread for a while, and ``generate``'s sampling runs
torch's operations on one thread of the caller (``_native.one_thread_while_busy``); where
nothing was seen, every thread. The flash kernel's own rule is tested in test_native.py.
"""

from __future__ import annotations

import pytest
import torch
from threads import threads as thread_count

from attnlab import _native
from attnlab.models import GPT, GPTConfig

needs_native = pytest.mark.skipif(not _native.available(),
                                  reason=f"native kernel: {_native.unavailable_reason()}")


def _by_columns(n_in: int, n_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-row input and a weight stored ``(in, out)`` as modules.fused packs it: the
    product sums bands of inputs into partial outputs and adds them (one band at one
    torch thread)."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, n_in, generator=g), torch.randn(n_in, n_out, generator=g).t()


@needs_native
def test_a_one_row_product_runs_on_one_thread_while_the_machine_is_seen_busy():
    ops = _native.load()
    x, w = _by_columns(2048, 1024)
    with thread_count(1):
        one = ops.linear(x, w, None, None)
    with thread_count(2):
        try:
            ops.workers_for(0.0, 0)  # nothing seen: both threads
            assert ops.product_threads(w.numel()) == 2
            two = [ops.linear(x, w, None, None) for _ in range(50)]
            assert ops.workers_for(0.0, 1) == 1  # late starts noted
            assert ops.product_threads(w.numel()) == 1
            busy = ops.linear(x, w, None, None)
            ops.workers_for(0.0, 0)
            assert ops.workers_for(0.0, 2) == 1  # two workers seen on one core
            assert ops.product_threads(w.numel()) == 1
            shared = ops.linear(x, w, None, None)
        finally:
            ops.workers_for(0.0, 0)
        assert ops.product_threads(w.numel()) == 2 and ops.product_threads(1000) == 1
    torch.testing.assert_close(two[0], one, rtol=1e-5, atol=1e-4)
    # The same bits whichever thread took which band of inputs, and however many did.
    assert all(torch.equal(t, two[0]) for t in (*two, busy, shared))


@needs_native
def test_sampling_runs_on_one_thread_of_the_caller_while_busy_and_picks_the_same_tokens():
    ops = _native.load()
    model = GPT(GPTConfig(vocab_size=40000, context_length=64, d_model=64, num_heads=4,
                          num_layers=2)).eval()
    prompt = torch.tensor([[5, 17, 3, 99]])

    def sample() -> torch.Tensor:
        generator = torch.Generator().manual_seed(7)
        with torch.inference_mode():
            return model.generate(prompt, max_new_tokens=12, temperature=0.9, top_p=0.95,
                                  generator=generator)

    with thread_count(2):
        try:
            ops.workers_for(0.0, 0)
            with _native.one_thread_while_busy():
                assert torch.get_num_threads() == 2  # nothing seen: as it was
            quiet = sample()
            ops.workers_for(0.0, 1)
            with _native.one_thread_while_busy():
                assert torch.get_num_threads() == 1
            assert torch.get_num_threads() == 2  # restored
            with pytest.raises(RuntimeError, match="inside"), _native.one_thread_while_busy():
                raise RuntimeError("inside")
            assert torch.get_num_threads() == 2  # restored after an error too
            ops.workers_for(0.0, 1)
            busy = sample()
        finally:
            ops.workers_for(0.0, 0)
    assert torch.equal(quiet, busy)


@needs_native
def test_a_decoding_step_on_a_busy_machine_runs_its_chunks_serially_with_the_same_bits():
    """One kv head and 8 query heads over 48 cached positions: two threads cut the keys
    into two chunks (flash-decoding); seen busy, the step runs both chunks on the caller's
    thread, cut the same way, so the bits are the quiet step's."""
    from attnlab import _decode
    from attnlab.cache import KVCache

    ops = _native.load()
    g = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(1, 1, 48, 64, generator=g) for _ in range(2))
    qkv = torch.randn(1, 1, (8 + 2) * 64, generator=g)

    def step() -> torch.Tensor:
        cache = KVCache(1, 64, 1, 64)
        cache.update(keys, values)
        with torch.inference_mode():
            out = _decode.step(qkv, cache, None, None, 8, 1)
        assert out is not None and cache.seq_len == 49
        return out

    with thread_count(2):
        try:
            ops.workers_for(0.0, 0)
            quiet = step()
            ops.workers_for(0.0, 1)
            busy = step()
            ops.workers_for(0.0, 0)
            ops.workers_for(0.0, 2)
            shared = step()
        finally:
            ops.workers_for(0.0, 0)
    with thread_count(1):
        one = step()  # one chunk: another rounding of the same softmax
    torch.testing.assert_close(one, quiet, rtol=1e-5, atol=1e-6)
    assert torch.equal(busy, quiet) and torch.equal(shared, quiet)
