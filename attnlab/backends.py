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
from ._eager import eager_attention, eager_block_backward, eager_block_forward
from ._sdpa import sdpa_attention, sdpa_block_backward, sdpa_block_forward
from ._tiled import tiled_attention, tiled_block_backward, tiled_block_forward, tiled_weights

__all__ = ["Backend", "BlockStep", "Request", "TABLE", "choose", "choose_block"]


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

    @property
    def learned_mask(self) -> bool:
        """An additive mask that requires grad (a learned bias)."""
        return self.mask is not None and self.mask.requires_grad


def _always(request: Request) -> bool:
    return True


@dataclass(frozen=True)
class BlockStep:
    """Attention of one block of queries against one block of keys that also returns the
    log-sum-exp, so that blocks merge exactly: the local step of attention split across
    processes (:mod:`attnlab.distributed`), where a rank meets the keys a block at a time.

    ``forward(q, k, v, mask, causal, window, offset, scale) -> (out, lse)``: 4-D
    ``q (B, Hq, Lq, D)``, ``k``/``v (B, Hkv, Lk, D/Dv)``; query row ``i`` sits at position
    ``i + offset`` among the keys (``masks.KeyRule``: the causal and window rules of a
    piece of a longer sequence; ALiBi-style variants read the same positions); ``mask``
    None or a bool key mask broadcastable to ``(B, 1, 1, Lk)``; ``window`` None or >= 1.
    ``out (B, Hq, Lq, Dv)`` and ``lse (B, Hq, Lq)`` (natural log) in float32 (float64 for
    float64 inputs); a row with no allowed key gives zeros and ``lse = +inf``.

    ``backward(q, k, v, mask, out, lse, grad_out, causal, window, offset, scale) ->
    (dq, dk, dv)``: this block's share of the gradients, given the row's ``out`` and
    ``lse`` merged over every block it attends (FlashAttention-2's backward reads only
    those), in float32 (float64).
    """

    forward: Callable
    backward: Callable


