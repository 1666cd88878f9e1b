"""``nn.Module``s built on :func:`attnlab.attention`.

- the tutorial family of the book's chapter 3 (:mod:`.tutorial`):
  :class:`SimplifiedSelfAttention`, :class:`SelfAttentionV1`, :class:`SelfAttentionV2`,
  :class:`CausalAttention`, :class:`MultiHeadAttentionWrapper`;
- :class:`MultiHeadAttention` (:mod:`.multihead`): MHA/GQA/MQA, causal, sliding window,
  cross-attention, RoPE and a KV cache; the module the models stack.
"""

from .multihead import MultiHeadAttention
from .tutorial import (
    CausalAttention,
    MultiHeadAttentionWrapper,
    SelfAttentionV1,
    SelfAttentionV2,
    SimplifiedSelfAttention,
)

__all__ = [
    "SimplifiedSelfAttention",
    "SelfAttentionV1",
    "SelfAttentionV2",
    "CausalAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadAttention",
]
