"""attnlab.distributed: ring and all-to-all attention across processes (gloo), exact.

Spawning processes is the slow part, so each world size spawns ONE group that runs a
whole seeded random list of cases (lengths not divisible by the world size, causal
or not, windows, GQA, padding, the variants that cross shards (softcap, ALiBi, sinks,
document ids), both layouts, every log-sum-exp step, both strategies) and
reports each case's error against single-process ``attnlab.attention``.
"""

from __future__ import annotations

import os
import random

import distributed_workers as workers
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlab
from attnlab.distributed import (
    ContextParallel,
    gather,
    ring_attention,
    shard,
    shard_lengths,
    shard_mask,
    shard_positions,
    shard_ranges,
    ulysses_attention,
    unshard,
)

TOL = 1e-5  # float32, relative to 1 + |expected|


def _case(rng: random.Random, world: int) -> dict:
    """One random case for ``world`` ranks."""
    strategy = rng.choice(["ring", "ring", "ring", "ulysses"])
    kv_heads = rng.choice([1, 2]) if strategy == "ring" else world
    q_len = rng.randint(1, 4 * world + 3)
    same = strategy == "ulysses" or rng.random() < 0.75
    variants = rng.choice([(), (), (), ("softcap",), ("alibi",), ("sinks",), ("documents",),
                           ("softcap", "alibi", "sinks", "documents")])
    backend = rng.choice(["auto", "flash", "sdpa", "tiled", "eager"])
    if backend == "sdpa" and {"softcap", "sinks"} & set(variants):
        backend = "auto"  # torch's kernel takes neither (the table says so)
    return {
        "strategy": strategy,
        "batch": rng.randint(1, 2),
        "kv_heads": kv_heads,
        "group": rng.choice([1, 2, 3]),
        "head_dim": rng.choice([4, 8]),
        "v_extra": rng.choice([0, 0, 2]),
        "q_len": q_len,
        "k_len": q_len if same else rng.randint(1, 4 * world + 3),
        "causal": rng.random() < 0.5,
        "window": rng.choice([None, None, 1, 2, 5]),
        "padding": rng.random() < 0.5,
        "layout": rng.choice(["contiguous", "zigzag"]),
        "backend": backend,
        "variants": variants,
        "block": rng.choice([None, None, 1, 2, 3]),
    }


def _sweep(world: int, n: int, seed: int | None = None):
    """``n`` random cases (seeded: ``ATTNLAB_RING_SEED`` or the world size), run in one
    spawned group of ``world`` ranks. Not a hypothesis list: drawn once per test, its
    first example would be the simplest case ``n`` times over."""
    seed = int(os.environ.get("ATTNLAB_RING_SEED", world)) if seed is None else seed
    rng = random.Random(seed)
    cases = [_case(rng, world) for _ in range(n)]
    # The sweep covers what it claims: both strategies and rules, variants, every backend.
    assert {c["strategy"] for c in cases} == {"ring", "ulysses"}
    assert {c["causal"] for c in cases} == {True, False}
    assert {c["backend"] for c in cases} >= {"flash", "eager", "tiled"}
    assert {v for c in cases for v in c["variants"]} >= {"softcap", "alibi", "sinks",
                                                          "documents"}
    if world == 1:
        errors = [workers.exactness(0, 1, cases)]
    else:
        results = workers.spawn(world, workers.exactness, cases)
        bad = {r: res for r, res in results.items() if res[0] != "ok"}
        assert not bad, bad
        errors = [results[r][1] for r in range(world)]
    worst = [max(per_rank[i] for per_rank in errors) for i in range(n)]
    failing = [(cases[i], worst[i]) for i in range(n) if not worst[i] <= TOL]
    assert not failing, (seed, failing)
    assert max(worst) > 0  # the comparison ran: float32 paths differ in the last bits
    return max(worst)


def test_world_size_1(one_rank):
    _sweep(1, 40)


def test_world_size_2():
    _sweep(2, 28)


def test_world_size_3():
    _sweep(3, 24)


@pytest.mark.slow
def test_world_size_4():
    _sweep(4, 24)


@pytest.mark.parametrize("world", [2, 3])
def test_message_buffers_are_reused_so_memory_does_not_grow_with_the_sequence(world):
    # Each pass makes the few buffers it holds at once (a piece per shard in hand, the
    # next ones arriving, the last ones still being sent) and reuses them: 4x the
    # sequence sends 4x the messages through the same buffers.
    runs = [workers.spawn(world, workers.message_buffers, seq, 16, limit=120)
            for seq in (160 * world, 640 * world)]
    assert all(res[0] == "ok" for r in runs for res in r.values()), runs
    for rank in range(world):
        short, long = (r[rank][1] for r in runs)
        assert long["messages"] >= 4 * short["messages"] - 8 * world
        assert long["buffers"] == short["buffers"] <= 3 * world
        assert long["backward_buffers"] == short["backward_buffers"] <= 6 * world


