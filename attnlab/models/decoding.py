"""One decoded token through GPT blocks in native calls, and the check that a call may
stand in for a block's modules.

The check reads each block's pieces straight from ``_modules`` and ``_parameters`` and
checks only what Python must (types, hooks, flags, packed layouts); the kernel checks
the tensors once, when a layer is added to a ``_decode.Run``, and hands runs of
consecutive blocks to one native call each. Made afresh, the plan costs about 20 us a
layer, cold: 0.7 ms of a 21-22 ms token for a SmolLM-135M-shaped model at batch 1 on a
quiet 16-core Xeon at two threads, where one made per ``generate`` call decoded 3.6% and
5.6% faster in two interleaved measurements. So:

- a :class:`Decoder` made by ``generate`` holds the plan made at the first decoded token
  and keeps it to the last, where nothing of the user's can run in between
  (:func:`library_only`: no callback, no hooks, no forward of an instance's own, only
  attnlab's and torch's module classes, plain tensors, no torch function or dispatch
  mode in force; then nothing can change the blocks between two tokens);
- a forward without one (any other call with a cache) makes the plan for that token,
  so a piece replaced, a hook added or a parameter moved is seen at the next one.

Greedy decoding of one row then needs Python only once per chunk of tokens
(:meth:`Decoder.greedy`; ``generation.GREEDY_CHUNK``): the plan's run loops natively.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch
from torch import nn

from .. import _decode, _native
from ..cache import KVCache
from ..functional import may_decode
from ..modules import MultiHeadAttention, fused, quantized
from ..modules.layers import GATED_MLP_KINDS, MLP, norm_kind

_LIBRARY = ("attnlab.", "torch.nn.")

# A plan: (start, stop, run) for each stretch of blocks, run a _decode.Run where the
# kernel may take blocks[start:stop], None for one block that runs its modules.
Plan = list[tuple[int, int, "_decode.Run | None"]]


class Decoder:
    """The fused decoding of ``blocks`` (each of type ``kind``, GPT's ``Block``), then
    where the kernel takes them ``model``'s final norm and output layer (its ``norm`` and
    ``lm_head``, read when the plan is made), for the tokens of one ``generate`` call: the
    plan is made at the first decoded token and kept. Make one only where nothing can
    change the model until the last token (:func:`library_only`);
    ``GPT.forward(..., decoder=...)`` takes it."""

    def __init__(self, blocks: nn.ModuleList, kind: type, model: nn.Module | None = None) -> None:
        self.blocks, self.kind, self.model = blocks, kind, model
        self.plan: Plan | None = None
        self.embedding: bool | None = None  # whether the run holds the model's token table

    def __call__(self, x: torch.Tensor, caches: Sequence[KVCache]
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``x (1, 1, d_model)`` through the blocks for one new token: ``(hidden, None)``,
        or ``(None, logits)`` where the kernel ran the final norm and output layer too
        (logits ``(1, 1, vocab)`` float32)."""
        if self.plan is None:
            head = [getattr(self.model, n, None) for n in ("norm", "lm_head")]
            self.plan = _plan(self.blocks, self.kind, x, *head)
        return _run(self.plan, self.blocks, x, caches)

    def greedy(self, first: int, count: int, caches: Sequence[KVCache],
               stops: Sequence[int] = ()) -> list[int] | None:
        """Up to ``count`` greedy tokens after ``first`` (batch size 1) in one native call
        (``_decode.Run.greedy``), after a token decoded through :meth:`__call__` made the
        plan; the same tokens as that many forwards and ``sample_next`` at temperature 0,
        ending after a token in ``stops``. Between tokens Python ran cold after each
        token's weights (0.4-0.6 ms of a 6.4 ms int8 SmolLM-135M token, one thread).
        None, nothing changed, where the kernel does not take every block, the head and
        the model's embedding (:func:`_set_embedding`)."""
        plan = self.plan
        run = plan[0][2] if plan is not None and len(plan) == 1 else None
        if run is None or not run.has_head:
            return None
        if self.embedding is None:
            self.embedding = _set_embedding(run, self.model)
        return run.greedy(first, count, caches, stops) if self.embedding else None


def library_only(model: nn.Module, ids: object = None) -> bool:
    """Whether a forward of ``model`` on ``ids`` (a prompt given to ``generate``) runs only
    attnlab's and torch's code: no hooks (global, on any module, an attention's
    ``qkv_hook``), no instance's own ``forward``, every module of a class from attnlab or
    ``torch.nn``, every parameter, buffer and the prompt a plain tensor (or a list), no
    torch function or dispatch mode in force."""
    if ids is not None and type(ids) not in (torch.Tensor, list, tuple):
        return False
    if _modes_active() or fused.global_forward_hooks():
        return False
    # One pass over the modules, each one's attributes read off its dicts: parameters() and
    # buffers() walked the tree twice more with their sets of seen tensors, and getattr
    # raised inside nn.Module.__getattr__ for every module without a qkv_hook (3.5 ms of
    # each generate call at SmolLM-135M's 366 modules).
    for m in model.modules():
        own = m.__dict__
        if (m._forward_hooks or m._forward_pre_hooks or "forward" in own
                or not type(m).__module__.startswith(_LIBRARY)
                or own.get("qkv_hook", m._modules.get("qkv_hook")) is not None
                or not _plain(chain(m._parameters.values(), m._buffers.values()))):
            return False
    return True


