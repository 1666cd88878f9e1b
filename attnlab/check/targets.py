"""The learner's code as ``attnlab check`` runs it: load it, build it, call it.

Three shapes of code are understood, the tutorials' signatures:

- a function ``(q, k, v[, mask])`` (``causal=`` too where it takes one), compared with
  the oracle directly;
- a weight-free function ``(x[, mask])`` (the book's simplified self-attention:
  ``softmax(x x^T) x``, unscaled; a ``1/sqrt(d)`` scale is accepted as well);
- an ``nn.Module`` (a class is built with small sizes read from its parameter names)
  ``forward(x[, mask])``, whose projections are read by name (``W_query``, ``W_key``,
  ``W_value``, ``out_proj`` and the usual others) so that the oracle uses the same
  weights.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .messages import InputError
from .oracle import Block, Weights

# Sizes a class is built with: every width different, so that each wrong scale
# gives different numbers (sqrt(d_out)=4, sqrt(head_dim)=2, sqrt(d_in)=sqrt(6)).
D_IN, D_OUT, HEADS, KV_HEADS, CONTEXT, DROPOUT = 6, 16, 4, 2, 32, 0.5

_CTOR = {
    "d_in": ("d_in", "in_dim", "input_dim", "in_features", "dim_in"),
    "d_out": ("d_out", "out_dim", "output_dim", "out_features", "dim_out"),
    "d_model": ("d_model", "embed_dim", "emb_dim", "dim", "d", "hidden_size", "n_embd",
                "hidden_dim", "model_dim", "embedding_dim"),
    "context": ("context_length", "context_len", "block_size", "max_len", "max_seq_len",
                "seq_len", "n_ctx", "max_length", "max_position_embeddings"),
    "dropout": ("dropout", "dropout_p", "attn_dropout", "dropout_rate", "p_drop", "attn_pdrop",
                "drop"),
    "heads": ("num_heads", "n_heads", "n_head", "heads", "nhead", "h", "num_attention_heads"),
    "kv_heads": ("num_kv_heads", "n_kv_heads", "num_key_value_heads", "kv_heads", "n_kv_head",
                 "num_kv_groups", "num_groups", "n_groups"),
    "causal": ("causal", "is_causal"),
}
_PROJ = {
    "q": ("W_query", "W_q", "Wq", "W_Q", "query", "q_proj", "wq", "to_q", "q_linear", "linear_q",
          "q", "queries"),
    "k": ("W_key", "W_k", "Wk", "W_K", "key", "k_proj", "wk", "to_k", "k_linear", "linear_k", "k",
          "keys"),
    "v": ("W_value", "W_v", "Wv", "W_V", "value", "v_proj", "wv", "to_v", "v_linear", "linear_v",
          "v", "values"),
    "qkv": ("W_qkv", "qkv", "c_attn", "to_qkv", "qkv_proj", "in_proj"),
    "out": ("out_proj", "W_o", "W_out", "o_proj", "wo", "to_out", "c_proj", "fc_out", "proj",
            "linear_out", "out"),
}
_MASK_NAMES = ("mask", "attn_mask", "attention_mask")
# Parameters that are options, never the mask, wherever they stand (the fourth of
# ``attn(q, k, v, causal=False)`` or of SDPA's ``(q, k, v, scale=None)``).
_OPTION_NAMES = (*_CTOR["causal"], *_CTOR["dropout"], "scale", "softmax_scale", "sm_scale",
                 "training", "return_weights", "need_weights", "return_attn", "window",
                 "temperature", "enable_gqa", "softcap")
# What the learner's code may raise where attnlab calls it: a demo left at the end of
# the file calls sys.exit() or exit() (SystemExit) as often as it raises.
LEARNER_ERRORS = (Exception, SystemExit)


def load(spec: str) -> tuple[Any, str]:
    """``FILE:NAME`` -> the object NAME defined in the Python file FILE, and its name.

    The file is the learner's own code, imported in this process as they asked;
    its folder is put on ``sys.path`` meanwhile, so its own imports work.
    """
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise InputError("spec_form", spec=spec)
    file = Path(path)
    if not file.is_file():
        raise InputError("not_a_file", path=path, spec=spec)
    module_name = f"_attnlab_check_{file.stem.replace('-', '_')}"
    loader = importlib.util.spec_from_file_location(module_name, file)
    if loader is None or loader.loader is None:
        raise InputError("not_python", path=path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up
    sys.path.insert(0, str(file.resolve().parent))
    try:
        loader.loader.exec_module(module)
    except SystemExit as exc:  # a demo at the end of the file, run on import
        raise InputError("import_exited", path=path, status=exc.code) from None
    except Exception as exc:  # the learner's file: any error, said in one line
        raise InputError("import_failed", path=path,
                         error=f"{type(exc).__name__}: {exc}") from None
    finally:
        sys.path.remove(str(file.resolve().parent))
    if not hasattr(module, name):
        found = sorted(n for n, v in vars(module).items() if not n.startswith("_")
                       and (inspect.isclass(v) or inspect.isfunction(v))
                       and getattr(v, "__module__", None) == module_name)
        raise InputError("not_defined", path=path, name=name,
                         found=", ".join(found))
    return getattr(module, name), name


def _params(fn: Callable) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []


def _first(names: tuple[str, ...], params: dict[str, inspect.Parameter]) -> str | None:
    return next((n for n in names if n in params), None)


def build(cls: type) -> list[tuple[nn.Module, str]]:
    """Instances of the learner's class with small sizes, and what each one is (two,
    causal and not, when the constructor takes ``causal``)."""
    params = {p.name: p for p in _params(cls.__init__)[1:]
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    kwargs: dict[str, object] = {}
    has_out = _first(_CTOR["d_out"], params)
    for role, value in (("d_in", D_IN), ("d_out", D_OUT), ("context", CONTEXT),
                        ("dropout", DROPOUT), ("heads", HEADS), ("kv_heads", KV_HEADS)):
        name = _first(_CTOR[role], params)
        if name:
            kwargs[name] = value
    name = _first(_CTOR["d_model"], params)
    if name:  # the one width of (d_model, num_heads) signatures; d_in where d_out is there
        kwargs[name] = D_IN if has_out and not _first(_CTOR["d_in"], params) else D_OUT
    d_in = _first(_CTOR["d_in"], params)
    if d_in and not has_out and not name and _first(_CTOR["heads"], params):
        kwargs[d_in] = D_OUT  # (d_in, num_heads): the one width, split over the heads
    missing = [n for n, p in params.items() if n not in kwargs and p.default is p.empty
               and n not in _CTOR["causal"]]
    if missing:
        raise InputError("cannot_build", cls=cls.__name__, param=missing[0])
    causal = _first(_CTOR["causal"], params)
    variants = [{causal: False}, {causal: True}] if causal else [{}]
    built = []
    for extra in variants:
        try:
            module = cls(**kwargs, **extra)
        except LEARNER_ERRORS as exc:  # the learner's constructor: one line, any error
            call = ", ".join(f"{k}={v!r}" for k, v in {**kwargs, **extra}.items())
            raise InputError("build_raised", cls=cls.__name__, call=call,
                             error=f"{type(exc).__name__}: {exc}") from None
        built.append((module, ", ".join(f"{k}={v}" for k, v in {**kwargs, **extra}.items())))
    return built


def prepare(module: nn.Module) -> nn.Module:
    """A copy of ``module`` in eval mode, its projections set to random weights of unit
    scale (the book's ``torch.rand`` weights saturate the softmax, where every scale looks
    alike); the learner's own module is left as it was."""
    module = copy.deepcopy(module).eval()
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for sub in [module, *module.modules()]:
            for role in ("q", "k", "v", "qkv", "out"):
                for name in _PROJ[role]:
                    layer = getattr(sub, name, None)
                    w = layer.weight if isinstance(layer, nn.Linear) else layer
                    if isinstance(w, torch.Tensor) and w.ndim == 2 and w.is_floating_point():
                        fan_in = w.shape[1] if isinstance(layer, nn.Linear) else w.shape[0]
                        w.copy_(torch.randn(w.shape, generator=gen) / fan_in ** 0.5)
                    bias = getattr(layer, "bias", None) if isinstance(layer, nn.Linear) else None
                    if isinstance(bias, torch.Tensor):
                        bias.copy_(torch.randn(bias.shape, generator=gen) * 0.1)
    return module


