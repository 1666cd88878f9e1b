"""The one attention function, ``attention``, and its backends.

Shapes: ``q`` is ``(..., q_heads, q_len, head_dim)``; ``k`` is ``(..., kv_heads, k_len,
head_dim)``; ``v`` is ``(..., kv_heads, k_len, v_dim)``; the output is ``(..., q_heads, q_len,
v_dim)``. Internally ``(batch, heads, seq, dim)``, extra leading dimensions in batch.

Conventions (DESIGN.md): bool masks are True where a query may attend, float
masks are additive; causal and window rules are aligned to the end when
``q_len != k_len``; a row with nothing to attend gives zeros, never NaN;
grouped-query attention never copies K/V; bf16/fp16 accumulate in float32.
The variants (softcap, ALiBi, sinks, documents, mask_mod, score_mod) are defined in
``attention``'s docstring and applied by ``_variants`` (checks and the score pipeline).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from . import _lse, _variants
from . import mask_shift as _shift
from ._arguments import BACKENDS, check_decode
from ._arguments import check as _check
from ._tracing import autocasting
from .backends import TABLE, Backend, Request, choose, resolve
from .blockmask import BlockMask
from .checks import one_of

__all__ = ["attention", "attention_with_lse", "BACKENDS", "backend_table", "may_decode",
           "decode_step"]

# Who takes a fused decoding step under each backend setting (auto: the first of the
# table that can; a named backend only itself).
_DECODERS = {name: b.decode for name, b in TABLE.items() if b.decoding}
if _DECODERS:
    _DECODERS["auto"] = next(iter(_DECODERS.values()))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool | Sequence[int] | torch.Tensor = False,
    backend: str = "auto",
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    document_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    mask_mod: Callable | BlockMask | None = None,
    score_mod: Callable | None = None,
):
    """Scaled dot-product attention, ``softmax(q k^T * scale + mask) v``, and its variants.

    Args:
        q: ``(..., q_heads, q_len, head_dim)`` queries.
        k: ``(..., kv_heads, k_len, head_dim)`` keys; ``q_heads % kv_heads == 0``
            (grouped-query attention: query head h reads kv head
            ``h // (q_heads // kv_heads)``).
        v: ``(..., kv_heads, k_len, v_dim)`` values.
        mask: bool (True = may attend) or additive float mask broadcastable to
            ``(..., q_heads, q_len, k_len)``. Float masks are added exactly: a row
            that is one large finite value everywhere (``-1e9``) leaves the
            weights as they were, in every dtype; only ``-inf`` forbids a key.
        causal: query at end-aligned position ``p = i + k_len - q_len`` sees keys ``j <= p``.
        window: sliding window W >= 1: keys with ``p - W < j`` (and ``j < p + W``
            when not causal).
        scale: multiplier of the scores; ``1/sqrt(head_dim)`` when None.
        dropout_p: dropout on the weights; applied whenever > 0 (modules pass 0
            in eval mode, like ``F.scaled_dot_product_attention``).
        return_weights: True to also return the weights ``(..., q_heads, q_len, k_len)``,
            or a sequence of query indices to return only those rows
            ``(..., q_heads, len(rows), k_len)``. The weights are the softmax
            before dropout. Not available with ``backend="sdpa"``.
        backend: ``"auto"``, ``"eager"``, ``"sdpa"``, ``"tiled"`` or ``"flash"`` (the
            native kernel, CPU only; its weights come from the tiled path's rows).
            What each takes is in :func:`backend_table`; ``"auto"``'s rule is
            :func:`attnlab.backends.choose`. A named backend that cannot take the
            call raises ValueError saying why (``backend_table()`` lists which variants
            each takes; ``auto`` picks one that takes them all).

    Variants (each composes with the others, with causal, window, masks, GQA and
    dropout). The scores ``s = q k^T * scale`` go through, in this order:

        softcap: a float > 0: ``s = softcap * tanh(s / softcap)`` on the scaled score
            (Gemma 2's attention logit softcapping; FlashAttention's ``softcap``).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's
            signature), called vectorised on whole tiles: ``score`` ``(B, Hkv, G, n, kn)``
            (the G query heads of a kv head next to each other), the indices long
            tensors broadcast against it (``h`` the query head, ``q_idx``/``kv_idx`` the
            row and key numbers). It must be written with tensor operations and return
            a tensor of the score's shape; autograd differentiates it (the tiled
            backend recomputes it per query block in the backward: memory O(seq)).
        alibi_slopes: ``(q_heads,)`` or ``(..., q_heads)`` (per batch element) floats:
            ``s -= slope[h] * |p - j|``, with ``p`` the query's end-aligned position
            (FlashAttention's ALiBi). Under a causal rule this equals BLOOM's
            ``+ slope * j`` (the two differ by ``slope * p``, a constant per row, which
            softmax ignores). Fixed: the slopes get no gradient.
        mask: the additive float mask is added here (with sinks, as it is: elsewhere
            each row is shifted by a constant first, which softmax ignores but a sink's
            share would not: its largest entry over the keys that the rules below allow,
            so that a large finite value stays exact; a key only ``score_mod`` sends to
            ``-inf`` still counts there, so forbid keys with ``mask_mod``); then every
            forbidden key gets
            ``-inf``: the causal/window rule, ``document_ids``, a bool mask and
            ``mask_mod``.
        document_ids: packed sequences: a long tensor ``(..., seq)`` or ``(seq,)`` of
            each position's document (when ``q_len == k_len``), or a pair
            ``(q_ids, k_ids)`` of ``(..., q_len)`` and ``(..., k_len)``; non-decreasing
            along each sequence. A query attends only the keys of its own document,
            and within a document the causal/window rule and ALiBi's positions are
            aligned to the document's end (FlashAttention varlen's per-sequence
            bottom-right alignment; the global rule when each document has as many
            queries as keys). ``masks.Documents`` is the rule.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's
            signature; True = may attend), or a block mask made from one
            (``attnlab.blockmask.block_mask``, ``attnlab.compat.create_block_mask``).
            Evaluated into a block mask, cached per (function, what it reads, shape)
            (``attnlab.blockmask``: vectorised as there); tiles it forbids are
            skipped. Exceptions it raises come back as one ValueError naming it.
        sinks: ``(q_heads,)`` floats, differentiable: gpt-oss's attention sinks, one
            logit per head that joins each row's softmax denominator and weighs no
            value: ``w_ij = exp(s_ij) / (exp(sink_h) + sum_k exp(s_ik))``. The weights
            (``return_weights``) then sum to less than 1; a row with no allowed key
            still gives zeros.

    Returns:
        ``out`` of shape ``(..., q_heads, q_len, v_dim)``, or ``(out, weights)``.
    """
    return _attend(q, k, v, mask, causal, window, scale, dropout_p, return_weights, backend,
                   dict(softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                        document_ids=document_ids, mask_mod=mask_mod, score_mod=score_mod))


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    document_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    mask_mod: Callable | BlockMask | None = None,
    score_mod: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` (the same arguments, no weights) that also returns each query
    row's log-sum-exp: ``(out, lse)`` with ``lse`` ``(..., q_heads, q_len)`` float32 (float64
    for float64 inputs), the natural log of the row's softmax denominator over its
    allowed keys (the sink included), ``+inf`` for a row with nothing to attend (as
    FlashAttention returns it), differentiable once as torch's ``flex_attention``'s (see
    ``attnlab._lse``; not under torch.compile). Only the backends declaring ``lse`` in
    :func:`backend_table` take it (``auto`` too)."""
    return _attend(q, k, v, mask, causal, window, scale, dropout_p, False, backend, dict(
        softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, document_ids=document_ids,
        mask_mod=mask_mod, score_mod=score_mod), want_lse=True)


