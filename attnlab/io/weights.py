"""Loading a state dict into a model: the one place names, shapes and dtypes are checked.

Checkpoints, Hugging Face layouts, the bundled MiniLM and a training resume all
load weights through :func:`load_state`, so a mismatch always reads the same
way and names where the weights came from.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from .files import CheckpointError
from .tensors import check_file

__all__ = ["load_state", "state_mismatches", "build_loaded", "read_into",
           "SafetensorsState"]


def _kind(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "float"
    return "complex" if dtype.is_complex else str(dtype)


def state_mismatches(expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                     given: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                     allow_missing: Collection[str] = ()) -> list[str]:
    """What keeps ``given`` (name -> (shape, dtype)) from loading where ``expected`` is wanted.

    Shapes must be equal; a floating-point tensor may load into a parameter of
    another floating-point dtype (it is cast, as ``load_state_dict`` does), any
    other dtype must match in kind. Works on shapes alone, so a safetensors
    header can be checked before a single weight is read.
    """
    problems = []
    missing = [n for n in expected if n not in given and n not in allow_missing]
    unexpected = [n for n in given if n not in expected]
    if missing:
        problems.append(f"missing {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
    if unexpected:
        problems.append(f"unexpected {unexpected[:5]}" + (" ..." if len(unexpected) > 5 else ""))
    for name, (shape, dtype) in given.items():
        if name not in expected:
            continue
        want_shape, want_dtype = expected[name]
        if tuple(shape) != tuple(want_shape):
            problems.append(f"{name!r} has shape {tuple(shape)}, expected {tuple(want_shape)}")
        elif _kind(dtype) != _kind(want_dtype):
            problems.append(f"{name!r} has dtype {dtype}, expected {want_dtype}")
    return problems


def _shapes(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    if isinstance(state, SafetensorsState):
        return state.shapes()  # from the file headers: nothing is read
    return {n: (tuple(t.shape), t.dtype) for n, t in state.items()}


def load_state(model: nn.Module, state: Mapping[str, torch.Tensor], *, source: str,
               allow_missing: Collection[str] = (), assign: bool = False) -> nn.Module:
    """Copy ``state`` into ``model`` after checking every name, shape and dtype.

    Args:
        model: the module to fill; its own ``state_dict()`` says what is expected.
        state: name -> tensor, in the model's naming.
        source: where the weights come from, for the message (a file path, "the
            transformers model", ...).
        allow_missing: names the model may keep as they are (an output layer tied
            to the embedding, which the source stores once).
        assign: make the given tensors the model's parameters instead of copying
            into them (no second copy; the model may be on the meta device).

    Raises:
        CheckpointError: ``"<source> does not fit the <Model>: <what differs>"``;
            the model is unchanged then.
    """
    check_fits(model, state, source=source, allow_missing=allow_missing)
    model.load_state_dict(dict(state.items()), strict=False, assign=assign)
    return model


def check_fits(model: nn.Module, state: Mapping[str, torch.Tensor], *, source: str,
               allow_missing: Collection[str] = ()) -> None:
    """CheckpointError ``"<source> does not fit the <Model>: ..."`` unless every name,
    shape and dtype of ``state`` fits ``model`` (which may be on the meta device)."""
    own = model.state_dict()
    problems = state_mismatches({n: (tuple(t.shape), t.dtype) for n, t in own.items()},
                                _shapes(state), allow_missing)
    if problems:
        raise CheckpointError(f"{source} does not fit the {type(model).__name__}: "
                              + "; ".join(problems[:4]))


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one tensor (a tied output layer), primary first."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _set_param(model: nn.Module, name: str, value) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attr, value)


def build_loaded(make: Callable[[], nn.Module], state: Mapping[str, torch.Tensor], *,
                 source: str) -> nn.Module:
    """``make()`` a model without allocating or initialising its weights, then fill it
    from the tensors of ``state``: the weights exist once, never beside a throwaway
    random copy, and the model owns every one of them.

    The model is built on the meta device; names, shapes and dtypes are checked
    (:func:`load_state`) before anything is allocated. Every parameter gets storage of
    its own, filled from its source: a file's tensors straight from disk in chunks
    (:func:`read_into`), so the model never maps the user's file (replacing or
    truncating it later changes nothing) and a live model's tensors are copied, never
    shared (training the loaded model leaves the live one as it was). Parameters
    that are views of one tensor (weights packed for decoding, see
    :mod:`attnlab.modules.fused`) get that tensor allocated group by group; a ``dict``
    state lets go of each tensor as it is copied, so at no point are the weights held
    twice. Tied parameters (an output layer sharing the embedding) stay tied, whether
    the source stores them once or twice.
    """
    with torch.device("meta"):
        model = make()
    tied = _tied_groups(model)
    aliases = {name for names in tied for name in names[1:]}
    check_fits(model, state, source=source, allow_missing=aliases)
    blocks: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, p in model.named_parameters():
        blocks.setdefault(p.untyped_storage()._cdata, []).append((name, p))
    packed = {name for members in blocks.values()
              if len(members) > 1 or not members[0][1].is_contiguous() for name, _ in members}
    # One buffer for every chunk read from a file: a new one per tensor would leave
    # holes between the blocks that the allocator keeps.
    bounce = torch.empty(_CHUNK, dtype=torch.uint8)
    # A parameter in its plain layout (and a buffer) gets a tensor of its own: taking
    # the given one would keep the user's file mapped (its pages read whenever used) or
    # share a live model's storage.
    own = {}
    with torch.no_grad():
        for name in [n for n in state if n not in packed and n not in aliases]:
            src = state[name]
            own[name] = torch.empty(src.shape, dtype=src.dtype, device=src.device)
            read_into(own[name], src, bounce)
            del src
            if isinstance(state, dict):
                del state[name]  # freed now (unless a live model still holds it)
    model.load_state_dict(own, strict=False, assign=True)
    del own
    for members in blocks.values():
        if members[0][0] in packed:
            _fill_block(model, members, state, bounce)
    for names in tied:
        primary = model.get_parameter(names[0])
        for name in names[1:]:
            _set_param(model, name, primary)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"{source} does not fit the {type(model).__name__}: "
                              f"missing {left[:5]}")
    return model


def _fill_block(model: nn.Module, members: list[tuple[str, torch.Tensor]],
                state: Mapping, bounce: torch.Tensor) -> None:
    """Allocate the one tensor that ``members`` (meta parameters) are views of, in the
    sources' dtype and device, and copy each source into its view."""
    given = [state[n] for n, _ in members if n in state]
    if not given:
        return
    first = given[0]
    del given
    meta = members[0][1]
    numel = meta.untyped_storage().nbytes() // meta.element_size()
    with torch.no_grad():
        base = torch.empty(numel, dtype=first.dtype, device=first.device)
        del first
        views = []
        for name, p in members:
            view = base.as_strided(p.shape, p.stride(), p.storage_offset())
            _set_param(model, name, nn.Parameter(view, requires_grad=p.requires_grad))
            views.append(view)
        for (name, _), view in zip(members, views):
            if name in state:
                read_into(view, state[name], bounce)
                if isinstance(state, dict):
                    del state[name]  # freed now (unless a live model still holds it)


