"""The ``sdpa`` backend: torch's fused ``scaled_dot_product_attention`` with attnlab's
conventions translated (end-aligned causal rule, windows, the empty-row rule, NaN kept).

Inputs are ``attention()``'s after its checks: 4-D ``(batch, heads, seq, dim)``, an
additive mask already shifted by :func:`attnlab.mask_shift.shift_rows`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _variants
from . import mask_shift as _shift
from . import masks as _masks
from ._eager import eager_attention, eager_lse, eager_lse_backward, nothing_to_compute
from ._tracing import reads_values


def sdpa_attention(q, k, v, mask, causal, window, scale, dropout_p, variants=None):
    """torch's fused kernel, with attnlab's causal alignment and empty-row rule. Of the
    variants it takes what a dense mask states exactly: documents and a ``mask_mod``
    (a bool mask), ALiBi (an additive one); O(q_len x k_len) memory for them."""
    checked = _checks_inputs(q)
    if checked and not (bool(torch.isfinite(q).all()) and bool(torch.isfinite(k).all())):
        # The fused kernel gives 0 for a row whose scores hold NaN (NaN in q or k, or
        # inf - inf from an infinite key entry) and a gradient of 0 to what such a row
        # weighs; the README's rule is IEEE's. On the CPU the check is free of a device
        # sync, and such rare inputs take the textbook path, which keeps the rule.
        return eager_attention(q, k, v, mask, causal, window, scale, dropout_p, None,
                               variants)[0]
    q_len, k_len = q.shape[-2], k.shape[-2]
    is_causal = False
    struct = bias = None
    rule = None  # made only where a mask is built: the fast paths below need none
    if variants is not None:
        rule = _variants.rule(variants, q_len, k_len, causal, window)
        struct = _masks.combine(
            rule.allowed(device=q.device) if rule.structural else None,
            None if variants.block_mask is None else variants.block_mask.dense())
        if variants.alibi_slopes is not None:
            rows = torch.arange(q_len, device=q.device)
            bias = _variants.alibi(variants.alibi_slopes, rule, rows, 0, k_len, k.shape[1],
                                   _shift.additive_dtype(q.dtype)).flatten(1, 2)
    elif causal and window is None and mask is None and q_len == k_len and scale > 0:
        # torch's top-left alignment equals ours when the lengths agree. Its CPU kernel
        # returns NaN with is_causal for a scale <= 0 (torch 2.13), so those take the
        # explicit rule below.
        is_causal = True
    elif causal and window is None and q_len == 1:
        pass  # end-aligned: the one query (the newest token) sees every key
    else:
        rule = _masks.KeyRule(q_len, k_len, causal=causal, window=window)
        struct = rule.allowed(device=q.device) if rule.structural else None
    attn_mask = _masks.combine(struct, mask, bias)
    empty = None
    # Only a mask of the user's, a block mask or a rule whose rows may go past the keys
    # can leave a row empty (ALiBi's bias is finite): else no test, no pass over the mask.
    if attn_mask is not None and (
            mask is not None or rule is None or not rule.every_row_sees_a_key
            or (variants is not None and variants.block_mask is not None)):
        allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
        empty = ~allowed.any(dim=-1, keepdim=True)
        # Off the CPU the test would sync the device: empty rows are opened and zeroed
        # whether there are any or not (two ops over the mask and the output).
        if not checked or bool(empty.any()):
            # Let empty rows see everything (no NaN in forward or backward), zero them after.
            attn_mask = attn_mask | empty if attn_mask.dtype == torch.bool else (
                attn_mask.masked_fill(empty, 0.0)
            )
        else:
            empty = None
        if attn_mask.dtype != torch.bool:
            # Rows already shifted by attention(); torch takes a float32 mask with bf16/
            # fp16 inputs, so the bias is never rounded to half precision.
            attn_mask = attn_mask.to(_shift.additive_dtype(q.dtype))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    if not checked:  # elsewhere (CUDA: a check would sync the device) NaN is carried
        out = _CarryNaN.apply(out, q, k, v)[0] if out.requires_grad else out.add_(
            _nan_carry(q, k).to(out.dtype))
    if empty is not None:
        out = out.masked_fill(empty, 0.0)
    return out


def _checks_inputs(q) -> bool:
    """Whether q and k are checked for NaN and inf before the fused kernel (on the CPU,
    where values may be read: free of a device sync, outside ``torch.compile`` and
    ``torch.func``); elsewhere :class:`_CarryNaN` carries the NaN the kernel drops."""
    return q.device.type == "cpu" and reads_values()


def _nan_carry(q, k) -> torch.Tensor:
    """``(B, Hq, Lq, 1)``: NaN for a query row holding NaN or inf and for every row of a
    head whose keys hold NaN, else 0. Only NaN counts in k: an infinite key entry can
    give a -inf score, which excludes the key and leaves the row finite; the rule allows
    NaN in rows that may not see the key. Flags, not arithmetic: ``q.sum() * 0``
    overflowed for large finite rows (fp16) and inductor folds ``x * 0`` to 0."""
    key_nan = k.isnan().any(dim=-1).any(dim=-1)  # (B, Hkv)
    if q.shape[1] != k.shape[1]:
        key_nan = key_nan.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    bad = ~q.isfinite().all(dim=-1, keepdim=True) | key_nan[..., None, None]
    return torch.where(bad, float("nan"), 0.0).to(q.dtype)


class _CarryNaN(torch.autograd.Function):
    """``out + carry`` (:func:`_nan_carry`), and in backward the NaN that torch's fused
    backward drops: in dq of the carried rows, and in dk and dv of every key of a
    (batch, kv head) that holds such a row. The kernels return 0 for a query row holding
    NaN (eager and tiled return NaN: what the math gives). One autograd node with a
    few small kernels (not a chain of broadcast ops); ``setup_context`` apart, so that
    ``torch.func`` transforms take it. Returns ``(out, carry)``."""

    generate_vmap_rule = True  # its forward is plain torch operations

    @staticmethod
    def forward(out, q, k, v):
        carry = _nan_carry(q, k)
        return out + carry.to(out.dtype), carry

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, q, k, v = inputs
        ctx.save_for_backward(output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.shapes = q.shape, k.shape, v.shape

    @staticmethod
    def backward(ctx, grad_out, _):
        (carry,) = ctx.saved_tensors  # (B, Hq, Lq, 1)
        q_shape, k_shape, v_shape = ctx.shapes
        head = carry.isnan().reshape(*k_shape[:2], -1).any(dim=-1)  # (B, Hkv)
        keys = torch.where(head, float("nan"), 0.0).to(carry.dtype)[..., None, None]
        return grad_out, carry.expand(q_shape), keys.expand(k_shape), keys.expand(v_shape)


# --------------------------------------------------------------------------- block step
# torch's own fused kernels return the log-sum-exp too: on the CPU
# _scaled_dot_product_flash_attention_for_cpu (any rule, as an additive mask), on CUDA
# _scaled_dot_product_flash_attention (fp16/bf16, no mask but its top-left causal rule).
# Blocks the CUDA kernel cannot take run on the textbook block step, on the same device.
# The CUDA calls were checked once by hand on an H100 (torch 2.11: two key blocks merged
# by their lse, and each block's backward with the merged ones, equal SDPA on the whole
# to bf16 precision); CI has no GPU, so no test runs them.

_INF = float("inf")


def _block_rule(q, k, mask, causal, window, offset, scale):
    """``(is_causal, additive mask or None, empty rows or None)`` of one block: torch's
    top-left ``is_causal`` where it is the rule (offset 0, no window, no mask, a positive
    scale: the CPU kernel returns NaN with is_causal for a scale <= 0, torch 2.13), else
    the rule and the key mask as one ``(B|1, 1, Lq, Lk)`` additive mask of q's dtype."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    rule = _masks.KeyRule(q_len, k_len, causal=causal, window=window, offset=offset)
    if mask is None and (not rule.structural or rule.full(0, q_len, 0, k_len)):
        return False, None, None
    if mask is None and causal and window is None and offset == 0 and (
            scale is None or scale > 0):
        return True, None, None
    allowed = rule.allowed(device=q.device) if rule.structural else None
    allowed = _masks.combine(allowed, mask)  # (Lq, Lk) and/or (B, 1, 1, Lk)
    allowed = allowed.expand(*allowed.shape[:-2], q_len, k_len)
    while allowed.ndim < 4:
        allowed = allowed.unsqueeze(0)
    empty = ~allowed.any(dim=-1)  # (B|1, 1, Lq)
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
    return False, bias.masked_fill_(~allowed, -_INF), empty if bool(empty.any()) else None


