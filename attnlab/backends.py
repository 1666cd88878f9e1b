"""The backend table of :func:`attnlab.attention`: each backend, what it can take, and
the one rule by which ``backend="auto"`` chooses among them.

Part of ``functional.py`` in all but file: ``attention`` validates its arguments,
builds a :class:`Request`, asks the named backend (or :func:`choose`) and calls its
``run``; no other code names a backend. A new backend is one :class:`Backend` entry
in :data:`TABLE`; a new feature of a call is one field of :class:`Request` and one
capability that :meth:`Backend.supports` checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from . import _decode, _flash
from . import masks as _masks
from ._eager import eager_attention, eager_lse, eager_lse_backward, nothing_to_compute
from ._sdpa import sdpa_attention, sdpa_lse, sdpa_lse_backward
from ._tiled import tiled_attention, tiled_lse_backward, tiled_weights
from ._tracing import batched, func_gradients
from ._variants import Variants

__all__ = ["Backend", "LseStep", "Request", "TABLE", "choose", "resolve"]


@dataclass(slots=True)
class Request:
    """What one call of ``attention`` asks, after its checks: 4-D ``q``/``k``, the mask
    (after ``_to_4d``), the structural rule, the weight rows wanted (None for none)."""

    q: torch.Tensor
    k: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    window: int | None
    dropout_p: float
    rows: torch.Tensor | None
    variants: Variants | None = None
    lse: bool = False  # the log-sum-exp of each row is wanted too (attention_with_lse)

    @property
    def learned_mask(self) -> bool:
        """An additive mask that requires grad (a learned bias)."""
        return self.mask is not None and self.mask.requires_grad


def _always(request: Request) -> bool:
    return True


@dataclass(frozen=True)
class LseStep:
    """Attention that also returns each row's log-sum-exp, and the backward of one block of
    keys given the rows' merged output and log-sum-exp: what :func:`attention_with_lse`
    runs, and the local step of attention split across processes
    (:mod:`attnlab.distributed`), where a rank meets the keys a block at a time and merges
    the blocks exactly by their log-sum-exp.

    ``forward(q, k, v, mask, causal, window, scale, dropout_p, variants, offset=None) ->
    (out, lse)``: 4-D inputs after ``attention``'s checks (``variants`` a
    ``_variants.Variants`` or None); ``offset`` is query row 0's position among the keys
    (``masks.KeyRule``: None is end-aligned, a piece of a longer sequence passes its own;
    ALiBi reads the same positions). ``out (B, Hq, Lq, Dv)`` in q's dtype, differentiable;
    ``lse (B, Hq, Lq)`` (natural log, the sink included) in float32 (float64 for float64
    inputs), without gradient, ``+inf`` for a row with nothing to attend (its ``out``
    zeros).

    ``backward(q, k, v, mask, out, lse, grad_out, causal, window, scale, variants, offset)
    -> (dq, dk, dv)``: this block's share of the gradients, given each row's ``out`` and
    ``lse`` merged over every block it attends (FlashAttention-2's backward reads only
    those), in float32 (float64); ``mask`` None or bool, no dropout. A sink is already in
    ``lse``: its own gradient is the caller's.
    """

    forward: Callable
    backward: Callable


@dataclass(frozen=True)
class Backend:
    """One backend and its capabilities.

    ``run(q, k, v, mask, causal, window, scale, dropout_p, rows, variants) -> (out,
    weights)`` takes 4-D inputs after ``attention``'s checks (``weights`` None unless
    ``rows``; ``variants`` a ``_variants.Variants`` or None).
    Capabilities: ``masks`` (bool and additive), ``mask_gradients`` (differentiates an
    additive mask that requires grad), ``windows``, ``dropout``, ``weights``
    (``return_weights``), ``gradients`` (of q, k, v), the variants of ``attention``
    (``softcap``, ``alibi`` (``alibi_slopes``), ``sinks`` (with their gradient),
    ``documents`` (``document_ids``), ``mask_mod``, ``score_mod``), ``func_gradients``
    (under ``torch.func.grad``, ``jacrev``, ``vmap`` of ``grad``: its backward may run on
    batched tensors), ``mapped_variants`` (ALiBi slopes, sinks or document ids mapped by
    ``torch.func.vmap``), ``devices`` and ``dtypes``
    (None: any device, every floating dtype), ``decode`` (a fused one-token step with a
    cache, as :func:`attnlab._decode.step` takes it; None where there is none), ``lse``
    (an :class:`LseStep`: each row's log-sum-exp too, and the backward of one block of
    keys; reported as ``log_sum_exp``; None where the backend does not form it).
    ``unavailable(q)`` says why the backend cannot run here (a build, a device), or
    None; ``pays(request)`` whether ``auto`` should take it for a call it supports.
    """

    name: str
    run: Callable
    masks: bool = True
    mask_gradients: bool = True
    windows: bool = True
    dropout: bool = True
    weights: bool = True
    gradients: bool = True
    softcap: bool = True
    alibi: bool = True
    sinks: bool = True
    documents: bool = True
    mask_mod: bool = True
    score_mod: bool = True
    func_gradients: bool = True
    mapped_variants: bool = True
    devices: tuple[str, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    decode: Callable | None = None
    lse: LseStep | None = None
    unavailable: Callable[[torch.Tensor], str | None] | None = None
    pays: Callable[[Request], bool] = _always
    label: str = ""  # how errors name it, after the name: " (the native kernel)"
    no_weights: str = ""  # why it cannot return weights, for the error
    instead: str = ""  # what the errors suggest using instead

    @property
    def decoding(self) -> bool:
        return self.decode is not None

    def capabilities(self) -> dict[str, object]:
        """The capability fields by name (``decoding`` for ``decode``)."""
        skip = {"name", "run", "decode", "lse", "unavailable", "pays", "label", "no_weights",
                "instead"}
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        out["decoding"] = self.decoding
        out["log_sum_exp"] = self.lse is not None
        return out

    def supports(self, request: Request) -> str | None:
        """Why this backend cannot take ``request``, as the ValueError names it, or None."""
        q, name = request.q, self.name
        if request.lse and self.lse is None:
            return (f"backend={name!r}{self.label} does not return the log-sum-exp; use "
                    "backend='auto', 'eager' or 'tiled'")
        if request.rows is not None and not self.weights:
            return f"backend={name!r} cannot return weights ({self.no_weights}); {self.instead}"
        if self.unavailable is not None and (why := self.unavailable(q)) is not None:
            return f"backend={name!r}{self.label} is not available: {why}; {self.instead}"
        if self.devices is not None and q.device.type not in self.devices:
            return (f"backend={name!r} runs on {'/'.join(self.devices)} tensors only, got a "
                    f"tensor on {q.device}")
        if self.dtypes is not None and q.dtype not in self.dtypes:
            return f"backend={name!r} takes {self.dtypes}, got {q.dtype}"
        if request.mask is not None and not self.masks:
            return f"backend={name!r} takes no mask"
        if request.window is not None and not self.windows:
            return f"backend={name!r} takes no window"
        if request.dropout_p > 0 and not self.dropout:
            return f"backend={name!r} has no dropout"
        if not self.mapped_variants and request.variants is not None and \
                batched(*request.variants.tensors()):
            return (f"backend={name!r}{self.label} does not take torch.func.vmap over ALiBi "
                    "slopes, sinks or document ids; use backend='auto' or 'eager'")
        if not self.func_gradients and func_gradients():
            return (f"backend={name!r}{self.label} does not take torch.func's gradient "
                    "transforms (grad, jacrev, vmap of grad); use backend='auto', 'eager', "
                    "'sdpa' or 'flash'")
        if not self.gradients and torch.is_grad_enabled() and (q.requires_grad
                                                               or request.k.requires_grad):
            return f"backend={name!r} does not differentiate q, k, v; use backend='auto'"
        if request.variants is not None:
            for cap in request.variants.present():
                if not getattr(self, cap):
                    arg = Variants.CAPABILITIES[cap].replace("block_mask", "mask_mod")
                    return (f"backend={name!r}{self.label} does not take {arg}; "
                            f"{self.instead or 'use backend=' + repr('auto')}")
        if not self.mask_gradients and request.learned_mask and torch.is_grad_enabled():
            return (f"backend={name!r} does not differentiate an additive mask (mask requires "
                    "grad); use backend='eager' or 'sdpa' for a learned bias")
        return None


def choose(request: Request) -> Backend:
    """``backend="auto"``'s one rule: from the last backend of :data:`TABLE` to the first
    (each is registered after those it improves on), the first that supports the call,
    differentiates the mask where it requires grad (grad mode on or not, so that a
    learned bias keeps one backend from training to evaluation) and says it pays
    (``Backend.pays``: where it is faster than the ones before it). The first entry,
    ``eager``, takes everything and always pays."""
    learned = request.learned_mask
    for backend in _AUTO_ORDER:
        if ((backend.mask_gradients or not learned)
                and backend.pays(request) and backend.supports(request) is None):
            return backend
    raise AssertionError("the eager backend takes every call")  # unreachable


def resolve(request: Request, backend: str) -> Backend:
    """The backend that runs ``request``: ``"auto"``'s choice (:func:`choose`), or the named
    one, ValueError saying why where it cannot take the call."""
    if backend == "auto":
        return choose(request)
    chosen = TABLE.get(backend)
    if chosen is None:
        raise ValueError(f"backend must be one of {('auto', *TABLE)}, got {backend!r}")
    if (why := chosen.supports(request)) is not None:
        raise ValueError(why)
    return chosen


# --------------------------------------------------------------------------- runs


def _sdpa(q, k, v, mask, causal, window, scale, dropout_p, rows, variants):
    return sdpa_attention(q, k, v, mask, causal, window, scale, dropout_p, variants), None


def _tiled(q, k, v, mask, causal, window, scale, dropout_p, rows, variants):
    if nothing_to_compute(q, k, v):
        return eager_attention(q, k, v, mask, causal, window, scale, dropout_p, rows, variants)
    out, _ = tiled_attention(q, k, v, mask, causal, window, scale, dropout_p,
                             variants=variants)
    return out, None if rows is None else tiled_weights(q, k, mask, causal, window, scale, rows,
                                                        variants)


def _tiled_lse(q, k, v, mask, causal, window, scale, dropout_p, variants, offset=None):
    if nothing_to_compute(q, k, v):
        return eager_lse(q, k, v, mask, causal, window, scale, dropout_p, variants, offset)
    out, lse = tiled_attention(q, k, v, mask, causal, window, scale, dropout_p, offset,
                               variants=variants)
    return out, lse.reshape(q.shape[:3])


def _flash_variants(variants: Variants | None) -> dict:
    """The variants as the kernel's wrapper takes them (it has every one but score_mod)."""
    if variants is None:
        return {}
    return dict(softcap=variants.softcap, alibi_slopes=variants.alibi_slopes,
                sinks=variants.sinks, documents=variants.documents,
                block_mask=variants.block_mask)


