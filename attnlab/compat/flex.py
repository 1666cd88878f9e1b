"""FlexAttention's ``flex_attention`` and ``create_block_mask`` (``torch.nn.attention.
flex_attention``'s signatures) on :func:`attnlab.attention`, forward and backward on any
device (torch's own runs on the CPU forward only, compiled per mask).

- ``flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
  enable_gqa=False, return_lse=False, kernel_options=None, *, return_aux=None)``:
  ``(B, H, L, E)`` inputs;
  ``score_mod(score, b, h, q_idx, kv_idx)`` on the scaled score and the block mask's
  ``mask_mod`` are attnlab's, called vectorised (``attnlab.blockmask``): write them with
  tensor operations, as FlexAttention's examples are (a score_mod's result broadcasts to
  the score's shape). A key and value of batch one serve every query batch, as in torch.
  ``block_mask`` is one from :func:`create_block_mask` or torch's own ``BlockMask``, read
  as torch's compiled kernel (what GPU code runs) reads it: the blocks it lists, whole
  where it lists them full, its ``mask_mod`` evaluated again on the others
  (``BlockMask.from_kv_blocks`` too), at the call's every ``b`` and ``h`` (also where it
  was made with ``B`` or ``H`` None), and again once a tensor it reads has changed (as for
  attnlab's own: ``attnlab.blockmask``). A row
  that may attend nothing gives zeros and, with ``return_lse``, an lse of ``-inf``
  (FlexAttention's). ``kernel_options`` are accepted and ignored.
- ``and_masks``, ``or_masks``, ``noop_mask``: torch's own (they broadcast as attnlab calls
  a mask_mod), so that their import can be swapped too.
- ``create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=128)``:
  a :class:`FlexBlockMask`, attnlab's block mask evaluated at once (so that a faulty
  mask_mod fails here, as torch's does) and again at each call where torch's kernels
  would ask the function something new: at the call's ``b`` and ``h`` where ``B``/``H``
  is None, and once a tensor it reads is bound again or changed in place; from a cache
  per (function, the tensors and values it reads, shape, device, block size) otherwise.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention.flex_attention import and_masks, noop_mask, or_masks

from .._tracing import reads_values
from ..blockmask import BLOCK_SIZE, EMPTY, BlockMask, block_mask, reads
from ..checks import boolean, positive_int
from ..functional import attention, attention_with_lse

__all__ = ["flex_attention", "create_block_mask", "and_masks", "or_masks", "noop_mask"]


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=BLOCK_SIZE,
                      _compile=False, separate_full_blocks=True, compute_dq_write_order=False,
                      dq_kv_order=True):
    """FlexAttention's ``create_block_mask``: ``mask_mod`` evaluated into a block mask of
    ``(B or 1, H or 1, Q_LEN, KV_LEN)`` in blocks of ``BLOCK_SIZE`` (an int, or a pair
    (query rows, keys)). ``_compile``, ``separate_full_blocks``, ``compute_dq_write_order``
    and ``dq_kv_order`` are torch's kernel settings: accepted, and they change no number."""
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be a function (b, h, q_idx, kv_idx) -> bool tensor, "
                        f"got {type(mask_mod).__name__}")
    B = None if B is None else positive_int("B", B)
    H = None if H is None else positive_int("H", H)
    if isinstance(BLOCK_SIZE, tuple | list) and len(BLOCK_SIZE) == 2:
        block_q, block_k = (positive_int("BLOCK_SIZE", x) for x in BLOCK_SIZE)
    else:
        block_q = block_k = positive_int("BLOCK_SIZE", BLOCK_SIZE)
    built = block_mask(mask_mod, B or 1, H or 1, positive_int("Q_LEN", Q_LEN),
                       positive_int("KV_LEN", KV_LEN), block_q=block_q, block_k=block_k,
                       device=device)
    made = built.__dict__.setdefault("_flex", {})  # the same mask, the same object
    if (B, H) not in made:
        made[B, H] = FlexBlockMask(built, B, H)
    return made[B, H]


