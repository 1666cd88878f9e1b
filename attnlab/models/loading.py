"""Loading a state dict into a model: the one place names, shapes and dtypes are checked.

Checkpoints, Hugging Face layouts, the bundled MiniLM and a training resume all
load weights through :func:`load_state` (a model that exists) or :func:`build_loaded`
(a model built on the meta device and filled from the tensors), so a mismatch always
reads the same way and names where the weights came from. Building models is not
I/O: the reading of the files themselves is :mod:`attnlab.io.weights`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection, Mapping

import torch
from torch import nn

from .. import _pages
from ..io.files import CheckpointError
from ..io.weights import CHUNK, SafetensorsState, read_into
from ..modules import fused, quantized

__all__ = ["load_state", "state_mismatches", "check_fits", "build_loaded"]


def source_name(model) -> str:
    """How an error names where the weights came from: a folder's path, or the live
    model's class."""
    if isinstance(model, str | os.PathLike):
        return repr(str(model))
    return f"the {type(model).__name__}"


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


def parameter_names(model: nn.Module) -> list[list[str]]:
    """Every parameter's names, primary first: more than one where a parameter is tied (an
    output layer sharing the embedding)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return list(groups.values())


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one tensor (a tied output layer), primary first."""
    return [names for names in parameter_names(model) if len(names) > 1]


def _set_param(model: nn.Module, name: str, value) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attr, value)


def build_loaded(make: Callable[[], nn.Module], state: Mapping[str, torch.Tensor], *,
                 source: str, dtype: torch.dtype | None = None,
                 quantize: str | None = None,
                 int8: Mapping[str, Callable[[], object]] | None = None) -> nn.Module:
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

    ``dtype``: floating-point tensors are stored in it (converted chunk by chunk as
    they are read) instead of the source's dtype. ``quantize="int8"``: every linear
    layer is stored as :class:`~attnlab.modules.quantized.Int8Linear`, quantised from
    the source a few thousand rows at a time (a source value may also be a ready
    ``(data, scales)`` pair in that layout: then it is copied), so the float weights
    are never all in memory. ``int8`` maps a weight's name to a function giving its
    int8 weight (a pair, a :class:`~attnlab.layouts.int8.Q8Rows`, or rows to quantise) in
    place of ``state``'s (a GGUF file's Q8_0 tensors, whose ``state`` entries are then only
    placeholders of their shapes).
    """
    with torch.device("meta"):
        model = make()
    tied = _tied_groups(model)
    aliases = {name for names in tied for name in names[1:]}
    check_fits(model, state, source=source, allow_missing=aliases)
    if dtype is not None and quantize is None:
        fused.repack(model, dtype)  # each dtype's packed layout (bf16: by rows)
    # One buffer for every chunk read from a file: a new one per tensor would leave
    # holes between the blocks that the allocator keeps.
    bounce = torch.empty(CHUNK, dtype=torch.uint8)
    if quantize is not None:
        # The biases quantize makes take the meta model's dtype (float32): the source's
        # where it is kept (a bf16 checkpoint's come back bf16).
        for name, p in model.named_parameters():
            if name.endswith(".bias") and name in state:
                want = _stored(state[name].dtype, dtype)
                if want.is_floating_point and p.dtype != want:
                    p.data = p.data.to(want)
        primary = {alias: names[0] for names in tied for alias in names[1:]}
        def rows_of(layer: str):
            name = primary.get(f"{layer}.weight", f"{layer}.weight")
            return int8[name]() if int8 and name in int8 else _rows(state, name, bounce)
        quantized.quantize(model, quantize, sources=rows_of, dtype=_stored(torch.float32, dtype))
        tied = _tied_groups(model)
        aliases = {name for names in tied for name in names[1:]}
    blocks: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, p in model.named_parameters():
        if p.is_meta:
            blocks.setdefault(p.untyped_storage()._cdata, []).append((name, p))
    packed = {name for members in blocks.values()
              if len(members) > 1 or not members[0][1].is_contiguous() for name, _ in members}
    wanted = {n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta}
    plain = [n for n in state if n in wanted and n not in packed and n not in aliases]
    fills = [(members, _block_plan(members, state, dtype)) for members in blocks.values()
             if members[0][0] in packed]
    # The linear layers' weights, which decoding streams, on huge pages (_pages), in the
    # order it reads them.
    streamed = _in_read_order(model, plain, fills, _linear_parameters(model, tied), state,
                              dtype)
    with _pages.arena([math.prod(shape) * kind.itemsize for _, (shape, kind, _) in streamed]):
        cut = {name: _pages.empty(*how) for name, how in streamed}
        # A parameter in its plain layout (and a buffer) gets a tensor of its own: taking
        # the given one would keep the user's file mapped (its pages read whenever used)
        # or share a live model's storage.
        own = {}
        with torch.no_grad():
            for name in plain:
                src = state[name]
                own[name] = cut[name] if name in cut else _torch_empty(
                    tuple(src.shape), _stored(src.dtype, dtype), src.device)
                read_into(own[name], src, bounce)
                del src
                if isinstance(state, dict):
                    del state[name]  # freed now (unless a live model still holds it)
            for name, p in model.named_parameters():  # made by quantize (biases): in place
                if not p.is_meta and name in state:
                    read_into(p, state[name], bounce)
        model.load_state_dict(own, strict=False, assign=True)
        del own
        for members, plan in fills:
            if plan is not None:
                base = cut.get(members[0][0])
                _fill_block(model, members, state, bounce,
                            _torch_empty(*plan) if base is None else base)
    for names in tied:
        primary = model.get_parameter(names[0])
        for name in names[1:]:
            _set_param(model, name, primary)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"{source} does not fit the {type(model).__name__}: "
                              f"missing {left[:5]}")
    if quantize is not None and dtype is None and any(
            t.dtype == torch.float16 for t in [*model.parameters(), *model.buffers()]):
        # A float16 folder's norms, biases and untied embedding: an int8 model's rows are
        # float32, and float16 ones would send every block to torch's modules (the fused
        # int8 step reads float32 or bf16). Widened in place, ties kept.
        model.float()
    return model


def _stored(given: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of dtype ``given`` is stored in when loading asks for ``dtype``."""
    return dtype if dtype is not None and given.is_floating_point else given


