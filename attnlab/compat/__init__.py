"""Drop-in signatures of the GPU attention libraries, on attnlab (any device, CPU included).

Code written for FlashAttention or FlexAttention runs unchanged with its import
swapped: ``from attnlab.compat import flash_attn_func`` in place of ``from flash_attn
import flash_attn_func``, ``from attnlab.compat import flex_attention,
create_block_mask`` in place of ``torch.nn.attention.flex_attention``'s. Each function
maps its library's documented semantics onto :func:`attnlab.attention` exactly (the
modules say how, and which cases they refuse), and keeps its layout, defaults and
return values.
"""

from .flash_attn import flash_attn_func, flash_attn_varlen_func
from .flex import and_masks, create_block_mask, flex_attention, noop_mask, or_masks

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flex_attention", "create_block_mask",
           "and_masks", "or_masks", "noop_mask"]
