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
            "(RuntimeError) between its messages; its peers' receives are still open"), again


def test_a_group_marked_on_one_rank_is_refused_on_every_rank():
    # a backward can fail on one rank alone (after its last send): its peers, unmarked,
    # must not go on to wait for it in the next call's exchange
    results = workers.spawn(2, workers.marked_on_rank_0, timeout=20.0, limit=60)
    assert results[0] == ("ok", "RingError: ring_attention: it was marked; its peers' "
                                "receives are still open and would take this call's "
                                "messages: make a new group (dist.new_group) for the split "
                                "attentions"), results
    assert results[1][0] == "ok" and results[1][1].startswith(
        "RingError: ring_attention: rank 0's earlier split call on this group raised between "
        "its messages;"), results


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


def test_options_that_the_variants_refuse_are_named_by_them(one_rank):
    # the ranks' digest of the options runs first, and must not pre-empt their messages
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match="softcap must be a number, got list"):
        ring_attention(q, q, q, softcap=[2.0])
    with pytest.raises(ValueError, match="sinks is on meta but q is on cpu"):
        ring_attention(q, q, q, sinks=torch.zeros(2, device="meta"))
    with pytest.raises(TypeError, match="alibi_slopes"):
        ring_attention(q, q, q, alibi_slopes=torch.ones(2, dtype=torch.complex64))


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_a_split_model_gathers_its_length_once_and_each_layer_its_shapes_once(one_rank,
                                                                              positions):
    # each layer's context_length check reads the length the model gathered: one
    # all-gather for the model and one per layer's ring call, as before that check came
    from unittest import mock

    from attnlab.distributed.comm import Group

    model = GPT(GPTConfig(vocab_size=11, d_model=16, num_heads=2, num_layers=4,
                          context_length=32, positions=positions),
                context_parallel=ContextParallel())
    with mock.patch.object(Group, "all_gather_ints", autospec=True,
                           side_effect=Group.all_gather_ints) as gathers:
        model(torch.randint(0, 11, (1, 12)))
    assert gathers.call_count == 1 + 4
