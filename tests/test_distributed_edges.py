"""attnlab.distributed at its edges: bf16 and fp16 shards, empty batches, calls that
raise on every rank (the group stays usable), ranks that disagree on an option, and
the refusals of Ulysses and of models split with a fixed ``seq_len``."""

from __future__ import annotations

import distributed_workers as workers
import pytest
import torch

import attnlab
from attnlab.distributed import ContextParallel, ring_attention, ulysses_attention
from attnlab.models import GPT, GPTConfig


@pytest.mark.parametrize(("batch", "v_dim"), [(0, 4), (1, 0), (0, 0)])
def test_an_empty_batch_or_value_width_is_the_whole_calls_empty_output(one_rank, batch, v_dim):
    q = torch.randn(batch, 2, 5, 4, requires_grad=True)
    k = torch.randn(batch, 1, 5, 4, requires_grad=True)
    v = torch.randn(batch, 1, 5, v_dim, requires_grad=True)
    out = ring_attention(q, k, v, causal=True)
    assert out.shape == attnlab.attention(q, k, v, causal=True).shape == (batch, 2, 5, v_dim)
    out.sum().backward()
    assert [t.grad.shape for t in (q, k, v)] == [t.shape for t in (q, k, v)]


def test_bf16_and_fp16_split_attention_equals_the_whole_call_in_them():
    # Each backend's local step takes q, k and v in their own dtype, as attention does
    # (q went in as float32 beside bf16 keys, and every backend but tiled refused it);
    # the merged output and the gradients' sums stay float32.
    cases = [dict(strategy=strategy, batch=1, kv_heads=2 if strategy == "ulysses" else 1,
                  group=2, head_dim=8, v_extra=0, q_len=11, k_len=11, causal=True,
                  window=None, padding=False, layout="zigzag", backend=backend,
                  variants=variants, block=3, dtype=dtype)
             for dtype in ("bfloat16", "float16")
             for backend in ("auto", "flash", "eager", "sdpa", "tiled")
             for strategy, variants in (("ring", ()), ("ring", ("alibi", "documents")),
                                        ("ulysses", ()))]
    results = workers.spawn(2, workers.exactness, cases)
    assert all(res[0] == "ok" for res in results.values()), results
    worst = [max(results[r][1][i] for r in range(2)) for i in range(len(cases))]
    failing = [(c["dtype"], c["backend"], c["strategy"], c["variants"], w)
               for c, w in zip(cases, worst) if not w <= 3e-2]
    assert not failing, failing


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_a_call_that_raises_on_every_rank_leaves_the_group_usable(which):
    # The messages it had posted are drained before the error leaves it: without that, a
    # receive posted a tick ahead stays open and the next collective waits out the
    # group's timeout. A backward's peers still wait for gradient sums that a failed step
    # never sends: the group takes collectives, and the next split attention on it is
    # refused in one line (its messages would go to those receives).
    results = workers.spawn(2, workers.raises_alike, which, timeout=20.0, limit=60)
    for rank in range(2):
        assert results[rank][0] == "ok", results[rank]
        said, total, seconds, again = results[rank][1]
        assert said == f"a {which} step" and total == 2.0 and seconds < 5, results[rank]
        assert again == "ok" if which == "forward" else again.startswith(
            "RingError: ring_attention: a ring_attention backward on this group raised "
            "(RuntimeError) between its messages; its receives are still open"), again


def test_ulysses_names_what_it_cannot_take(one_rank):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="return_weights is not supported by split attention"):
        ulysses_attention(q, q, q, return_weights=True)
    with pytest.raises(TypeError, match="ulysses_attention\\(\\) got an unexpected keyword "
                                        "argument 'block'"):
        ulysses_attention(q, q, q, block=2)
    assert torch.equal(ulysses_attention(q, q, q, return_weights=False),
                       attnlab.attention(q, q, q))
    with pytest.raises(ValueError, match=r"seq_len must be the whole sequence's length, or "
                                         r"\(q_len, k_len\) when they differ, got \(4,\)"):
        ring_attention(q, q, q, seq_len=(4,))


def test_a_split_module_or_model_checks_the_whole_length(one_rank):
    # MultiHeadAttention's context_length counts the whole sequence, as GPT's does, and a
    # shard that a fixed seq_len does not give is named before any position is made
    results = workers.spawn(2, workers.split_module_too_long)
    assert all(results[r] == ("ok", "sequence of 12 tokens (split over the ranks) is longer "
                                    "than context_length=8") for r in range(2)), results
    for positions in ("learned", "rope", "alibi"):
        model = GPT(GPTConfig(vocab_size=11, d_model=16, num_heads=2, num_layers=1,
                              context_length=32, positions=positions),
                    context_parallel=ContextParallel(seq_len=16))
        with pytest.raises(ValueError, match="rank 0's shard holds 12 tokens; a zigzag split "
                                             "of ContextParallel's seq_len=16 over 1 ranks "
                                             "gives it 16"):
            model(torch.randint(0, 11, (1, 12)))
