"""attnlab: attention mechanisms, exact, fast and visible.

The public API is listed in DESIGN.md; the attention math lives in
:mod:`attnlab.functional` and nowhere else.
"""

from . import masks, reference
from .cache import KVCache
from .checkpoint import load_checkpoint, save_checkpoint
from .functional import BACKENDS, attention
from .modules import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttentionV1,
    SelfAttentionV2,
    SimplifiedSelfAttention,
)
from .rope import RotaryEmbedding

__version__ = "0.1.0"

__all__ = [
    "attention", "BACKENDS", "masks", "reference",
    "SimplifiedSelfAttention", "SelfAttentionV1", "SelfAttentionV2", "CausalAttention",
    "MultiHeadAttentionWrapper", "MultiHeadAttention", "KVCache", "RotaryEmbedding",
    "save_checkpoint", "load_checkpoint", "__version__",
]
