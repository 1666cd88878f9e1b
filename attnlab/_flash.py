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
from . import mask_shift as _shift
from ._tracing import each_mapped_call, first_derivatives_only, transforms_active

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


# Keys up to this many are packed once per (head, worker) and shared by its query
# blocks (csrc/flash_common.h, HeadPack::MAX_KEYS: tests/test_native.py keeps the two
# equal); small query blocks then cost no extra packing.
HEAD_PACK_KEYS = 8192


SHORT_DOCUMENT = 64  # keys: a document this short tiles by 32 rows (see _blocks)


def _blocks(q_len: int, k_len: int, causal: bool, window: int,
            backward: bool = False, documents: float | None = None) -> tuple[int, int]:
    """Tile shape (query rows, keys): large enough to amortise each tile product's
    set-up, small enough that the boundary tiles of a causal or window rule (partly
    wasted) stay small. The backward recomputes its tiles from the log-sum-exp, so it
    may tile otherwise: its five products per tile favoured 128 x 128 at every causal
    length (T=4096, BLAS: 0.86x SDPA against 0.91x; with the tile kernel 64-256 x
    128-256 moved it by under 1%).
    The forward's keys are packed once per head where a worker can hold them
    (HEAD_PACK_KEYS), so its query blocks can be small: causal blocks of 32 rows (their
    half-wasted diagonal tiles shrink) against key tiles of 512, dense ones of 64 x 512.
    On the Zen 4 with the tile kernel, interleaved against SDPA, two threads: causal
    T=256 0.60x -> 0.53x (from 64 x 256), T=512 0.55x -> 0.48x, T=1024 0.76x -> 0.74x,
    T=2048 0.84x -> 0.81x, T=4096 0.89x -> 0.87x, T=8192 0.92x -> 0.90x (from 128 x 512);
    dense T=1024 1.01x -> 0.98x, T=2048 1.00x -> 0.96x. Longer rows, and the dense
    backward, keep 128 x 512 (64 x 512 for a short dense row), whose blocks pack their
    own keys. So do ``documents`` (measured when a worker held only a block's own keys,
    before it held them to the head's end: 8 documents in T=8192, 1.39x the time of a
    call per document in blocks of 32, 1.04x in blocks of 128 x 512). ``documents``: the
    mean number of keys a query's document holds, or None. Short documents (packed
    sentences; the forward takes a block's rows a document at a time) take blocks of 32
    rows: 12 heads,
    one thread, the forward, against the blocks above: documents of 14 keys (head_dim 32,
    T=454) 0.82x, of 40 (T=1024) 0.92x, of 64 (T=2048) causal 0.85x, dense 1.02x; of 128,
    no gain. The backward tiles documents of up to 4 * SHORT_DOCUMENT keys by 64 x 64 (at
    most SHORT_DOCUMENT) or 64 x 128, where key tiles of 512 were mostly outside them
    (forward+backward, 12 heads, head_dim 64, against the blocks above: documents of 14
    keys 0.51x dense and 0.73x causal, of 64 keys 0.39x and 0.85x, of 256 keys 0.58x and
    0.98x; of 1024 keys these tiles were 3-10% slower, so the blocks above stay)."""
    ruled = bool(causal or window)
    if 0 < window < k_len // 2:  # a band of about 2W keys per query block
        block_q, block_k = (64, 128) if window <= 512 else (128, 256)
    elif backward and documents is not None and documents <= 4 * SHORT_DOCUMENT:
        block_q, block_k = 64, (64 if documents <= SHORT_DOCUMENT else 128)
    elif backward and ruled:
        block_q, block_k = 128, 128
    elif documents is not None and documents <= SHORT_DOCUMENT:
        block_q, block_k = 32, 512
    elif documents is not None and ruled:  # as before the keys were held: see above
        block_q, block_k = (64, 256) if k_len <= 1024 else (128, 512)
    elif backward or k_len > HEAD_PACK_KEYS:  # key tiles of 512 like torch's kernel
        block_q, block_k = (64 if q_len <= 256 and not ruled else 128), 512
    else:
        block_q, block_k = (32 if ruled else 64), 512
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