def _plain(tensors) -> bool:
    """Whether every tensor is a plain one (no subclass whose own code would run); None
    (a module's missing bias) is none."""
    return all(t is None or type(t) in (torch.Tensor, nn.Parameter) for t in tensors)


def _modes_active() -> bool:
    """Whether a ``TorchFunctionMode`` or ``TorchDispatchMode`` (user code run on every
    op) is in force; True where torch no longer says."""
    try:
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    except ImportError:
        return True
    return bool(_get_current_function_mode_stack() or _get_current_dispatch_mode_stack())


def _run(plan: Plan, blocks: nn.ModuleList, x: torch.Tensor,
         caches: Sequence[KVCache]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    for start, stop, fused_run in plan:
        y = None if fused_run is None else fused_run(x, caches[start:stop])
        if y is not None:
            if fused_run.has_head:
                return None, y
            x = y
            continue
        # Declined (the caches or the positions are not what the kernel reads): the
        # blocks through their modules.
        for i in range(start, stop):
            x = blocks[i](x, None, caches[i], None, False)[0]
    return x, None


def _plan(blocks: Sequence[nn.Module], kind: type, x: torch.Tensor,
          norm: nn.Module | None = None, lm_head: nn.Module | None = None) -> Plan:
    """Which blocks the kernel may take now for rows like ``x``: runs of consecutive
    ones, one each; the last run also takes ``norm`` and ``lm_head`` where it ends the
    blocks and the kernel knows them (:func:`_set_head`)."""
    plan: Plan = []
    if _native.for_inference(x, dtypes=_native.PRODUCT_DTYPES) is None:
        # gradients on, another dtype or device, no build
        return [(i, i + 1, None) for i in range(len(blocks))]
    current: _decode.Run | None = None
    for i, block in enumerate(blocks):
        layer = _layer(block, kind)
        if layer is not None:
            current = current if current is not None else _decode.Run()
            if current.add(layer) is None:
                continue
        if current is not None and len(current):
            plan.append((i - len(current), i, current))
        current = None
        plan.append((i, i + 1, None))
    if current is not None and len(current):
        plan.append((len(blocks) - len(current), len(blocks), current))
        if lm_head is not None:
            _set_head(current, norm, lm_head)
    return plan


def _set_embedding(run: _decode.Run, model: nn.Module) -> bool:
    """Give ``run`` ``model``'s token table where ``GPT.embed`` and ``GPT.forward`` do no
    more for a decoded token than look its row up (cast to the activations' dtype) and
    return the output layer's logits: no position embedding, scale, embedding norm,
    dropout or logit softcap; GPT's own ``embed`` (none of the instance's or patched in);
    an ``nn.Embedding`` without ``max_norm``, or an int8 table tied to the output layer."""
    cfg, emb = model.config, model.tok_emb
    embed = getattr(type(model), "embed", None)
    if ("embed" in model.__dict__ or getattr(embed, "__qualname__", None) != "GPT.embed"
            or embed.__module__ != f"{__package__}.gpt"):
        return False
    act = getattr(model.norm, "weight", None)
    act = None if act is None else act.dtype
    if (model.pos_emb is not None or model.embed_norm is not None or cfg.scale_embeddings
            or cfg.logit_softcap is not None or (model.training and cfg.dropout)
            or act not in (None, torch.float32, torch.bfloat16) or _hooked(emb)):
        return False
    if type(emb) is quantized.Int8Embedding:
        if emb.dtype not in (torch.float32, torch.bfloat16):
            return False
        table = emb.table
        why = run.set_embedding(table.data, table.scales, table.out_features,
                                torch.bfloat16 in (emb.dtype, act))
    elif type(emb) is nn.Embedding and emb.max_norm is None:
        why = run.set_embedding(emb.weight, None, emb.num_embeddings, act == torch.bfloat16)
    else:
        return False
    return why is None


def _hooked(m: nn.Module) -> bool:
    """Whether ``m`` must run itself: a hook, or a ``forward`` of the instance's own."""
    return bool(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__)


def _product(group: list) -> tuple | None:
    """``(weight, bias, scales)`` of one product over ``group`` (linear layers multiplying
    one input, packed side by side: ``modules.fused``, ``modules.quantized``), or None
    where the layers must run themselves."""
    kind = type(group[0])
    if any(type(m) is not kind or _hooked(m) for m in group) or kind not in (
            nn.Linear, quantized.Int8Linear):
        return None
    if kind is quantized.Int8Linear:
        if not quantized.is_packed(group):
            return None
        data, scales, bias, _ = quantized.tensors(group)
        return data, bias, scales
    return (*fused.block(group), None) if fused.is_packed(group) else None


def _set_head(run: _decode.Run, norm: nn.Module | None, lm_head: nn.Module) -> None:
    """Give ``run`` the model's final norm and output layer where the kernel knows them
    (the norm kinds of the blocks, an output layer packed as one product, no hooks, plain
    tensors) and no torch function or dispatch mode would see them run (a FLOP counter
    sees the model's largest product)."""
    kind = norm_kind(norm) if norm is not None else None
    if (kind is None or _hooked(norm) or len(norm.normalized_shape) != 1 or _modes_active()
            or not _plain(chain(norm.parameters(), lm_head.parameters(), lm_head.buffers()))):
        return
    product = _product([lm_head])
    if product is None:
        return
    weight, bias, scales = product
    params = norm._parameters
    run.set_head(kind, torch.finfo(torch.float32).eps if norm.eps is None else norm.eps,
                 params.get("weight"), params.get("bias"), weight, bias, scales,
                 lm_head.out_features)


def _layer(block: nn.Module, kind: type) -> _decode.DecoderLayer | None:
    """What the kernel needs of ``block`` now, or None where its modules must run: a block
    or piece the kernel does not know (a subclass, a ``forward`` of its own), a hook or
    ``qkv_hook`` that must see it run, a chosen backend, dropout in training (each
    module's own flag: ``attn.train()`` alone turns on attention dropout), a product
    whose weights no longer lie packed (``modules.fused``: the modules pack them again;
    ``modules.quantized``: int8 layers quantised apart). The products may be float32,
    bf16 or int8 (the kernel checks the tensors). What the kernel does not implement (a
    norm or MLP kind it does not know) it refuses when the layer is added to a run
    (``_decode.Run.add``)."""
    if type(block) is not kind or "forward" in block.__dict__:
        return None
    mods = block._modules
    attn, mlp, norm1, norm2 = (mods.get(n) for n in ("attn", "mlp", "norm1", "norm2"))
    post_attn, post_mlp = mods.get("post_attn_norm"), mods.get("post_mlp_norm")
    q_norm, k_norm = (None, None) if attn is None else (attn._modules.get("q_norm"),
                                                        attn._modules.get("k_norm"))
    if (type(attn) is not MultiHeadAttention or type(mlp) is not MLP
            or attn.qkv_hook is not None
            or not may_decode(attn.backend, dropout_p=attn.dropout if attn.training else 0.0)
            or (block.training and block.dropout)
            or (attn.training and attn.resid_dropout)):
        return None
    norm = norm_kind(norm1)
    norms = [n for n in (norm1, norm2, post_attn, post_mlp, q_norm, k_norm) if n is not None]
    if (norm is None or (post_attn is None) != (post_mlp is None)
            or (q_norm is None) != (k_norm is None)
            or any(type(n) is not type(norm1) or n.eps != norm1.eps
                   or len(n.normalized_shape) != 1 for n in norms)):
        return None
    groups = [[attn._modules.get(n) for n in ("W_query", "W_key", "W_value")],
              [attn._modules.get("out_proj")],
              [mlp._modules.get(n) for n in (("gate", "fc") if mlp.kind in GATED_MLP_KINDS
                                             else ("fc",))],
              [mlp._modules.get("proj")]]
    products = [_product(group) for group in groups]
    if None in products or any(_hooked(m) for m in (block, attn, mlp, *norms)):
        return None
    n1, n2 = norm1._parameters, norm2._parameters
    p1, p2, pq, pk = ({} if n is None else n._parameters
                      for n in (post_attn, post_mlp, q_norm, k_norm))
    (qkv_w, qkv_b, qkv_s), (out_w, out_b, out_s), (up_w, up_b, up_s), (down_w, down_b, down_s) \
        = products
    return _decode.DecoderLayer(
        norm=norm, eps=torch.finfo(torch.float32).eps if norm1.eps is None else norm1.eps,
        norm1_weight=n1.get("weight"), norm1_bias=n1.get("bias"),
        norm2_weight=n2.get("weight"), norm2_bias=n2.get("bias"),
        qkv_weight=qkv_w, qkv_bias=qkv_b, out_weight=out_w, out_bias=out_b,
        mlp=mlp.kind, up_weight=up_w, up_bias=up_b, down_weight=down_w, down_bias=down_b,
        num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
        window=attn.window, rotary=attn.rotary, d_model=attn.d_in,
        up_out=sum(m.out_features for m in groups[2]), qkv_scales=qkv_s, out_scales=out_s,
        up_scales=up_s, down_scales=down_s, **attn.score_options(),
        post_attn_norm_weight=p1.get("weight"), post_attn_norm_bias=p1.get("bias"),
        post_mlp_norm_weight=p2.get("weight"), post_mlp_norm_bias=p2.get("bias"),
        q_norm_weight=pq.get("weight"), q_norm_bias=pq.get("bias"),
        k_norm_weight=pk.get("weight"), k_norm_bias=pk.get("bias"))