def _rows(state: Mapping, name: str, bounce: torch.Tensor):
    """The row source :func:`~attnlab.modules.quantized.quantize` reads ``state[name]``
    through: rows ``[a, b)`` as float32, read from the file in chunks; or the ``(data,
    scales)`` pair a state already holds in the int8 layout."""
    src = state[name]
    if isinstance(src, tuple):
        return src

    def rows(a: int, b: int) -> torch.Tensor:
        out = torch.empty(b - a, src.shape[1], dtype=torch.float32)
        read_into(out, src[a:b], bounce)
        return out
    return rows


def _in_read_order(model: nn.Module, plain: list[str], fills: list, streamed: set[str],
                   state: Mapping, dtype: torch.dtype | None) -> list[tuple[str, tuple]]:
    """``(name, (shape, dtype, device))`` of each tensor to make for the ``streamed``
    parameters (a packed block: by its first member's name), in the order of the model's
    parameters, which is the order decoding reads them (a layer's q|k|v, output
    projection, gate|up, down, then the next layer's): cut from one arena in this order,
    a token streams one region front to back."""
    rank = {name: i for i, (name, _) in enumerate(model.named_parameters(remove_duplicate=False))}
    jobs = [(name, (tuple(state[name].shape), _stored(state[name].dtype, dtype),
                    state[name].device)) for name in plain if name in streamed]
    jobs += [(members[0][0], plan) for members, plan in fills
             if plan is not None and members[0][0] in streamed]
    return sorted(jobs, key=lambda job: rank.get(job[0], len(rank)))


def _torch_empty(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _linear_parameters(model: nn.Module, tied: list[list[str]]) -> set[str]:
    """Names of the parameters of the model's ``nn.Linear`` layers and of those tied to
    them (an embedding the output layer reads): what decoding streams every token."""
    names = {f"{prefix}.{p}" if prefix else p for prefix, m in model.named_modules()
             if isinstance(m, nn.Linear) for p in m._parameters}
    return names.union(*(group for group in tied if names.intersection(group)))


def _block_plan(members: list[tuple[str, torch.Tensor]], state: Mapping,
                dtype: torch.dtype | None) -> tuple[tuple[int], torch.dtype, torch.device] | None:
    """``((numel,), dtype, device)`` of the one tensor that ``members`` (meta parameters)
    are views of, in the sources' dtype (or ``dtype``) and device; None where the state
    gives none of them."""
    first = next((state[n] for n, _ in members if n in state), None)
    if first is None:
        return None
    meta = members[0][1]
    numel = meta.untyped_storage().nbytes() // meta.element_size()
    return (numel,), _stored(first.dtype, dtype), first.device


def _fill_block(model: nn.Module, members: list[tuple[str, torch.Tensor]],
                state: Mapping, bounce: torch.Tensor, base: torch.Tensor) -> None:
    """Make ``members`` (meta parameters) views of ``base`` (see :func:`_block_plan`) and
    copy each source into its view."""
    with torch.no_grad():
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