@pytest.mark.slow
def test_a_rank_that_dies_mid_step_stops_the_others_with_one_clear_error():
    world, victim = 3, 1
    results = workers.spawn(world, workers.die_mid_step, victim, 5.0, timeout=5.0, limit=60)
    assert results[victim] == ("hung",)  # killed: it never reported
    for rank in set(range(world)) - {victim}:
        status, message = results[rank]
        assert status == "ok", results
        assert message.startswith("RingError after "), message
        assert f"rank {rank} of {world} stopped while" in message
        assert "another process of the group died" in message
        assert float(message.split()[2].rstrip("s:")) < 20


# --------------------------------------------------------------------------- sharding


@given(st.integers(0, 40), st.integers(1, 6), st.sampled_from(["contiguous", "zigzag"]))
def test_shards_cover_the_sequence_once_and_come_back(seq_len, world, layout):
    x = torch.arange(seq_len * 2).view(2, seq_len)
    parts = [shard(x, world, r, layout=layout) for r in range(world)]
    assert [p.shape[1] for p in parts] == shard_lengths(seq_len, world, layout)
    assert torch.equal(unshard(parts, layout=layout), x)
    positions = torch.cat([shard_positions(seq_len, world, r, layout) for r in range(world)])
    assert sorted(positions.tolist()) == list(range(seq_len))
    for r in range(world):
        assert torch.equal(parts[r][0], shard_positions(seq_len, world, r, layout))
    lengths = shard_lengths(seq_len, world, layout)
    assert max(lengths) - min(lengths) <= (1 if layout == "contiguous" else 2)


def test_zigzag_balances_causal_work():
    """Each rank's (query, key) pairs under a causal rule: zig-zag keeps them within a
    few percent of each other; contiguous gives the last rank ~7x the first (N=4)."""
    def pairs(layout, r):
        return sum(p + 1 for s, e in shard_ranges(4096, 4, r, layout) for p in range(s, e))

    zig = [pairs("zigzag", r) for r in range(4)]
    flat = [pairs("contiguous", r) for r in range(4)]
    assert max(zig) / min(zig) < 1.01
    assert flat[3] / flat[0] > 6


def test_shard_helpers_refuse_bad_input():
    with pytest.raises(ValueError, match="layout must be one of"):
        shard_ranges(8, 2, 0, "spiral")
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\)"):
        shard(torch.zeros(1, 8), 2, 2)
    with pytest.raises(ValueError, match="key-padding mask"):
        shard_mask(torch.ones(2, 3, 8, dtype=torch.bool), 2, 0)
    with pytest.raises(ValueError, match=r"shards have lengths \[4, 2\] along dim 1; a "
                       r"zigzag split of 6 tokens over 2 ranks has \[3, 3\]"):
        unshard([torch.zeros(1, 4), torch.zeros(1, 2)], layout="zigzag")
    assert shard_mask(torch.tensor([[1, 1, 0, 0]]), 2, 1, layout="zigzag").tolist() == [[1, 0]]


# --------------------------------------------------------------------------- one process


def test_gather_and_context_parallel_in_one_process(one_rank):
    x = torch.randn(2, 5, 3)
    assert torch.equal(gather(x, layout="zigzag"), x)
    cp = ContextParallel(layout="zigzag")
    assert (cp.world_size, cp.rank) == (1, 0)
    assert cp.positions(5).tolist() == [0, 1, 2, 3, 4]


