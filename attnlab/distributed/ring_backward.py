"""The backward of ring attention: the key and value pieces go around the ring again,
each with the running sum of its key and value gradients.

At every tick a rank computes, for each piece in hand, its queries' share of dq (kept)
and of the piece's dk, dv (added to the sum that arrived with the piece, then sent on);
the rank at the piece's reach sends the finished sum home to its owner. Receives are
posted a tick ahead, as in the forward (``plan.py``).
"""

from __future__ import annotations

import time

import torch

from .pieces import Pieces, work_dtype


def backward(call, q, k, v, mask, out, lse, grad_out, compute: bool = True):
    """``(dq, dk, dv)`` of this rank's shards, in the work dtype (``compute`` False: the
    messages alone, for the bench)."""
    posted: list = []  # every message's work, drained if the call raises
    try:
        return _ticks(call, q, k, v, mask, out, lse, grad_out, compute, posted)
    except Exception as exc:
        # The peers' receives of this tick's gradient sums stay open (their sends come
        # after the step that failed): the group cannot carry another call's messages.
        call.comm.drain(posted)
        call.comm.spoil(f"a ring_attention backward on this group raised "
                        f"({type(exc).__name__}) between its messages")
        raise


def _ticks(call, q, k, v, mask, out, lse, grad_out, compute, posted):
    plan, comm, rank = call.plan, call.comm, call.comm.rank
    work = work_dtype(q)  # of the gradients' sums; each step takes q, k, v, out, grad_out
    out, dout = out.to(q.dtype), grad_out.to(q.dtype)  # in q's dtype, as attention's own
    dq = torch.zeros(q.shape, dtype=work, device=q.device)
    dk = torch.zeros(k.shape, dtype=work, device=q.device)
    dv = torch.zeros(v.shape, dtype=work, device=q.device)
    pieces = Pieces(k, v, mask, k.dtype, plan.block)
    incoming: dict[tuple[int, int], tuple] = {}  # (uid, kind) -> (buffer, work)
    sending: list = []
    clock = {"backward_compute_s": 0.0, "backward_wait_s": 0.0}
    waited = time.perf_counter

    def wait(w, what, peer):
        start = waited()
        comm.wait(w, what, peer)
        clock["backward_wait_s"] += waited() - start

    for tick in range(plan.ticks):
        items = plan.items(rank, tick)
        held = {}
        for it in items:
            if it.hop:
                flat, w = incoming.pop((it.piece.uid, 0))
                wait(w, "receiving keys and values from", rank - 1)
                held[it.piece.uid] = flat
        ops = []
        for it in items:
            if it.send:
                flat = held.get(it.piece.uid)
                flat = pieces.pack(it.piece) if flat is None else flat
                ops.append(("send", flat, rank + 1, plan.tag(it.piece, it.hop + 1, 0)))
        for piece, hop in plan.arrivals(rank, tick + 1):
            ops.append(("recv", pieces.empty(piece.size), rank - 1, plan.tag(piece, hop, 0)))
            ops.append(("recv", pieces.empty(piece.size, True, work), rank - 1,
                        plan.tag(piece, hop, 1)))
        for piece in plan.finals(rank, tick + 1):
            ops.append(("recv", pieces.empty(piece.size, True, work),
                        rank + plan.reach[piece.uid], plan.tag(piece, 0, 2)))
        sent = _post(comm, ops, incoming, plan, posted)
        for it in items:
            kp, vp, mp = pieces.views(held.get(it.piece.uid), it.piece)
            acc = None
            if it.hop:
                acc, w = incoming.pop((it.piece.uid, 1))
            share = None
            start = waited()
            for c in it.calls if compute else ():
                rows = slice(c.q_local, c.q_local + c.q_len)
                dq_c, dk_c, dv_c = call.backward(
                    q[:, :, rows], kp, vp, mp, out[:, :, rows], lse[:, :, rows],
                    dout[:, :, rows], it.piece, c)
                dq[:, :, rows] += dq_c
                if share is None:
                    share = pieces.empty(it.piece.size, True, work).zero_()
                sk, sv = pieces.views(share, it.piece, True)
                sk += dk_c
                sv += dv_c
            clock["backward_compute_s"] += waited() - start
            if it.hop:
                wait(w, "receiving key gradients from", rank - 1)
                if share is not None:
                    acc += share
                    pieces.release(share)
            else:
                acc = share if share is not None else pieces.empty(it.piece.size, True,
                                                                   work).zero_()
            if it.send:
                sent += _post(comm, [("send", acc, rank + 1, plan.tag(it.piece, it.hop + 1, 1))],
                              incoming, plan, posted)
            elif it.hop:
                sent += _post(comm, [("send", acc, it.piece.owner, plan.tag(it.piece, 0, 2))],
                              incoming, plan, posted)
            else:
                _add_home(dk, dv, pieces, acc, it.piece)
                pieces.release(acc)
            if not it.send:  # its keys and values are done with; sent ones once sent
                pieces.release(held.get(it.piece.uid))
        for piece in plan.finals(rank, tick):
            flat, w = incoming.pop((piece.uid, 2))
            wait(w, "receiving the finished key gradients from", rank + plan.reach[piece.uid])
            _add_home(dk, dv, pieces, flat, piece)
            pieces.release(flat)
        for w, peer, flat in sending:
            wait(w, "sending to", peer)
            pieces.release(flat)
        sending = sent
    for w, peer, _ in sending:
        wait(w, "sending to", peer)
    if call.profile is not None:
        call.profile.update(clock, backward_buffers=pieces.allocated)
    return dq, dk, dv


def _post(comm, ops, incoming, plan, posted) -> list:
    """Post ``ops``; receives go to ``incoming`` by (piece uid, kind); returns the sends'
    ``(work, peer, buffer)``, the buffer kept alive until the send is waited. ``posted``
    gets the works a raising call may drain: the sends, and the receives of keys and
    values, whose sends the peer posts in the same tick before it computes (a gradient
    sum's is posted after the step; waiting for one a failed step never sent would close
    gloo's connection)."""
    works = comm.post(ops)
    posted += [w for (kind, _, _, tag), w in zip(ops, works) if kind == "send" or tag % 3 == 0]
    sent = []
    for (kind, flat, peer, tag), w in zip(ops, works):
        if kind == "send":
            sent.append((w, peer, flat))
        else:
            uid, what = divmod(tag, 3)
            incoming[(uid // (plan.world + 1), what)] = (flat, w)
    return sent


def _add_home(dk, dv, pieces, flat, piece) -> None:
    gk, gv = pieces.views(flat, piece, True)
    dk[:, :, piece.local:piece.local + piece.size] += gk
    dv[:, :, piece.local:piece.local + piece.size] += gv
