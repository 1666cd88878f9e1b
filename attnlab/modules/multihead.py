"""``MultiHeadAttention``: the module the models stack (MHA, GQA/MQA, RoPE, KV cache).

It projects, splits heads, rotates (RoPE), appends to the cache and calls
:func:`attnlab.attention` once; the attention math itself lives only there.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import masks as _masks
from ..cache import KVCache
from ..checks import boolean, one_of, optional_positive_int, positive_int, probability
from ..distributed import ContextParallel
from ..functional import BACKENDS, attention, decode_step, may_decode
from ..rope import RotaryEmbedding
from . import fused, inputs, rows, scores, split
from .construction import book_call, from_torch
from .inputs import _shape
from .layers import NORM_KINDS, dropout, make_norm

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(rows.AttentionRows, scores.ScoreOptions, split.SplitSequence,
                         inputs.InputChecks, nn.Module):
    """Multi-head attention with grouped-query heads, RoPE, sliding window and a KV cache.

    Args:
        d_in (int): feature size of the input ``x`` (and of ``kv``).
        d_out (int): feature size of the output; ``head_dim = d_out // num_heads``.
        num_heads (int): query heads ``H``; must divide ``d_out``.
        num_kv_heads (int | None): key/value heads ``Hkv`` (must divide ``num_heads``);
            None = ``num_heads`` (MHA), 1 = multi-query attention, else grouped-query.
        context_length (int | None): longest sequence accepted (cached + new tokens);
            None = no limit.
        causal (bool): each token sees only itself and earlier tokens (self-attention
            only: not applied when ``kv`` is given).
        dropout (float): dropout on the attention weights, in training mode only.
        resid_dropout (float): dropout on the output (after ``out_proj``), training only.
        qkv_bias (bool): biases in ``W_query``, ``W_key``, ``W_value``.
        out_bias (bool): bias in ``out_proj``.
        rope (bool): rotate queries and keys with :class:`RotaryEmbedding` (Llama's
            half-split convention).
        window (int | None): sliding window W: a query at position p sees keys
            ``p - W < j`` (and ``j <= p`` when causal, ``j < p + W`` otherwise).
        backend (str): backend of :func:`attnlab.attention`, one of ``attnlab.BACKENDS``.
        rope_base (float), rope_scaling (dict | None): RoPE's frequency base and scaling
            (:class:`RotaryEmbedding`'s ``base`` and ``scaling``).
        head_dim (int | None): width of each head; None = ``d_out // num_heads``. Given,
            the queries are ``num_heads * head_dim`` wide and ``out_proj`` maps that width
            back to ``d_out`` (Gemma 2's heads are wider than ``d_model / num_heads``).
        scale (float | None): multiplier of ``q . k``; None = ``1/sqrt(head_dim)`` (Gemma 2:
            ``query_pre_attn_scalar ** -0.5``).
        softcap (float | None): cap the scaled scores as ``softcap * tanh(s / softcap)``
            (Gemma 2's attention logit softcapping), None for none.
        alibi (bool): ALiBi: each head adds ``-slope * |p - j|`` to the score of key ``j``
            from a query at position ``p``, with the slopes of
            :func:`~attnlab.modules.scores.alibi_slopes` (BLOOM's).
        sinks (bool): a learned logit per head (``sinks``, ``(num_heads,)``, zeros at
            first) that joins each softmax's denominator and weighs no value (gpt-oss).
        context_parallel (ContextParallel | None): the sequence split across processes
            (:mod:`.split`): ``forward`` takes and returns this rank's shard.
        qk_norm (str | None), qk_norm_eps (float): a norm of ``NORM_KINDS`` over each
            head's query and key (``q_norm``, ``k_norm``, ``(head_dim,)`` weights) after
            the projections and before RoPE, and its epsilon: Qwen3's ``"rmsnorm"``.

    Parameters are created in the book's order (``W_query``, ``W_key``, ``W_value``,
    ``out_proj``), so under the same seed ``MultiHeadAttention(d_in, d_out, H, causal=True)``
    equals ``llms_from_scratch.ch03.MultiHeadAttention(d_in, d_out, T, 0.0, H)``.
    ``W_key`` and ``W_value`` map ``d_in -> num_kv_heads * head_dim``.

    The book's positional call works as it is:
    ``MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads[, qkv_bias])``
    (five or six positional arguments; this signature takes three, so the two never
    meet) builds the book's module: causal, with that ``context_length``, ``dropout`` and
    ``qkv_bias``; under the same seed its weights are the book's, and so are its outputs in
    eval mode or without dropout (training-mode dropout draws other masks). The book's
    class is always causal, so ``causal`` defaults to True there and to False in the
    three-argument form. As the rest of the tutorial family, ``forward`` takes one
    unbatched ``(seq, d_in)`` sequence too.
    """

    product_groups = (("W_query", "W_key", "W_value"), ("out_proj",))  # (modules.fused)

    def __init__(
        self,
        d_in: int,
        d_out: int,
        num_heads: int,
        *book_args: object,
        num_kv_heads: int | None = None,
        context_length: int | None = None,
        causal: bool | None = None,
        dropout: float = 0.0,
        resid_dropout: float = 0.0,
        qkv_bias: bool = False,
        out_bias: bool = True,
        rope: bool = False,
        window: int | None = None,
        backend: str = "auto",
        rope_base: float = 10000.0,
        rope_scaling: dict | None = None,
        head_dim: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        alibi: bool = False,
        sinks: bool = False,
        context_parallel: ContextParallel | None = None,
        qk_norm: str | None = None,
        qk_norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if book_args:
            num_heads, context_length, dropout, qkv_bias, causal = book_call(
                num_heads, book_args, context_length, dropout, qkv_bias, causal)
        causal = False if causal is None else causal
        positive_int("d_in", d_in)
        positive_int("d_out", d_out)
        positive_int("num_heads", num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        positive_int("num_kv_heads", num_kv_heads)
        if head_dim is None and d_out % num_heads:
            raise ValueError(
                f"d_out={d_out} must be divisible by num_heads={num_heads} "
                f"(head_dim = d_out // num_heads)"
            )
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads} "
                "(each key/value head serves a whole group of query heads)"
            )
        optional_positive_int("context_length", context_length)
        optional_positive_int("window", window)
        one_of("backend", backend, BACKENDS)
        self.d_in, self.d_out = d_in, d_out
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = d_out // num_heads if head_dim is None else positive_int(
            "head_dim", head_dim)
        inner = num_heads * self.head_dim  # the heads side by side
        if rope and self.head_dim % 2:
            raise ValueError(f"rope needs an even head_dim, got d_out/num_heads={self.head_dim}")
        self.context_length = context_length
        self.causal = boolean("causal", causal)
        self.dropout = probability("dropout", dropout)
        self.resid_dropout = probability("resid_dropout", resid_dropout)
        self.window = window
        self.backend = backend
        self._split_context(context_parallel)

        kv_out = self.head_dim * num_kv_heads
        self.W_query = nn.Linear(d_in, inner, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, kv_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, kv_out, bias=qkv_bias)
        self.out_proj = nn.Linear(inner, d_out, bias=out_bias)
        self._init_scores(num_heads, scale=scale, softcap=softcap, alibi=alibi, sinks=sinks)
        self.rotary = RotaryEmbedding(self.head_dim, rope_base, rope_scaling) if rope else None
        if qk_norm is not None:
            one_of("qk_norm", qk_norm, NORM_KINDS)
        self.q_norm, self.k_norm = (tuple(make_norm(qk_norm, self.head_dim, qk_norm_eps,
                                                    "qk_norm_eps") for _ in "qk")
                                    if qk_norm is not None else (None, None))
        # One (d_in, q + k + v) tensor (by rows in bf16 or past 4096 outputs, see
        # modules.fused) holds the three weights, views of it; the output projection too.
        fused.pack_groups(self)
        # Hook point for attnlab.experiments: None, or a callable (q, k, v) -> (q, k, v)
        # on the (batch, heads, len, head_dim) tensors exactly as attention receives
        # them (after RoPE, before the cache), so ablations see the real scores.
        self.qkv_hook = None

    def extra_repr(self) -> str:
        parts = [f"num_heads={self.num_heads}", f"num_kv_heads={self.num_kv_heads}",
                 f"head_dim={self.head_dim}", f"causal={self.causal}"]
        if self.window is not None:
            parts.append(f"window={self.window}")
        parts += self._scores_repr()
        if self.context_length is not None:
            parts.append(f"context_length={self.context_length}")
        if self.dropout or self.resid_dropout:
            parts.append(f"dropout={self.dropout}, resid_dropout={self.resid_dropout}")
        parts.append(f"backend={self.backend!r}")
        return ", ".join(parts)

    def new_cache(self, batch_size: int, max_seq_len: int, *, dtype=None, device=None) -> KVCache:
        """An empty :class:`KVCache` shaped for this module (default: its weights' dtype,
        float32 for int8, and device); a bf16 one is read back in the queries' dtype."""
        w_dtype, w_device = fused.dtype_device(self.W_key)
        return KVCache(batch_size, max_seq_len, self.num_kv_heads, self.head_dim,
                       dtype=dtype or w_dtype, device=device or w_device)

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        x: torch.Tensor,
        *,
        kv: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        return_weights: bool = False,
        document_ids: torch.Tensor | None = None,
    ):
        """Attend from ``x`` to itself (or to ``kv``) and project.

        Args:
            x: ``(batch, q_len, d_in)`` queries' sequence (batch first).
            kv: ``(batch, k_len, d_in)`` the other sequence for cross-attention, or
                None for self-attention. With ``kv`` the module is never causal.
            mask: which keys each query may see, any of:

                - bool, True = may attend: 4-D, broadcastable to
                  ``(batch, heads, q_len, k_len)``, or 3-D ``(batch, q_len, k_len)``,
                  one mask per example shared by all heads;
                - a 2-D ``(batch, k_len)`` key-padding mask: bool (True = real token)
                  or integer 1/0 as tokenizers return it. **Every 2-D mask is read as
                  key padding**; give a per-query ``(q_len, k_len)`` mask as
                  ``mask[None, None]``;
                - float, additive (0 allowed, ``-inf`` not), same shapes.

                With a cache, ``k_len`` counts the cached tokens too.
            cache: a :class:`KVCache` to append this call's keys/values to; attention
                then covers every cached token. RoPE positions continue from
                ``cache.seq_len``. Not supported together with ``kv``. A call that
                raises leaves the cache unchanged.
            positions: ``(q_len,)`` or ``(batch, q_len)`` RoPE positions of the tokens
                of ``x`` (default ``seq_len_cached + arange(q_len)``); only with ``rope``.
                With ``kv``, the keys are rotated at their own positions ``0..k_len-1``.
            return_weights: True to also return the weights
                ``(batch, heads, q_len, k_len)``.
            document_ids: ``(batch, q_len)`` integer ids, non-decreasing along each row:
                packed sequences, where no token attends to a token of another document
                (:func:`attnlab.attention`'s ``document_ids``). Self-attention without a
                cache only.

        Returns:
            ``(batch, q_len, d_out)``, or ``(out, weights)`` with ``return_weights``.

        An unbatched ``(seq, d_in)`` ``x`` (as the book's chapter 3 passes it) is one
        sequence of a batch of 1: ``kv`` then is ``(k_seq, d_in)``, ``mask`` and
        ``cache`` are those of that batch of 1, and the batch axis is dropped from the
        output (``(seq, d_out)``) and the weights (``(heads, q_len, k_len)``).
        """
        if isinstance(x, torch.Tensor) and x.ndim == 2:
            return self._unbatched(x, kv=kv, mask=mask, cache=cache, positions=positions,
                                   return_weights=return_weights, document_ids=document_ids)
        b, t = self._check_x(x)
        if document_ids is not None and (kv is not None or cache is not None):
            raise ValueError("document_ids is for packed self-attention without a cache; got "
                             f"{'kv (cross-attention)' if kv is not None else 'a cache'} too")
        past = 0
        if cache is not None:
            if kv is not None:
                raise ValueError(
                    "cache with kv (cross-attention) is not supported: the cache appends "
                    "self-attention keys/values; compute the other sequence's keys once instead"
                )
            cache.check_layout(b, self.num_kv_heads, self.head_dim, who="input")
            past = cache.seq_len
        if self.context_length is not None and past + t > self.context_length:
            raise ValueError(
                f"sequence of {past + t} tokens ({past} cached + {t} new) is longer than "
                f"context_length={self.context_length}"
            )
        src = x
        if kv is not None:
            self._check_kv(kv, b)
            src = kv
            if self.context_length is not None and kv.shape[1] > self.context_length:
                raise ValueError(
                    f"kv of {kv.shape[1]} tokens is longer than "
                    f"context_length={self.context_length}"
                )
        s = src.shape[1]

        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        rot = self.rotary
        if rot is None and positions is not None:
            raise ValueError("positions is only used with rope=True; this module has rope=False")
        if self.context_parallel is not None:
            positions = self._split_positions(x, kv, cache, positions, return_weights,
                                              rot is not None)
        # (B, T, (H + 2 Hkv) * D) in one product in inference (fused.joint), else None.
        qkv = None if kv is not None else fused.joint(
            x, (self.W_query, self.W_key, self.W_value))
        if qkv is not None and self._normed_heads():
            qkv = self._norm_packed(qkv)
        options = self.score_options(x.device)
        if (qkv is not None and t == 1 and cache is not None and positions is None
                and self.qkv_hook is None
                and may_decode(self.backend, mask=mask, weights=return_weights,
                               dropout_p=self.dropout if self.training else 0.0)):
            # Decoding one token: RoPE, cache append and attention in one backend call.
            out = decode_step(qkv, cache, rot, self.window, heads, kv_heads,
                              backend=self.backend, validate=False, **options)
            if out is not None:
                return self._project(out)
        if rot is not None:
            dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
            cos, sin = rot.factors(t, past if positions is None else positions,
                                   device=x.device, dtype=dtype)  # (T, D) or (B, 1, T, D)

        # (B, T, H*D) -> (B, H, T, D); K/V have Hkv heads.
        if qkv is not None:
            # Inference: one product instead of three, and the heads of q|k|v lie side
            # by side, so RoPE rotates q and k at once.
            qk, v = qkv.view(b, t, heads + 2 * kv_heads, head_dim).transpose(1, 2).split_with_sizes(
                [heads + kv_heads, kv_heads], dim=1)
            if rot is not None:
                qk = rot.rotate(qk, cos, sin)
            q, k = qk.split_with_sizes([heads, kv_heads], dim=1)
        else:
            q = fused.run(x, self.W_query).view(b, t, heads, head_dim).transpose(1, 2)
            k = fused.run(src, self.W_key).view(b, s, kv_heads, head_dim).transpose(1, 2)
            v = fused.run(src, self.W_value).view(b, s, kv_heads, head_dim).transpose(1, 2)
            q, k = self._norm_heads(q, k)
            if rot is not None:
                q = rot.rotate(q, cos, sin)
                if kv is not None:  # the other sequence has its own positions 0..S-1
                    cos, sin = rot.factors(s, 0, device=x.device, dtype=dtype)
                k = rot.rotate(k, cos, sin)
        if self.qkv_hook is not None:
            q, k, v = self.qkv_hook(q, k, v)
        mask = _masks.as_attention_mask(mask, b, past + s)
        if self.context_parallel is not None:
            out = self._split_attention(q, k, v, mask, **options, **(
                {} if document_ids is None else {"document_ids": document_ids}))
            return self._project(out.transpose(1, 2).reshape(b, t, heads * head_dim))
        if cache is not None:
            k, v = (t.to(q.dtype) for t in cache.update(k, v))  # (B, Hkv, past + T, D) views
        try:
            out = attention(
                q, k, v, mask=mask, causal=self.causal and kv is None, window=self.window,
                dropout_p=self.dropout if self.training else 0.0,
                return_weights=return_weights, backend=self.backend, **options,
                **({} if document_ids is None else {"document_ids": document_ids}),
            )
        except (ValueError, TypeError):
            if cache is not None:
                cache.crop(past)  # a refused call leaves the cache as it was
            raise
        weights = None
        if return_weights is not False and return_weights is not None:
            out, weights = out
        out = self._project(out.transpose(1, 2).reshape(b, t, heads * head_dim))  # (B, T, d_out)
        return out if weights is None else (out, weights)

    def _unbatched(self, x: torch.Tensor, *, kv, return_weights, **kw):
        if kv is not None:
            if not isinstance(kv, torch.Tensor) or kv.ndim != 2:
                raise ValueError(f"kv must be (k_seq, features={self.d_in}) with an unbatched "
                                 f"(seq, features) x, got {_shape(kv)}")
            kv = kv.unsqueeze(0)
        ids = kw.get("document_ids")
        if isinstance(ids, torch.Tensor) and ids.ndim == 1:
            kw["document_ids"] = ids.unsqueeze(0)  # (seq,): the ids of the one sequence
        out = self(x.unsqueeze(0), kv=kv, return_weights=return_weights, **kw)
        if isinstance(out, tuple):
            return out[0][0], out[1][0]
        return out[0]

    def _normed_heads(self) -> bool:
        return self.q_norm is not None or self.k_norm is not None

    def _norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, H, T, D)`` queries and ``(B, Hkv, S, D)`` keys through ``q_norm`` and
        ``k_norm`` (each head's D features) where the module has them."""
        return (q if self.q_norm is None else self.q_norm(q),
                k if self.k_norm is None else self.k_norm(k))

    def _norm_packed(self, qkv: torch.Tensor) -> torch.Tensor:
        """The joint ``(B, T, (H + 2 Hkv) * D)`` product with its queries and keys normed."""
        q, k, v = qkv.unflatten(-1, (-1, self.head_dim)).split_with_sizes(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=-2)
        return torch.cat([*self._norm_heads(q, k), v], dim=-2).flatten(-2)

    def _project(self, merged: torch.Tensor) -> torch.Tensor:
        """The heads side by side ``(B, T, num_heads * head_dim)`` -> output projection
        ``(B, T, d_out)``, dropout."""
        return dropout(fused.apply(merged, self.out_proj), self.resid_dropout, self.training)

    # ------------------------------------------------------------------ interop

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> MultiHeadAttention:
        """An equivalent module with a copy of ``torch.nn.MultiheadAttention``'s weights.

        Args:
            m: the torch module; ``batch_first`` True or False (ours is always batch
                first: pass ``(batch, seq, embed_dim)`` input). Biases are copied.
                ``add_bias_kv``, ``add_zero_attn`` and ``kdim``/``vdim`` different from
                ``embed_dim`` are not supported (ValueError).

        torch's masks say True = *not* allowed: convert ``attn_mask`` as ``~attn_mask``
        and ``key_padding_mask`` as ``~key_padding_mask`` (or float masks unchanged).
        The result is not causal; pass a mask or set ``causal`` yourself.
        """
        return from_torch(cls, m)