def _cuda_takes(q, k, is_causal, bias):
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and bias is None and q.shape[1] == k.shape[1])


def _takes(q, v, mask, dropout_p, variants) -> bool:
    """Whether torch's kernels take the call: one head size for q, k and v, no variant,
    no dropout, a bool mask or none (the rest goes to the textbook path)."""
    return (variants is None and dropout_p == 0 and q.shape[-1] == v.shape[-1]
            and (mask is None or mask.dtype == torch.bool))


def sdpa_lse(q, k, v, mask, causal, window, scale, dropout_p, variants=None, offset=None):
    """``backends.LseStep.forward`` on torch's fused kernels: ``(out, lse)``, ``out`` in q's
    dtype, ``lse`` ``(B, Hq, Lq)`` float32 (float64 for float64), ``+inf`` for a row with
    no allowed key; ``offset`` query row 0's position among the keys (None: end-aligned).
    What the kernels cannot take runs on the textbook path (an empty sequence too: torch's
    CPU kernel divides by its length)."""
    if nothing_to_compute(q, k, v) or not _takes(q, v, mask, dropout_p, variants):
        return eager_lse(q, k, v, mask, causal, window, scale, dropout_p, variants, offset)
    offset = k.shape[2] - q.shape[2] if offset is None else int(offset)
    is_causal, bias, empty = _block_rule(q, k, mask, causal, window, offset, scale)
    if q.device.type == "cpu":
        heads, kv_heads = q.shape[1], k.shape[1]
        if heads != kv_heads:  # the kernel takes one head count: K/V repeated per block
            k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale)
    elif _cuda_takes(q, k, is_causal, bias):  # not in CI (no CUDA device there)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k.contiguous(), v.contiguous(), 0.0, is_causal, False, scale=scale)[:2]
    else:
        return eager_lse(q, k, v, mask, causal, window, scale, 0.0, None, offset)
    lse = lse.detach().to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    if empty is not None:  # the kernel gives such a row lse 0
        lse = lse.masked_fill(empty, _INF)
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out.to(q.dtype), lse


