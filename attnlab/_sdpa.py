"""The ``sdpa`` backend: torch's fused ``scaled_dot_product_attention`` with attnlab's
conventions translated (end-aligned causal rule, windows, the empty-row rule, NaN kept).

Inputs are ``attention()``'s after its checks: 4-D ``(batch, heads, seq, dim)``, an
additive mask already shifted by :func:`attnlab.masks.shift_rows`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _variants
from . import masks as _masks
from ._eager import eager_attention


def sdpa_attention(q, k, v, mask, causal, window, scale, dropout_p, variants=None):
    """torch's fused kernel, with attnlab's causal alignment and empty-row rule. Of the
    variants it takes what a dense mask states exactly: documents and a ``mask_mod``
    (a bool mask), ALiBi (an additive one); O(q_len x k_len) memory for them."""
    if (q.device.type == "cpu" and not torch.compiler.is_compiling()
            and not (bool(torch.isfinite(q).all()) and bool(torch.isfinite(k).all()))):
        # The fused kernel gives 0 for a row whose scores hold NaN (NaN in q or k, or
        # inf - inf from an infinite key entry) and a gradient of 0 to what such a row
        # weighs; the README's rule is IEEE's. On the CPU the check is free of a device
        # sync, and such rare inputs take the textbook path, which keeps the rule.
        return eager_attention(q, k, v, mask, causal, window, scale, dropout_p, None,
                               variants)[0]
    q_len, k_len = q.shape[-2], k.shape[-2]
    is_causal = False
    struct = bias = None
    if variants is not None:
        rule = _variants.rule(variants, q_len, k_len, causal, window)
        struct = _masks.combine(
            rule.allowed(device=q.device) if rule.structural else None,
            None if variants.block_mask is None else variants.block_mask.dense())
        if variants.alibi_slopes is not None:
            rows = torch.arange(q_len, device=q.device)
            bias = _variants.alibi(variants.alibi_slopes, rule, rows, 0, k_len, k.shape[1],
                                   _masks.additive_dtype(q.dtype)).flatten(1, 2)
    elif causal and window is None and mask is None and q_len == k_len and scale > 0:
        # torch's top-left alignment equals ours when the lengths agree. Its CPU kernel
        # returns NaN with is_causal for a scale <= 0 (torch 2.13), so those take the
        # explicit rule below.
        is_causal = True
    elif causal and window is None and q_len == 1:
        pass  # end-aligned: the one query (the newest token) sees every key
    else:
        struct = _masks.structural(q_len, k_len, causal=causal, window=window, device=q.device)
    attn_mask = _masks.combine(struct, mask, bias)
    empty = None
    if attn_mask is not None:
        allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
        empty = ~allowed.any(dim=-1, keepdim=True)
        if bool(empty.any()):
            # Let empty rows see everything (no NaN in forward or backward), zero them after.
            attn_mask = attn_mask | empty if attn_mask.dtype == torch.bool else (
                attn_mask.masked_fill(empty, 0.0)
            )
        else:
            empty = None
        if attn_mask.dtype != torch.bool:
            # Rows already shifted by attention(); torch takes a float32 mask with bf16/
            # fp16 inputs, so the bias is never rounded to half precision.
            attn_mask = attn_mask.to(_masks.additive_dtype(q.dtype))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    # Elsewhere (CUDA: a check would sync the device), the NaN is carried instead. The
    # fused kernels return 0 for a query row holding NaN; eager and tiled return NaN
    # (what the math gives). Adding the row's sum times 0 carries it through here too.
    nan_carry = q.sum(dim=-1, keepdim=True).to(out.dtype)
    # They drop a NaN key the same way. Only NaN is carried from k (an infinite key entry
    # can give a -inf score, which excludes the key and leaves the row finite); every row
    # of the head gets it, which the rule allows for rows that may not see that key.
    key_nan = k.isnan().any(dim=-1).any(dim=-1)  # (batch, kv_heads)
    key_nan = key_nan.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    nan_carry = nan_carry + torch.where(key_nan, float("nan"), 0.0).to(out.dtype)[..., None, None]
    if out.requires_grad:
        # torch's backward gives the values a NaN row weighs a gradient of 0. Tie every
        # value to the carry, so theirs is NaN too (0 * NaN) and stays exactly 0 for a
        # finite row; the mean's non-finite entries are zeroed so that the forward adds
        # nothing a finite row would not otherwise get.
        group = q.shape[1] // v.shape[1]
        v_mean = torch.nan_to_num(v.mean(dim=-2, keepdim=True), nan=0.0, posinf=0.0,
                                  neginf=0.0).repeat_interleave(group, dim=1)
        out = out + nan_carry.mul(0) * v_mean.to(out.dtype)
    else:  # decoding: in place, two small ops instead of four (0 * NaN is NaN)
        out.add_(nan_carry, alpha=0)
    if empty is not None:
        out = out.masked_fill(empty, 0.0)
    return out
