"""All-to-all attention over heads (DeepSpeed-Ulysses): the second way to split a
sequence's attention across ranks.

Each rank starts with a shard of the sequence and every head. One all-to-all
(``dist.all_to_all_single``) turns that into the whole sequence and ``heads / N`` of the
heads; each rank runs :func:`attnlab.attention` on its heads (so every option and
backend of it works unchanged, end-aligned causal rule and all), and a second
all-to-all turns the output back into sequence shards. The traffic per rank is four
shards' worth of q, k, v and out, whatever ``N``; the heads must divide by ``N``.
"""

from __future__ import annotations

import torch

from ..functional import attention
from .agree import agreed_lengths
from .comm import Group
from .ring import _check, _key_mask, optional_timeout
from .shards import shard, shard_lengths, unshard
from .variants import check as check_variants

__all__ = ["ulysses_attention"]


# The keywords ulysses_attention passes on to attention, and those it refuses with a
# reason of its own (the rest are not attention's, or are ring_attention's alone).
OPTIONS = ("dropout_p", "softcap", "alibi_slopes", "sinks", "document_ids")
REFUSED = ("mask_mod", "score_mod", "return_weights")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
                      causal: bool = False, window: int | None = None,
                      mask: torch.Tensor | None = None, scale: float | None = None,
                      layout: str = "contiguous", backend: str = "auto",
                      seq_len: int | tuple[int, int] | None = None,
                      timeout: float | None = None, **options) -> torch.Tensor:
    """The same contract as :func:`~attnlab.distributed.ring_attention` (this rank's shards
    in, this rank's shard of the output back, equal to :func:`attnlab.attention` on the
    whole sequence), by all-to-all over heads: ``q_heads`` and ``kv_heads`` must both be
    divisible by the group's size. ``backend`` and ``**options`` (``dropout_p``,
    ``softcap``) go to :func:`attnlab.attention` as they are; ``alibi_slopes`` and
    ``sinks`` (one per head) are cut to this rank's heads (the sinks' gradient is then
    this rank's heads' share: sum it over the group); ``document_ids`` is this rank's
    shard of the ids, split like the sequence, gathered once. ``mask_mod`` and
    ``score_mod`` are refused (their functions see head numbers a rank does not have).
    """
    unknown = sorted(set(options) - set(OPTIONS) - set(REFUSED))
    if unknown:
        raise TypeError(f"ulysses_attention() got an unexpected keyword argument "
                        f"{unknown[0]!r} (beside q, k, v, group, causal, window, mask, scale, "
                        f"layout, backend, seq_len and timeout it takes {', '.join(OPTIONS)})")
    if options.get("return_weights"):
        raise ValueError("return_weights is not supported by split attention (no rank holds "
                         "a whole row of weights); pass return_weights=False")
    options.pop("return_weights", None)
    comm = Group(group, optional_timeout(timeout), "ulysses_attention")
    mask = _key_mask(mask, q, k)
    window, scale = _check(q, k, v, causal, window, scale, layout, None)
    n = comm.size
    if q.shape[1] % n or k.shape[1] % n:
        raise ValueError(f"ulysses_attention splits the heads over the {n} ranks: q_heads "
                         f"({q.shape[1]}) and kv_heads ({k.shape[1]}) must both be divisible "
                         f"by {n}; use ring_attention, which has no such limit")
    q_len, k_len = agreed_lengths(comm, q, k, v, mask, seq_len, causal, window, layout,
                                  scale, options)
    q_lens, k_lens = shard_lengths(q_len, n, layout), shard_lengths(k_len, n, layout)
    options = _head_variants(comm, q, k, q_len, k_len, layout, options)
    qh = _Exchange.apply(q, comm, q_lens, layout, True)
    kh = _Exchange.apply(k, comm, k_lens, layout, True)
    vh = _Exchange.apply(v, comm, k_lens, layout, True)
    whole = None
    if mask is not None:  # (B, k_len_rank) -> (B, 1, 1, k_len) on every rank
        m = mask.to(torch.uint8)[:, None, :, None].expand(-1, n, -1, -1)  # one copy per rank
        whole = _seq_to_heads(m.contiguous(), comm, k_lens, layout)[:, 0, :, 0].bool()
        whole = whole[:, None, None, :]
    out = attention(qh, kh, vh, mask=whole, causal=causal, window=window, scale=scale,
                    backend=backend, **options)
    return _Exchange.apply(out, comm, q_lens, layout, False)


