"""ToyAttnLM: the smallest language model in which attention can learn a rule.

Token embedding + position embedding -> one causal attention head -> output
layer. No MLP, no norm: what it learns, it learns in the attention weights
(for example "look at the previous token"), which makes it the model of
``attnlab demo``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import masks as _masks
from ..cache import KVCache
from ..checks import fits_in_memory, non_negative_int, positive_int, probability
from ..config import Config
from ..modules import MultiHeadAttention
from ..modules.layers import embedding
from .generation import GenerationMixin
from .ids import check_ids, packed_positions
from .outputs import with_extras


@dataclass
class ToyConfig(Config):
    vocab_size: int = 32
    context_length: int = 32
    d_model: int = 32
    dropout: float = 0.0
    backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model"):
            positive_int(f"ToyConfig.{name}", getattr(self, name))
        probability("ToyConfig.dropout", self.dropout)
        d = self.d_model
        params = (2 * self.vocab_size + self.context_length) * d + 4 * d * d
        fits_in_memory(f"a ToyAttnLM of about {params:,} parameters", 4 * params)


class ToyAttnLM(GenerationMixin, nn.Module):
    """One causal attention head between an embedding and an output layer.

    ``forward(ids)``: ``(batch, seq)`` ids -> logits ``(batch, seq, vocab)``.
    """

    model_type = "toy"

    def __init__(self, config: ToyConfig | None = None, **kwargs) -> None:
        super().__init__()
        config = config or ToyConfig(**kwargs)
        self.config = config
        self.context_length = config.context_length
        self.tok_emb = embedding(config.vocab_size, config.d_model)
        self.pos_emb = embedding(config.context_length, config.d_model)
        self.attn = MultiHeadAttention(
            config.d_model, config.d_model, 1, context_length=config.context_length,
            causal=True, dropout=config.dropout, backend=config.backend,
        )
        self.out = nn.Linear(config.d_model, config.vocab_size)

    def new_cache(self, batch_size: int, max_seq_len: int) -> list[KVCache]:
        return [self.attn.new_cache(batch_size, max_seq_len)]

    def embed(self, ids: torch.Tensor, *, positions: torch.Tensor | None = None,
              past: int = 0) -> torch.Tensor:
        """Token ids ``(batch, seq)`` to hidden states ``(batch, seq, d_model)``: token
        plus position embedding, positions ``past .. past + seq - 1`` unless given."""
        if positions is None:
            positions = torch.arange(past, past + ids.shape[1], device=ids.device)
        return self.tok_emb(ids) + self.pos_emb(positions)

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
        document_ids: torch.Tensor | None = None,
    ):
        """Logits ``(batch, seq, vocab)``; with ``output_attentions`` also a list
        with the head's weights ``(batch, 1, seq, past + seq)``; with
        ``output_hidden_states`` also ``[embeddings, embeddings + attention]``, each
        ``(batch, seq, d_model)`` (the second is what the output layer reads).
        Arguments and the order of the returned tuple as :meth:`attnlab.models.GPT.forward`."""
        check_ids(ids, self.config.vocab_size)
        non_negative_int("logits_to_keep", logits_to_keep)
        past = caches[0].seq_len if caches else 0
        seq = ids.shape[1]
        if past + seq > self.context_length:
            raise ValueError(
                f"sequence of {past + seq} tokens is longer than context_length="
                f"{self.context_length}"
            )
        positions = packed_positions(document_ids, ids.shape, caches, positions)
        x = self.embed(ids, positions=positions, past=past)  # (B, T, d_model)
        mask = _masks.as_attention_mask(attention_mask, ids.shape[0], past + seq)
        a = self.attn(x, mask=mask, cache=caches[0] if caches else None,
                      return_weights=output_attentions, document_ids=document_ids)
        w = None
        if output_attentions:
            a, w = a
        h = x + a
        kept = h[:, -logits_to_keep:] if logits_to_keep else h
        return with_extras(self.out(kept), None if w is None else [w],
                           [x, h] if output_hidden_states else None)
