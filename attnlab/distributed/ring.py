"""Ring attention: exact attention over a sequence split across the ranks of a group.

Each rank holds a shard of the queries, keys and values (``shards.py``'s layouts). The
keys and values travel around the ring in pieces (``plan.py``'s schedule) with
``isend``/``irecv``; while the next pieces are on the way, the rank attends its queries
to the pieces in hand with a backend's log-sum-exp step (``backends.LseStep``: the
native kernel on the CPU, torch's fused kernel, the textbook path), which returns each
block's log-sum-exp, and merges the partial outputs exactly by it (``variants.py``: the
variants across shards). The backward sends the pieces
around again; each rank adds its share of a piece's key and value gradients to the
running sum that travels with the piece, and the sum comes home to the piece's owner
(ring-flash-attention's scheme: a block's backward with the merged output and
log-sum-exp gives exactly its share of dq, dk, dv).
"""

from __future__ import annotations

import functools
import math
import time

import torch

from .._tracing import first_derivatives_only
from ..backends import Request, choose, resolve
from ..checks import boolean, finite_float, one_of, optional_positive_int
from .agree import agreed_lengths
from .comm import Group
from .pieces import Pieces, merge, work_dtype
from .plan import Plan
from .ring_backward import backward as backward_pass
from .shards import LAYOUTS
from .variants import check as check_variants

__all__ = ["ring_attention"]