def _forward(q, k, v, sinks, mask, causal, window, offset, scale, dropout_p, seed, blocks,
             extras):
    """The kernel's forward: ``(out, lse)``. ``extras``: the variants as the op takes them
    (softcap, alibi, documents, the block mask's three tensors)."""
    softcap, alibi, documents, kinds, index, partial = extras
    sink_logits = None if sinks is None else sinks.detach().to(torch.float64).contiguous()
    return _ops().flash_forward(q, k, v, mask, causal, window, offset, scale, dropout_p, seed,
                                *blocks[0], softcap, alibi, sink_logits, documents, kinds,
                                index, partial)


class _FlashAttention(torch.autograd.Function):
    """The kernel's forward and backward; ``setup_context`` apart, so that
    ``torch.func.grad`` (and ``jacrev``) take it."""

    @staticmethod
    def forward(q, k, v, sinks, mask, causal, window, offset, scale, dropout_p, seed,
                blocks, extras):
        """``sinks`` is an input of its own (it has a gradient)."""
        return _forward(_rows(q), _rows(k), _rows(v), sinks, mask, causal, window, offset,
                        scale, dropout_p, seed, blocks, extras)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, sinks, mask, causal, window, offset, scale, dropout_p, seed, blocks, extras = \
            inputs
        out, lse = output
        ctx.settings = (causal, window, offset, scale, dropout_p, seed, blocks[1], extras)
        # (_rows gives the tensor itself unless its layout is one the kernel cannot read)
        ctx.save_for_backward(_rows(q), _rows(k), _rows(v), sinks, mask, out, lse)
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def vmap(info, in_dims, *args):
        """Under ``torch.func.vmap``: each mapped call in turn, stacked, so that a ``grad``
        around the ``vmap`` reaches every one. q, k, v and the mask may be mapped; mapped
        variants' tensors are refused before (the backend table's ``mapped_variants``)."""
        return each_mapped_call(_FlashAttention, info, in_dims, args)

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, sinks, mask, out, lse = ctx.saved_tensors
        causal, window, offset, scale, dropout_p, seed, blocks, extras = ctx.settings
        softcap, alibi, documents, kinds, index, partial = extras
        grad_out = _rows(grad_out)
        sink_logits = None if sinks is None else sinks.detach().to(torch.float64).contiguous()
        dq, dk, dv = _ops().flash_backward(
            q, k, v, mask, out, lse, grad_out, causal, window, offset, scale, dropout_p, seed,
            *blocks, softcap, alibi, sink_logits, documents, kinds, index, partial)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # d sink_h = -sum over rows of P(sink) * D_i, D_i = rowsum(dO_i * O_i): the
            # sink takes weight exp(sink - lse) from every value the row weighs.
            acc = lse.dtype
            delta = (grad_out.to(acc) * out.to(acc)).sum(dim=-1)  # (B, Hq, Lq)
            share = torch.exp(sink_logits.to(acc).view(1, -1, 1) - lse)
            dsinks = -(share * delta).sum(dim=(0, 2)).to(sinks.dtype)
        dq, dk, dv, dsinks = first_derivatives_only("the flash backend", (dq, dk, dv, dsinks),
                                                    q, k, v, sinks, grad_out, out)
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None, None, None


def _block_mask_tensors(block_mask, device):
    """The three tensors of a ``blockmask.BlockMask`` as the kernel reads them: kinds
    (int8), each partial block's row in ``partial`` (int64, -1 elsewhere), the partial
    blocks (bool, contiguous)."""
    return (block_mask.kinds.to(device=device, dtype=torch.int8).contiguous(),
            block_mask.index.to(device=device, dtype=torch.int64).contiguous(),
            block_mask.partial.to(device=device, dtype=torch.bool).contiguous())


