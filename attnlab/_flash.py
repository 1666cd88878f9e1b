"""The ``flash`` backend of :func:`attnlab.attention`: the native kernel (``csrc/``) for CPU.

Part of ``functional.py`` in all but file: only ``functional.attention`` calls it.
It is the algorithm of ``_tiled.py`` (FlashAttention-2: online softmax forward that
keeps the log-sum-exp, backward that recomputes the weights from it) in C++,
doing only the work the causal and window rules allow. Weights, when asked for,
come from :func:`attnlab._tiled.tiled_weights` (the kernel never forms them).

NaN is never hidden: a row whose allowed scores hold a NaN comes out NaN (the
kernel's row max skips NaN, so it checks for one where the max stays -inf), as on
the other backends; a row the mask and rules empty gives zeros (README, "NaN in").
"""

from __future__ import annotations

import torch

from . import _native
from . import masks as _masks

# Query rows x keys per tile; None picks by length (_blocks). Tests set tiny ones.
BLOCK_Q: int | None = None
BLOCK_K: int | None = None


def unavailable(q: torch.Tensor) -> str | None:
    """Why ``backend="flash"`` cannot take ``q`` here, or None when it can."""
    if q.device.type != "cpu":
        return f"it runs on CPU tensors only, got a tensor on {q.device}"
    if q.shape[-1] == 0:
        return "head_dim is 0"
    return _native.unavailable_reason()


# A property of the CPU and the build: under torch.compile, run (not traced) and kept.
@_native.constant_under_compile
def tile_kernel() -> bool:
    """Whether the kernel multiplies float32 tiles with its AVX-512 routine (the CPU has
    it) rather than the BLAS torch links. False where the kernel is not available."""
    global _tiles
    ops = _native.load()
    if ops is None:
        return False
    if _tiles is None:  # a property of the CPU: asked once
        _tiles = bool(ops.tile_kernel_active())
    return _tiles


_tiles: bool | None = None


