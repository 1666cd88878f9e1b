"""attnlab: attention mechanisms, exact, fast and visible.

The public API is listed in DESIGN.md; the attention math lives in
:mod:`attnlab.functional` and nowhere else.
"""

from . import masks, reference
from ._version import __version__
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

# Names a user types first, loaded on first use (module __getattr__, PEP 562): the
# models, the pictures (matplotlib) and the experiments cost nothing until then.
_LAZY_NAMES = {
    "GPT": "models", "GPTConfig": "models", "Encoder": "models", "EncoderConfig": "models",
    "ToyAttnLM": "models", "ToyConfig": "models", "HFTokenizer": "text",
}
_LAZY_MODULES = ("models", "text", "viz", "experiments", "interop", "training", "checkpoint")

__all__ = [
    "attention", "BACKENDS", "masks", "reference",
    "SimplifiedSelfAttention", "SelfAttentionV1", "SelfAttentionV2", "CausalAttention",
    "MultiHeadAttentionWrapper", "MultiHeadAttention", "KVCache", "RotaryEmbedding",
    "save_checkpoint", "load_checkpoint", "__version__",
    *_LAZY_NAMES, *_LAZY_MODULES,
]


def __getattr__(name: str):
    import importlib

    if name in _LAZY_MODULES:
        value = importlib.import_module(f".{name}", __name__)
    elif name in _LAZY_NAMES:
        value = getattr(importlib.import_module(f".{_LAZY_NAMES[name]}", __name__), name)
    else:
        raise AttributeError(f"module 'attnlab' has no attribute {name!r}")
    globals()[name] = value  # found once; later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