def _matrix(obj: object, d_in: int) -> tuple[np.ndarray, np.ndarray | None] | None:
    """An ``nn.Linear`` or a 2-D tensor used as ``x @ W`` -> ``(out, in)`` weight and bias."""
    if isinstance(obj, nn.Linear):
        bias = None if obj.bias is None else obj.bias.detach().double().numpy()
        return obj.weight.detach().double().numpy(), bias
    if isinstance(obj, torch.Tensor) and obj.ndim == 2:
        w = obj.detach().double().numpy()
        # The book's nn.Parameter(torch.rand(d_in, d_out)) is applied as x @ W.
        return (w.T, None) if w.shape[0] == d_in else (w, None)
    return None


def _int_attr(module: nn.Module, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _own_block(module: nn.Module, d_in: int) -> Block | None:
    found = {}
    for role in ("q", "k", "v"):
        found[role] = next((m for n in _PROJ[role] if (m := _matrix(getattr(module, n, None),
                                                                      d_in)) is not None), None)
    if any(v is None for v in found.values()):
        qkv = next((m for n in _PROJ["qkv"] if (m := _matrix(getattr(module, n, None), d_in))
                    is not None), None)
        if qkv is None:
            return None
        w, b = qkv
        third = w.shape[0] // 3
        found = {role: (w[i * third:(i + 1) * third], None if b is None
                        else b[i * third:(i + 1) * third]) for i, role in enumerate("qkv")}
    (wq, bq), (wk, bk), (wv, bv) = found["q"], found["k"], found["v"]
    heads = _int_attr(module, _CTOR["heads"]) or 1
    head_dim = _int_attr(module, ("head_dim", "d_k", "d_head", "head_size")) or wq.shape[0] // heads
    kv_heads = _int_attr(module, _CTOR["kv_heads"]) or max(1, wk.shape[0] // head_dim)
    return Block(wq, wk, wv, bq, bk, bv, heads, kv_heads, head_dim)


def read_weights(module: nn.Module, d_in: int) -> Weights | None:
    """The module's projections (its own, or those of a list of one-head modules, as the
    book's MultiHeadAttentionWrapper), or None for a module without weights."""
    if getattr(module, "rotary", None) is not None or getattr(module, "rope", None) not in (
            None, False):
        raise InputError("rotary", cls=type(module).__name__)
    block = _own_block(module, d_in)
    blocks = [block] if block else []
    if not blocks:
        for child in module.children():
            if isinstance(child, nn.ModuleList) and len(child) and all(
                    _own_block(m, d_in) for m in child):
                blocks = [_own_block(m, d_in) for m in child]
                break
    if not blocks:
        return None
    out = next((m for n in _PROJ["out"] if (m := _matrix(getattr(module, n, None),
                                                          sum(b.heads * b.head_dim
                                                              for b in blocks))) is not None),
               None)
    return Weights(blocks, *(out if out else (None, None)))


def input_width(module: nn.Module) -> int:
    """The width a module without a known width attribute reads: its first linear layer's
    input (or an ``nn.MultiheadAttention``'s ``embed_dim``), else 0."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            return sub.in_features
        if isinstance(sub, nn.MultiheadAttention):
            return sub.embed_dim
    return 0


def mask_buffer_length(module: nn.Module) -> int | None:
    """The length of the longest sequence a square mask buffer (Karpathy's ``tril``, GPT-2's
    ``bias``, the book's ``mask``) covers, the shortest of them, or None without one."""
    sizes = [b.shape[-1] for b in module.buffers() if b.ndim >= 2 and b.shape[-1] == b.shape[-2]]
    return min(sizes) if sizes else None


def is_causal(module: nn.Module) -> bool | None:
    """Whether the module means to be causal: a ``causal`` flag, a triangular mask buffer
    (the book's ``mask``), a list of causal one-head modules, or "causal" in its name;
    None where nothing says (the check then asks its outputs: ``Target.behaves_causal``)."""
    for sub in [module, *module.children(), *(c for lst in module.children()
                                              if isinstance(lst, nn.ModuleList) for c in lst)]:
        for name in ("causal", "is_causal"):
            if isinstance(getattr(sub, name, None), bool):
                return getattr(sub, name)
        for name, buf in sub.named_buffers(recurse=False):
            if buf.ndim >= 2 and buf.shape[-1] == buf.shape[-2] and buf.shape[-1] > 1 and (
                    name in ("mask", "tril", "causal_mask", "bias")):
                # Triangular at any offset: an off-by-one mask is still meant to be causal.
                b = buf.reshape(buf.shape[-2:]).bool()
                if b.any() and not b.all() and (torch.equal(b, torch.triu(b))
                                                or torch.equal(b, torch.tril(b))):
                    return True
    return True if "causal" in type(module).__name__.lower() else None


def mask_param(fn: Callable, before: int | None) -> tuple[str | None, bool]:
    """``fn``'s mask parameter (or None) and whether to pass it by name: a parameter named
    as a mask goes by name wherever it stands (positionally only where it must, right
    after the ``before`` inputs); else, for a function (``before`` given), a required
    parameter right after its inputs that is not an option (``causal``, ``scale``, ...):
    ``attention(q, k, v, m)``. A module's ``forward(x, context=None)`` or ``(x, kv_cache)``
    has other things there, so a module's mask is only ever found by its name."""
    params = _params(fn)
    for p in params:
        if p.name in _MASK_NAMES:
            return p.name, p.kind != p.POSITIONAL_ONLY
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if before is not None and len(positional) > before:
        p = positional[before]
        if p.name not in _OPTION_NAMES and p.default is p.empty:
            return p.name, False
    return None, False


def positional_count(fn: Callable) -> int:
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in _params(fn))


def causal_param(fn: Callable) -> str | None:
    return next((p.name for p in _params(fn) if p.name in _CTOR["causal"]), None)


def as_array(out: object) -> np.ndarray:
    """The learner's output (a tensor, an array, or a tuple whose first item is one)."""
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    if isinstance(out, torch.Tensor):
        return out.detach().cpu().double().numpy()
    if isinstance(out, np.ndarray):
        return out.astype(np.float64)
    raise TypeError(f"returned {type(out).__name__}, expected a tensor or an array")