class FlexBlockMask(BlockMask):
    """:func:`create_block_mask`'s result: attnlab's block mask as it was evaluated, which
    a call evaluates again as torch's kernels do, at the call's every ``b`` and ``h`` where
    ``B`` or ``H`` was None, and again once a tensor the mask_mod reads has changed (from
    :func:`attnlab.blockmask.block_mask`'s cache while nothing has). Torch's ``shape``,
    ``BLOCK_SIZE``, ``mask_mod``, ``to``, ``sparsity`` and ``to_dense``; not its indexing.
    Under ``torch.compile`` a call reads it as it was made (at ``b``/``h`` 0 where ``B``/``H``
    was None): make it with the call's ``B`` and ``H`` there if the mask_mod reads them."""

    def __init__(self, built: BlockMask, B: int | None, H: int | None):
        self.__dict__.update({k: v for k, v in built.__dict__.items() if k != "_flex"})
        self._request = (B, H)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        B, H = self._request
        return (B or 1, H or 1, self.q_len, self.k_len)

    @property
    def BLOCK_SIZE(self) -> tuple[int, int]:  # noqa: N802 - torch's name
        return (self.block_q, self.block_k)

    def for_call(self, batch: int, heads: int) -> BlockMask:
        if not reads_values():  # a torch.compile trace: as made (no evaluation in a graph)
            return self
        B, H = self._request
        return block_mask(self.mask_mod, B or batch, H or heads, self.q_len, self.k_len,
                          block_q=self.block_q, block_k=self.block_k, device=self.device)

    def to(self, device) -> FlexBlockMask:
        """The same mask on ``device``."""
        return create_block_mask(self.mask_mod, *self._request, self.q_len, self.k_len,
                                 device=device, BLOCK_SIZE=self.BLOCK_SIZE)

    def to_dense(self) -> torch.Tensor:
        """``(B, H, nq, nk)`` int32: 1 where a block is computed (torch's)."""
        return (self.kinds != EMPTY).to(torch.int32).expand(*self.shape[:2], *self.kinds.shape[2:])

    def sparsity(self) -> float:
        """The percentage of the mask's area not computed, counted in whole blocks as torch
        counts it (a block past the ends counts whole)."""
        area = self.shape[0] * self.shape[1] * self.q_len * self.k_len
        return 100.0 * (1.0 - int(self.to_dense().sum()) * self.block_q * self.block_k / area)


# The attribute of a torch BlockMask that keeps attnlab's evaluation of it: (what its
# mask_mod reads, the call's batch and heads, device), the BlockMask, and the objects the key
# names. On the object itself, not in a table: a mask_mod that reads the module owning the
# mask (``self.docs``) then makes a cycle the collector frees, not an entry held forever.
_EVALUATED = "_attnlab_evaluated"


def _listed(num, indices, nk: int) -> torch.Tensor:
    """The blocks a torch BlockMask lists (``num`` (B, H, nq) of ``indices`` (B, H, nq, n)
    valid) as a bool ``(B, H, nq, nk)``."""
    valid = torch.arange(indices.shape[-1], device=indices.device) < num[..., None]
    out = torch.zeros(*num.shape, nk + 1, dtype=torch.bool, device=indices.device)
    out.scatter_(-1, torch.where(valid, indices.long(), nk), True)
    return out[..., :nk]


