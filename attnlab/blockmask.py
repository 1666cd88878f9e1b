"""A ``mask_mod`` evaluated once into blocks: FlexAttention's block mask, for attnlab.

``mask_mod(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's signature) says whether query
``q_idx`` of head ``h`` in batch element ``b`` may attend key ``kv_idx``. attnlab calls it
**vectorised**: once per block of ``block_q`` query rows, with broadcast index tensors
``b (B, 1, 1, 1)``, ``h (1, H, 1, 1)``, ``q_idx (1, 1, n, 1)``, ``kv_idx (1, 1, 1, k_len)``
(long), and it must return a bool tensor that broadcasts to ``(B, H, n, k_len)``. So the
function must be written with tensor operations (``&``, ``|``, ``torch.where``, indexing a
tensor by the indices), not Python ``if``/``and`` on them; FlexAttention's own mask_mods
are written that way. Indices are the raw row and key numbers (not end-aligned).

:class:`BlockMask` keeps, per tile of ``block_q x block_k`` (query rows x keys) and per
``(b, h)`` it depends on, whether the tile is **empty** (nothing allowed: kernels skip it),
**full** (everything allowed: no mask to apply) or **partial** (its bool tile is kept).
Memory is the partial tiles only: a causal-like or prefix-LM mask keeps O(seq x block).
:func:`block_mask` caches what it builds per (function, what it reads, shape, device, block
sizes), at most :data:`CACHE_SIZE` of them. What a function reads is what its default
arguments, its closure and the globals its code names hold (its comprehensions' and
generator expressions' too, and those of the functions among them, as ``and_masks`` holds
its parts), each tensor by identity and version: so a
document-id tensor bound again to the same global name, or changed in place, is a new
mask, as FlexAttention's ``create_block_mask`` evaluates the function on every call. A
bound method counts as its object and function. Not seen: a Python list or dict (or a
NumPy array) the function reads changed in place, a tensor written without a version
bump (through ``.data``, or through a NumPy array that shares its memory), and what it
reaches through an attribute (``self.ids``) or a callable object's state: bind a new one,
or pass ``cache=False``. (A ``functools.partial`` counts as its function and the values it
binds.)
"""

from __future__ import annotations

import functools
import types
from collections import OrderedDict
from collections.abc import Callable

import torch

from ._tracing import reads_values

__all__ = ["BlockMask", "block_mask", "evaluate_mod", "mod_name", "reads", "CACHE_SIZE",
           "BLOCK_SIZE"]

EMPTY, PARTIAL, FULL = 0, 1, 2
BLOCK_SIZE = 128  # FlexAttention's default
CACHE_SIZE = 32
_CACHE: OrderedDict = OrderedDict()


def mod_name(fn) -> str:
    """How errors name the user's function."""
    return getattr(fn, "__name__", None) or repr(fn)


