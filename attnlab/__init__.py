"""attnlab: attention mechanisms, exact, fast and visible.

The public API is listed in the README; the package's layers and where each rule
lives are in docs/DESIGN.md. The attention math lives in :mod:`attnlab.functional`
and nowhere else.

Every public name is loaded on first use (module ``__getattr__``, PEP 562): the
``attnlab`` command lives in this package, and ``attnlab --help`` should not wait
1.5 s for torch; the models, the pictures (matplotlib) and the experiments cost
nothing until used either.
"""

from typing import TYPE_CHECKING

from ._version import __version__

if TYPE_CHECKING:  # for editors and type checkers; at run time __getattr__ finds them
    from . import check, distributed, masks, reference
    from .cache import KVCache
    from .checkpoint import load_checkpoint, save_checkpoint
    from .functional import BACKENDS, attention
    from .interop import load
    from .models import GPT, Encoder, EncoderConfig, GPTConfig, ToyAttnLM, ToyConfig
    from .modules import (
        CausalAttention,
        MultiHeadAttention,
        MultiHeadAttentionWrapper,
        SelfAttentionV1,
        SelfAttentionV2,
        SimplifiedSelfAttention,
    )
    from .rope import RotaryEmbedding
    from .text import HFTokenizer

# name -> the submodule that defines it
_LAZY_NAMES = {
    "attention": "functional", "BACKENDS": "functional", "KVCache": "cache",
    "RotaryEmbedding": "rope", "save_checkpoint": "checkpoint", "load_checkpoint": "checkpoint",
    "SimplifiedSelfAttention": "modules", "SelfAttentionV1": "modules",
    "SelfAttentionV2": "modules", "CausalAttention": "modules",
    "MultiHeadAttentionWrapper": "modules", "MultiHeadAttention": "modules",
    "GPT": "models", "GPTConfig": "models", "Encoder": "models", "EncoderConfig": "models",
    "ToyAttnLM": "models", "ToyConfig": "models", "HFTokenizer": "text",
    "load": "interop",
}
# ``check`` is a module that can be called: ``attnlab.check(fn_or_module)``.
_LAZY_MODULES = ("masks", "reference", "models", "text", "viz", "experiments", "heads",
                 "interop", "training", "checkpoint", "check", "distributed")

__all__ = [  # a plain list, so that linters see the names of the TYPE_CHECKING block used
    "attention", "BACKENDS", "masks", "reference",
    "SimplifiedSelfAttention", "SelfAttentionV1", "SelfAttentionV2", "CausalAttention",
    "MultiHeadAttentionWrapper", "MultiHeadAttention", "KVCache", "RotaryEmbedding",
    "save_checkpoint", "load_checkpoint", "__version__",
    "GPT", "GPTConfig", "Encoder", "EncoderConfig", "ToyAttnLM", "ToyConfig", "HFTokenizer",
    "models", "text", "viz", "experiments", "heads", "interop", "training", "checkpoint",
    "check", "load", "distributed",
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