def _head_variants(comm, q, k, q_len, k_len, layout, options: dict) -> dict:
    """``options`` for this rank's heads over the whole sequence: the per-head variants
    cut to its heads, the document ids of the whole sequence."""
    options = dict(options)
    split = check_variants(comm, q, k, q_len, k_len, layout, **{
        name: options.pop(name, None) for name in ("alibi_slopes", "sinks", "document_ids",
                                                   "mask_mod", "score_mod")})
    heads = q.shape[1] // comm.size
    mine = slice(comm.rank * heads, (comm.rank + 1) * heads)
    if split.block is not None and split.block.alibi_slopes is not None:
        slopes = split.block.alibi_slopes[:, mine]  # (1 or B, heads)
        options["alibi_slopes"] = slopes[0] if slopes.shape[0] == 1 else slopes
    if split.sinks is not None:
        options["sinks"] = split.sinks[mine]
    if split.ids is not None:
        options["document_ids"] = split.ids
    return options


def _seq_to_heads(x, comm, lens, layout):
    """``(B, H, lens[rank], D)`` -> ``(B, H / N, sum(lens), D)``: this rank's head group
    over the whole sequence."""
    b, h, n_local, d = x.shape
    n = comm.size
    send = x.reshape(b, n, h // n, n_local, d).transpose(0, 1).contiguous()
    per = b * (h // n) * d
    recv = x.new_empty(per * sum(lens))
    _exchange(comm, recv, send.reshape(-1), [per * m for m in lens], [per * n_local] * n)
    parts = [p.view(b, h // n, m, d) for p, m in zip(recv.split([per * m for m in lens]),
                                                      lens)]
    return unshard(parts, layout=layout, dim=2)


def _heads_to_seq(y, comm, lens, layout):
    """The inverse: ``(B, H / N, sum(lens), D)`` -> ``(B, H, lens[rank], D)``."""
    b, hn, _, d = y.shape
    n, mine = comm.size, lens[comm.rank]
    send = torch.cat([shard(y, n, r, layout=layout, dim=2).reshape(-1) for r in range(n)])
    per = b * hn * d
    recv = y.new_empty(n * per * mine)
    _exchange(comm, recv, send, [per * mine] * n, [per * m for m in lens])
    return recv.view(n, b, hn, mine, d).transpose(0, 1).reshape(b, n * hn, mine, d)


def _exchange(comm, recv, send, recv_sizes, send_sizes) -> None:
    import torch.distributed as dist

    try:
        work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=comm.group,
                                      async_op=True)
    except Exception as exc:
        raise comm.error("exchanging heads with", comm.rank + 1, exc) from exc
    comm.wait(work, "exchanging heads with", comm.rank + 1)


class _Exchange(torch.autograd.Function):
    """``_seq_to_heads`` (``to_heads``) or ``_heads_to_seq``, differentiable: each one's
    backward is the other."""

    @staticmethod
    def forward(ctx, x, comm, lens, layout, to_heads):
        ctx.args = (comm, lens, layout, not to_heads)
        return _move(x, comm, lens, layout, to_heads)

    @staticmethod
    def backward(ctx, grad):
        return _move(grad.contiguous(), *ctx.args), None, None, None, None


def _move(x, comm, lens, layout, to_heads):
    return (_seq_to_heads if to_heads else _heads_to_seq)(x, comm, lens, layout)
