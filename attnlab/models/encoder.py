"""Encoder: a BERT-style bidirectional transformer (post-norm, padding masks).

``embeddings = LayerNorm(word + position + token_type)``; each layer is
``x = LN(x + attn(x))``, ``x = LN(x + mlp(x))`` as in BERT, so BERT checkpoints
(and the bundled all-MiniLM-L6-v2) load without conversion of the math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import masks as _masks
from ..checks import (
    finite_float,
    fits_in_memory,
    non_negative_int,
    one_of,
    positive_int,
    probability,
)
from ..config import Config
from ..layouts.hf import encoder_layout
from ..modules import MultiHeadAttention
from ..modules.layers import MLP, dropout, embedding, residual
from .ids import check_ids, document_positions
from .loading import build_loaded, source_name
from .outputs import with_extras


@dataclass
class EncoderConfig(Config):
    vocab_size: int = 30522
    context_length: int = 512
    d_model: int = 384
    num_layers: int = 6
    num_heads: int = 12
    d_ff: int = 1536
    type_vocab_size: int = 2
    norm_eps: float = 1e-12
    activation: str = "gelu"
    dropout: float = 0.0
    pad_id: int = 0
    positions: str = "index"
    backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads",
                     "d_ff", "type_vocab_size"):
            positive_int(f"EncoderConfig.{name}", getattr(self, name))
        one_of("EncoderConfig.activation", self.activation, ("gelu", "gelu_tanh", "relu"))
        one_of("EncoderConfig.positions", self.positions, ("index", "roberta"))
        probability("EncoderConfig.dropout", self.dropout)
        finite_float("EncoderConfig.norm_eps", self.norm_eps, positive=True)
        non_negative_int("EncoderConfig.pad_id", self.pad_id)
        d = self.d_model
        params = (self.vocab_size + self.context_length + self.type_vocab_size) * d + \
            self.num_layers * (4 * d * d + 2 * d * self.d_ff)
        fits_in_memory(f"an Encoder of about {params:,} parameters", 4 * params)


class EncoderBlock(nn.Module):
    """Post-norm BERT layer; parameters named as GPT's blocks (attn, norm1, mlp, norm2)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(cfg.d_model, cfg.d_model, cfg.num_heads, qkv_bias=True,
                                       dropout=cfg.dropout, backend=cfg.backend)
        self.norm1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg.d_model, cfg.d_ff, cfg.activation)
        self.norm2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.dropout = cfg.dropout

    def forward(self, x, mask, output_attentions, document_ids=None):
        a = self.attn(x, mask=mask, return_weights=output_attentions, document_ids=document_ids)
        weights = None
        if output_attentions:
            a, weights = a
        x = self.norm1(residual(self, x, dropout(a, self.dropout, self.training)))
        x = self.norm2(residual(self, x, dropout(self.mlp(x), self.dropout, self.training)))
        return x, weights


