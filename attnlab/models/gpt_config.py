"""``GPTConfig``: the shape and flavour of a :class:`~attnlab.models.GPT`, each field
checked when the config is made (and so when a ``config.json`` is read)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..checks import (
    boolean,
    finite_float,
    fits_in_memory,
    non_negative_int,
    one_of,
    optional_positive_int,
    positive_int,
    probability,
)
from ..config import Config
from ..modules.layers import GATED_MLP_KINDS, MLP_KINDS, NORM_KINDS
from ..rope import check_scaling

__all__ = ["GPTConfig"]

_CHOICES = {
    "positions": ("learned", "rope", "alibi"),
    "norm": NORM_KINDS,
    "mlp": tuple(kind for kind in MLP_KINDS if kind != "relu"),  # relu: encoders only
}


@dataclass
class GPTConfig(Config):
    """Shape and flavour of a :class:`GPT`.

    ``d_ff`` defaults to ``4 * d_model`` (GELU) or ``8/3 * d_model`` rounded up to a
    multiple of 64 (SwiGLU, GeGLU). ``num_kv_heads`` < ``num_heads`` gives GQA (1 = MQA).

    ``positions``: ``"learned"`` (an embedding added to the tokens'), ``"rope"`` (queries
    and keys rotated) or ``"alibi"`` (no position embedding; each head adds
    ``-slope * |p - j|`` to its scores, BLOOM's slopes for any head count).

    The options modern models add (each None/False for the plain GPT):

    - ``head_dim``: width of each head, default ``d_model // num_heads`` (Gemma 2's heads
      are wider: the attention is ``num_heads * head_dim`` wide, ``out_proj`` maps back);
    - ``attn_scale``: multiplier of ``q . k``, default ``1/sqrt(head_dim)`` (Gemma 2:
      ``query_pre_attn_scalar ** -0.5``);
    - ``attn_softcap``: scores capped as ``c * tanh(s / c)`` after scaling (Gemma 2's
      ``attn_logit_softcapping``); ``logit_softcap``: the same on the output logits
      (``final_logit_softcapping``);
    - ``window`` with ``window_layers``: the sliding window on the layers listed (indices
      from 0), or on every layer when ``window_layers`` is None (Gemma 2 slides on the
      even layers, some Qwen2 models from ``max_window_layers`` on);
    - ``sinks``: a learned logit per head and layer in every softmax's denominator
      (gpt-oss's attention sinks);
    - ``post_norms``: a norm on the output of the attention and of the MLP before each is
      added back (Gemma 2's ``post_attention_layernorm`` / ``post_feedforward_layernorm``);
    - ``qk_norm``: a norm of the model's ``norm`` kind over each head's query and key
      before RoPE (Qwen3's ``q_norm`` / ``k_norm``);
    - ``rope_scaling``: RoPE's frequencies stretched for longer contexts,
      ``{"rope_type": "linear" | "llama3", ...}`` with transformers' keys (Llama 3.1-3.3's
      ``llama3``; :mod:`attnlab.rope`); ``window_rope_base`` with ``window_rope_scaling``:
      the RoPE of the layers with a window, where it is their own (Gemma 3's local layers
      turn slower than its global ones);
    - ``scale_embeddings``: token embeddings times ``sqrt(d_model)`` (Gemma);
      ``embed_norm``: a norm of the embeddings before the first block (BLOOM's
      ``word_embeddings_layernorm``).

    ``norm="rmsnorm_plus_one"`` is Gemma's RMSNorm (``1 + weight``), ``mlp="geglu"``
    Gemma's ``gelu_tanh(gate) * up``.
    """

    vocab_size: int = 256
    context_length: int = 256
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    d_ff: int | None = None
    positions: str = "learned"
    rope_base: float = 10000.0
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    mlp: str = "gelu"
    tie_embeddings: bool = True
    qkv_bias: bool = False
    out_bias: bool = True
    mlp_bias: bool = True
    dropout: float = 0.0
    window: int | None = None
    backend: str = "auto"
    head_dim: int | None = None
    attn_scale: float | None = None
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    window_layers: Sequence[int] | None = None
    sinks: bool = False
    post_norms: bool = False
    scale_embeddings: bool = False
    embed_norm: bool = False
    qk_norm: bool = False
    rope_scaling: dict | None = None
    window_rope_base: float | None = None
    window_rope_scaling: dict | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads"):
            positive_int(f"GPTConfig.{name}", getattr(self, name))
        for name, options in _CHOICES.items():
            one_of(f"GPTConfig.{name}", getattr(self, name), options)
        if self.d_ff is None:
            self.d_ff = (4 * self.d_model if self.mlp not in GATED_MLP_KINDS
                         else -(-(8 * self.d_model // 3) // 64) * 64)
        positive_int("GPTConfig.d_ff", self.d_ff)
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(f"GPTConfig.d_model={self.d_model} must be divisible by "
                             f"num_heads={self.num_heads} (or give head_dim)")
        if self.head_dim is None:
            self.head_dim = self.d_model // self.num_heads
        positive_int("GPTConfig.head_dim", self.head_dim)
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"GPTConfig.head_dim={self.head_dim} must be even with "
                             "positions='rope' (RoPE rotates pairs of features)")
        kv = optional_positive_int("GPTConfig.num_kv_heads", self.num_kv_heads)
        if kv is not None and self.num_heads % kv:
            raise ValueError(f"GPTConfig.num_kv_heads={kv} must divide num_heads="
                             f"{self.num_heads}")
        optional_positive_int("GPTConfig.window", self.window)
        self.window_layers = _layer_list("GPTConfig.window_layers", self.window_layers,
                                         self.num_layers)
        if self.window_layers is not None and self.window is None:
            raise ValueError(f"GPTConfig.window_layers={list(self.window_layers)} needs a "
                             "window (GPTConfig.window), got None")
        for name in ("attn_scale", "attn_softcap", "logit_softcap"):
            if getattr(self, name) is not None:
                finite_float(f"GPTConfig.{name}", getattr(self, name), positive=True)
        for name in ("tie_embeddings", "qkv_bias", "out_bias", "mlp_bias", "sinks",
                     "post_norms", "scale_embeddings", "embed_norm", "qk_norm"):
            boolean(f"GPTConfig.{name}", getattr(self, name))  # "no" is not False
        probability("GPTConfig.dropout", self.dropout)
        finite_float("GPTConfig.norm_eps", self.norm_eps, positive=True)
        finite_float("GPTConfig.rope_base", self.rope_base, positive=True)
        self.rope_scaling = check_scaling("GPTConfig.rope_scaling", self.rope_scaling,
                                          self.head_dim)
        self.window_rope_scaling = check_scaling("GPTConfig.window_rope_scaling",
                                                 self.window_rope_scaling, self.head_dim)
        if self.window_rope_base is not None:
            finite_float("GPTConfig.window_rope_base", self.window_rope_base, positive=True)
        elif self.window_rope_scaling is not None:
            raise ValueError("GPTConfig.window_rope_scaling needs window_rope_base")
        for name in ("rope_scaling", "window_rope_base"):
            if getattr(self, name) is not None and self.positions != "rope":
                raise ValueError(f"GPTConfig.{name} needs positions='rope', got "
                                 f"positions={self.positions!r}")
        count = self.num_parameters()
        fits_in_memory(f"a GPT of {count:,} parameters", 4 * count)

    def num_parameters(self) -> int:
        """Parameters a GPT of this config holds (computed, nothing allocated; biases
        counted as if present, norms as LayerNorms: an upper bound within a few per cent)."""
        d, head_dim = self.d_model, self.head_dim or self.d_model // self.num_heads
        inner, kv_dim = self.num_heads * head_dim, (self.num_kv_heads or self.num_heads) * head_dim
        attn = d * (inner + 2 * kv_dim) + inner * d + inner + 2 * kv_dim + d + self.num_heads
        mlp = (3 if self.mlp in GATED_MLP_KINDS else 2) * d * self.d_ff + 2 * self.d_ff + d
        per_layer = attn + mlp + (8 if self.post_norms else 4) * d + 4 * head_dim
        emb = self.vocab_size * d + (self.context_length * d if self.positions == "learned"
                                     else 0) + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return emb + self.num_layers * per_layer + 2 * d + head

    def layer_rope(self, layer: int) -> tuple[float, dict | None]:
        """RoPE's base and scaling on layer ``layer``: the window's own where it has a
        window and ``window_rope_base`` is given, else ``rope_base`` and ``rope_scaling``."""
        if self.window_rope_base is not None and self.layer_window(layer) is not None:
            return self.window_rope_base, self.window_rope_scaling
        return self.rope_base, self.rope_scaling

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: it attends to every earlier token)."""
        if self.window_layers is None or layer in self.window_layers:
            return self.window
        return None


def _layer_list(name: str, value: object, num_layers: int) -> tuple[int, ...] | None:
    """``value`` (None or a list of layer indices) as a sorted tuple of distinct indices in
    ``[0, num_layers)``, else a ValueError naming ``name``."""
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list of layer indices or None, got {value!r}")
    layers = [non_negative_int(f"{name}[{i}]", v) for i, v in enumerate(value)]
    bad = [v for v in layers if v >= num_layers]
    if bad:
        raise ValueError(f"{name} lists layers {bad}, but there are {num_layers} layers "
                         f"(expected indices in [0, {num_layers - 1}])")
    if len(set(layers)) != len(layers):
        raise ValueError(f"{name} lists a layer twice: {list(value)}")
    return tuple(sorted(layers))