def _flash_run(q, k, v, mask, causal, window, scale, dropout_p, rows, variants):
    out = _flash.flash_attention(q, k, v, mask, causal, window, scale, dropout_p,
                                 **_flash_variants(variants))
    return out, None if rows is None else tiled_weights(q, k, mask, causal, window, scale, rows,
                                                        variants)


def _flash_lse(q, k, v, mask, causal, window, scale, dropout_p, variants, offset=None):
    return _flash.flash_attention(q, k, v, mask, causal, window, scale, dropout_p, offset,
                                  with_lse=True, **_flash_variants(variants))


def _flash_lse_backward(q, k, v, mask, out, lse, grad_out, causal, window, scale, variants,
                        offset=None):
    options = _flash_variants(variants)
    options.pop("sinks", None)  # already in lse
    return _flash.flash_lse_backward(q, k, v, mask, out, lse, grad_out, causal, window, scale,
                                     offset, **options)


def _flash_decode(qkv, cache, rotary, window, num_heads, num_kv_heads, **scores):
    # Looked up at each call: tests count the steps by replacing _decode.step.
    return _decode.step(qkv, cache, rotary, window, num_heads, num_kv_heads, **scores)


# --------------------------------------------------------------------------- when auto pays

# tiled: above this many weights per (batch, head) the textbook path's rows x k_len
# matrix stops fitting in cache and the tiled path wins when weights are wanted.
_EAGER_MAX_SCORES = 1024 * 1024
# tiled: a sliding window goes to the tiled path once most of the dense matrix is
# masked out (k_len >= _WINDOW_RATIO * window) and the sequence is long enough for
# tile skipping to pay for its Python loop.
_WINDOW_RATIO = 4
_WINDOW_MIN_LEN = 2048
# flash takes CPU float32 calls of any length. Even on short rows (B=1-32, 4-12 heads,
# 1-100 queries, inference and training, with and without padding masks, one and two
# threads) it ran at 0.09-0.42x the sdpa backend's time with its AVX-512 tiles and at
# 0.3-0.73x with BLAS tiles: at these sizes the sdpa backend's time goes to its
# checks (non-finite inputs, empty rows) and torch's per-head set-up. With BLAS tiles,
# dense rows (no rule to skip by) stay with SDPA, which matches it on long ones.