# About this many bytes of keys and values per message (and of partial output per
# kernel call): a rank holds a few such pieces beside its own shard, never a whole
# remote shard, and each message is still large enough for the network to run at speed.
PIECE_BYTES = 1 << 20
_INF = float("inf")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
                   causal: bool = False, window: int | None = None,
                   mask: torch.Tensor | None = None, scale: float | None = None,
                   layout: str = "contiguous", backend: str = "auto",
                   seq_len: int | tuple[int, int] | None = None, block: int | None = None,
                   timeout: float | None = None, profile: dict | None = None,
                   softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
                   sinks: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                   mask_mod=None, score_mod=None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys, which are split
    across the ranks of ``group``; the result equals :func:`attnlab.attention` on the
    whole sequence, sharded the same way (forward and backward).

    Args:
        q: ``(batch, q_heads, q_len_rank, head_dim)``: this rank's shard of the queries.
        k, v: ``(batch, kv_heads, k_len_rank, head_dim / v_dim)``: this rank's shard of the
            keys and values; ``q_heads % kv_heads == 0`` (GQA: K/V are never repeated).
        group: the ``torch.distributed`` process group (None: the default group).
        causal, window, scale: as :func:`attnlab.attention`, over the whole sequence's
            positions (causal aligned to the end when the query and key lengths differ).
            A window skips the remote pieces it rules out: they are never sent.
        mask: this rank's shard of a key-padding mask, ``(batch, k_len_rank)`` or
            ``(batch, 1, 1, k_len_rank)``, bool (True = may attend) or 1/0 integers
            (:func:`~attnlab.distributed.shard_mask` cuts one). It travels with the keys.
        layout: how the sequence was split: ``"contiguous"`` or ``"zigzag"`` (balances the
            work under a causal rule); see :mod:`attnlab.distributed.shards`.
        backend: the local step, ``"auto"`` or a backend with a log-sum-exp step (flash,
            sdpa, tiled, eager: ``log_sum_exp`` in ``attnlab.backend_table()``).
        seq_len: the whole sequence's length (``(q_len, k_len)`` when they differ). None:
            gathered from the ranks, one small all-gather per call that also checks that
            they agree on the shapes and options (the scale, softcap, slopes and sinks
            too). Given, only this rank's shard is checked against it: ranks that then
            disagree on a shape may wait out the timeout, or gloo may stop the process.
        block: keys per message and query rows per kernel call (default: about
            ``PIECE_BYTES`` of keys and values per message).
        timeout: seconds to wait for a neighbour before raising
            :class:`~attnlab.distributed.RingError` (None: the group's timeout).
        profile: a dict to fill with timings: the forward's ``compute_s``, ``wait_s`` (time
            blocked on messages), ``ticks``, ``messages``, ``bytes``, ``buffers``
            (message buffers made: the most pieces held at once); the backward's as
            ``backward_compute_s``, ``backward_wait_s``, ``backward_buffers``.
        softcap, alibi_slopes, sinks: as :func:`attnlab.attention`, over the whole
            sequence's positions (ALiBi's distances are global); ``sinks`` join each
            row's softmax once, and their gradient is this rank's rows' share (sum it
            over the group, as for any replicated parameter).
        document_ids: this rank's shard of the ids ``(seq_shard,)`` or ``(batch,
            seq_shard)``, split like the sequence (self-attention only); gathered once.
        mask_mod, score_mod: refused (ValueError): their functions see positions and
            heads no shard can give them.

    Returns:
        ``(batch, q_heads, q_len_rank, v_dim)``: this rank's shard of the output.
    """
    call, mask = _prepare(q, k, v, group=group, causal=causal, window=window, mask=mask,
                          scale=scale, layout=layout, backend=backend, seq_len=seq_len,
                          block=block, timeout=timeout, profile=profile, softcap=softcap,
                          alibi_slopes=alibi_slopes, sinks=sinks, document_ids=document_ids,
                          mask_mod=mask_mod, score_mod=score_mod)
    return _RingAttention.apply(q, k, v, mask, call.variants.sinks, call)


def messages_only(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  backward: bool = False, profile: dict | None = None, **options) -> dict:
    """The messages of one :func:`ring_attention` call (with ``options``) and none of its
    computation: the forward's (and with ``backward``, the backward's) exchange alone,
    as its profile (``wait_s``: the time the messages take when nothing hides them),
    filled into ``profile`` when given (``profile["events"]``: see ``_forward``).
    What ``attnlab bench --suite distributed`` measures the overlap against."""
    profile = {} if profile is None else profile
    call, mask = _prepare(q, k, v, profile=profile, **options)
    out, lse = _forward(call, q, k, v, mask, compute=False)
    if backward:
        backward_pass(call, q, k, v, mask, out, lse, torch.zeros_like(out), compute=False)
    return profile


def _prepare(q, k, v, *, group=None, causal=False, window=None, mask=None, scale=None,
             layout="contiguous", backend="auto", seq_len=None, block=None, timeout=None,
             profile=None, **variants):
    """The checked arguments of a call as its ``_Setup``, and the key mask."""
    comm = Group(group, optional_timeout(timeout))
    mask = _key_mask(mask, q, k)
    window, scale = _check(q, k, v, causal, window, scale, layout, block)
    q_len, k_len = agreed_lengths(comm, q, k, v, mask, seq_len, causal, window, layout,
                                  scale, variants)
    window = None if window is None else min(window, q_len + k_len + 1)
    block = block or _default_block(q, k, v)
    split = check_variants(comm, q, k, q_len, k_len, layout, **variants)
    request = Request(q, k, None if mask is None else mask[:, None, None, :], causal, window,
                      0.0, None, split.request(q.shape[2], k.shape[2]), lse=True)
    with torch.no_grad():  # the steps have their own backward
        step = (choose(request) if backend == "auto" else resolve(request, backend)).lse
    plan = _plan(q_len, k_len, comm.size, layout, causal, window, block)
    return _Setup(comm, plan, step, causal, window, scale, profile, split, k_len - q_len), mask


def optional_timeout(timeout) -> float | None:
    return None if timeout is None else finite_float("timeout", timeout, positive=True)


class _Setup:
    """What the forward and backward passes of one call share."""

    def __init__(self, comm, plan, step, causal, window, scale, profile, variants, shift):
        self.comm, self.plan, self.step = comm, plan, step
        self.causal, self.window, self.scale = causal, window, scale
        self.profile = profile
        self.variants, self.shift = variants, shift  # shift: k_len - q_len

    def forward(self, q, kp, vp, mp, piece, c):
        """The step of call ``c`` (rows of ``q``) on ``piece`` (keys ``kp``, ``vp``)."""
        variants, offset = self._variants(piece, c)
        return self.step.forward(q, kp, vp, mp, self.causal, self.window, self.scale, 0.0,
                                 variants, offset)

    def backward(self, q, kp, vp, mp, out, lse, grad_out, piece, c):
        variants, offset = self._variants(piece, c)
        return self.step.backward(q, kp, vp, mp, out, lse, grad_out, self.causal, self.window,
                                  self.scale, variants, offset)

    def _variants(self, piece, c):
        position = c.offset + piece.start - self.shift  # of the call's first query
        return self.variants.for_call(position, c.q_len, piece.start, piece.size, c.offset)


@functools.lru_cache(maxsize=64)
def _plan(q_len, k_len, world, layout, causal, window, block) -> Plan:
    return Plan(q_len, k_len, world, layout, causal, window, block)


def _default_block(q, k, v) -> int:
    batch, q_heads, _, _ = q.shape
    per_key = batch * k.shape[1] * (k.shape[-1] + v.shape[-1]) * k.element_size()
    per_row = batch * q_heads * v.shape[-1] * 4
    # (an empty batch or v_dim 0 has nothing to carry: any block will do)
    return max(64, min(PIECE_BYTES // max(1, per_key), PIECE_BYTES // max(1, per_row)))


# --------------------------------------------------------------------------- checks


def _check(q, k, v, causal, window, scale, layout, block):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq_shard, head_dim), got "
                             f"shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point or t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name} has dtype {t.dtype} on {t.device}; expected q's "
                            f"floating dtype {q.dtype} on {q.device}")
    if k.shape[:3] != v.shape[:3] or k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         "expected one batch, k/v of one length and head count, and k's "
                         "head_dim equal to q's")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q has {q.shape[1]} heads and k/v have {k.shape[1]}; expected q "
                         "heads to be a multiple of kv heads (grouped-query attention)")
    boolean("causal", causal)
    window = optional_positive_int("window", window)
    one_of("layout", layout, LAYOUTS)
    optional_positive_int("block", block)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else finite_float("scale", scale)
    return window, scale


def _key_mask(mask, q, k):
    """The key-padding mask as ``(batch, k_len_rank)`` bool, or None."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    shape = tuple(mask.shape)
    if mask.ndim == 4 and shape[1:3] == (1, 1):
        mask = mask[:, 0, 0]
    if mask.ndim != 2 or mask.shape[0] not in (1, q.shape[0]) or mask.shape[1] != k.shape[2]:
        raise ValueError(
            f"mask must be this rank's key-padding shard (batch={q.shape[0]}, "
            f"k_len_rank={k.shape[2]}) or (batch, 1, 1, k_len_rank), got shape {shape}; "
            "split attention takes no per-query masks")
    if mask.dtype != torch.bool:
        if mask.dtype.is_floating_point:
            raise TypeError(f"mask must be bool (True = may attend) or 1/0 integers, got "
                            f"{mask.dtype}")
        values = torch.unique(mask)
        if not bool(((values == 0) | (values == 1)).all()):
            raise ValueError(f"mask must hold only 0 and 1, got values {values.tolist()[:8]}")
        mask = mask == 1
    return mask.to(q.device).expand(q.shape[0], k.shape[2])