_CHUNK = 1 << 20


def read_into(dst: torch.Tensor, src: torch.Tensor, bounce: torch.Tensor | None = None) -> None:
    """``dst.copy_(src)``; a tensor :class:`SafetensorsState` memory-mapped, or a view
    of one whose rows each lie in one piece (a transpose, a slice of columns: how
    GPT-2's Conv1D weights become ``nn.Linear``'s), is read from its file in chunks of
    rows through ``bounce`` (bytes) instead, so its pages never become part of the
    process. Only while the mapping holds what the file holds: a tensor edited in
    memory (its copy-on-write pages written) is copied as it is, edits included."""
    if src.ndim == 2 and dst.ndim == 2 and src.stride(0) == 1 and src.stride(1) != 1:
        dst, src = dst.t(), src.t()  # read the transpose's rows
    origin = _ORIGINS.get(src.untyped_storage().data_ptr())
    row_shape = src.shape[1:]
    if (origin is None or src.ndim == 0 or src.numel() == 0 or not src[0].is_contiguous()
            or src.stride(0) < max(1, src[0].numel())):
        dst.copy_(src)
        return
    file, offset = origin
    es = src.element_size()
    row = src[0].numel() * es  # the bytes of one row; rows start `pitch` bytes apart
    pitch = src.stride(0) * es
    span = (src.shape[0] - 1) * pitch + row
    if _written(src.data_ptr(), span):
        dst.copy_(src)
        return
    offset += src.storage_offset() * es
    if bounce is None or bounce.numel() < row:
        bounce = torch.empty(max(_CHUNK, row), dtype=torch.uint8)
    step = (bounce.numel() - row) // pitch + 1  # rows a chunk holds
    raw = bounce.numpy()
    for a in range(0, src.shape[0], step):
        b = min(a + step, src.shape[0])
        n = (b - a - 1) * pitch + row
        # The file the mapping was made of (its descriptor), even if its path now names
        # another one.
        if os.preadv(file.fileno(), [memoryview(raw)[:n]], offset + a * pitch) != n:
            raise CheckpointError(f"{file.name!r} ended early (truncated?)")
        rows = bounce[:n].view(src.dtype)
        dst[a:b].copy_(rows.as_strided((b - a, *row_shape), (src.stride(0), *src[0].stride())))