def _attend(q, k, v, mask, causal, window, scale, dropout_p, return_weights, backend,
            variant_args, want_lse=False):
    """attention()'s body: checks, dispatch through the table, shapes back."""
    kind = autocasting(q, k, v)  # (see _tracing.autocasting: every backend as SDPA)
    if kind is not None:
        dtype = torch.get_autocast_dtype(kind)
        q, k, v = (t.to(dtype) if t.dtype != torch.float64 else t for t in (q, k, v))
        with torch.autocast(kind, enabled=False):
            return _attend(q, k, v, mask, causal, window, scale, dropout_p, return_weights,
                           backend, variant_args, want_lse)
    rows = _check(q, k, v, mask, causal, window, scale, dropout_p, return_weights, backend)
    variants = _variants.check(q, k, **variant_args)
    lead = q.shape[:-3]
    q4, k4, v4, mask4 = _to_4d(q, k, v, mask)
    scale = 1.0 / math.sqrt(q4.shape[-1]) if scale is None else float(scale)
    # A window wider than both sequences rules nothing out; capped, so that 2**70
    # stays a valid index on every path instead of overflowing a C long.
    window = min(int(window), q4.shape[-2] + k4.shape[-2] + 1) if window is not None else None
    # Dispatch through the table (attnlab.backends): a named backend that cannot take
    # the call says why; auto takes the one its rule gives.
    request = Request(q4, k4, mask4, causal, window, dropout_p, rows, variants, want_lse)
    chosen = resolve(request, backend)
    # Exact additive semantics in any dtype (mask_shift.for_kernels): in float32 (or float64)
    # on every route, each row shifted by its allowed keys' maximum (but beside sinks).
    mask4, shift = _shift.for_kernels(mask4, q4.shape[-2], k4.shape[-2], q4.dtype,
                                      causal=causal, window=window, documents=variants and
                                      variants.documents, sinks=bool(variants and
                                                                     variants.sinks is not None),
                                      blocks=variants and variants.block_mask)
    if want_lse:
        out, lse = chosen.lse.forward(q4, k4, v4, mask4, causal, window, scale, dropout_p,
                                      variants)
        lse = _lse.with_gradient(lse, chosen.lse, q4, k4, mask4, causal, window, scale, variants)
        lse = lse if shift is None else lse + shift  # the denominators of the mask as given
        return out.reshape(*lead, *out.shape[1:]), lse.reshape(*lead, *lse.shape[1:])
    out, weights = chosen.run(q4, k4, v4, mask4, causal, window, scale, dropout_p, rows,
                              variants)

    if q.ndim != 4:
        out = out.reshape(*lead, *out.shape[1:])
        weights = None if weights is None else weights.reshape(*lead, *weights.shape[1:])
    return out if rows is None else (out, weights)