def _from_torch(torch_mask, mod, shape, sizes, device, batch, heads) -> BlockMask:
    """A torch BlockMask as its compiled kernel reads it: blocks it does not list are empty,
    its full blocks are whole (the mask_mod is not asked there), its partial blocks are the
    mask_mod's at each (b, h) of the call, ``batch`` x ``heads`` (torch's kernels ask it
    with the real b and h, also where the mask was made with B or H None; torch's eager
    path asks the mask_mod everywhere; from_kv_blocks masks carry noop_mask, so only the
    blocks say anything)."""
    q_len, k_len = (int(x) for x in shape[2:])
    evaluated = block_mask(mod, batch, heads, q_len, k_len, block_q=int(sizes[0]),
                           block_k=int(sizes[1]), device=device).dense()
    nk = -(-k_len // int(sizes[1]))

    def expand(blocks):  # (B, H, nq, nk) -> (B, H, q_len, k_len)
        rows = blocks.repeat_interleave(int(sizes[0]), 2)[:, :, :q_len]
        return rows.repeat_interleave(int(sizes[1]), 3)[..., :k_len].to(device)

    allowed = expand(_listed(torch_mask.kv_num_blocks, torch_mask.kv_indices, nk)) & evaluated
    if torch_mask.full_kv_num_blocks is not None:
        allowed = allowed | expand(_listed(torch_mask.full_kv_num_blocks,
                                           torch_mask.full_kv_indices, nk))

    one_b, one_h = allowed.shape[0] == 1, allowed.shape[1] == 1

    def by_blocks(b, h, q_idx, kv_idx):  # a mask of one b or h keeps it: stored once
        return allowed[b[:1] * 0 if one_b else b, h[:, :1] * 0 if one_h else h, q_idx, kv_idx]
    return block_mask(by_blocks, batch, heads, q_len, k_len, block_q=int(sizes[0]),
                      block_k=int(sizes[1]), device=device, cache=False)


def _as_block_mask(block_mask_, query, key) -> BlockMask | None:
    if block_mask_ is None or isinstance(block_mask_, BlockMask):
        return block_mask_
    mod = getattr(block_mask_, "mask_mod", None)
    shape = getattr(block_mask_, "shape", None)
    if mod is None or shape is None or len(shape) != 4:
        raise TypeError("block_mask must come from create_block_mask (attnlab.compat's or "
                        f"torch's), got {type(block_mask_).__name__}")
    if tuple(shape[-2:]) != (query.shape[-2], key.shape[-2]):
        raise ValueError(f"block_mask is for (Q_LEN, KV_LEN) = {tuple(shape[-2:])}, but the "
                         f"inputs have {(query.shape[-2], key.shape[-2])}")
    sizes = getattr(block_mask_, "BLOCK_SIZE", (BLOCK_SIZE, BLOCK_SIZE))
    if getattr(block_mask_, "kv_num_blocks", None) is None:
        return block_mask(mod, int(shape[0]), int(shape[1]), int(shape[2]), int(shape[3]),
                          block_q=int(sizes[0]), block_k=int(sizes[1]), device=query.device)
    # Evaluated again where torch's kernel would ask the mask_mod something new: at the
    # call's batch and heads where the mask has one of them, and once a tensor it reads has
    # changed (in place, or bound again).
    batch = query.shape[0] if int(shape[0]) == 1 else int(shape[0])
    heads = query.shape[1] if int(shape[1]) == 1 else int(shape[1])
    held: list = []
    seen = (reads(mod, held), batch, heads, str(query.device))
    entry = getattr(block_mask_, _EVALUATED, None)
    if entry is not None and entry[0] == seen:
        return entry[1]
    found = _from_torch(block_mask_, mod, shape, sizes, query.device, batch, heads)
    with contextlib.suppress(AttributeError):  # (one that takes none: evaluated each call)
        setattr(block_mask_, _EVALUATED, (seen, found, held))
    return found


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                   enable_gqa=False, return_lse=False, kernel_options=None, *,
                   return_aux=None):
    """FlexAttention's ``flex_attention`` (module docstring): ``(B, Hq, L, E)`` query,
    ``(B, Hkv, S, E)`` key, ``(B, Hkv, S, Ev)`` value; returns ``(B, Hq, L, Ev)``, or
    ``(out, lse)`` with ``lse`` ``(B, Hq, L)`` float32 (float64 for float64 inputs, as
    torch's, and differentiable as torch's: see ``attention_with_lse``) (``return_lse``,
    which FlexAttention now calls deprecated), or ``(out, AuxOutput)`` for
    ``return_aux=AuxRequest(lse=True)`` (torch's classes; ``max_scores`` is not computed
    here and is refused)."""
    if return_aux is not None:
        if return_lse:
            raise ValueError("give return_lse or return_aux, not both (as FlexAttention)")
        if getattr(return_aux, "max_scores", False):
            raise ValueError("return_aux asks for max_scores, which attnlab's flex_attention "
                             "does not compute; ask for lse only (AuxRequest(lse=True))")
        from torch.nn.attention.flex_attention import AuxOutput

        if not getattr(return_aux, "lse", False):
            return flex_attention(query, key, value, score_mod, block_mask, scale,
                                  enable_gqa, False, kernel_options), AuxOutput()
        out, lse = flex_attention(query, key, value, score_mod, block_mask, scale,
                                  enable_gqa, True, kernel_options)
        return out, AuxOutput(lse=lse)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, H, seq, dim), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else t!r}")
    boolean("enable_gqa", enable_gqa)
    boolean("return_lse", return_lse)
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}; "
                         "grouped-query attention needs enable_gqa=True (as FlexAttention)")
    if key.shape[0] == 1 and value.shape[0] == 1 and query.shape[0] > 1:
        # one key/value batch for every query batch, as FlexAttention broadcasts it
        key, value = (t.expand(query.shape[0], *t.shape[1:]) for t in (key, value))
    mask = _as_block_mask(block_mask, query, key)
    if isinstance(mask, BlockMask):  # named as the caller passed it
        shown, mask = mask.shape, mask.for_call(query.shape[0], query.shape[1])
        wanted = (query.shape[0], query.shape[1], query.shape[-2], key.shape[-2])
        if not mask.fits(*wanted):
            raise ValueError(f"block_mask is for (B, H, Q_LEN, KV_LEN) = {shown}, but the "
                             f"inputs have {wanted}")
    kw = dict(scale=scale, score_mod=score_mod, mask_mod=mask)
    if not return_lse:
        return attention(query, key, value, **kw)
    out, lse = attention_with_lse(query, key, value, **kw)
    return out, lse.masked_fill(lse == float("inf"), float("-inf"))