_PAGE = mmap.PAGESIZE


def _written(address: int, nbytes: int) -> bool:
    """Whether this process wrote to any page of ``[address, address + nbytes)`` of a
    private file mapping (a written copy-on-write page is anonymous memory, no longer
    the file's; Linux's ``/proc/self/pagemap`` tells them apart). True where it cannot
    be told, so the caller copies what the memory holds."""
    import numpy as np

    first, last = address // _PAGE, (address + nbytes - 1) // _PAGE
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
    except OSError:
        return True
    if entries.size != last - first + 1:
        return True
    present, swapped, file = (entries >> np.uint64(bit) & np.uint64(1) for bit in (63, 62, 61))
    return bool(((present | swapped) & (file ^ np.uint64(1))).any())


# --------------------------------------------------------------------- safetensors files


class SafetensorsState(Mapping):
    """The tensors of one or more safetensors files (a sharded checkpoint), read lazily.

    Shapes and dtypes come from the headers without reading any data; a tensor is
    read (memory-mapped by safetensors) when it is looked up, and not kept here, so
    a converter that walks the names holds each tensor only as long as it needs it.
    """

    def __init__(self, files: list[str | os.PathLike], *, device: str = "cpu") -> None:
        from safetensors import safe_open

        self._handles = {}
        self._where: dict[str, object] = {}
        self._device = str(device)
        self._places: dict[str, tuple] = {}
        for path in files:
            path = Path(path)
            check_file(path)
            try:
                handle = safe_open(path, framework="pt", device=device)
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{str(path)!r}: not a valid safetensors file "
                                      f"(truncated or corrupt?): {exc}") from exc
            self._handles[path] = handle
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                self._where[name] = handle
            self._places.update(_places(_File(path)))

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._device != "cpu":
            return self._where[name].get_tensor(name)
        return _mapped(*self._places[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        out = {}
        for name, handle in self._where.items():
            part = handle.get_slice(name)
            out[name] = (tuple(part.get_shape()), _DTYPES.get(part.get_dtype(), torch.uint8))
        return out


# safetensors' dtype names -> torch's.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}

# Where each tensor SafetensorsState mapped lies in its file: storage address -> (file,
# offset). An entry lives exactly as long as its mapping (weakref.finalize), so an
# address reused later never points at a stale file.
_ORIGINS: dict[int, tuple[_File, int]] = {}


class _File:
    """One open descriptor of a weights file: its header, its mappings and the reads of
    :func:`read_into` all see the same file, even if its path is given another one
    meanwhile. Closed once nothing uses it."""

    def __init__(self, path: Path) -> None:
        self.name = str(path)
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)

    def fileno(self) -> int:
        return self.fd


def _places(file: _File) -> dict[str, tuple]:
    """name -> (file, offset, shape, safetensors dtype) from the file's header."""
    (n,) = struct.unpack("<Q", os.pread(file.fd, 8, 0).ljust(8, b"\0"))
    header = json.loads(os.pread(file.fd, n, 8))
    start = 8 + n
    return {name: (file, start + int(info["data_offsets"][0]), tuple(info["shape"]),
                   info["dtype"]) for name, info in header.items() if name != "__metadata__"}


def _mapped(file: _File, offset: int, shape: tuple, dtype: str) -> torch.Tensor:
    """The tensor memory-mapped from the file (copy on write): nothing is read until
    it is used, and a page read stays shared with the page cache."""
    import numpy as np

    want = _DTYPES.get(dtype, torch.uint8)
    count = 1
    for d in shape:
        count *= d
    if count == 0:
        return torch.empty(shape, dtype=want)
    nbytes = count * torch.empty((), dtype=want).element_size()
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    view = mmap.mmap(file.fd, offset - start + nbytes, access=mmap.ACCESS_COPY, offset=start)
    raw = np.frombuffer(view, dtype=np.uint8, count=nbytes, offset=offset - start)
    t = torch.from_numpy(raw)
    ptr = t.untyped_storage().data_ptr()
    _ORIGINS[ptr] = (file, offset)
    weakref.finalize(raw, _ORIGINS.pop, ptr, None)
    return t.view(want).view(shape)