def test_split_attention_refuses_bad_calls(one_rank):
    q = torch.randn(1, 4, 6, 8)
    k = torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match=r"key-padding shard \(batch=1, k_len_rank=6\)"):
        ring_attention(q, k, k, mask=torch.ones(6, 6, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be bool"):
        ring_attention(q, k, k, mask=torch.zeros(1, 6))
    with pytest.raises(ValueError, match="seq_len=9"):
        ring_attention(q, k, k, seq_len=9)
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'eager'"):
        ring_attention(q, k, k, backend="nope")
    with pytest.raises(ValueError, match="window must be a positive int"):
        ring_attention(q, k, k, window=0)
    with pytest.raises(ValueError, match="layout must be one of"):
        ulysses_attention(q, k, k, layout="spiral")
    with pytest.raises(ValueError, match="timeout must be"):
        ring_attention(q, k, k, timeout=-1)
    with pytest.raises(ValueError, match="strategy must be one of"):
        ContextParallel(strategy="tree")
    assert attnlab.distributed.ring_attention is ring_attention


def test_split_attention_needs_a_group():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="needs torch.distributed initialised"):
        ring_attention(*(torch.randn(1, 1, 2, 4) for _ in range(3)))


def test_ring_profile_counts_the_work(one_rank):
    q = torch.randn(1, 2, 64, 8)
    profile = {}
    out = ring_attention(q, q, q, causal=True, block=16, profile=profile)
    torch.testing.assert_close(out, attnlab.attention(q, q, q, causal=True))
    assert profile["ticks"] == 4 and profile["messages"] == 0 and profile["compute_s"] > 0


@pytest.mark.slow
def test_a_rank_that_stops_answering_is_given_up_on_after_the_timeout():
    results = workers.spawn(2, workers.one_stalls, timeout=60.0, limit=60)
    assert results[1] == ("ok", None)
    status, message = results[0]
    assert message.startswith("RingError after "), message
    assert 2 <= float(message.split()[2].rstrip("s:")) < 10
    assert "did not answer within 2 s" in message


@pytest.mark.slow
def test_every_rank_refuses_the_same_calls_with_the_same_error():
    results = workers.spawn(2, workers.refusals)
    assert results[0] == results[1] and results[0][0] == "ok", results
    heads, disagree, *options = results[0][1]
    assert heads.startswith("ulysses_attention splits the heads over the 2 ranks: q_heads (3)")
    assert "the ranks disagree on causal: [0, 1]" in disagree
    # the options beside the shapes too (each rank's rows would follow its own; ids on
    # one rank only left the others waiting in another exchange until the timeout)
    for name, said in zip(["scale", "softcap", "sinks", "alibi_slopes", "document_ids"],
                          options, strict=True):
        assert said.startswith(f"the ranks disagree on {name}: rank 1's differs from rank "
                               "0's; every rank must call with the same shapes"), said


@pytest.mark.slow
def test_a_group_of_two_gives_ring_error_not_a_hang_when_one_rank_raises():
    results = workers.spawn(2, workers.one_raises, timeout=5.0, limit=60)
    assert results[0][0] == "error" and results[0][1] == "ValueError"
    assert results[1][0] == "error" and results[1][1] == "RingError", results[1]


@pytest.mark.slow
def test_gpt_split_across_two_processes_equals_the_whole():
    cases = [dict(positions=p, kv_heads=kv, window=w, layout=lay, strategy=s, seq=seq, fixed=f)
             for p, kv, w, lay, s, seq, f in [
                 ("rope", 2, None, "zigzag", "ring", 13, True),
                 ("learned", 4, None, "contiguous", "ring", 12, False),
                 ("rope", 1, 4, "zigzag", "ring", 11, False),
                 ("rope", 2, None, "zigzag", "ulysses", 9, True),
                 ("alibi", 2, None, "zigzag", "ring", 13, True),
                 ("alibi", 2, None, "contiguous", "ulysses", 10, True)]]
    # The variant models (Gemma 2's softcap, BLOOM's ALiBi, gpt-oss's sinks) split too.
    for case in cases[-2:]:
        case["config"] = {"attn_softcap": 5.0, "sinks": True}
    results = workers.spawn(2, workers.model_split, cases)
    assert all(r[0] == "ok" for r in results.values()), results
    for rank in range(2):
        assert max(results[rank][1]) < TOL, results


# --------------------------------------------------------------------------- the plan


@settings(max_examples=60, deadline=None)
@given(q_len=st.integers(1, 40), k_extra=st.integers(-5, 5), world=st.integers(1, 5),
       layout=st.sampled_from(["contiguous", "zigzag"]), causal=st.booleans(),
       window=st.sampled_from([None, 1, 3, 8]), block=st.integers(1, 9))
def test_the_plan_computes_every_allowed_pair_once_and_sends_no_more(q_len, k_extra, world,
                                                                   layout, causal, window,
                                                                   block):
    """Summed over ranks, ticks and calls, the pairs computed are exactly the pairs the
    rule allows on the whole sequence; a piece is sent on only while a later rank
    still computes on it (no message is wasted)."""
    from attnlab import masks
    from attnlab.distributed.plan import Plan

    k_len = max(1, q_len + k_extra)
    plan = Plan(q_len, k_len, world, layout, causal, window, block)
    want = masks.KeyRule(q_len, k_len, causal=causal, window=window).pairs()
    got, held = 0, {}
    for rank in range(world):
        for tick in range(plan.ticks):
            for it in plan.items(rank, tick):
                assert tick == it.piece.index + it.hop
                held[(it.piece.uid, it.hop)] = it
                got += sum(masks.KeyRule(c.q_len, it.piece.size, causal=causal, window=window,
                                         offset=c.offset).pairs() for c in it.calls)
    assert got == want
    for (uid, hop), it in held.items():
        assert (uid, hop + 1) in held if it.send else (uid, hop + 1) not in held
        if it.send:  # someone further on computes with it
            assert any(held[(uid, h)].calls for h in range(hop + 1, world) if (uid, h) in held)


@settings(max_examples=60, deadline=None)
@given(q_len=st.integers(1, 40), k_extra=st.integers(-5, 5), world=st.integers(1, 5),
       layout=st.sampled_from(["contiguous", "zigzag"]), causal=st.booleans(),
       window=st.sampled_from([None, 1, 3, 8]), block=st.integers(1, 9))
def test_the_receives_posted_ahead_are_the_pieces_held_next_tick(q_len, k_extra, world, layout,
                                                                 causal, window, block):
    """``arrivals`` (what the passes post receives for, a tick ahead, without working out
    any calls) names exactly the received pieces of the next tick's ``items``."""
    from attnlab.distributed.plan import Plan

    plan = Plan(q_len, max(1, q_len + k_extra), world, layout, causal, window, block)
    for rank in range(world):
        for tick in range(plan.ticks + 1):
            assert plan.arrivals(rank, tick) == [(it.piece, it.hop)
                                                 for it in plan.items(rank, tick) if it.hop]


def test_a_causal_contiguous_ring_never_sends_keys_backwards():
    from attnlab.distributed.plan import Plan

    plan = Plan(64, 64, 4, "contiguous", True, None, 8)
    assert all(it.hop == 0 for t in range(plan.ticks) for it in plan.items(0, t))
    sent = sum(it.send for r in range(4) for t in range(plan.ticks) for it in plan.items(r, t))
    assert sent == 2 * (3 + 2 + 1)  # each rank's 2 pieces go only to the ranks after it
    # A window of 4: only the last piece of ranks 0-2 is needed by the next rank, once.
    window = Plan(64, 64, 4, "contiguous", True, 4, 8)
    assert [window.reach[p.uid] for own in window.pieces for p in own] == [0, 1] * 3 + [0, 0]


@pytest.mark.parametrize("value", ["x", "-1", "2.5"])
def test_a_bad_launcher_variable_is_named(value, monkeypatch, tmp_path):
    """WORLD_SIZE / RANK / LOCAL_RANK left by hand or by another launcher: an error that
    names the variable and what it holds, not int()'s "invalid literal"."""
    import subprocess
    import sys

    from attnlab.training.distributed import launch_env, world_size

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"{name}='{value}'.*whole number"):
            launch_env(name, 0)
        monkeypatch.delenv(name)
    assert launch_env("RANK", 0) == 0
    monkeypatch.setenv("WORLD_SIZE", " 3 ")
    assert world_size() == 3
    env = {**os.environ, "WORLD_SIZE": value}
    done = subprocess.run([sys.executable, "-m", "attnlab", "train", "--steps", "1", "--out",
                           str(tmp_path / "run")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"WORLD_SIZE='{value}'" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()


def test_ring_attention_gives_first_derivatives_with_create_graph_and_refuses_a_second(
        one_rank):
    # The local steps' gradients build no graph (create_graph used to fail inside them),
    # and a second derivative, the sinks' too, raises instead of coming out partial.
    torch.manual_seed(0)
    q, k, v, c = (torch.randn(1, 2, 8, 8) for _ in range(4))
    sinks = torch.randn(2, requires_grad=True)
    q.requires_grad_()
    for backend in ("eager", "auto"):
        out = ring_attention(q, k, v, causal=True, sinks=sinks, backend=backend)
        dq, ds = torch.autograd.grad((out * c).sum(), (q, sinks), create_graph=True)
        want = attnlab.attention(q, k, v, causal=True, sinks=sinks, backend="eager")
        wq, ws = torch.autograd.grad((want * c).sum(), (q, sinks))
        torch.testing.assert_close((dq, ds), (wq, ws), rtol=1e-5, atol=1e-6)
        with pytest.raises(RuntimeError, match="ring attention's gradients cannot be"):
            torch.autograd.grad(ds.sum(), sinks)