def sdpa_lse_backward(q, k, v, mask, out, lse, grad_out, causal, window, scale, variants=None,
                      offset=None):
    """``backends.LseStep.backward`` on torch's fused backward kernels (the textbook
    path's where they cannot take the call)."""
    if nothing_to_compute(q, k, v) or not _takes(q, v, mask, 0.0, variants):
        return eager_lse_backward(q, k, v, mask, out, lse, grad_out, causal, window, scale,
                                  variants, offset)
    offset = k.shape[2] - q.shape[2] if offset is None else int(offset)
    is_causal, bias, _ = _block_rule(q, k, mask, causal, window, offset, scale)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    if q.device.type == "cpu":
        heads, kv_heads = q.shape[1], k.shape[1]
        group = heads // kv_heads
        if group > 1:
            k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.to(q.dtype), q, k, v, out.to(q.dtype), lse.to(work).contiguous(), 0.0,
            is_causal, attn_mask=bias, scale=scale)
        if group > 1:  # the repeated heads' gradients summed back onto their kv head
            dk, dv = (t.unflatten(1, (kv_heads, group)).sum(2) for t in (dk, dv))
    elif _cuda_takes(q, k, is_causal, bias):  # not in CI (no CUDA device there)
        # A dense batch has no cumulative lengths (None), and without dropout the seed
        # and offset are never read.
        seed = torch.zeros(2, dtype=torch.int64, device=q.device)
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out.to(q.dtype), q, k.contiguous(), v.contiguous(), out.to(q.dtype),
            lse.float().contiguous(), None, None, q.shape[2], k.shape[2], 0.0, is_causal,
            seed, zero, scale=scale)
    else:
        return eager_lse_backward(q, k, v, mask, out, lse, grad_out, causal, window, scale,
                                  variants, offset)
    return dq.to(work), dk.to(work), dv.to(work)