# tiled, with variants: the textbook path alone takes softcap, sinks and score_mod; the
# tiled one is faster from this many scores per (batch, head) (its causal rows beat
# eager's from T=512 on the bench grid) and needs no q_len x k_len buffer.
_VARIANT_MIN_SCORES = 512 * 512
# tiled, where the route without tiles would build an O(q_len x k_len) tensor of more
# than this many bytes per call (_untiled_bytes): O(T^2) memory per call is not worth
# its speed.
_DENSE_MAX_BYTES = 1 << 30
# What sdpa cannot state: calls with these go to eager (or tiled).
_EAGER_VARIANTS = {"softcap", "sinks", "score_mod"}


def _untiled_bytes(r: Request) -> int:
    """The bytes of the ``q_len x k_len`` tensor that the route without tiles builds for
    ``r``: eager's float32 scores where weights or softcap, sinks or a score_mod send
    the call there (every row's, whatever rows of weights are asked for); else sdpa's
    dense mask (documents or a mask_mod per batch, ALiBi's float bias per head, the bool
    mask of a window or of causal rows that torch's alignment does not match); 0 where
    torch's fused kernels need none."""
    v, (batch, heads, q_len, _) = r.variants, r.q.shape
    k_len = r.k.shape[-2]
    if r.rows is not None or (v is not None and _EAGER_VARIANTS & set(v.present())):
        return 4 * batch * heads * q_len * k_len
    if v is None:
        ruled = r.window is not None or (r.causal and q_len not in (1, k_len))
        return q_len * k_len if ruled else 0
    size = q_len * k_len * (batch if v.documents or v.block_mask else 1)
    if v.alibi_slopes is not None:
        size *= 4 * heads * (batch if v.alibi_slopes.shape[0] > 1 else 1)
    return size


