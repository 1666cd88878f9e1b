"""GPT: a decoder-only transformer wide enough to host GPT-2 and Llama layouts.

Pre-norm blocks ``x + attn(norm(x))``, ``x + mlp(norm(x))``; learned or rotary
positions; LayerNorm or RMSNorm; GELU or SwiGLU MLP; MHA, GQA or MQA; tied or
untied output layer. Every attention goes through ``MultiHeadAttention`` and so
through ``attnlab.attention``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from .. import masks as _masks
from ..cache import KVCache
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
from ..distributed import ContextParallel
from ..functional import may_decode
from ..layouts.gguf import gguf_layout
from ..layouts.hf import gpt_layout
from ..modules import MultiHeadAttention, fused
from ..modules.layers import MLP, MLP_KINDS, NORM_KINDS, dropout, embedding, make_norm
from . import decoding
from .generation import GenerationMixin
from .ids import check_ids
from .loading import build_loaded
from .outputs import with_extras

_CHOICES = {
    "positions": ("learned", "rope"),
    "norm": NORM_KINDS,
    "mlp": tuple(kind for kind in MLP_KINDS if kind != "relu"),  # relu: encoders only
}


@dataclass
class GPTConfig(Config):
    """Shape and flavour of a :class:`GPT`.

    ``d_ff`` defaults to ``4 * d_model`` (GELU) or ``8/3 * d_model`` rounded up to a
    multiple of 64 (SwiGLU). ``num_kv_heads`` < ``num_heads`` gives GQA (1 = MQA).
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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads"):
            positive_int(f"GPTConfig.{name}", getattr(self, name))
        for name, options in _CHOICES.items():
            one_of(f"GPTConfig.{name}", getattr(self, name), options)
        if self.d_ff is None:
            self.d_ff = (4 * self.d_model if self.mlp != "swiglu"
                         else -(-(8 * self.d_model // 3) // 64) * 64)
        positive_int("GPTConfig.d_ff", self.d_ff)
        if self.d_model % self.num_heads:
            raise ValueError(f"GPTConfig.d_model={self.d_model} must be divisible by "
                             f"num_heads={self.num_heads}")
        kv = optional_positive_int("GPTConfig.num_kv_heads", self.num_kv_heads)
        if kv is not None and self.num_heads % kv:
            raise ValueError(f"GPTConfig.num_kv_heads={kv} must divide num_heads="
                             f"{self.num_heads}")
        optional_positive_int("GPTConfig.window", self.window)
        for name in ("tie_embeddings", "qkv_bias", "out_bias", "mlp_bias"):
            boolean(f"GPTConfig.{name}", getattr(self, name))  # "no" is not False
        probability("GPTConfig.dropout", self.dropout)
        finite_float("GPTConfig.norm_eps", self.norm_eps, positive=True)
        finite_float("GPTConfig.rope_base", self.rope_base, positive=True)
        count = self.num_parameters()
        fits_in_memory(f"a GPT of {count:,} parameters", 4 * count)

    def num_parameters(self) -> int:
        """Parameters a GPT of this config holds (computed, nothing allocated)."""
        d, head_dim = self.d_model, self.d_model // self.num_heads
        kv_dim = (self.num_kv_heads or self.num_heads) * head_dim
        attn = d * (d + 2 * kv_dim) + d * d + (3 * d if self.qkv_bias else 0) + d
        mlp = (3 if self.mlp == "swiglu" else 2) * d * self.d_ff + self.d_ff + d
        per_layer = attn + mlp + 4 * d
        emb = self.vocab_size * d + (self.context_length * d if self.positions == "learned"
                                     else 0)
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return emb + self.num_layers * per_layer + 2 * d + head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, context_parallel: ContextParallel | None = None) -> None:
        super().__init__()
        self.norm1 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.attn = MultiHeadAttention(
            cfg.d_model, cfg.d_model, cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
            context_length=cfg.context_length, causal=True, dropout=cfg.dropout,
            resid_dropout=cfg.dropout, qkv_bias=cfg.qkv_bias, out_bias=cfg.out_bias,
            rope=cfg.positions == "rope", rope_base=cfg.rope_base, window=cfg.window,
            backend=cfg.backend, context_parallel=context_parallel,
        )
        self.norm2 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg.d_model, cfg.d_ff, cfg.mlp, bias=cfg.mlp_bias)
        self.dropout = cfg.dropout

    def forward(self, x, mask, cache, positions, output_attentions):
        a = self.attn(self.norm1(x), mask=mask, cache=cache, positions=positions,
                      return_weights=output_attentions)
        weights = None
        if output_attentions:
            a, weights = a
        x = x + a
        return x + dropout(self.mlp(self.norm2(x)), self.dropout, self.training), weights


class GPT(GenerationMixin, nn.Module):
    """Decoder-only language model.

    ``forward(ids)`` maps ``(batch, seq)`` token ids to logits ``(batch, seq, vocab)``.

    ``context_parallel`` (an :class:`attnlab.distributed.ContextParallel`, also settable
    later as ``model.context_parallel = cp``) splits one long sequence across processes:
    ``forward`` then takes this rank's shard of the ids (``cp.shard(ids)``) and returns
    the logits of those tokens, equal to the whole sequence's logits cut the same way.
    """

    model_type = "gpt"

    def __init__(self, config: GPTConfig, *,
                 context_parallel: ContextParallel | None = None) -> None:
        super().__init__()
        self._context_parallel = context_parallel
        self.config = config
        self.context_length = config.context_length
        self.tok_emb = embedding(config.vocab_size, config.d_model)
        self.pos_emb = (embedding(config.context_length, config.d_model)
                        if config.positions == "learned" else None)
        self.blocks = nn.ModuleList(Block(config, context_parallel)
                                    for _ in range(config.num_layers))
        self.norm = make_norm(config.norm, config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # The output layer is stored (d_model, vocab): a one-row product streams it in
        # order, much faster than F.linear's rows. Tied, the embedding is that same tensor
        # (its rows are then strided, which a lookup of a few tokens does not notice).
        fused.pack((self.lm_head,))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        # GPT-2's initialisation: N(0, 0.02) for weights, zeros for biases. Drawn in the
        # usual (out, in) order and copied, so packed weights get the same numbers.
        if isinstance(m, (nn.Linear, nn.Embedding)):
            if m.weight.is_meta:  # built to be loaded: nothing to draw
                return
            with torch.no_grad():
                w = m.weight
                w.copy_(torch.empty(w.shape, dtype=w.dtype, device=w.device).normal_(std=0.02))
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    @property
    def context_parallel(self) -> ContextParallel | None:
        """How the sequence is split across processes (None: it is not)."""
        return self._context_parallel

    @context_parallel.setter
    def context_parallel(self, value: ContextParallel | None) -> None:
        for block in self.blocks:
            block.attn._split_context(value)
        self._context_parallel = value

    def new_cache(self, batch_size: int, max_seq_len: int) -> list[KVCache]:
        """One preallocated :class:`KVCache` per layer."""
        return [b.attn.new_cache(batch_size, max_seq_len) for b in self.blocks]

    def forward(
        self,
        ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        caches: list[KVCache] | None = None,
        positions: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        logits_to_keep: int = 0,
        decoder: decoding.Decoder | None = None,
    ):
        """Logits for every position (or the last ``logits_to_keep``).

        Args:
            ids: ``(batch, seq)`` token ids.
            attention_mask: ``(batch, past + seq)`` 1/0 (or bool) key padding mask,
                1 = real token; covers the cached tokens too when ``caches`` is given.
            caches: per-layer KV caches from :meth:`new_cache`; the new keys/values
                are appended and attention covers everything cached.
            positions: ``(batch, seq)`` or ``(seq,)`` position of each token (default:
                ``past + arange(seq)``); left-padded batches pass their own.
            output_attentions: also return one ``(batch, heads, seq, past + seq)``
                weight tensor per layer.
            output_hidden_states: also return what flows between layers, as
                transformers does for GPT-2 and Llama: ``num_layers + 1`` tensors
                ``(batch, seq, d_model)``, the embeddings (the input of layer 0), then
                each layer's output, the last one after the final norm (the input of
                the output layer).
            logits_to_keep: 0 for the logits of every position, else of the last
                ``logits_to_keep`` positions only (as transformers; generation needs
                the last one, and the output layer is the largest product).
            decoder: a :meth:`decoder` made for the tokens of one generation, which keeps
                the plan of the fused decoding step from token to token; None (the
                default) makes it anew for this call.

        Returns:
            logits ``(batch, seq, vocab)`` (``seq`` = ``logits_to_keep`` when given);
            with either flag a tuple: logits, then
            ``attentions`` (a list) if asked, then ``hidden_states`` (a list) if asked.
        """
        check_ids(ids, self.config.vocab_size)
        non_negative_int("logits_to_keep", logits_to_keep)
        batch, seq = ids.shape
        past = caches[0].seq_len if caches else 0
        split = self._context_parallel
        if split is not None:  # ids: this rank's shard of the sequence
            if caches is not None or output_attentions or logits_to_keep:
                raise ValueError("caches, output_attentions and logits_to_keep are not "
                                 "supported with context_parallel")
            whole = split.total(seq)
            if positions is None:
                positions = split.positions(seq, seq_len=whole, device=ids.device)
        if past + (seq if split is None else whole) > self.context_length:
            raise ValueError(
                f"sequence of {past + (seq if split is None else whole)} tokens is longer "
                f"than context_length={self.context_length}"
            )
        if caches is not None and len(caches) != len(self.blocks):
            raise ValueError(f"caches must hold one KVCache per layer ({len(self.blocks)}), "
                             f"got {len(caches)}")
        x = dropout(self.embed(ids, positions=positions, past=past), self.config.dropout,
                    self.training)  # (B, T, d_model)
        if self.pos_emb is not None:
            positions = None  # learned positions were added by embed, not rotated
        # Converted once here, not again in every layer for every decoded token.
        mask = _masks.as_attention_mask(attention_mask, batch, past + seq)
        attentions, hidden = [], ([x] if output_hidden_states else None)
        # One row decoded with a cache and nothing asked beyond the logits: the blocks
        # in native calls where they can (models.decoding), else through their modules.
        # (Each block's own backend and dropout are asked again in decoding.run.)
        fused_rows = (caches is not None and batch * seq == 1 and positions is None
                      and hidden is None and not fused.global_forward_hooks()
                      and may_decode(mask=mask, weights=output_attentions))
        if fused_rows:
            x = (decoder or decoding.Decoder(self.blocks, Block))(x, caches)
        for i, block in enumerate(() if fused_rows else self.blocks):
            x, w = block(x, mask, None if caches is None else caches[i], positions,
                         output_attentions)
            if output_attentions:
                attentions.append(w)
            if hidden is not None:
                hidden.append(x)
        x = self.norm(x)
        if hidden is not None:
            hidden[-1] = x  # transformers' convention: the last entry is after the final norm
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        # In inference one product over the (d_model, vocab) tensor, packed again first
        # if its layout was lost (see modules.fused).
        logits = fused.joint(x, (self.lm_head,))
        if logits is None:
            logits = self.lm_head(x)
        return with_extras(logits, attentions if output_attentions else None, hidden)

    def decoder(self, ids=None) -> decoding.Decoder | None:
        """A :class:`~attnlab.models.decoding.Decoder` for the tokens of one generation
        from ``ids``, to pass to every :meth:`forward` of it; None where user code could
        change the model between tokens (hooks, classes of the user's, tensor subclasses,
        torch function modes: see ``decoding.library_only``)."""
        return decoding.Decoder(self.blocks, Block) if decoding.library_only(self, ids) else None

    def embed(self, ids: torch.Tensor, *, positions: torch.Tensor | None = None,
              past: int = 0) -> torch.Tensor:
        """The first step of the model: token ids to hidden states.

        Args:
            ids: ``(batch, seq)`` token ids.
            positions: ``(batch, seq)`` or ``(seq,)`` positions for the learned position
                embedding (default ``past .. past + seq - 1``).
            past: tokens already cached before ``ids``.

        Returns:
            ``(batch, seq, d_model)``: the token embedding, plus the position embedding
            when ``positions="learned"`` (rotary models add none here: their attention
            rotates queries and keys). Dropout is applied by :meth:`forward`.
        """
        x = self.tok_emb(ids)
        if self.pos_emb is not None:
            if positions is None:
                positions = torch.arange(past, past + ids.shape[1], device=ids.device)
            x = x + self.pos_emb(positions)
        return x

    @classmethod
    def from_hf(cls, model) -> GPT:
        """A GPT with the weights of a ``transformers`` ``GPT2LMHeadModel``,
        ``LlamaForCausalLM`` (SmolLM, TinyLlama), ``MistralForCausalLM`` or
        ``Qwen2ForCausalLM``, or of a local folder written by their ``save_pretrained``
        (safetensors only; nothing is downloaded).

        The model owns its weights: a folder's are read once from the file into this
        model's parameters (nothing of the file stays mapped, so replacing or truncating
        it later changes nothing), a live model's are copied (training this model never
        changes it). Every tensor's shape is checked against the config before anything
        is allocated.
        """
        config, state = gpt_layout(model)
        config = GPTConfig.from_dict(config)
        return build_loaded(lambda: cls(config), state, source=_source(model)).eval()

    @classmethod
    def from_gguf(cls, path) -> GPT:
        """A GPT with the weights of a GGUF file (llama.cpp's format): the ``llama``
        (Llama 2 and 3, SmolLM, TinyLlama, Mistral) and ``qwen2`` architectures, tensors
        of the types :data:`attnlab.io.gguf.SUPPORTED_TYPES` (F32, F16, BF16, Q8_0, Q4_1,
        K-quants...), dequantised to float32. ``path`` may also be an open
        :class:`attnlab.io.gguf.GGUFFile`. The architecture, the tensor types and every
        shape are checked before anything is allocated; a damaged or unsupported file
        is one ValueError naming it. The tokenizer is
        :meth:`attnlab.text.GGUFTokenizer.from_gguf`.
        """
        config, state, source = gguf_layout(path)
        config = GPTConfig.from_dict(config)
        return build_loaded(lambda: cls(config), state, source=source).eval()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _source(model) -> str:
    """How an error names where the weights came from."""
    if isinstance(model, str | os.PathLike):
        return repr(str(model))
    return f"the {type(model).__name__}"