@dataclass(frozen=True)
class Backend:
    """One backend and its capabilities.

    ``run(q, k, v, mask, causal, window, scale, dropout_p, rows) -> (out, weights)``
    takes 4-D inputs after ``attention``'s checks (``weights`` None unless ``rows``).
    Capabilities: ``masks`` (bool and additive), ``mask_gradients`` (differentiates an
    additive mask that requires grad), ``windows``, ``dropout``, ``weights``
    (``return_weights``), ``gradients`` (of q, k, v), ``devices`` and ``dtypes``
    (None: any device, every floating dtype), ``decode`` (a fused one-token step with a
    cache, as :func:`attnlab._decode.step` takes it; None where there is none), ``block``
    (a :class:`BlockStep`, reported as ``blocks``; None where there is none).
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
    devices: tuple[str, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    decode: Callable | None = None
    block: BlockStep | None = None
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
        skip = {"name", "run", "decode", "block", "unavailable", "pays", "label", "no_weights",
                "instead"}
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        out["decoding"] = self.decoding
        out["blocks"] = self.block is not None
        return out

    def supports(self, request: Request) -> str | None:
        """Why this backend cannot take ``request``, as the ValueError names it, or None."""
        q, name = request.q, self.name
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
        if not self.gradients and torch.is_grad_enabled() and (q.requires_grad
                                                               or request.k.requires_grad):
            return f"backend={name!r} does not differentiate q, k, v; use backend='auto'"
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


# The block steps auto prefers, best first: the native kernel, then torch's fused kernel,
# then the textbook path (tiled, the readable statement of the same algorithm in Python
# loops, only when named).
_BLOCK_ORDER = ("flash", "sdpa", "eager")


def choose_block(q: torch.Tensor, k: torch.Tensor, window: int | None,
                 backend: str = "auto") -> Backend:
    """The backend whose :class:`BlockStep` runs the local step of a split attention on
    ``q``/``k`` (a bool key mask is taken by every block step); ``"auto"``: the first of
    flash, sdpa, eager that supports the call. ValueError for a named backend that has no
    block step or cannot take the call, saying why."""
    request = Request(q, k, None, False, window, 0.0, None)
    if backend != "auto":
        chosen = TABLE.get(backend)
        if chosen is None or chosen.block is None:
            names = [b.name for b in TABLE.values() if b.block is not None]
            raise ValueError(f"backend must be 'auto' or one with a block step {names}, "
                             f"got {backend!r}")
        why = chosen.supports(request)
        if why is not None:
            raise ValueError(why)
        return chosen
    with torch.no_grad():  # the block steps have their own backward
        for name in _BLOCK_ORDER:
            if TABLE[name].supports(request) is None:
                return TABLE[name]
    raise AssertionError("the eager backend takes every call")  # unreachable


# --------------------------------------------------------------------------- runs


def _sdpa(q, k, v, mask, causal, window, scale, dropout_p, rows):
    return sdpa_attention(q, k, v, mask, causal, window, scale, dropout_p), None


def _tiled(q, k, v, mask, causal, window, scale, dropout_p, rows):
    if min(q.numel(), k.numel(), v.numel()) == 0:  # nothing to tile: an empty batch,
        return eager_attention(q, k, v, mask, causal, window, scale, dropout_p, rows)  # head, seq
    out, _ = tiled_attention(q, k, v, mask, causal, window, scale, dropout_p)
    return out, None if rows is None else tiled_weights(q, k, mask, causal, window, scale, rows)


def _flash_run(q, k, v, mask, causal, window, scale, dropout_p, rows):
    out = _flash.flash_attention(q, k, v, mask, causal, window, scale, dropout_p)
    return out, None if rows is None else tiled_weights(q, k, mask, causal, window, scale, rows)


def _flash_decode(qkv, cache, rotary, window, num_heads, num_kv_heads):
    # Looked up at each call: tests count the steps by replacing _decode.step.
    return _decode.step(qkv, cache, rotary, window, num_heads, num_kv_heads)


# --------------------------------------------------------------------------- when auto pays

# tiled: above this many weights per (batch, head) the textbook path's rows x k_len
# matrix stops fitting in cache and the tiled path wins when weights are wanted.
_EAGER_MAX_SCORES = 1024 * 1024
# tiled: a sliding window goes to the tiled path once most of the dense matrix is
# masked out (k_len >= _WINDOW_RATIO * window) and the sequence is long enough for
# tile skipping to pay for its Python loop.
_WINDOW_RATIO = 4
_WINDOW_MIN_LEN = 2048
# flash: from this many queries (fewer when training: torch's backward is slow on
# short rows). With its AVX-512 tile products it beats SDPA on every row (bench grid:
# 0.55-0.6x dense, 0.45x causal); with BLAS tiles only where a causal or window rule
# leaves work to skip, and dense rows stay with SDPA, which matches it there.
# Measured crossovers, B=1-8, 12 heads, head_dim 64.
_FLASH_MIN_LEN = {"tiles": 64, "blas": 128}
_FLASH_MIN_LEN_TRAINING = 32


def _tiled_pays(r: Request) -> bool:
    k_len = r.k.shape[-2]
    if r.rows is not None:
        return len(r.rows) * k_len > _EAGER_MAX_SCORES
    return (r.window is not None and r.q.shape[-2] > 1 and k_len >= _WINDOW_MIN_LEN
            and k_len >= _WINDOW_RATIO * r.window)


def _flash_pays(r: Request) -> bool:
    """CPU float32 without weights, long enough; with BLAS tiles only a causal or
    window rule to skip by. (Its weights come from the tiled path's rows: auto leaves
    them to ``eager`` or ``tiled``.)"""
    q = r.q
    if r.rows is not None or q.device.type != "cpu" or q.dtype != torch.float32:
        return False
    tiles = _flash.tile_kernel()
    if not tiles and not r.causal and r.window is None:
        return False
    training = torch.is_grad_enabled() and (q.requires_grad or r.k.requires_grad)
    least = _FLASH_MIN_LEN_TRAINING if training else _FLASH_MIN_LEN["tiles" if tiles else "blas"]
    return q.shape[-2] >= least


# In the order of attnlab.BACKENDS; auto reads it backwards (see choose).
TABLE: dict[str, Backend] = {b.name: b for b in (
    Backend("eager", eager_attention,
            block=BlockStep(eager_block_forward, eager_block_backward)),
    Backend("sdpa", _sdpa, weights=False,
            block=BlockStep(sdpa_block_forward, sdpa_block_backward),
            no_weights="torch's fused kernel never forms them",
            instead="use backend='auto', 'eager' or 'tiled'"),
    Backend("tiled", _tiled, mask_gradients=False, pays=_tiled_pays,
            block=BlockStep(tiled_block_forward, tiled_block_backward)),
    Backend("flash", _flash_run, mask_gradients=False, devices=("cpu",),
            decode=_flash_decode, unavailable=_flash.unavailable, pays=_flash_pays,
            block=BlockStep(_flash.block_forward, _flash.block_backward),
            label=" (the native kernel)",
            instead="use backend='tiled' (the same algorithm in PyTorch) or 'auto'"),
)}
_AUTO_ORDER = tuple(reversed(TABLE.values()))