# --------------------------------------------------------------------------- checks


def _to_4d(q, k, v, mask):
    """Flatten leading dimensions into one batch dimension; masks keep broadcast dims
    and become 4-D (a 1-D ``(k_len,)`` mask is ``(1, 1, 1, k_len)``, as PyTorch reads it)."""
    if q.ndim > 4:
        target = (*q.shape[:-1], k.shape[-2])
        q, k, v = (t.reshape(-1, *t.shape[-3:]) for t in (q, k, v))
        if mask is not None:
            mask = mask.expand(target).reshape(-1, *target[-3:])
    elif q.ndim == 3:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if mask is not None and mask.ndim < 4:
        mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))  # a view
    return q, k, v, mask


def _choose(q, k, mask, window, rows, causal=False, variants=None) -> str:
    """The name of the backend ``auto`` takes for 4-D ``q``, ``k`` (backends.choose)."""
    return choose(Request(q, k, mask, causal, window, 0.0, rows, variants)).name


# --------------------------------------------------------------------------- the table


def backend_table() -> tuple[Backend, ...]:
    """The backends ``attention`` dispatches to, in the order of :data:`BACKENDS`, each
    with its capabilities (``Backend.capabilities()``: masks, mask gradients, windows,
    dropout, weights, gradients, devices, dtypes, decoding, and the variants softcap,
    alibi, sinks, documents, mask_mod, score_mod) and ``supports(request)``.
    ``backend="auto"`` takes the last one that supports a call and pays for it
    (:func:`attnlab.backends.choose`)."""
    return tuple(TABLE.values())


def may_decode(backend: str = "auto", *, dropout_p: float = 0.0, mask: object = None,
               weights: object = False) -> bool:
    """Whether a one-token step with a cache may go to a fused decoding step (a
    backend's ``decode``, see :func:`decode_step`): the one question the modules and
    models ask before their fast path. Yes for ``backend`` ``"auto"`` or one that
    declares decoding, with no mask, no weights, no dropout and no gradients (the
    step has no backward). The callers check what is theirs (hooks, positions)."""
    return (backend in _DECODERS and mask is None and not weights and not dropout_p
            and not torch.is_grad_enabled())


def decode_step(qkv: torch.Tensor, cache, rotary, window: int | None, num_heads: int,
                num_kv_heads: int, *, backend: str = "auto", scale: float | None = None,
                softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
                sinks: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor | None:
    """Attention of one new token: RoPE, cache append and attention over the cache in
    one call of the decoding backend (:func:`attnlab._decode.step` has the arguments;
    ``window``, ``scale``, ``softcap``, ``alibi_slopes`` ``(num_heads,)`` and ``sinks``
    as :func:`attention` takes them). Returns ``(B, 1, num_heads * head_dim)``, or None
    (the cache unchanged) where the backend stands aside for these tensors; the caller
    then runs :func:`attention`. ValueError for a ``backend`` with no decoding step (ask
    :func:`may_decode` first), and for arguments :func:`attention` would refuse.
    ``validate=False`` skips those checks: for a module that checked its own settings
    once and calls this for every token of every layer."""
    step = _DECODERS.get(backend)
    if step is None:
        one_of("backend", backend, BACKENDS)
        raise ValueError(f"backend={backend!r} has no fused decoding step; use backend="
                         f"{' or '.join(map(repr, _DECODERS))} (ask may_decode first)")
    if validate:
        softcap, alibi_slopes, sinks = check_decode(qkv, cache, window, num_heads,
                                                     num_kv_heads, scale, softcap,
                                                     alibi_slopes, sinks)
    return step(qkv, cache, rotary, window, num_heads, num_kv_heads, scale=scale,
                softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
