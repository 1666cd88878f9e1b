"""GPT: a decoder-only transformer wide enough to host GPT-2, Llama, Qwen, Gemma 2 and 3
and BLOOM layouts.

Pre-norm blocks ``x + attn(norm(x))``, ``x + mlp(norm(x))`` (Gemma 2 also norms each
branch's output); learned, rotary or ALiBi positions; LayerNorm, RMSNorm or Gemma's
RMSNorm; GELU, SwiGLU or GeGLU MLP; MHA, GQA or MQA; softcapped scores and logits, sink
logits, a sliding window on chosen layers (with a RoPE of their own); norms over each
head's queries and keys; tied or untied output layer. Every attention
goes through ``MultiHeadAttention`` and so through ``attnlab.attention``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import masks as _masks
from ..cache import KVCache
from ..checks import non_negative_int
from ..distributed import ContextParallel
from ..distributed.context import whole_length
from ..functional import may_decode
from ..layouts.gguf import gguf_layout
from ..layouts.hf import gpt_layout
from ..modules import MultiHeadAttention, fused, quantized
from ..modules.layers import MLP, dropout, embedding, make_norm, residual
from . import decoding
from .generation import GenerationMixin, check_precision
from .gpt_config import GPTConfig
from .ids import check_ids, packed_positions
from .loading import build_loaded, source_name
from .outputs import with_extras

__all__ = ["GPT", "GPTConfig", "Block"]


class Block(nn.Module):
    """Layer ``layer`` of a GPT: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``; with
    ``post_norms`` each branch is normed again before it is added
    (``post_attn_norm``, ``post_mlp_norm``)."""

    def __init__(self, cfg: GPTConfig, layer: int = 0,
                 context_parallel: ContextParallel | None = None) -> None:
        super().__init__()
        self.norm1 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        rope_base, rope_scaling = cfg.layer_rope(layer)
        self.attn = MultiHeadAttention(
            cfg.d_model, cfg.d_model, cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
            context_length=cfg.context_length, causal=True, dropout=cfg.dropout,
            resid_dropout=cfg.dropout, qkv_bias=cfg.qkv_bias, out_bias=cfg.out_bias,
            rope=cfg.positions == "rope", rope_base=rope_base, rope_scaling=rope_scaling,
            window=cfg.layer_window(layer), backend=cfg.backend, head_dim=cfg.head_dim,
            scale=cfg.attn_scale, softcap=cfg.attn_softcap, alibi=cfg.positions == "alibi",
            sinks=cfg.sinks, context_parallel=context_parallel,
            qk_norm=cfg.norm if cfg.qk_norm else None, qk_norm_eps=cfg.norm_eps,
        )
        self.post_attn_norm = (make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
                               if cfg.post_norms else None)
        self.norm2 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg.d_model, cfg.d_ff, cfg.mlp, bias=cfg.mlp_bias)
        self.post_mlp_norm = (make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
                              if cfg.post_norms else None)
        self.dropout = cfg.dropout

    def forward(self, x, mask, cache, positions, output_attentions, document_ids=None):
        a = self.attn(self.norm1(x), mask=mask, cache=cache, positions=positions,
                      return_weights=output_attentions, document_ids=document_ids)
        weights = None
        if output_attentions:
            a, weights = a
        if self.post_attn_norm is not None:
            a = self.post_attn_norm(a)
        x = residual(self, x, a)
        m = self.mlp(self.norm2(x))
        if self.post_mlp_norm is not None:
            m = self.post_mlp_norm(m)
        return residual(self, x, dropout(m, self.dropout, self.training)), weights


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
        self.embed_norm = (make_norm(config.norm, config.d_model, config.norm_eps)
                           if config.embed_norm else None)
        self.blocks = nn.ModuleList(Block(config, i, context_parallel)
                                    for i in range(config.num_layers))
        # One rotary table for all layers of one RoPE (one head_dim, base and scaling): it
        # grows with the positions decoded, 2 * positions * head_dim floats once, not once
        # a layer (Gemma 3: one for its local layers, one for its global ones).
        shared: dict[str, nn.Module] = {}
        for block in self.blocks:
            if block.attn.rotary is not None:
                block.attn.rotary = shared.setdefault(repr(block.attn.rotary),
                                                      block.attn.rotary)
        self.norm = make_norm(config.norm, config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # The output layer is packed alone, as its one-row product streams it fastest
        # (modules.fused.by_rows: rows for bf16, or past 4096 outputs with the kernel). Tied,
        # the embedding is that same tensor (its rows may then be strided, which a lookup
        # of a few tokens does not notice).
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

    def new_cache(self, batch_size: int, max_seq_len: int, *,
                  dtype: torch.dtype | None = None) -> list[KVCache]:
        """One preallocated :class:`KVCache` per layer (``dtype``: default the weights')."""
        return [b.attn.new_cache(batch_size, max_seq_len, dtype=dtype) for b in self.blocks]

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
        document_ids: torch.Tensor | None = None,
    ):
        """Logits for every position (or the last ``logits_to_keep``).

        Args:
            ids: ``(batch, seq)`` token ids.
            attention_mask: ``(batch, past + seq)`` 1/0 (or bool) key padding mask,
                1 = real token; covers the cached tokens too when ``caches`` is given.
            caches: per-layer KV caches from :meth:`new_cache`; the new keys/values
                are appended and attention covers everything cached.
            positions: ``(batch, seq)`` or ``(seq,)`` position of each token (default:
                ``past + arange(seq)``, or each token's place in its document with
                ``document_ids``); left-padded batches pass their own. ALiBi models
                (``positions="alibi"``) take distances from the order of the tokens and
                use no positions.
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
            document_ids: ``(batch, seq)`` integer ids, non-decreasing along each row, for
                rows that pack several documents: no token attends to another document's,
                and each document's positions start at 0 (unless ``positions`` says
                otherwise), so every document gets the logits it would alone. Without
                caches.

        Returns:
            logits ``(batch, seq, vocab)`` (``seq`` = ``logits_to_keep`` when given), float32
            for bf16 and int8 weights too;
            with either flag a tuple: logits, then
            ``attentions`` (a list) if asked, then ``hidden_states`` (a list) if asked.
        """
        check_ids(ids, self.config.vocab_size)
        non_negative_int("logits_to_keep", logits_to_keep)
        batch, seq = ids.shape
        past = caches[0].seq_len if caches else 0
        split = self._context_parallel
        if split is not None and document_ids is not None:
            raise ValueError("document_ids is not supported with context_parallel (a shard "
                             "cannot number its documents' positions alone); pass "
                             "positions and call ring_attention with document_ids")
        positions = packed_positions(document_ids, ids.shape, caches, positions)
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
        if self.config.positions != "rope":
            # Learned positions were added by embed, not rotated; ALiBi reads distances
            # from the order of the keys (the same as the positions' for the real tokens
            # of a padded row, and per document with document_ids).
            positions = None
        # Converted once here, not again in every layer for every decoded token.
        mask = _masks.as_attention_mask(attention_mask, batch, past + seq)
        attentions, hidden = [], ([x] if output_hidden_states else None)
        # One row decoded with a cache and nothing asked beyond the logits: the blocks (and
        # the final norm and output layer, giving the logits) in native calls where they
        # can (models.decoding, which asks each block's backend and dropout), else modules.
        fused_rows = (caches is not None and batch * seq == 1 and positions is None
                      and hidden is None and not fused.global_forward_hooks()
                      and may_decode(mask=mask, weights=output_attentions))
        x, logits = (decoder or self._decoder())(x, caches) if fused_rows else (x, None)
        with whole_length(split, whole if split is not None else 0):  # one gather, not one a layer
            for i, block in enumerate(() if fused_rows else self.blocks):
                x, w = block(x, mask, None if caches is None else caches[i], positions,
                             output_attentions, document_ids)
                if output_attentions:
                    attentions.append(w)
                if hidden is not None:
                    hidden.append(x)
        if logits is None:
            logits = self._output(x, hidden, logits_to_keep)
        cap = self.config.logit_softcap
        if cap is not None:  # Gemma 2's final logit softcapping, in its order of operations
            logits = torch.tanh(logits / cap) * cap
        return with_extras(logits, attentions if output_attentions else None, hidden)

    def _output(self, x: torch.Tensor, hidden: list | None, logits_to_keep: int) -> torch.Tensor:
        """The final norm and output layer: float32 logits of the last ``logits_to_keep``
        positions of ``x`` (0: all); ``hidden``'s last entry becomes the normed ``x``."""
        x = self.norm(x)
        if hidden is not None:
            hidden[-1] = x  # transformers' convention: the last entry is after the final norm
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        # Float32 logits whatever the weights: the output layer's products accumulate in
        # float32, and a vocabulary of logits rounded to bf16 would tie its top tokens.
        if x.dtype in (torch.bfloat16, torch.float16):
            x = x.float()
        # In inference one product over the packed output layer, packed again first if
        # its layout was lost (see modules.fused).
        logits = fused.joint(x, (self.lm_head,))
        return fused.run(x, self.lm_head) if logits is None else logits

    def decoder(self, ids=None) -> decoding.Decoder | None:
        """A :class:`~attnlab.models.decoding.Decoder` for the tokens of one generation
        from ``ids``, to pass to every :meth:`forward` of it; None where user code could
        change the model between tokens (hooks, classes of the user's, tensor subclasses,
        torch function modes: see ``decoding.library_only``)."""
        return self._decoder() if decoding.library_only(self, ids) else None

    def _decoder(self) -> decoding.Decoder:  # the blocks, then the final norm and lm_head
        return decoding.Decoder(self.blocks, Block, self)

    def embed(self, ids: torch.Tensor, *, positions: torch.Tensor | None = None,
              past: int = 0) -> torch.Tensor:
        """The first step of the model: token ids to hidden states.

        Args:
            ids: ``(batch, seq)`` token ids.
            positions: ``(batch, seq)`` or ``(seq,)`` positions for the learned position
                embedding (default ``past .. past + seq - 1``).
            past: tokens already cached before ``ids``.

        Returns:
            ``(batch, seq, d_model)``: the token embedding (times ``sqrt(d_model)`` with
            ``scale_embeddings``), plus the position embedding when
            ``positions="learned"`` (rotary and ALiBi models add none here: their attention
            rotates queries and keys, or biases the scores), normed with ``embed_norm``.
            Dropout is applied by :meth:`forward`.
        """
        x = self.tok_emb(ids)
        # The activations' dtype is the final norm's (float32 where only the matrices are
        # bf16 or int8, as a GGUF file's are; bf16 after model.to(torch.bfloat16)).
        act = getattr(self.norm, "weight", None)
        if act is not None and x.dtype != act.dtype:
            x = x.to(act.dtype)
        if self.config.scale_embeddings:
            # sqrt(d_model) rounded to float32 first, then to x's dtype, as Gemma does.
            x = x * torch.tensor(math.sqrt(self.config.d_model)).to(x.dtype)
        if self.pos_emb is not None:
            if positions is None:
                positions = torch.arange(past, past + ids.shape[1], device=ids.device)
            x = x + self.pos_emb(positions)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        return x

    @classmethod
    def from_hf(cls, model, *, dtype: torch.dtype | None = None,
                quantize: str | None = None) -> GPT:
        """A GPT with the weights of a ``transformers`` ``GPT2LMHeadModel``,
        ``LlamaForCausalLM`` (SmolLM, TinyLlama), ``MistralForCausalLM``,
        ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Gemma2ForCausalLM``,
        ``Gemma3ForCausalLM`` or ``BloomForCausalLM``, or of a local
        folder written by their ``save_pretrained`` (safetensors only; nothing is
        downloaded).

        The model owns its weights: a folder's are read once from the file into this
        model's parameters (nothing of the file stays mapped, so replacing or truncating
        it later changes nothing), a live model's are copied (training this model never
        changes it). Every tensor's shape is checked against the config before anything
        is allocated.

        Args:
            model: the folder or the transformers model.
            dtype: the dtype every floating-point tensor is stored in (default: the
                source's). ``torch.bfloat16`` holds the weights once in bf16, as
                ``model.to(torch.bfloat16)`` would, converted as they are read.
            quantize: ``"int8"`` holds every linear layer's weight as int8 (weight-only,
                llama.cpp's Q8_0 scheme: :meth:`quantize`), quantised as it is read.
        """
        check_precision(dtype, quantize)
        config, state = gpt_layout(model)
        config = GPTConfig.from_dict(config)
        return build_loaded(lambda: cls(config), state, source=source_name(model), dtype=dtype,
                            quantize=quantize).eval()

    def quantize(self, scheme: str = "int8") -> GPT:
        """Hold every linear layer's weight as int8, in place (returns the model).

        Weight-only, symmetric, llama.cpp's Q8_0 scheme: one float16 scale per block of
        32 weights along each output's row (``attnlab.layouts.int8``), about 1.06 bytes a
        weight. The decoding products multiply on the CPU's int8 dot product
        (``vpdpbusd``) where it has one, each activation row quantised on the fly per
        block of 32 (as llama.cpp's Q8_0 products do); norms, biases and an untied
        embedding keep their dtype, a tied embedding reads the int8 output layer.
        Logits stay within the tolerance ``docs/precision.md`` states of float32's.
        """
        check_precision(None, scheme)
        quantized.quantize(self, scheme)
        return self

    @classmethod
    def from_gguf(cls, path, *, dtype: torch.dtype | None = None,
                  quantize: str | None = None) -> GPT:
        """A GPT with the weights of a GGUF file (llama.cpp's format): the ``llama``
        (Llama 2 and 3, SmolLM, TinyLlama, Mistral), ``qwen2``, ``qwen3``, ``gemma2`` and
        ``gemma3`` architectures, tensors of the types
        :data:`attnlab.io.gguf.SUPPORTED_TYPES` (F32, F16, BF16, Q8_0, Q4_1, K-quants...).
        ``path`` may also be an open :class:`attnlab.io.gguf.GGUFFile`. The architecture,
        the tensor types and every shape are checked before anything is
        allocated; a damaged or unsupported file is one ValueError naming it. The
        tokenizer is :meth:`attnlab.text.GGUFTokenizer.from_gguf`.

        The file keeps its precision unless told otherwise (``layouts.gguf.file_precision``):
        Q8_0 matrices become attnlab's int8 (the same scheme: their bytes are moved, no
        float is computed; the file's other matrices are quantised to it), BF16 and F16
        ones bf16 (F16 rounded to bf16), the rest float32. ``dtype=torch.float32`` expands
        everything to float32, ``dtype=torch.bfloat16`` holds the matrices in bf16,
        ``quantize="int8"`` quantises every linear layer.
        """
        check_precision(dtype, quantize)
        precision = ("int8" if quantize else "bfloat16" if dtype == torch.bfloat16
                     else "float32" if dtype == torch.float32 else None)
        config, state, source, int8 = gguf_layout(path, precision)
        config = GPTConfig.from_dict(config)
        return build_loaded(lambda: cls(config), state, source=source,
                            quantize="int8" if int8 else None, int8=int8).eval()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

