"""Autoregressive generation shared by the decoder models (``GPT``, ``ToyAttnLM``).

A model provides ``forward(ids, *, attention_mask, caches, positions, logits_to_keep)``
returning logits ``(batch, seq, vocab)`` (the last ``logits_to_keep`` positions),
``new_cache(batch_size, max_seq_len)`` (and ``dtype=`` for ``cache_dtype``) and
``context_length``. Prompts of different lengths are left-padded; each sequence's
positions count only its real tokens, so padding changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .. import _native
from ..checks import bounded_int, is_int, optional_positive_int
from ..text.stream import TextStream

# The most tokens one call adds. Each is a forward pass of the model (without the
# cache, over the whole window): a million are days of CPU time already, and more
# is a typo (``--max-new-tokens 10**20`` would otherwise run until killed).
MAX_NEW_TOKENS = 10**6


def _from_numpy(ids):
    """A tokenizer's integer numpy ids as a tensor; anything else as it is."""
    if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":
        return torch.from_numpy(ids.astype(np.int64))
    return ids


def _as_batch(ids, pad_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(batch, seq)`` ids and a 1/0 mask (None when no padding is needed)."""
    ids = _from_numpy(ids)
    if isinstance(ids, torch.Tensor):
        if ids.dtype not in (torch.int64, torch.int32) or ids.ndim not in (1, 2):
            raise ValueError(
                f"ids must be a (batch, seq) or (seq,) integer tensor, got shape "
                f"{tuple(ids.shape)} dtype {ids.dtype}"
            )
        ids = (ids[None] if ids.ndim == 1 else ids).long()
        if ids.numel() == 0:  # nothing to continue: the first step has no last position
            raise ValueError(f"ids must hold at least one prompt of at least one token, got "
                             f"shape {tuple(ids.shape)}; expected (batch, seq) or (seq,) "
                             "with batch >= 1 and seq >= 1")
        return ids, None
    if not isinstance(ids, Sequence) or isinstance(ids, str | bytes):
        raise TypeError(f"ids must be a tensor or a list of prompts (lists of ints), got "
                        f"{type(ids).__name__}")
    def row(r) -> list:  # a prompt: a list of ints, or a 1-D integer tensor of them
        r = _from_numpy(r)
        if isinstance(r, torch.Tensor):
            if r.ndim != 1 or r.is_floating_point() or r.is_complex() or r.dtype == torch.bool:
                raise TypeError(f"ids must hold prompts as lists of ints or 1-D integer "
                                f"tensors, got a tensor of shape {tuple(r.shape)} dtype "
                                f"{r.dtype}")
            return r.tolist()
        if not isinstance(r, Sequence) or isinstance(r, str | bytes):
            raise TypeError(f"ids must hold prompts as lists of ints or 1-D integer tensors, "
                            f"got {r!r} among them")
        return list(r)

    nested = ids and isinstance(ids[0], Sequence | torch.Tensor | np.ndarray)
    rows = [row(r) for r in ids] if nested else [list(ids)]
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("ids must hold at least one token per prompt, got an empty prompt")
    bad = [x for r in rows for x in r if not is_int(x)]
    if bad:  # 1.5 would be truncated to 1 by torch.tensor(..., dtype=long)
        raise TypeError(f"ids must hold int token ids, got {bad[0]!r}")
    width = max(len(r) for r in rows)
    padded = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        padded[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return padded, (mask if bool((mask == 0).any()) else None)


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None,
                top_p: float | None, generator: torch.Generator | None) -> torch.Tensor:
    """Pick the next token ``(batch,)`` from last-position logits ``(batch, vocab)``."""
    # NaN logits (overflowing weights) must not break a stream already printing: they
    # rank lowest, and a row with nothing finite falls back to token 0 via argmax.
    if temperature == 0:  # the float32 logits decide it: no float64 copy of the vocab
        if logits.device.type != "cpu":  # no host sync on an accelerator
            return torch.nan_to_num(logits, nan=float("-inf")).argmax(dim=-1)
        if logits.dtype == torch.float32 and logits.dim() == 2:
            # NumPy's argmax (the first maximum, as torch's max gives it on the CPU; NaN
            # ranked highest, as there): 2 us over SmolLM's 49152 logits, torch's max 30.
            scores = logits.detach().resolve_neg().numpy()
            picked = scores.argmax(axis=-1)
            if not np.isnan(scores[np.arange(len(picked)), picked]).any():
                return torch.from_numpy(picked)
            # NaN won: only then the copy
            return torch.nan_to_num(logits, nan=float("-inf")).argmax(dim=-1)
        best, picked = logits.max(dim=-1)  # (bf16 logits: a model under autocast)
        if bool(best.isnan().any()):
            picked = torch.nan_to_num(logits, nan=float("-inf")).argmax(dim=-1)
        return picked
    logits = torch.nan_to_num(logits.double(), nan=float("-inf"))
    # float64: logits / 1e-45 and a top_p of 1e-300 stay finite and non-zero there.
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # keep the first over p
        drop[:, 0] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    # A degenerate row (nothing finite, so softmax gave NaN) is decided greedily:
    # sampling never fails after the prompt has been printed.
    bad = ~torch.isfinite(probs).all(dim=-1) | (probs.sum(dim=-1) <= 0)
    if bool(bad.any()):
        probs = torch.where(bad[:, None], F.one_hot(logits.argmax(dim=-1), logits.shape[-1])
                            .to(probs.dtype), probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_eos_id(eos_id: object, vocab_size: int) -> tuple[int, ...] | None:
    """None, or ``eos_id`` (a token id, or a list of them: transformers' ``eos_token_id``
    may name several, Gemma 3 its end of text and of turn) as a tuple of ids in ``[0,
    vocab_size)``: an id the model can never produce (``-1``, ``vocab_size``) would
    silently never stop a sequence, and ``2.5`` or ``True`` is a typo, not a token."""
    if eos_id is None:
        return None
    ids = list(eos_id) if isinstance(eos_id, list | tuple) and eos_id else [eos_id]
    for i in ids:
        if not is_int(i):
            raise TypeError(f"eos_id must be an int token id, a list of them, or None, got "
                            f"{type(eos_id).__name__} {eos_id!r}")
        if not 0 <= i < vocab_size:
            raise ValueError(f"eos_id must be a token id in [0, {vocab_size}) (the model's "
                             f"vocab_size is {vocab_size}), got {i}")
    return tuple(int(i) for i in ids)


def check_precision(dtype: object, quantize: object) -> None:
    """TypeError/ValueError unless ``dtype`` is None, torch.float32 or torch.bfloat16 and
    ``quantize`` None or "int8" (what a model's weights may be held in)."""
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"dtype must be None, torch.float32 or torch.bfloat16, got {dtype!r}")
    if quantize is not None and quantize != "int8":
        raise ValueError(f"quantize must be None or 'int8', got {quantize!r}")


def check_cache_dtype(dtype: object) -> None:
    """TypeError unless ``dtype`` is None or a floating-point torch dtype."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"cache_dtype must be None or a floating-point torch.dtype such as "
                        f"torch.bfloat16, got {dtype!r}")


def check_sampling(max_new_tokens, temperature, top_k, top_p):
    bounded_int("max_new_tokens", max_new_tokens, 0, MAX_NEW_TOKENS)
    # nan passes every comparison-based check and inf divides the logits into nan;
    # either would only fail inside torch.multinomial, after the prompt was echoed.
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or (
        temperature < 0
    ):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got "
                         f"{temperature!r}")
    optional_positive_int("top_k", top_k)
    check_top_p("top_p", top_p)


def check_top_p(name: str, top_p):
    """``top_p``: None, or the nucleus's probability mass, a finite number in (0, 1]."""
    if top_p is not None and not (
        isinstance(top_p, (int, float)) and not isinstance(top_p, bool)
        and math.isfinite(top_p) and 0 < top_p <= 1
    ):
        either = " or None" if name else ""  # a command-line option is never None
        raise ValueError(f"{name} must be a finite number in (0, 1]{either}, got {top_p!r}")
    return top_p


GREEDY_CHUNK = 64  # tokens a native call of generate's loop: Ctrl-C seen every ~0.4 s


class GenerationMixin:
    """``generate`` and ``stream`` for models with the decoder interface above."""

    pad_id: int = 0

    def stream(
        self,
        ids,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        use_cache: bool = True,
        eos_id: int | Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        tokenizer=None,
        decoder=None,
        cache_dtype: torch.dtype | None = None,
    ) -> Iterator[torch.Tensor] | Iterator[str]:
        """Yield the next token of every sequence ``(batch,)``, one step at a time.

        Finished sequences (that produced ``eos_id``, or one of its ids) keep yielding it
        (the first of them);
        the stream ends when all are finished or after ``max_new_tokens``.

        With ``tokenizer`` (one prompt only) it yields text instead: the new text
        after each step, holding back a character until all its bytes are there
        (:class:`attnlab.text.stream.TextStream`), so the pieces joined are the
        decode of prompt and continuation minus the prompt's text, with no
        ``U+FFFD`` that the whole decode does not have.

        ``decoder`` (GPT: ``model.decoder(ids)``) keeps the fused decoding plan from token
        to token; give one only where nothing changes the model while the stream runs.
        Without it the plan is made at every token (the caller's code runs in between).
        ``cache_dtype``: the KV caches' dtype (default: the model's; ``torch.bfloat16``
        halves their bytes, see :meth:`~attnlab.KVCache`).
        """
        check_cache_dtype(cache_dtype)
        tokens = self._stream_ids(ids, max_new_tokens, temperature, top_k, top_p, use_cache,
                                  eos_id, generator, decoder, cache_dtype)
        if tokenizer is None:
            return tokens
        prompt, _ = _as_batch(ids, self.pad_id)
        if prompt.shape[0] != 1:
            raise ValueError(f"ids: streaming text takes one prompt, got a batch of "
                             f"{prompt.shape[0]}; stream token ids instead (tokenizer=None)")
        return _text_pieces(tokens, TextStream(tokenizer, context=prompt[0].tolist()))

    @torch.inference_mode()
    def _stream_ids(self, ids, max_new_tokens, temperature, top_k, top_p, use_cache, eos_id,
                    generator, decoder, cache_dtype=None,
                    greedy_loop=False) -> Iterator[torch.Tensor]:
        check_sampling(max_new_tokens, temperature, top_k, top_p)
        eos_ids = check_eos_id(eos_id, self.config.vocab_size)
        device = next(self.parameters()).device
        stops = None if eos_ids is None else torch.tensor(eos_ids, device=device)
        ids, mask = _as_batch(ids, self.pad_id)
        ids = ids.to(device)
        batch, prompt_len = ids.shape
        total = prompt_len + max_new_tokens
        limit = self.context_length
        # The last new token is never fed back: the model sees total - 1 positions.
        if use_cache and total - 1 > limit:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} needs "
                f"{total - 1} positions (the last new token is not fed back), beyond the "
                f"model's context_length={limit}; use fewer tokens"
            )
        if mask is not None:  # allocated once for the run, like the caches
            full_mask = torch.ones(batch, total, dtype=mask.dtype, device=device)
            full_mask[:, :prompt_len] = mask
            mask = full_mask[:, :prompt_len]
        # (dtype only when asked: a model's new_cache may take just the two sizes)
        kept_dtype = {} if cache_dtype is None else {"dtype": cache_dtype}
        caches = self.new_cache(batch, max(total - 1, 1), **kept_dtype) if use_cache else None
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        seq, seq_mask = ids, mask
        # Without padding the layers read positions off the cache (a cheap slice);
        # left-padded prompts carry each row's own positions.
        step_ids = ids
        step_pos = None if mask is None else _positions(mask, 0, prompt_len, device, batch)
        kept = {} if decoder is None else {"decoder": decoder}
        # generate (greedy_loop) takes one row's greedy tokens after the second in native
        # calls where the decoder can (Decoder.greedy); a stream yields each as it comes.
        greedy_loop = (greedy_loop and decoder is not None and temperature == 0 and use_cache
                       and batch == 1 and mask is None)
        made = 0
        while made < max_new_tokens:
            # Only the last position's logits are sampled from.
            if use_cache:
                logits = self(step_ids, attention_mask=seq_mask, caches=caches,
                              positions=step_pos, logits_to_keep=1, **kept)
            else:
                window = seq[:, -limit:]
                win_mask = None if seq_mask is None else seq_mask[:, -limit:]
                logits = self(window, attention_mask=win_mask, logits_to_keep=1,
                              positions=_positions(win_mask, 0, window.shape[1], device, batch))
            with _native.one_thread_while_busy():  # small ops over the vocabulary
                nxt = sample_next(logits[:, -1], temperature, top_k, top_p, generator)
            if stops is not None:  # a finished row yields the first end-of-text id
                nxt = torch.where(done, torch.full_like(nxt, eos_ids[0]), nxt)
                done |= torch.isin(nxt, stops)
            yield nxt
            made += 1
            if stops is not None and bool(done.all()):
                return
            if not use_cache:  # the cache holds the past; only the window re-reads it
                seq = torch.cat([seq, nxt[:, None]], dim=1)
            if seq_mask is not None:
                seq_mask = full_mask[:, :seq_mask.shape[1] + 1]
            step_ids = nxt[:, None]
            step_pos = None if step_pos is None else step_pos[:, -1:] + 1
            while greedy_loop and made >= 2 and made < max_new_tokens:
                rest = decoder.greedy(int(nxt), min(GREEDY_CHUNK, max_new_tokens - made),
                                      caches, eos_ids or ())
                if rest is None:  # declined, nothing changed: on token by token
                    greedy_loop = False
                    break
                yield from (torch.tensor([t], device=device) for t in rest)
                made += len(rest)
                if eos_ids is not None and rest[-1] in eos_ids:
                    return
                nxt = torch.tensor([rest[-1]], device=device)
                step_ids = nxt[:, None]

    @torch.no_grad()
    def generate(
        self,
        ids,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        use_cache: bool = True,
        eos_id: int | Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        on_token: Callable[[torch.Tensor], None] | None = None,
        cache_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Continue each prompt by up to ``max_new_tokens`` tokens.

        Args:
            ids: ``(batch, seq)`` / ``(seq,)`` token tensor, or a list of prompts
                (lists of ids) of any lengths, which are left-padded.
            max_new_tokens: tokens to add.
            temperature: 0 = greedy (argmax); otherwise sample from softmax(logits / T).
            top_k: sample only among the k most likely tokens.
            top_p: sample only among the smallest set of tokens whose probability
                reaches p (nucleus sampling).
            use_cache: keep keys/values in a KV cache (default) instead of re-running
                the whole sequence every step; both give the same tokens. With the cache
                the prompt and new tokens must fit ``context_length``; without it a longer
                run predicts each token from the last ``context_length`` tokens only
                (nanoGPT's crop), positions counted from the window's start.
            eos_id: stop a sequence when it produces this token (or any of a list).
            generator: a ``torch.Generator`` for reproducible sampling.
            on_token: called with each step's ``(batch,)`` new tokens (streaming).
            cache_dtype: the KV caches' dtype (default: the model's);
                ``torch.bfloat16`` halves their bytes (keys and values rounded as
                written, attention computed in float32).

        Returns:
            ``(batch, prompt_len + new)`` ids: the prompts and what was generated.
            Prompts shorter than the longest are left-padded with ``self.pad_id`` (0),
            which may be a real token (a char-level tokenizer's first character): row
            ``i``'s own ids start at ``prompt_len - len(ids[i])``. Sequences that stopped
            early are filled with ``eos_id`` (its first).
        """
        prompt, _ = _as_batch(ids, self.pad_id)
        batch, length = prompt.shape
        # With no callback nothing of the user's runs until the last token (where the
        # model runs only library code): the fused decoding plan is made once.
        decoder = self.decoder(ids) if on_token is None and hasattr(self, "decoder") else None
        check_cache_dtype(cache_dtype)
        tokens = self._stream_ids(ids, max_new_tokens, temperature, top_k, top_p, use_cache,
                                  eos_id, generator, decoder, cache_dtype, greedy_loop=True)
        out = None
        for tok in tokens:
            if out is None:  # after the first token: the stream has checked the request
                # Built outside inference mode (stream runs in it, for speed): the result
                # is an ordinary tensor that may feed a later forward with autograd.
                # Allocated once: a list of one small tensor per token, kept while each
                # token's logits come and go, broke up malloc's heap (SmolLM-135M int8:
                # 11 MB more at the peak).
                out = torch.empty(batch, length + max_new_tokens, dtype=prompt.dtype,
                                  device=tok.device)
                out[:, :length] = prompt
            out[:, length] = tok
            length += 1
            if on_token is not None:
                on_token(tok)
        if out is None:  # no new token asked for
            return prompt.to(next(self.parameters()).device).clone()
        return out if length == out.shape[1] else out[:, :length].clone()


def _text_pieces(tokens: Iterator[torch.Tensor], text: TextStream) -> Iterator[str]:
    """The non-empty text pieces of a one-sequence token stream, then what was held back."""
    for tok in tokens:
        piece = text.push(int(tok[0]))
        if piece:
            yield piece
    rest = text.flush()
    if rest:
        yield rest


def _positions(mask, start, length, device, batch) -> torch.Tensor:
    """Position of each token ``(batch, length)``: real tokens count from 0, pads sit at 0."""
    if mask is None:
        return torch.arange(start, start + length, device=device).expand(batch, length)
    return (mask.cumsum(dim=1) - 1).clamp(min=0)
