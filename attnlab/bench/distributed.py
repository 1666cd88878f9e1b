"""``attnlab bench --suite distributed``: ring attention across processes on this machine.

Every measurement runs in fresh processes started with ``torch.multiprocessing`` (gloo):
``N`` ranks for the ring, one process for the single-process flash peer. Each process
notes its RSS after its imports and set-up (and the kernel's load), builds its inputs
(a rank only its own shards; the exactness case builds the whole sequence on every rank
to check against, so it reports no peak), runs the step once and reads its RSS high-water mark
(``memprobe``'s ``VmHWM``): ``peak_mb`` is the difference. Then it times ``rounds``
more steps (ranks start each together, after a barrier).

Per case, the ring's record adds: ``per_rank_peak_mb`` and ``peak_ratio`` (the largest
rank's peak over the single-process peak); ``per_rank_ms`` (the slowest rank's step) and
``time_vs_single_over_n`` (that over the single process's time / N: 1 is perfect
scaling on N machines, but here the N ranks share the cores the single process had,
so N is perfect);
``hidden_fraction`` (per rank, 1 - the forward's exposed communication over the same
messages' time run alone, without computation: the share of communication hidden
behind the kernels; a wait counts only from when the neighbour had posted the piece,
so that waiting for a neighbour still computing, which ranks sharing cores do, is not
counted as communication); ``max_error`` for the exactness case (output
and gradients against single-process ``attnlab.attention``); ``compute_gflops`` (the
single process's rate, what the README's scaling model starts from).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from .memprobe import _status_mb
from .runner import Case, Impl, format_record

MOD = __name__
# Not in a plain ``attnlab bench``: it takes minutes (T=65536 on every rank); name it.
OPT_IN = True
BASELINE = "attnlab-flash (1 process)"
RING = "ring (per rank)"


def _spec(seq, *, world=4, heads=8, kv_heads=8, dim=64, causal=True, layout="zigzag",
          backward=False, rounds=3, check=False, block=None) -> dict:
    return dict(seq=seq, world=world, heads=heads, kv_heads=kv_heads, dim=dim, causal=causal,
                layout=layout, backward=backward, rounds=rounds, check=check, block=block)


def cases(quick: bool = False) -> list[Case]:
    specs = ([_spec(1027, kv_heads=2, backward=True, rounds=1, check=True),
              _spec(4096, rounds=2), _spec(4096, backward=True, rounds=1)] if quick else
             [_spec(4099, kv_heads=2, backward=True, rounds=1, check=True),
              _spec(16384, rounds=3), _spec(8192, backward=True, rounds=2),
              _spec(65536, rounds=0)])
    out = []
    for s in specs:
        name = (f"{'exact ' if s['check'] else ''}{'fwd+bwd' if s['backward'] else 'fwd'} "
                f"T={s['seq']} H={s['heads']}/{s['kv_heads']} D={s['dim']} N={s['world']} "
                f"{'causal ' if s['causal'] else ''}{s['layout']}")
        out.append(Case("distributed", name, [Impl(RING, (MOD, "_unused", {})),
                                              Impl(BASELINE, (MOD, "_unused", {}))],
                        repeats=s["rounds"], extra={"spec": s}))
    return out


def run_cases(cases: list[Case], *, memory: bool = True, log: Callable[[str], None] = print,
              under_load: bool = False) -> list[dict]:
    """This suite's own runner (``bench.run`` calls it instead of ``runner.run_cases``):
    each case spawns its processes, the records have the runner's fields. It has no
    ``under_load`` runs (the ranks fill the cores already): asked for, it says so once."""
    if under_load:
        log("--under-load: the distributed suite's ranks fill the cores already; its cases "
            "run quiet only")
    records = []
    for case in cases:
        spec = case.extra["spec"]
        log(f"[distributed] {case.name} ...")
        ring = _spawn(spec["world"], spec)
        single = _spawn(1, {**spec, "single": True})[0]
        records += _records(case, spec, ring, single)
        for r in records[-2:]:
            log("    " + format_record(r) + _summary(r))
    return records


def _records(case, spec, ring, single) -> list[dict]:
    world = spec["world"]
    # A step takes as long as its slowest rank, the first (untimed rounds) included.
    step_ms = [max(r["times_ms"][i] for r in ring) for i in range(len(ring[0]["times_ms"]))]
    step_ms = step_ms or [max(r["first_ms"] for r in ring)]
    ring_rec = {"suite": "distributed", "case": case.name, "impl": RING,
                "median_ms": statistics.median(step_ms), "times_ms": step_ms,
                "peak_mb": max(r["peak_mb"] for r in ring),
                "per_rank_peak_mb": [r["peak_mb"] for r in ring], "world_size": world}
    single_rec = {"suite": "distributed", "case": case.name, "impl": BASELINE,
                  "median_ms": (statistics.median(single["times_ms"]) if single["times_ms"]
                                else single["first_ms"]),
                  "times_ms": single["times_ms"] or [single["first_ms"]],
                  "peak_mb": single["peak_mb"], "compute_gflops": single["gflops"]}
    # The exactness case builds the whole sequence on every rank to check it: no peak.
    ring_rec["peak_ratio"] = (None if spec["check"]
                              else ring_rec["peak_mb"] / single_rec["peak_mb"])
    ring_rec["time_vs_single_over_n"] = ring_rec["median_ms"] / (single_rec["median_ms"] / world)
    ring_rec["cores"] = os.cpu_count()
    if ring[0].get("events"):
        exposed = [statistics.median(_exposed(ring, i, r) for i in range(len(ring[0]["events"])))
                   for r in range(world)]
        alone = [statistics.median(_exposed(ring, i, r, "alone")
                                   for i in range(len(ring[0]["alone"]))) for r in range(world)]
        ring_rec["hidden_fraction"] = [1.0 if a <= 0 else max(0.0, 1 - e / a)
                                       for e, a in zip(exposed, alone)]
        ring_rec["hidden_total"] = (1.0 if sum(alone) <= 0
                                    else max(0.0, 1 - sum(exposed) / sum(alone)))
        ring_rec["exposed_comm_ms"] = [e * 1000 for e in exposed]
        ring_rec["comm_alone_ms"] = [a * 1000 for a in alone]
        ring_rec["compute_ms"] = [r["compute_ms"] for r in ring]
        ring_rec["sent_mb_per_rank"] = [r["sent_mb"] for r in ring]
    if spec["check"]:
        ring_rec["max_error"] = max(r["error"] for r in ring)
    for a, b in ((ring_rec, single_rec), (single_rec, ring_rec)):
        a["ratio_to"] = {b["impl"]: a["median_ms"] / b["median_ms"]}
    return [ring_rec, single_rec]


def _exposed(ring: list[dict], i: int, rank: int, which: str = "events") -> float:
    """Seconds ``rank`` waited in round ``i`` for pieces that its neighbour had already
    posted: each wait counts from when both this rank waited and the piece was sent
    (a wait for a neighbour still computing is imbalance, not communication)."""
    sent = {(e[1], e[2]): e[3] for r in ring for e in r[which][i] if e[0] == "sent"}
    total = 0.0
    for e in ring[rank][which][i]:
        if e[0] == "received":
            _, uid, hop, waiting, done = e
            total += max(0.0, done - max(waiting, sent[(uid, hop)]))
    return total


def _summary(r: dict) -> str:
    parts = []
    if r.get("peak_ratio") is not None:
        parts.append(f"peak {r['peak_ratio']:.2f}x single")
    if "time_vs_single_over_n" in r:
        parts.append(f"time {r['time_vs_single_over_n']:.2f}x single/N")
    if r.get("hidden_fraction"):
        parts.append(f"comm hidden {r['hidden_total']:.0%} (ranks "
                     f"{min(r['hidden_fraction']):.0%}-{max(r['hidden_fraction']):.0%})")
    if "max_error" in r:
        parts.append(f"max error {r['max_error']:.1e}")
    if r.get("compute_gflops"):
        parts.append(f"{r['compute_gflops']:.0f} GFLOP/s")
    return ("  (" + ", ".join(parts) + ")") if parts else ""


def summary_table(records: list[dict]) -> str:
    """One row per case: the ring's peak, time and overlap against the single process."""
    lines = ["| case | per-rank peak / single | time / (single / N) | comm hidden | error |",
             "|---|---:|---:|---:|---:|"]
    for r in records:
        if r["impl"] != RING:
            continue
        peak = "-" if r.get("peak_ratio") is None else f"{r['peak_ratio']:.2f}x"
        hidden = f"{r['hidden_total']:.0%}" if "hidden_total" in r else "-"
        error = f"{r['max_error']:.1e}" if "max_error" in r else "-"
        lines.append(f"| {r['case']} | {peak} | {r['time_vs_single_over_n']:.2f}x | {hidden} | "
                     f"{error} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the processes


def _spawn(world: int, spec: dict) -> list[dict]:
    """Run ``_rank`` in ``world`` fresh processes; their reports in rank order."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:  # a free port for this group's rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, spec, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(world):
            rank, report = results.get(timeout=3600)
            if isinstance(report, str):
                raise RuntimeError(f"rank {rank} of the distributed bench failed: {report}")
            got[rank] = report
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(world)]


def _rank(rank, world, port, spec, results) -> None:
    try:
        results.put((rank, _measure(rank, world, port, spec)))
    except BaseException as exc:  # reported, not lost in a child's stderr
        results.put((rank, f"{type(exc).__name__}: {exc}"))


def _measure(rank: int, world: int, port: int, spec: dict) -> dict:
    import datetime

    import torch.distributed as dist

    from ..distributed import ring_attention
    from ..distributed.ring import messages_only
    from ..functional import attention

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    single = spec.get("single", False)
    if not single:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=3600))
    seq = spec["seq"]
    attention(*[torch.zeros(1, 1, 1, 1)] * 3, backend="flash")  # the kernel loaded first
    baseline = _status_mb("VmRSS")
    q, k, v, grad, whole = _inputs(rank, world, spec, single)
    options = dict(causal=spec["causal"], layout=spec["layout"], seq_len=seq,
                   block=spec.get("block"))

    def step(profile=None):
        if single:
            out = attention(q, k, v, causal=spec["causal"], backend="flash")
        else:
            out = ring_attention(q, k, v, profile=profile, **options)
        if spec["backward"]:
            out.backward(grad)
        return out

    def timed(profile=None) -> float:
        if not single:
            dist.barrier()
        start = time.perf_counter()
        step(profile)
        return (time.perf_counter() - start) * 1000

    first = timed()
    report = {"peak_mb": max(0.0, _status_mb("VmHWM") - baseline), "first_ms": first}
    profiles = [{"events": []} for _ in range(spec["rounds"])]
    report["times_ms"] = [timed(p) for p in profiles]
    flops = _flops(spec)
    report["gflops"] = flops / (statistics.median(report["times_ms"] or [first]) / 1000) / 1e9
    if not single and profiles:
        alone = [{"events": []} for _ in profiles]
        for p in alone:
            dist.barrier()
            messages_only(q.detach(), k.detach(), v.detach(), profile=p, **options)
        report.update(events=[p["events"] for p in profiles],
                      alone=[p["events"] for p in alone],
                      sent_mb=profiles[0]["bytes"] / 2**20,
                      compute_ms=statistics.median(p["compute_s"] for p in profiles) * 1000)
    if spec["check"] and not single:
        report["error"] = _error(rank, world, spec, q, k, v, grad, whole, step)
    if not single:
        dist.barrier()
        dist.destroy_process_group()
    return report


def _inputs(rank, world, spec, single):
    from ..distributed import shard

    seq, heads, kv, dim = spec["seq"], spec["heads"], spec["kv_heads"], spec["dim"]
    grad = spec["backward"]
    heads_of = (heads, kv, kv, heads) if grad else (heads, kv, kv)  # the output's gradient
    if single or spec["check"]:
        g = torch.Generator().manual_seed(0)
        whole = [torch.randn(1, h, seq, dim, generator=g) for h in heads_of]
        if single:
            return (*[t.requires_grad_(grad) for t in whole[:3]], _last(whole, grad), None)
        mine = [shard(t, world, rank, layout=spec["layout"], dim=2).clone() for t in whole]
        return (*[t.requires_grad_(grad) for t in mine[:3]], _last(mine, grad), whole)
    g = torch.Generator().manual_seed(rank)  # a rank builds its own shards only
    from ..distributed import shard_lengths

    n = shard_lengths(seq, world, spec["layout"])[rank]
    mine = [torch.randn(1, h, n, dim, generator=g) for h in heads_of]
    return (*[t.requires_grad_(grad) for t in mine[:3]], _last(mine, grad), None)


def _last(tensors, grad):
    return tensors[3] if grad else None


def _error(rank, world, spec, q, k, v, grad, whole, step) -> float:
    """The largest difference of this rank's output and gradients from single-process
    ``attnlab.attention`` on the whole sequence, cut to this rank's shard."""
    from ..distributed import shard
    from ..functional import attention

    for t in (q, k, v):
        t.grad = None
    out = step()
    leaves = [t.detach().clone().requires_grad_() for t in whole[:3]]
    want = attention(*leaves, causal=spec["causal"])
    want.backward(whole[3])
    pairs = [(out, want)] + [(a.grad, b.grad) for a, b in zip((q, k, v), leaves)]
    cut = [(a, shard(b, world, rank, layout=spec["layout"], dim=2)) for a, b in pairs]
    return max(float((a.detach() - b.detach()).abs().max()) for a, b in cut)


def _flops(spec) -> float:
    from .attention import attention_flops

    return attention_flops(1, spec["heads"], spec["seq"], spec["seq"], spec["dim"],
                           causal=spec["causal"], backward=spec["backward"])


def _unused():  # the impls' factories: this suite runs its own processes (run_cases)
    raise RuntimeError("the distributed suite runs through its run_cases")