# --------------------------------------------------------------------------- autograd


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, sinks, call):
        out, lse = _forward(call, q, k, v, mask)
        ctx.call = call
        ctx.save_for_backward(q, k, v, mask, out, lse)
        return out if out.dtype == q.dtype else out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, out, lse = ctx.saved_tensors
        with torch.no_grad():  # (create_graph: the local steps' sums build no graph)
            dq, dk, dv = backward_pass(ctx.call, q, k, v, mask, out, lse, grad_out)
            dsinks = ctx.call.variants.sink_grad(out, lse, grad_out) \
                if ctx.needs_input_grad[4] else None
        grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks)
        dq, dk, dv, dsinks = first_derivatives_only(
            "ring attention", grads, q, k, v, ctx.call.variants.sinks, grad_out, out,
            advice="attnlab.attention on one process has them with backend='eager'")
        return dq, dk, dv, None, dsinks, None


def _forward(call, q, k, v, mask, compute: bool = True):
    """This rank's ``(out, lse)`` in the work dtype, ``lse`` ``+inf`` for a row with no key."""
    posted: list = []  # every message's work, drained if the call raises
    try:
        return _forward_ticks(call, q, k, v, mask, compute, posted)
    except Exception:
        call.comm.drain(posted)
        raise


def _forward_ticks(call, q, k, v, mask, compute, posted):
    plan, comm, rank = call.plan, call.comm, call.comm.rank
    work = work_dtype(q)  # of the merged output and log-sum-exp; each step takes q, k, v
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=work, device=q.device)
    lse = torch.full(q.shape[:3], -_INF, dtype=work, device=q.device)
    pieces = Pieces(k, v, mask, k.dtype, plan.block)
    incoming: dict[int, tuple] = {}
    sending: list = []
    clock = {"compute_s": 0.0, "wait_s": 0.0, "messages": 0, "bytes": 0, "ticks": plan.ticks}
    # With profile["events"] a list: ("sent", uid, hop, t) when a piece is posted to the
    # next rank, ("received", uid, hop, t_wait, t_done) when this rank waited for one.
    events = None if call.profile is None else call.profile.get("events")
    for tick in range(plan.ticks):
        items = plan.items(rank, tick)
        start = time.perf_counter()
        held = {}
        for it in items:
            if it.hop:
                flat, work_ = incoming.pop(it.piece.uid)
                waiting = time.perf_counter()
                comm.wait(work_, "receiving keys and values from", rank - 1)
                held[it.piece.uid] = flat
                if events is not None:
                    events.append(("received", it.piece.uid, it.hop, waiting,
                                   time.perf_counter()))
        clock["wait_s"] += time.perf_counter() - start
        ops, kinds = [], []
        for it in items:
            if it.send:
                flat = held.get(it.piece.uid)
                flat = pieces.pack(it.piece) if flat is None else flat
                ops.append(("send", flat, rank + 1, plan.tag(it.piece, it.hop + 1, 0)))
                kinds.append(None)
        for piece, hop in plan.arrivals(rank, tick + 1):
            flat = pieces.empty(piece.size)
            ops.append(("recv", flat, rank - 1, plan.tag(piece, hop, 0)))
            kinds.append(piece.uid)
        works = comm.post(ops)
        posted += works
        if events is not None:
            now = time.perf_counter()
            events += [("sent", it.piece.uid, it.hop + 1, now) for it in items if it.send]
        clock["messages"] += len(ops)
        clock["bytes"] += sum(t.numel() * t.element_size() for kind, t, *_ in ops
                              if kind == "send")
        sent = []
        for (_, flat, *_), uid, w in zip(ops, kinds, works):
            if uid is None:
                sent.append((w, flat))
            else:
                incoming[uid] = (flat, w)
        start = time.perf_counter()
        if compute:
            for it in items:
                kp, vp, mp = pieces.views(held.get(it.piece.uid), it.piece)
                for c in it.calls:
                    rows = slice(c.q_local, c.q_local + c.q_len)
                    part, part_lse = call.forward(q[:, :, rows], kp, vp, mp, it.piece, c)
                    merge(out[:, :, rows], lse[:, :, rows], part, part_lse)
        clock["compute_s"] += time.perf_counter() - start
        for it in items:  # a piece not sent on is done with; a sent one, once its send is
            if not it.send:
                pieces.release(held.get(it.piece.uid))
        start = time.perf_counter()
        for w, flat in sending:
            comm.wait(w, "sending keys and values to", rank + 1)
            pieces.release(flat)
        clock["wait_s"] += time.perf_counter() - start
        sending = sent
    start = time.perf_counter()
    for w, _ in sending:
        comm.wait(w, "sending keys and values to", rank + 1)
    clock["wait_s"] += time.perf_counter() - start
    if call.profile is not None:
        call.profile.update(clock, buffers=pieces.allocated)
    call.variants.add_sinks(out, lse)
    return out, lse.masked_fill_(lse == -_INF, _INF)
