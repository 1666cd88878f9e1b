"""Encoder: a BERT-style bidirectional transformer (post-norm, padding masks).

``embeddings = LayerNorm(word + position + token_type)``; each layer is
``x = LN(x + attn(x))``, ``x = LN(x + mlp(x))`` as in BERT, so BERT checkpoints
(and the bundled all-MiniLM-L6-v2) load without conversion of the math.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import masks as _masks
from ..modules import MultiHeadAttention


@dataclass
class EncoderConfig:
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
    backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads",
                     "d_ff", "type_vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EncoderConfig.{name} must be a positive int, got {value!r}")
        if self.activation not in ("gelu", "gelu_tanh", "relu"):
            raise ValueError(f"EncoderConfig.activation must be gelu, gelu_tanh or relu, got "
                             f"{self.activation!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EncoderConfig:
        return cls(**d)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(cfg.d_model, cfg.d_model, cfg.num_heads, qkv_bias=True,
                                       dropout=cfg.dropout, backend=cfg.backend)
        self.norm1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.drop = nn.Dropout(cfg.dropout)
        self.activation = cfg.activation

    def _act(self, x):
        if self.activation == "relu":
            return F.relu(x)
        return F.gelu(x, approximate="tanh" if self.activation == "gelu_tanh" else "none")

    def forward(self, x, mask, output_attentions):
        a = self.attn(x, mask=mask, return_weights=output_attentions)
        weights = None
        if output_attentions:
            a, weights = a
        x = self.norm1(x + self.drop(a))
        x = self.norm2(x + self.drop(self.proj(self._act(self.fc(x)))))
        return x, weights


class Encoder(nn.Module):
    """Bidirectional encoder: ``(batch, seq)`` ids -> hidden states ``(batch, seq, d_model)``."""

    model_type = "encoder"

    def __init__(self, config: EncoderConfig | None = None, **kwargs) -> None:
        super().__init__()
        config = config or EncoderConfig(**kwargs)
        self.config = config
        self.context_length = config.context_length
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model,
                                    padding_idx=config.pad_id)
        self.pos_emb = nn.Embedding(config.context_length, config.d_model)
        self.type_emb = nn.Embedding(config.type_vocab_size, config.d_model)
        self.emb_norm = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))

    @classmethod
    def from_hf(cls, model) -> Encoder:
        """Copy a ``transformers`` ``BertModel``."""
        from ..interop.hf import encoder_from_hf

        return encoder_from_hf(model)

    def embed(self, ids: torch.Tensor, *,
              token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """BERT's embedding block: token ids ``(batch, seq)`` to hidden states
        ``(batch, seq, d_model)``, the LayerNorm of token + position + segment
        embeddings (segment 0 unless ``token_type_ids`` is given). Dropout is applied
        by :meth:`forward`."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(ids)
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
    ):
        """Encode a padded batch.

        Args:
            ids: ``(batch, seq)`` token ids.
            attention_mask: ``(batch, seq)`` 1/0 (or bool) key padding mask, 1 = real token.
            token_type_ids: ``(batch, seq)`` segment ids (default zeros).
            output_attentions: also return one ``(batch, heads, seq, seq)`` weight
                tensor per layer.

        Returns:
            hidden states ``(batch, seq, d_model)``, or ``(hidden, attentions)``.
        """
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.dtype.is_floating_point:
            raise ValueError("ids must be a (batch, seq) integer tensor")
        batch, seq = ids.shape
        if seq > self.context_length:
            raise ValueError(f"sequence of {seq} tokens is longer than context_length="
                             f"{self.context_length}")
        x = self.drop(self.embed(ids, token_type_ids=token_type_ids))  # (B, T, d_model)
        mask = None
        if attention_mask is not None:
            mask = _masks.from_attention_mask(attention_mask.to(ids.device))  # (B, 1, 1, T)
        attentions = []
        for layer in self.layers:
            x, w = layer(x, mask, output_attentions)
            if output_attentions:
                attentions.append(w)
        return (x, attentions) if output_attentions else x