class Encoder(nn.Module):
    """Bidirectional encoder: ``(batch, seq)`` ids -> hidden states ``(batch, seq, d_model)``."""

    model_type = "encoder"

    def __init__(self, config: EncoderConfig | None = None, **kwargs) -> None:
        super().__init__()
        config = config or EncoderConfig(**kwargs)
        self.config = config
        # RoBERTa's positions start after pad_id: fewer tokens fit its position table.
        self.context_length = config.context_length - (
            config.pad_id + 1 if config.positions == "roberta" else 0)
        self.tok_emb = embedding(config.vocab_size, config.d_model,
                                    padding_idx=config.pad_id)
        self.pos_emb = embedding(config.context_length, config.d_model)
        self.type_emb = embedding(config.type_vocab_size, config.d_model)
        self.emb_norm = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.blocks = nn.ModuleList(EncoderBlock(config) for _ in range(config.num_layers))

    @classmethod
    def from_hf(cls, model) -> Encoder:
        """An Encoder with the weights of a ``transformers`` ``BertModel``,
        ``RobertaModel`` or ``DistilBertModel`` (or a model holding one), or of a local
        folder written by its ``save_pretrained`` (see :meth:`GPT.from_hf`)."""
        config, state = encoder_layout(model)
        config = EncoderConfig.from_dict(config)
        return build_loaded(lambda: cls(config), state, source=source_name(model)).eval()

    def embed(self, ids: torch.Tensor, *, token_type_ids: torch.Tensor | None = None,
              document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """BERT's embedding block: token ids ``(batch, seq)`` to hidden states
        ``(batch, seq, d_model)``, the LayerNorm of token + position + segment
        embeddings (segment 0 unless ``token_type_ids`` is given). Positions are
        ``0 .. seq-1``, or with ``positions="roberta"`` RoBERTa's: ``pad_id + 1 + i`` for
        the i-th non-padding token, ``pad_id`` for padding. With ``document_ids`` (packed
        rows, see :meth:`forward`) each document counts its positions from the start.
        Dropout is applied by :meth:`forward`."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(ids)
        if document_ids is not None:
            positions = document_positions(document_ids, tuple(ids.shape))
            longest = int(positions.max()) + 1 if positions.numel() else 0
            if longest > self.context_length:
                raise ValueError(f"a document of {longest} tokens is longer than "
                                 f"context_length={self.context_length}")
            if self.config.positions == "roberta":
                positions = positions + self.config.pad_id + 1
        elif self.config.positions == "roberta":
            # RoBERTa: real tokens count from pad_id + 1, padding tokens sit at pad_id.
            real = (ids != self.config.pad_id).long()
            positions = real.cumsum(1) * real + self.config.pad_id
        else:
            positions = torch.arange(ids.shape[1], device=ids.device)
        return self.emb_norm(self.tok_emb(ids) + self.pos_emb(positions)
                             + self.type_emb(token_type_ids))

    def forward(
        self,
        ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        document_ids: torch.Tensor | None = None,
    ):
        """Encode a padded batch, or packed rows.

        Args:
            ids: ``(batch, seq)`` token ids.
            attention_mask: ``(batch, seq)`` 1/0 (or bool) key padding mask, 1 = real token.
            document_ids: ``(batch, seq)`` integer ids, non-decreasing along each row:
                several sequences packed into one row with no padding, each token
                attending only to its own sequence's tokens and each sequence's
                positions counting from 0 (FlashAttention's varlen inputs; each
                sequence's hidden states equal those it gets alone). Not with
                ``attention_mask``.
            token_type_ids: ``(batch, seq)`` segment ids (default zeros).
            output_attentions: also return one ``(batch, heads, seq, seq)`` weight
                tensor per layer.
            output_hidden_states: also return ``num_layers + 1`` tensors
                ``(batch, seq, d_model)``: the embeddings (after their LayerNorm), then
                each layer's output, as transformers' BERT does (the last is the output).

        Returns:
            hidden states ``(batch, seq, d_model)``; with either flag a tuple: hidden,
            then ``attentions`` if asked, then ``hidden_states`` if asked.
        """
        check_ids(ids, self.config.vocab_size)
        batch, seq = ids.shape
        if document_ids is not None and attention_mask is not None:
            raise ValueError("give attention_mask (padded rows) or document_ids (packed "
                             "rows), not both")
        if seq > self.context_length and document_ids is None:
            raise ValueError(f"sequence of {seq} tokens is longer than context_length="
                             f"{self.context_length}")
        x = dropout(self.embed(ids, token_type_ids=token_type_ids, document_ids=document_ids),
                    self.config.dropout, self.training)  # (B, T, d_model)
        if attention_mask is not None:
            attention_mask = attention_mask.to(ids.device)
        mask = _masks.as_attention_mask(attention_mask, batch, seq)  # (B, 1, 1, T)
        attentions, hidden = [], [x]
        for block in self.blocks:
            x, w = block(x, mask, output_attentions, document_ids)
            if output_attentions:
                attentions.append(w)
            hidden.append(x)
        return with_extras(x, attentions if output_attentions else None,
                           hidden if output_hidden_states else None)