def _tiled_pays(r: Request) -> bool:
    k_len = r.k.shape[-2]
    if r.q.device.type != "cpu":
        # On a GPU each op of eager and sdpa is one kernel over the whole matrix, and
        # the tiled path's Python loop of small kernels lost to them in every case
        # measured (H100, torch 2.11, B=1, 12 heads, T=4096, bf16 and float32, forward
        # and forward+backward: softcap 4-5x eager's time, documents 8-18x sdpa's,
        # prefix-LM 1.7-4x): tiles there only for memory.
        return _untiled_bytes(r) > _DENSE_MAX_BYTES
    if r.rows is not None:
        return len(r.rows) * k_len > _EAGER_MAX_SCORES
    if r.variants is not None and _tiles_pay_for_variants(r):
        return True
    return (r.window is not None and r.q.shape[-2] > 1 and k_len >= _WINDOW_MIN_LEN
            and k_len >= _WINDOW_RATIO * r.window)


def _tiles_pay_for_variants(r: Request) -> bool:
    """On the CPU, where the tiled path beats the others on a call with variants: long
    rows where only eager could take it; rows where documents or a mask_mod leave at
    most 1/_WINDOW_RATIO of the pairs (the tiles it skips), as for windows; and calls
    whose dense mask for SDPA would be too large."""
    v, q_len, k_len = r.variants, r.q.shape[-2], r.k.shape[-2]
    if _EAGER_VARIANTS & set(v.present()):
        return q_len * k_len >= _VARIANT_MIN_SCORES
    if q_len * k_len == 0:
        return False
    live = 1.0
    if v.documents is not None:
        rule = _masks.KeyRule(q_len, k_len, causal=r.causal, window=r.window,
                              documents=v.documents)
        live = rule.pairs() / (v.documents.batch * q_len * k_len)
    if v.block_mask is not None:
        live = min(live, float(v.block_mask.live_share()))
    if live * _WINDOW_RATIO <= 1 and k_len >= _WINDOW_MIN_LEN and q_len > 1:
        return True
    return _untiled_bytes(r) > _DENSE_MAX_BYTES


# flash takes bf16 and fp16 calls as well: its tiles are converted to float32 as they are
# read, where torch's CPU kernel runs them 2-10x slower (B=1, 9-12 heads, T=32-2048, one
# Zen 5 thread: forward 0.19-0.37x SDPA's time, forward+backward 0.07-0.49x).
_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _flash_pays(r: Request) -> bool:
    """CPU float32, bf16 or fp16 without weights; with BLAS tiles only a causal or window
    rule to skip by. (Its weights come from the tiled path's rows: auto leaves
    them to ``eager`` or ``tiled``.)"""
    q = r.q
    if r.rows is not None or q.device.type != "cpu" or q.dtype not in _FLASH_DTYPES:
        return False
    return _flash.tile_kernel() or r.causal or r.window is not None


# In the order of attnlab.BACKENDS; auto reads it backwards (see choose).
TABLE: dict[str, Backend] = {b.name: b for b in (
    Backend("eager", eager_attention, lse=LseStep(eager_lse, eager_lse_backward)),
    Backend("sdpa", _sdpa, weights=False, softcap=False, sinks=False, score_mod=False,
            lse=LseStep(sdpa_lse, sdpa_lse_backward),
            no_weights="torch's fused kernel never forms them",
            instead="use backend='auto', 'eager' or 'tiled'"),
    Backend("tiled", _tiled, mask_gradients=False, pays=_tiled_pays, func_gradients=False,
            mapped_variants=False,
            lse=LseStep(_tiled_lse, tiled_lse_backward)),
    Backend("flash", _flash_run, mask_gradients=False, devices=("cpu",), mapped_variants=False,
            decode=_flash_decode, unavailable=_flash.unavailable, pays=_flash_pays,
            lse=LseStep(_flash_lse, _flash_lse_backward), score_mod=False,
            label=" (the native kernel)",
            instead="use backend='tiled' (the same algorithm in PyTorch) or 'auto'"),
)}
_AUTO_ORDER = tuple(reversed(TABLE.values()))
