"""What the spawned ranks of tests/test_distributed.py run, and the spawning itself.

Kept apart from the test module so that a spawned process imports torch and attnlab
only (not pytest and hypothesis): spawning is the slow part, so one group of processes
runs a whole list of cases.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main(rank, world, port, timeout, target, args, results):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        value = target(rank, world, *args)
        results.put((rank, "ok", value))
    except BaseException as exc:  # reported to the parent, which decides
        results.put((rank, "error", type(exc).__name__, str(exc), traceback.format_exc()))
    results.close()
    results.join_thread()
    os._exit(0)  # no teardown that could wait on a peer that is gone


def spawn(world: int, target, *args, timeout: float = 30.0, limit: float = 300.0) -> dict:
    """Run ``target(rank, world, *args)`` in ``world`` fresh processes on one gloo group
    (``timeout``: the group's, in seconds); returns ``{rank: ("ok", value)}`` or
    ``{rank: ("error", type, message, traceback)}``. Processes still running after
    ``limit`` seconds are killed and reported as ``("hung",)``."""
    import queue

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_main, args=(r, world, port, timeout, target, args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + limit
    while len(out) < world and time.monotonic() < deadline:
        try:
            rank, *rest = results.get(timeout=0.2)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                break  # every process is gone: what did not report never will
            continue
        out[rank] = tuple(rest)
    for r, p in enumerate(procs):
        p.join(timeout=max(0.1, deadline - time.monotonic()) if r not in out else 10)
        if p.is_alive():
            p.kill()
            p.join()
        out.setdefault(r, ("hung",))
    return out


# --------------------------------------------------------------------------- exactness


def _inputs(case, seed):
    g = torch.Generator().manual_seed(seed)
    b, hkv, group, d = case["batch"], case["kv_heads"], case["group"], case["head_dim"]
    q = torch.randn(b, hkv * group, case["q_len"], d, generator=g)
    k = torch.randn(b, hkv, case["k_len"], d, generator=g)
    v = torch.randn(b, hkv, case["k_len"], d + case.get("v_extra", 0), generator=g)
    mask = None
    if case["padding"]:
        mask = torch.rand(b, case["k_len"], generator=g) > 0.3
        mask[0, :] = mask[0, :] & (torch.arange(case["k_len"]) % 5 != 0)
    grad = torch.randn(b, hkv * group, case["q_len"], v.shape[-1], generator=g)
    return q, k, v, mask, grad, _variants(case, g, hkv * group)


def _variants(case, g, heads) -> dict:
    """The variants of ``case`` as ``attention`` takes them (whole-sequence document ids)."""
    options = {}
    names = case.get("variants", ())
    if "softcap" in names:
        options["softcap"] = 1.5
    if "alibi" in names:
        options["alibi_slopes"] = torch.rand(heads, generator=g) + 0.1
    if "sinks" in names:
        options["sinks"] = torch.randn(heads, generator=g).requires_grad_()
    if "documents" in names and case["q_len"] == case["k_len"]:
        ids = torch.randint(0, 4, (case["batch"], case["q_len"]), generator=g)
        options["document_ids"] = ids.sort(dim=-1).values
    return options


def check_case(case: dict, rank: int, world: int, seed: int) -> float:
    """The largest error of this rank's output and q/k/v gradients against
    ``attnlab.attention`` on the whole sequence (float32), relative to 1 + |expected|."""
    import torch.distributed as dist

    import attnlab
    from attnlab.distributed import ring_attention, shard, shard_mask, ulysses_attention

    q, k, v, mask, grad, options = _inputs(case, seed)
    dtype = getattr(torch, case.get("dtype", "float32"))  # the whole call is in it too
    q, k, v, grad = (t.to(dtype) for t in (q, k, v, grad))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    whole_mask = None if mask is None else mask[:, None, None, :]
    want = attnlab.attention(q, k, v, mask=whole_mask, causal=case["causal"],
                             window=case["window"], **options)
    sinks = [options["sinks"]] if "sinks" in options else []
    wants = [want, *torch.autograd.grad(want, (q, k, v, *sinks), grad)]
    layout = case["layout"]

    def cut(t, dim=2):
        return shard(t.detach(), world, rank, layout=layout, dim=dim)

    mine = [cut(t).requires_grad_() for t in (q, k, v)]
    if "document_ids" in options:  # this rank's shard of the ids, cut like the sequence
        options["document_ids"] = cut(options["document_ids"], dim=1)
    split = ring_attention if case["strategy"] == "ring" else ulysses_attention
    extra = {"block": case["block"]} if case["strategy"] == "ring" else {}
    out = split(*mine, causal=case["causal"], window=case["window"],
                mask=None if mask is None else shard_mask(mask, world, rank, layout=layout),
                layout=layout, backend=case["backend"], **extra, **options)
    got = [out, *torch.autograd.grad(out, (*mine, *sinks), cut(grad))]
    if sinks:  # each rank has its rows' (or heads') share of the sinks' gradient
        dist.all_reduce(got[-1])
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, wants)):
        w = cut(w) if i < 4 else w
        if w.numel():
            g, w = g.detach().float(), w.detach().float()
            worst = max(worst, float(((g - w).abs() / (1 + w.abs())).max()))
    return worst


def exactness(rank: int, world: int, cases: list[dict]) -> list[float]:
    return [check_case(case, rank, world, seed) for seed, case in enumerate(cases)]


# --------------------------------------------------------------------------- failure


def die_mid_step(rank: int, world: int, victim: int, timeout: float) -> str:
    """Every rank starts a ring attention; ``victim`` kills itself at its second kernel
    call (mid-step: messages are in flight). The others must raise RingError."""
    from attnlab import backends
    from attnlab.distributed import ring_attention

    step = backends.TABLE["eager"].lse
    calls = []

    def forward(*args):
        calls.append(1)
        if rank == victim and len(calls) == 2:
            os.kill(os.getpid(), 9)
        return step.forward(*args)

    backends.TABLE["eager"] = backends.Backend(
        "eager", backends.TABLE["eager"].run, lse=backends.LseStep(forward, step.backward))
    q = torch.randn(1, 2, 8, 4)
    start = time.monotonic()
    try:
        ring_attention(q, q, q, causal=False, backend="eager", block=2, timeout=timeout,
                       seq_len=8 * world)
    except Exception as exc:
        return f"{type(exc).__name__} after {time.monotonic() - start:.1f}s: {exc}"
    return "finished"


def refusals(rank: int, world: int) -> list[str]:
    """What every rank says to a call it must refuse: heads that do not divide over the
    ranks (ulysses), and ranks that disagree (rank 1 asks for a causal rule, rank 0 not)."""
    from attnlab.distributed import ring_attention, ulysses_attention

    said = []
    q = torch.randn(1, 3, 3, 4)
    mine = rank == 1  # what only rank 1 passes
    for call in (lambda: ulysses_attention(q, q, q),
                 lambda: ring_attention(q, q, q, causal=mine),
                 lambda: ring_attention(q, q, q, scale=0.25 if mine else None),
                 lambda: ring_attention(q, q, q, softcap=2.0 if mine else None),
                 lambda: ring_attention(q, q, q, sinks=torch.zeros(3) + mine),
                 lambda: ring_attention(q, q, q, alibi_slopes=torch.ones(3) if mine else None),
                 lambda: ring_attention(q, q, q, document_ids=torch.zeros(3, dtype=torch.long)
                                        if mine else None)):
        try:
            call()
            said.append("no error")
        except ValueError as exc:
            said.append(str(exc))
    return said


def one_raises(rank: int, world: int) -> None:
    """Rank 0 refuses its own call (a wrong seq_len) before any message; rank 1 waits for
    its keys and must raise RingError once rank 0's process is gone, not hang."""
    from attnlab.distributed import ring_attention

    q = torch.randn(1, 1, 3, 4)
    ring_attention(q, q, q, seq_len=7 if rank == 0 else 6)


def raises_alike(rank: int, world: int, which: str) -> tuple[str, float, float, str]:
    """Every rank's local step raises (``which``: forward or backward) after the call
    posted its messages; the caller catches it, and the group must still work: a plain
    all_reduce right after completes. Returns (the error, the all_reduce's sum, its
    seconds, what a second call does)."""
    from unittest import mock

    import torch.distributed as dist

    from attnlab.distributed import ring, ring_attention

    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    said = ""
    with mock.patch.object(ring._Setup, which, side_effect=RuntimeError(f"a {which} step")):
        try:
            ring_attention(q, q, q, causal=True, layout="zigzag", block=2).sum().backward()
        except RuntimeError as exc:
            said = str(exc)
    total, start = torch.ones(1), time.monotonic()
    dist.all_reduce(total)
    seconds = time.monotonic() - start
    try:
        ring_attention(q, q, q, causal=True, layout="zigzag", block=2, timeout=5).sum().backward()
        again = "ok"
    except RuntimeError as exc:
        again = f"{type(exc).__name__}: {exc}"
    return said, float(total), seconds, again


def marked_on_rank_0(rank: int, world: int) -> str:
    """Rank 0's group is marked as having open receives; every rank then calls."""
    from attnlab.distributed import ring_attention
    from attnlab.distributed.comm import Group

    if rank == 0:
        Group().spoil("it was marked")
    q = torch.randn(1, 2, 4, 8)
    try:
        ring_attention(q, q, q, timeout=10)
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def split_module_too_long(rank: int, world: int) -> str:
    """A 12-token sequence, 6 per rank, into a split module of context_length 8."""
    from attnlab.distributed import ContextParallel
    from attnlab.modules import MultiHeadAttention

    mha = MultiHeadAttention(16, 16, 2, context_length=8, context_parallel=ContextParallel())
    try:
        mha(torch.randn(1, 12 // world, 16))
    except ValueError as exc:
        return str(exc)
    return "no error"


def one_stalls(rank: int, world: int) -> str | None:
    """Rank 1 is alive but never calls (stuck elsewhere for 6 s); rank 0 must give up
    with RingError after its 2-second timeout, not wait for it."""
    from attnlab.distributed import ring_attention

    if rank == 1:
        time.sleep(6)
        return None
    q = torch.randn(1, 1, 3, 4)
    start = time.monotonic()
    try:
        ring_attention(q, q, q, seq_len=6, timeout=2.0)
    except Exception as exc:
        return f"{type(exc).__name__} after {time.monotonic() - start:.1f}s: {exc}"
    return "finished"


# --------------------------------------------------------------------------- models


def model_split(rank: int, world: int, cases: list[dict]) -> list[float]:
    """GPT with ``context_parallel`` against the same GPT on the whole sequence: this
    rank's logits and every parameter's gradient (summed over the ranks), as the largest
    error relative to 1 + |expected|, per case."""
    import torch.distributed as dist

    from attnlab.distributed import ContextParallel, shard, shard_mask
    from attnlab.models import GPT, GPTConfig

    errors = []
    for seed, case in enumerate(cases):
        torch.manual_seed(seed)
        config = GPTConfig(vocab_size=17, context_length=32, d_model=16, num_layers=2,
                           num_heads=4, num_kv_heads=case["kv_heads"],
                           positions=case["positions"], window=case["window"], mlp="swiglu",
                           norm="rmsnorm", **case.get("config", {}))
        whole = GPT(config)
        split = GPT(config, context_parallel=ContextParallel(
            layout=case["layout"], strategy=case["strategy"],
            seq_len=case["seq"] if case["fixed"] else None))
        split.load_state_dict(whole.state_dict())
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 17, (2, case["seq"]), generator=g)
        mask = torch.ones(2, case["seq"], dtype=torch.long)
        mask[1, -3:] = 0
        weight = torch.randn(2, case["seq"], 17, generator=g)
        want = whole(ids, attention_mask=mask)
        (want * weight).sum().backward()

        layout = case["layout"]

        def cut(t, layout=layout):
            return shard(t, world, rank, layout=layout, dim=1)

        got = split(cut(ids), attention_mask=shard_mask(mask, world, rank, layout=layout))
        (got * cut(weight)).sum().backward()
        want = want.detach()
        worst = float(((got.detach() - cut(want)).abs() / (1 + cut(want).abs())).max())
        for p, q in zip(whole.parameters(), split.parameters()):
            dist.all_reduce(q.grad)
            worst = max(worst, float(((q.grad - p.grad).abs() / (1 + p.grad.abs())).max()))
        errors.append(worst)
    return errors


def message_buffers(rank: int, world: int, seq: int, block: int) -> dict:
    """The profile of one causal ring forward and backward over ``seq`` tokens in pieces
    of ``block`` keys: how many message buffers each pass made, and how many messages."""
    from attnlab.distributed import ring_attention, shard

    g = torch.Generator().manual_seed(0)
    q, k, v = (shard(torch.randn(1, 2, seq, 8, generator=g), world, rank, layout="zigzag",
                     dim=2).requires_grad_() for _ in range(3))
    profile = {}
    out = ring_attention(q, k, v, causal=True, layout="zigzag", block=block, profile=profile)
    out.sum().backward()
    return {key: profile[key] for key in ("buffers", "backward_buffers", "messages")}