def flash_attention(q, k, v, mask, causal, window, scale, dropout_p, offset=None, *,
                    softcap=None, alibi_slopes=None, sinks=None, documents=None,
                    block_mask=None, with_lse=False):
    """Attention on 4-D CPU inputs ``q (B, Hq, Lq, D)``, ``k/v (B, Hkv, Lk, D/Dv)``.

    ``offset`` is query row 0's position among the keys (``masks.KeyRule``; default
    ``Lk - Lq``: the rules aligned to the end).

    ``mask`` is None, bool (True = may attend) or additive (rows already shifted by
    ``attention``), broadcastable to ``(B, Hq, Lq, Lk)``. bf16/fp16 inputs are read as
    they are stored and computed in float32, tile by tile (no float32 copy of them);
    the output and gradients come back in their dtype. Returns ``(B, Hq, Lq, Dv)``.

    The variants, as ``attention`` defines them (None: not asked for): ``softcap``
    (float), ``alibi_slopes`` ``(1 or B, Hq)``, ``sinks`` ``(Hq,)`` (differentiable),
    ``documents`` (a ``masks.Documents``; the rule then places each row at its
    document's end, and ``offset`` must be None), ``block_mask`` (a ``blockmask.BlockMask``:
    the kernel tiles by its blocks, skips the empty ones and masks the partial ones).
    ``with_lse``: return ``(out, lse)``, each row's log-sum-exp ``(B, Hq, Lq)`` in the
    accumulation dtype (no gradient; ``+inf`` for a row with nothing to attend).
    """
    batch, q_heads, q_len, _ = q.shape
    k_len = k.shape[-2]
    if mask is not None:
        if mask.dtype != torch.bool:  # added in the kernel's accumulation type
            mask = mask.to(_shift.additive_dtype(q.dtype))
        # Zero strides where the mask broadcasts: nothing is copied.
        mask = mask.detach().expand(batch, q_heads, q_len, k_len)
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else 0
    offset = k_len - q_len if offset is None else int(offset)
    window = 0 if window is None else window
    blocks, extras = _kernel_args(q, k, causal, window, softcap, alibi_slopes, documents,
                                  block_mask)
    args = (sinks, mask, causal, window, offset, scale, float(dropout_p), seed, blocks, extras)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
            sinks is not None and sinks.requires_grad) or transforms_active()):
        # (under torch.func a batched tensor hides that its grad level wants a gradient)
        out, lse = _FlashAttention.apply(q, k, v, *args)
    else:  # nothing to differentiate: no autograd node (a cold call's set-up shrinks)
        out, lse = _forward(_rows(q), _rows(k), _rows(v), *args)
    return (out, lse) if with_lse else out


def _kernel_args(q, k, causal, window, softcap, alibi_slopes, documents, block_mask):
    """The tile shapes ``(forward, backward)`` and the variants as the op takes them
    (softcap, alibi, documents, the block mask's three tensors)."""
    q_len, k_len, q_heads = q.shape[2], k.shape[2], q.shape[1]
    if block_mask is not None:  # the kernel's tiles are the mask's blocks
        blocks = ((block_mask.block_q, block_mask.block_k),) * 2
        kinds, index, partial = _block_mask_tensors(block_mask, q.device)
    else:
        span = None if documents is None else float((documents.ends - documents.starts)
                                                    .to(torch.float32).mean())
        blocks = (_blocks(q_len, k_len, causal, window, documents=span),
                  _blocks(q_len, k_len, causal, window, backward=True, documents=span))
        kinds = index = partial = None
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.detach().to(torch.float64).reshape(-1, q_heads).contiguous()
    if documents is not None:
        documents = torch.stack([documents.starts, documents.ends,
                                 documents.offsets]).to(device=q.device, dtype=torch.int64)
    return blocks, (0.0 if softcap is None else float(softcap), alibi_slopes, documents, kinds,
                    index, partial)


def _work(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the kernel's dtype: float64 stays, everything else is float32."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def flash_lse_backward(q, k, v, mask, out, lse, grad_out, causal, window, scale, offset=None, *,
                       softcap=None, alibi_slopes=None, documents=None, block_mask=None):
    """One block of keys' share of ``(dq, dk, dv)`` given each row's ``out`` and ``lse``
    merged over every block it attends (the kernel's backward reads nothing else), query
    row ``i`` at position ``i + offset`` among the keys; float32 (float64 kept). ``mask``
    None or bool, broadcastable to ``(B, Hq, Lq, Lk)``; the variants as
    :func:`flash_attention` takes them (a sink is already in ``lse``)."""
    q, k, v, out, grad_out = (_rows(_work(t)) for t in (q, k, v, out, grad_out))
    lse = _work(lse).contiguous()
    if mask is not None:
        mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    offset = k.shape[2] - q.shape[2] if offset is None else int(offset)
    window = 0 if window is None else window
    blocks, extras = _kernel_args(q, k, causal, window, softcap, alibi_slopes, documents,
                                  block_mask)
    softcap, alibi, documents, kinds, index, partial = extras
    return _ops().flash_backward(q, k, v, mask, out, lse, grad_out, causal, window, offset,
                                 scale, 0.0, 0, *blocks[1], softcap, alibi, None, documents,
                                 kinds, index, partial)