def _blocks(q_len: int, k_len: int, causal: bool, window: int,
            backward: bool = False) -> tuple[int, int]:
    """Tile shape (query rows, keys): large enough to amortise each tile product's
    set-up (BLAS packs both operands; the AVX-512 tile kernel only K^T and V^T, once);
    where a causal or window rule cuts rows short, small enough that the boundary
    tiles (partly wasted) stay small. Chosen on the bench grid (two cores) with BLAS
    tiles; with the tile kernel a sweep of 64-256 x 64-512 moved the times by under 5%
    (T=256-4096), so they stay. The backward recomputes its tiles from the
    log-sum-exp, so it may tile otherwise: its five products per tile favoured
    128 x 128 at every causal length (T=4096, BLAS: 0.86x SDPA against 0.91x)."""
    if 0 < window < k_len // 2:  # a band of about 2W keys per query block
        block_q, block_k = (64, 128) if window <= 512 else (128, 256)
    elif causal or window:
        block_q, block_k = (128, 128) if k_len <= 1024 or backward else (256, 256)
    else:  # dense rows: key tiles of 512 like torch's kernel, fewer rescales
        block_q, block_k = (64 if q_len <= 256 else 128), 512
    return BLOCK_Q or block_q, BLOCK_K or block_k


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when the kernel can read its rows in place (unit stride within a row,
    rows at least a row apart, as BLAS wants), else a copy in the standard layout.

    Not ``t.contiguous()``: a dimension of size 0 or 1 may carry any stride and still
    count as contiguous (``randn(1, 2, 1, 70).transpose(-1, -2)`` has a last stride
    of 70), so ``contiguous()`` would hand the same layout back. One copy costs a pass
    over the input, little beside the attention itself."""
    if t.stride(-1) == 1 and (t.shape[-2] <= 1 or t.stride(-2) >= t.shape[-1]):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _ops():
    """``torch.ops.attnlab_native``, loaded (``unavailable`` said so before any call here).
    Read from torch.ops rather than ``_native.load()``, whose lock and environment
    lookups torch.compile cannot trace."""
    return getattr(torch.ops, _native.LIBRARY)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, window, offset, scale, dropout_p, seed):
        ops = _ops()
        q, k, v = _rows(q), _rows(k), _rows(v)
        blocks = _blocks(q.shape[2], k.shape[2], causal, window)
        out, lse = ops.flash_forward(q, k, v, mask, causal, window, offset, scale, dropout_p,
                                     seed, *blocks)
        ctx.settings = (causal, window, offset, scale, dropout_p, seed,
                        _blocks(q.shape[2], k.shape[2], causal, window, backward=True))
        ctx.save_for_backward(q, k, v, mask, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, out, lse = ctx.saved_tensors
        causal, window, offset, scale, dropout_p, seed, blocks = ctx.settings
        dq, dk, dv = _ops().flash_backward(
            q, k, v, mask, out, lse, _rows(grad_out), causal, window, offset, scale, dropout_p,
            seed, *blocks)
        return dq, dk, dv, None, None, None, None, None, None, None


def flash_attention(q, k, v, mask, causal, window, scale, dropout_p, offset=None):
    """Attention on 4-D CPU inputs ``q (B, Hq, Lq, D)``, ``k/v (B, Hkv, Lk, D/Dv)``.

    ``offset`` is query row 0's position among the keys (``masks.KeyRule``; default
    ``Lk - Lq``: the rules aligned to the end).

    ``mask`` is None, bool (True = may attend) or additive (rows already shifted by
    ``attention``), broadcastable to ``(B, Hq, Lq, Lk)``. bf16/fp16 inputs are read as
    they are stored and computed in float32, tile by tile (no float32 copy of them);
    the output and gradients come back in their dtype. Returns ``(B, Hq, Lq, Dv)``.
    """
    batch, q_heads, q_len, _ = q.shape
    if mask is not None:
        if mask.dtype != torch.bool:  # added in the kernel's accumulation type
            mask = mask.to(_masks.additive_dtype(q.dtype))
        # Zero strides where the mask broadcasts: nothing is copied.
        mask = mask.detach().expand(batch, q_heads, q_len, k.shape[-2])
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else 0
    offset = k.shape[-2] - q_len if offset is None else int(offset)
    out = _FlashAttention.apply(q, k, v, mask, causal, 0 if window is None else window,
                                offset, scale, float(dropout_p), seed)
    return out


# --------------------------------------------------------------------------- block step


def _work(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the kernel's dtype: float64 stays, everything else is float32."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def block_forward(q, k, v, mask, causal, window, offset, scale):
    """One block of queries against one block of keys, query row ``i`` at position
    ``i + offset`` among them (``masks.KeyRule``): ``(out, lse)``, ``lse (B, Hq, Lq)``
    (``+inf`` for a row with no allowed key, whose ``out`` is zeros), computed in float32
    (float64 kept; ``backends.BlockStep`` has the contract); ``mask`` None or bool,
    broadcastable to ``(B, Hq, Lq, Lk)``."""
    q, k, v = _rows(_work(q)), _rows(_work(k)), _rows(_work(v))
    if mask is not None:
        mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    window = 0 if window is None else window
    return _ops().flash_forward(q, k, v, mask, causal, window, offset, scale, 0.0, 0,
                                *_blocks(q.shape[2], k.shape[2], causal, window))


def block_backward(q, k, v, mask, out, lse, grad_out, causal, window, offset, scale):
    """The block's share of ``(dq, dk, dv)`` given the row's merged ``out`` and ``lse``
    over every block it attends (the kernel's backward reads nothing else)."""
    q, k, v, out, grad_out = (_rows(_work(t)) for t in (q, k, v, out, grad_out))
    lse = _work(lse)
    if mask is not None:
        mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    window = 0 if window is None else window
    return _ops().flash_backward(q, k, v, mask, out, lse.contiguous(), grad_out,
                                 causal, window, offset, scale, 0.0, 0,
                                 *_blocks(q.shape[2], k.shape[2], causal, window, backward=True))