def evaluate_mod(kind: str, fn: Callable, *args):
    """Call the user's ``mask_mod`` or ``score_mod`` (``kind``); an exception it raises
    becomes one ValueError naming the function and the exception."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - any error of the user's function
        raise ValueError(f"{kind} {mod_name(fn)!r} raised {type(exc).__name__}: {exc} (it is "
                         "called once with broadcast index tensors, so it must be "
                         "vectorisable: see attnlab.blockmask)") from exc


class BlockMask:
    """A mask of ``(batch, heads, q_len, k_len)`` (``batch``/``heads`` 1 where the
    mask_mod does not depend on them) kept per tile: see the module's docstring.

    ``kinds`` is ``(batch, heads, nq, nk)`` int8 (EMPTY, PARTIAL, FULL); ``partial``
    ``(P, block_q, block_k)`` bool holds the partial tiles (padded past the ends),
    ``index`` ``(batch, heads, nq, nk)`` their row in it (-1 elsewhere).
    """

    def __init__(self, kinds, partial, index, *, q_len: int, k_len: int, block_q: int,
                 block_k: int, mask_mod: Callable | None = None):
        self.kinds, self.partial, self.index = kinds, partial, index
        self.q_len, self.k_len = q_len, k_len
        self.block_q, self.block_k = block_q, block_k
        self.mask_mod = mask_mod
        # Over every (b, h): whether a tile has anything allowed / everything allowed.
        self._live = (kinds != EMPTY).flatten(0, 1).any(dim=0).cpu().numpy()
        self._full = (kinds == FULL).flatten(0, 1).all(dim=0).cpu().numpy()
        self._kinds, self._index = kinds.cpu().numpy(), index.cpu().numpy()

    @property
    def batch(self) -> int:
        return self.kinds.shape[0]

    @property
    def heads(self) -> int:
        return self.kinds.shape[1]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.q_len, self.k_len)

    @property
    def device(self) -> torch.device:
        return self.kinds.device

    def __repr__(self) -> str:
        counts = [int((self.kinds == kind).sum()) for kind in (EMPTY, PARTIAL, FULL)]
        return (f"BlockMask(shape={self.shape}, block=({self.block_q}, {self.block_k}), "
                f"tiles empty/partial/full={counts[0]}/{counts[1]}/{counts[2]}, "
                f"mask_mod={mod_name(self.mask_mod) if self.mask_mod else None})")

    def fits(self, batch: int, heads: int, q_len: int, k_len: int) -> bool:
        """Whether this mask serves a call of ``batch`` x ``heads`` queries ``q_len`` by keys
        ``k_len`` (a batch or head dimension of one serves them all)."""
        return (self.batch in (1, batch) and self.heads in (1, heads)
                and (self.q_len, self.k_len) == (q_len, k_len))

    def for_call(self, batch: int, heads: int) -> BlockMask:
        """The block mask a call of ``batch`` x ``heads`` uses: this one (a FlexAttention
        mask of ``attnlab.compat`` evaluates its function again there, as torch's does)."""
        return self

    def live_share(self) -> float:
        """The share of the tiles (over every (b, h)) with anything allowed."""
        return float((self.kinds != EMPTY).float().mean()) if self.kinds.numel() else 0.0

    def _span(self, q0: int, q1: int, k0: int, k1: int) -> tuple[slice, slice]:
        return (slice(q0 // self.block_q, (q1 - 1) // self.block_q + 1),
                slice(k0 // self.block_k, (k1 - 1) // self.block_k + 1))

    def kind(self, q0: int, q1: int, k0: int, k1: int) -> int:
        """EMPTY, FULL or PARTIAL for the queries ``[q0, q1)`` and keys ``[k0, k1)`` over
        every (b, h): any tile, aligned to the blocks or not."""
        if q1 <= q0 or k1 <= k0:
            return EMPTY
        if not reads_values():  # a trace: no branch on the kinds' values, every tile masked
            return PARTIAL
        rows, cols = self._span(q0, q1, k0, k1)
        if not self._live[rows, cols].any():
            return EMPTY
        return FULL if self._full[rows, cols].all() else PARTIAL

    def _block(self, bi: int, bj: int) -> torch.Tensor:
        """Block ``(bi, bj)`` as a bool ``(batch, heads, block_q, block_k)`` tile (a view
        of the stored tile where one (b, h) stands for all)."""
        shape = (self.batch, self.heads, self.block_q, self.block_k)
        if self.batch * self.heads == 1:
            kind, idx = int(self._kinds[0, 0, bi, bj]), int(self._index[0, 0, bi, bj])
            if kind == PARTIAL:
                return self.partial[idx].view(shape)
            return torch.full((1, 1, 1, 1), kind == FULL, device=self.device).expand(shape)
        idx = self.index[:, :, bi, bj]
        full = (self.kinds[:, :, bi, bj] == FULL)[..., None, None]
        if not len(self.partial):
            return full.expand(shape)
        return torch.where((idx >= 0)[..., None, None], self.partial[idx.clamp(min=0)], full)

    def tile(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """The bool mask ``(batch, heads, q1 - q0, k1 - k0)`` of queries ``[q0, q1)`` and
        keys ``[k0, k1)``, put together from the blocks it covers."""
        if not reads_values():  # a trace: no loop over the blocks the values name
            return self.dense()[:, :, q0:q1, k0:k1]
        out = torch.zeros(self.batch, self.heads, q1 - q0, k1 - k0, dtype=torch.bool,
                          device=self.device)
        rows, cols = self._span(q0, q1, k0, k1) if q1 > q0 and k1 > k0 else (
            slice(0, 0), slice(0, 0))
        for bi in range(rows.start, rows.stop):
            r0, r1 = max(q0, bi * self.block_q), min(q1, (bi + 1) * self.block_q)
            for bj in range(cols.start, cols.stop):
                c0, c1 = max(k0, bj * self.block_k), min(k1, (bj + 1) * self.block_k)
                if not self._live[bi, bj]:
                    continue
                block = self._block(bi, bj)
                out[:, :, r0 - q0:r1 - q0, c0 - k0:c1 - k0] = block[
                    :, :, r0 - bi * self.block_q:r1 - bi * self.block_q,
                    c0 - bj * self.block_k:c1 - bj * self.block_k]
        return out

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The bool mask ``(batch, heads, len(rows), k_len)`` of the query ``rows``."""
        if not len(rows):
            return torch.zeros(self.batch, self.heads, 0, self.k_len, dtype=torch.bool,
                               device=self.device)
        lo, hi = int(rows.min()), int(rows.max()) + 1
        return self.tile(lo, hi, 0, self.k_len).index_select(2, rows.to(self.device) - lo)

    def dense(self) -> torch.Tensor:
        """The whole mask ``(batch, heads, q_len, k_len)``: O(q_len x k_len), for the
        backends that take a dense mask. Every block at once (one copy of the blocks'
        kinds, one scatter of the partial tiles), not a loop over the blocks, which on a
        GPU launched several small kernels a block (about 20 ms for T=4096 in blocks of
        128) and on the CPU took 8x this time."""
        kinds, index = self.kinds, self.index  # (b, h, nq, nk), b and h 1 or in full
        b, h, nq, nk = kinds.shape
        out = torch.empty(b, h, nq, self.block_q, nk, self.block_k, dtype=torch.bool,
                          device=self.device)
        blocks = out.permute(0, 1, 2, 4, 3, 5)  # (b, h, nq, nk, block_q, block_k)
        full = (kinds == FULL)[..., None, None].expand(blocks.shape)
        where = index >= 0
        if not len(self.partial):
            blocks.copy_(full)
        elif reads_values():
            blocks.copy_(full)
            blocks[where] = self.partial[index[where]]
        else:  # a trace: a gather of every block (a boolean index has a data-dependent size)
            blocks.copy_(torch.where(where[..., None, None], self.partial[index.clamp(min=0)],
                                     full))
        whole = out.view(b, h, nq * self.block_q, nk * self.block_k)
        return whole[:, :, :self.q_len, :self.k_len]


def _build(mask_mod, batch, heads, q_len, k_len, block_q, block_k, device) -> BlockMask:
    nq, nk = -(-q_len // block_q), -(-k_len // block_k)
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    kv = torch.arange(k_len, device=device).view(1, 1, 1, -1)
    pad_k = nk * block_k - k_len
    rows_kinds, rows_index, partial = [], [], []
    n_partial = 0
    mb = mh = None
    for bi in range(nq):
        q0, q1 = bi * block_q, min(q_len, (bi + 1) * block_q)
        q = torch.arange(q0, q1, device=device).view(1, 1, -1, 1)
        allowed = _checked(mask_mod, evaluate_mod("mask_mod", mask_mod, b, h, q, kv),
                           (batch, heads, q1 - q0, k_len))
        mb = allowed.shape[0] if mb is None else max(mb, allowed.shape[0])
        mh = allowed.shape[1] if mh is None else max(mh, allowed.shape[1])
        allowed = allowed.expand(batch if allowed.shape[0] > 1 else 1,
                                 heads if allowed.shape[1] > 1 else 1, q1 - q0, k_len)
        # Pad to whole blocks with False (so past the ends never counts as allowed) and
        # count the padded entries as allowed for "full".
        padded = torch.nn.functional.pad(allowed, (0, pad_k, 0, block_q - (q1 - q0)))
        valid = torch.zeros(block_q, nk * block_k, dtype=torch.bool, device=device)
        valid[:q1 - q0, :k_len] = True
        tiles = padded.unflatten(-1, (nk, block_k)).transpose(2, 3)  # (b, h, nk, bq, bk)
        valid_t = valid.unflatten(-1, (nk, block_k)).transpose(0, 1)
        some = tiles.flatten(-2).any(dim=-1)
        every = (tiles | ~valid_t).flatten(-2).all(dim=-1)
        kinds = torch.where(every, FULL, torch.where(some, PARTIAL, EMPTY)).to(torch.int8)
        index = torch.full(kinds.shape, -1, dtype=torch.long, device=device)
        where = kinds == PARTIAL
        count = int(where.sum())
        if count:
            index[where] = torch.arange(n_partial, n_partial + count, device=device)
            partial.append(tiles[where])
            n_partial += count
        rows_kinds.append(kinds)
        rows_index.append(index)
    shape = (mb or 1, mh or 1)
    kinds = torch.stack([x.expand(*shape, nk) for x in rows_kinds], dim=2) if nq else (
        torch.zeros(1, 1, 0, nk, dtype=torch.int8, device=device))
    # A broadcast block row points every (b, h) at the same stored tile.
    index = torch.stack([x.expand(*shape, nk) for x in rows_index], dim=2) if nq else (
        torch.full((1, 1, 0, nk), -1, dtype=torch.long, device=device))
    partial = torch.cat(partial) if partial else torch.zeros(
        0, block_q, block_k, dtype=torch.bool, device=device)
    return BlockMask(kinds, partial, index, q_len=q_len, k_len=k_len, block_q=block_q,
                     block_k=block_k, mask_mod=mask_mod)


def _checked(mask_mod, allowed, target) -> torch.Tensor:
    """The mask_mod's result as a 4-D bool tensor broadcastable to ``target``."""
    if isinstance(allowed, bool):
        allowed = torch.tensor(allowed)
    if not isinstance(allowed, torch.Tensor):
        raise TypeError(f"mask_mod {mod_name(mask_mod)!r} must return a bool tensor, got "
                        f"{type(allowed).__name__}")
    if allowed.dtype != torch.bool:
        raise TypeError(f"mask_mod {mod_name(mask_mod)!r} must return a bool tensor (True = "
                        f"may attend), got dtype {allowed.dtype}")
    try:
        ok = allowed.ndim <= 4 and torch.broadcast_shapes(allowed.shape, target) == target
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"mask_mod {mod_name(mask_mod)!r} returned shape "
                         f"{tuple(allowed.shape)}, which does not broadcast to (batch, heads, "
                         f"rows, k_len) = {target}")
    allowed = allowed.reshape((1,) * (4 - allowed.ndim) + tuple(allowed.shape))
    return allowed.expand(allowed.shape[0], allowed.shape[1], *target[2:])


def reads(fn, held: list, depth: int = 0) -> tuple:
    """What ``fn`` reads besides its arguments, as a hashable key: its default arguments'
    values, its closure's values and the globals its code names, tensors as (identity,
    version) and kept alive in ``held`` (so that no new tensor takes a cached one's
    identity), functions by their own reads."""
    if isinstance(fn, types.MethodType):  # a bound method: a new object at each access
        held.append(fn.__self__)
        return (("self", id(fn.__self__)), *reads(fn.__func__, held, depth))
    if isinstance(fn, functools.partial) and depth < 4:  # its function and what it binds
        bound = [*fn.args, *sorted(fn.keywords.items())]
        return (("partial", id(fn)), *reads(fn.func, held, depth + 1),
                *(_value(v, held, depth + 1) for v in bound))
    code = getattr(fn, "__code__", None)
    if not isinstance(fn, types.FunctionType) or code is None:
        return (_value(fn, held, depth),)
    # defaults (``ids=ids``: a common way to hand a tensor in), then the closure
    values = list(fn.__defaults__ or ()) + sorted((fn.__kwdefaults__ or {}).items())
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            values.append(None)
    scope = fn.__globals__
    values += [scope[name] for name in _names(code) if name in scope]
    return tuple(_value(v, held, depth) for v in values)


def _names(code: types.CodeType) -> list[str]:
    """The global names ``code`` reads, with those of the code nested in it (a generator
    expression, or a comprehension before Python 3.12, is a code object of its own)."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += [n for n in _names(const) if n not in names]
    return names


def _value(v, held: list, depth: int):
    if isinstance(v, torch.Tensor):
        held.append(v)
        # (an inference tensor keeps no version: changed in place under inference_mode,
        # it is not seen)
        return ("tensor", id(v), None if v.is_inference() else v._version)
    if v is None or isinstance(v, int | float | bool | str | bytes):
        return v
    if depth < 4 and isinstance(v, tuple):
        return tuple(_value(x, held, depth + 1) for x in v)
    if depth < 4 and isinstance(v, types.FunctionType):
        return ("function", id(v), reads(v, held, depth + 1))
    held.append(v)  # a list, a module, any other object: by identity
    return ("object", id(v))


def block_mask(mask_mod: Callable, batch: int, heads: int, q_len: int, k_len: int, *,
               block_q: int = BLOCK_SIZE, block_k: int = BLOCK_SIZE,
               device=None, cache: bool = True) -> BlockMask:
    """``mask_mod`` evaluated into a :class:`BlockMask` of ``(batch, heads, q_len,
    k_len)``, or the cached one of an earlier call with the same function reading the
    same values (module docstring), shape, device and blocks (``cache=False``: evaluated
    and not kept, for a function made for one call)."""
    device = torch.device("cpu" if device is None else device)
    held: list = []
    try:
        key = (mask_mod, reads(mask_mod, held), batch, heads, q_len, k_len, block_q,
               block_k, str(device))
        found = _CACHE.get(key) if cache else None
    except TypeError:  # an unhashable callable or value: built each time
        found, cache = None, False
    if not cache:
        return _build(mask_mod, batch, heads, q_len, k_len, block_q, block_k, device)
    if found is not None:
        _CACHE.move_to_end(key)
        return found[0]
    built = _build(mask_mod, batch, heads, q_len, k_len, block_q, block_k, device)
    _CACHE[key] = (built, held)
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    return built
