"""Weights held once: the packed (in, out) layout the one-row decoding path reads is the
only copy, and training, state dicts, checkpoints, ties and in-place edits see plain
nn.Linear layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnlab
from attnlab.models import GPT, GPTConfig
from attnlab.modules import fused
from attnlab.rope import RotaryEmbedding


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=61, context_length=64, d_model=32, num_layers=2, num_heads=4,
               num_kv_heads=2, positions="rope", norm="rmsnorm", mlp="swiglu",
               tie_embeddings=True, out_bias=False, mlp_bias=False)
    return GPT(GPTConfig(**{**cfg, **kw})).eval()


def _tensors(obj, seen, out, depth=0):
    """Every tensor reachable from ``obj`` through attributes, dicts, lists and tuples."""
    if id(obj) in seen or depth > 40 or isinstance(obj, RotaryEmbedding):
        return  # (RoPE keeps its cos/sin table: positions, not weights)
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, seen, out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, seen, out, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        _tensors(vars(obj), seen, out, depth + 1)


def _storages(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _held_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of every storage reachable from the model, bytes of its parameters')."""
    found: list[torch.Tensor] = []
    _tensors(model, set(), found)
    return sum(_storages(found).values()), sum(_storages(model.parameters()).values())


def test_decoding_holds_no_second_copy_of_the_weights():
    for model in (_gpt(), _gpt(tie_embeddings=False, positions="learned", norm="layernorm",
                               mlp="gelu", qkv_bias=True, out_bias=True, mlp_bias=True)):
        model.generate(torch.tensor([[1, 2, 3]]), 4, temperature=0)  # the one-row path
        reachable, params = _held_bytes(model)
        assert reachable == params
        n = sum(p.numel() * p.element_size() for p in model.parameters())
        assert params == n  # packed blocks hold exactly the parameters, nothing beside


def test_packed_layout_keeps_the_usual_names_and_shapes():
    model = _gpt()
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    assert attn.W_query.weight.shape == (32, 32) and attn.W_key.weight.shape == (16, 32)
    assert attn.W_query.weight.stride() == (1, 64)  # a view of one (32, 32 + 16 + 16) tensor
    assert fused.is_packed((attn.W_query, attn.W_key, attn.W_value))
    assert fused.is_packed((mlp.gate, mlp.fc))
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.tok_emb.weight.stride() == (1, 61)  # tied: stored (d_model, vocab)
    state = model.state_dict()
    assert state["blocks.0.attn.W_value.weight"].shape == (16, 32)
    fresh = _gpt()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(state)  # copies into the views: the layout stays
    assert fused.is_packed((fresh.blocks[0].attn.W_query, fresh.blocks[0].attn.W_key,
                            fresh.blocks[0].attn.W_value))
    ids = torch.tensor([[4, 5, 6]])
    torch.testing.assert_close(fresh(ids), model(ids))


def test_one_row_path_agrees_with_the_layers_and_follows_in_place_edits():
    model = _gpt(qkv_bias=True, mlp_bias=True)
    ids = torch.tensor([[7]])
    with torch.no_grad():
        fast = model(ids)  # one row, no gradients: packed products
    torch.testing.assert_close(fast, model(ids))  # with gradients: layer by layer
    with torch.no_grad():
        model.blocks[1].attn.W_key.weight.mul_(3)
        model.blocks[0].mlp.fc.bias.add_(1)
        model.lm_head.weight[5].mul_(2)
        edited = model(ids)
    torch.testing.assert_close(edited, model(ids))
    assert not torch.allclose(edited, fast)


def test_training_updates_the_packed_weights_in_place():
    model = _gpt().train()
    before = {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 61, (2, 9))
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1),
                                                 ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert model.blocks[0].attn.W_query.weight.grad.shape == (32, 32)
    assert before == {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}
    model.eval()
    one = torch.tensor([[3]])
    with torch.no_grad():
        fast = model(one)
    torch.testing.assert_close(fast, model(one))


def test_a_lost_layout_is_packed_again_without_a_copy_left_behind():
    model = _gpt().double()  # .to() gives each parameter its own tensor
    ids = torch.tensor([[1, 2]])
    want = model(ids)[:, -1:]  # with gradients: layer by layer
    caches = model.new_cache(1, 4)
    with torch.no_grad():
        model(ids[:, :1], caches=caches)
        got = model(ids[:, 1:2], caches=caches)  # one row: packs again, then the product
    assert fused.is_packed((model.blocks[0].attn.W_query, model.blocks[0].attn.W_key,
                            model.blocks[0].attn.W_value))
    assert model.lm_head.weight is model.tok_emb.weight
    torch.testing.assert_close(got[:, -1:], want)
    reachable, params = _held_bytes(model)
    assert reachable == params


def test_hooks_see_their_layer_run():
    model = _gpt()
    seen = []
    model.blocks[0].attn.W_key.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    model.generate(torch.tensor([[1, 2]]), 2, temperature=0)
    assert seen == [(1, 2, 16), (1, 1, 16)]


def test_checkpoints_round_trip_the_packed_model(tmp_path):
    model = _gpt()
    attnlab.save_checkpoint(model, tmp_path / "ck")
    loaded = attnlab.load_checkpoint(tmp_path / "ck")
    blocks = loaded.blocks[1]
    assert fused.is_packed((blocks.attn.W_query, blocks.attn.W_key, blocks.attn.W_value))
    assert loaded.lm_head.weight is loaded.tok_emb.weight
    ids = torch.tensor([[9, 8, 7]])
    torch.testing.assert_close(loaded(ids), model(ids))
    torch.testing.assert_close(loaded.generate(ids, 5, temperature=0),
                               model.generate(ids, 5, temperature=0))


def test_generation_allocates_its_caches_once(monkeypatch):
    model = _gpt()
    calls = []
    real = model.new_cache
    monkeypatch.setattr(model, "new_cache", lambda *a: calls.append(a) or real(*a))
    model.generate([[1, 2, 3], [4]], 6, temperature=0)  # left-padded: a mask too
    assert calls == [(2, 8)]  # 3 + 6 - 1 positions: the last new token is not fed back


def test_bf16_weights_are_packed_by_rows_once():
    """bf16 groups are packed as row blocks (what vdpbf16ps reads): each weight a plain
    contiguous slice of one (sum of out, in) tensor, the tied table (vocab, d_model) rows,
    still the only copy; the one-row product agrees with the layers run one by one."""
    model = _gpt(qkv_bias=True).to(torch.bfloat16)
    ids = torch.tensor([[1, 2]])
    want = model(ids)[:, -1:].float()  # with gradients: layer by layer, torch's bf16 products
    caches = model.new_cache(1, 4)
    with torch.no_grad():
        model(ids[:, :1], caches=caches)
        got = model(ids[:, 1:2], caches=caches).float()  # one row: packs by rows, then streams
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    group = (attn.W_query, attn.W_key, attn.W_value)
    assert fused.is_packed(group) and fused.is_packed((mlp.gate, mlp.fc))
    assert attn.W_query.weight.stride() == (32, 1) and attn.W_key.weight.stride() == (32, 1)
    assert attn.W_key.weight.data_ptr() == attn.W_query.weight.data_ptr() + 32 * 32 * 2
    assert attn.W_value.bias.data_ptr() == attn.W_query.bias.data_ptr() + (32 + 16) * 2
    weight, bias = fused.block(group)
    assert weight.shape == (64, 32) and weight.is_contiguous()
    torch.testing.assert_close(weight, torch.cat([m.weight for m in group]))
    torch.testing.assert_close(bias, torch.cat([m.bias for m in group]))
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.tok_emb.weight.stride() == (32, 1)  # tied: (vocab, d_model) rows
    reachable, params = _held_bytes(model)
    assert reachable == params
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("vocab, rows", [(fused.COLUMNS_MAX_OUT, False),
                                         (fused.COLUMNS_MAX_OUT + 1, True)])
def test_float32_groups_past_the_column_limit_are_packed_by_rows(vocab, rows):
    """A float32 output layer of more than COLUMNS_MAX_OUT outputs is packed by rows (its
    one-row product over columns would pass a partial sum of every output through the
    second-level cache once per input), up to it by columns (and at any width where the
    kernel is known not to run); either way the only copy, the tied table is the same
    tensor, and a decoded token's logits are F.linear's."""
    from attnlab import _native

    rows = rows and not _native.known_unavailable()
    model = _gpt(vocab_size=vocab, num_layers=1)
    weight = model.lm_head.weight
    assert weight is model.tok_emb.weight
    assert weight.stride() == ((32, 1) if rows else (1, vocab))
    assert fused.is_packed((model.lm_head,))
    head, _ = fused.block((model.lm_head,))
    assert head.shape == (vocab, 32) and head.data_ptr() == weight.data_ptr()
    x = torch.randn(1, 1, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = fused.joint(x, (model.lm_head,))
    torch.testing.assert_close(got, x @ weight.detach().t(), rtol=1e-5, atol=1e-5)
    assert weight.stride() == ((32, 1) if rows else (1, vocab))  # not packed again
    reachable, params = _held_bytes(model)
    assert reachable == params
    # The blocks' groups stay columns: the prompt's tile kernel reads them.
    assert model.blocks[0].attn.W_query.weight.stride() == (1, 64)


def test_without_the_kernel_a_wide_output_layer_is_packed_by_columns(monkeypatch):
    """Where the kernel is switched off (or failed to build), MKL multiplies one row by a
    wide output layer faster by columns: a one-row product packs it so, and by rows again
    once the kernel is back; the logits are the same either way, the tied table the same
    tensor, nothing held twice."""
    from attnlab import _native

    vocab = fused.COLUMNS_MAX_OUT + 1
    model = _gpt(vocab_size=vocab, num_layers=1)
    x = torch.randn(1, 1, 32, generator=torch.Generator().manual_seed(3))
    want = x @ model.lm_head.weight.detach().t()
    monkeypatch.setenv(_native.ENV_SWITCH, "0")
    assert _native.known_unavailable() and not fused.by_rows(torch.float32, vocab)
    with torch.no_grad():
        got = fused.joint(x, (model.lm_head,))
    assert model.lm_head.weight.stride() == (1, vocab)
    assert model.lm_head.weight is model.tok_emb.weight
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    head, _ = fused.block((model.lm_head,))
    assert head.stride() == (1, vocab) and head.data_ptr() == model.lm_head.weight.data_ptr()
    reachable, params = _held_bytes(model)
    assert reachable == params
    monkeypatch.delenv(_native.ENV_SWITCH)
    if _native.available():
        with torch.no_grad():
            got = fused.joint(x, (model.lm_head,))
        assert model.lm_head.weight.stride() == (32, 1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture
def in_place_always(monkeypatch):
    """The in-place steps at every size (they start at 65536 elements), so that these
    small models take them."""
    from attnlab.modules import layers

    monkeypatch.setattr(layers, "IN_PLACE_FROM", 0)


def _encoder():
    from attnlab.models import Encoder, EncoderConfig

    torch.manual_seed(0)
    return Encoder(EncoderConfig(vocab_size=50, context_length=32, d_model=32, num_layers=2,
                                 num_heads=4, d_ff=128)).eval()


def _encode(model, ids, mask):
    with torch.inference_mode():
        return model(ids, attention_mask=mask)


def _not_in_place(model, *args, **kwargs):
    """model(*args, **kwargs) in inference with the in-place steps off."""
    from attnlab.modules import layers

    before, layers.IN_PLACE_FROM = layers.IN_PLACE_FROM, float("inf")
    try:
        with torch.inference_mode():
            return model(*args, **kwargs)
    finally:
        layers.IN_PLACE_FROM = before


def test_inference_reuses_its_own_buffers_and_gives_the_same_values(in_place_always):
    # In inference the encoder sums each residual into its branch and runs GELU in
    # place: the same operations on the same numbers as with the steps off, bit for bit.
    model = _encoder()
    ids = torch.randint(1, 50, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    fast = _encode(model, ids, mask)
    torch.testing.assert_close(fast, _not_in_place(model, ids, attention_mask=mask),
                               rtol=0, atol=0)
    # with autograd on, the sums allocate as before and the gradients flow
    slow = model(ids, attention_mask=mask)
    slow.sum().backward()
    assert model.blocks[0].mlp.fc.weight.grad is not None
    torch.testing.assert_close(slow.detach(), fast, rtol=1e-5, atol=1e-5)


def test_outputs_a_hook_kept_are_not_overwritten(in_place_always):
    # A forward hook may keep a layer's output (as interpretability code does); the
    # in-place steps must then leave it as the layer returned it.
    model = _encoder()
    ids = torch.randint(1, 50, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    reference = _encode(model, ids, mask)
    block = model.blocks[0]
    for module in (block.attn, block.mlp, block.mlp.fc, block.attn.out_proj):
        kept: list = []
        handle = module.register_forward_hook(
            lambda m, args, out, kept=kept: kept.append((out, out.clone())))
        try:
            torch.testing.assert_close(_encode(model, ids, mask), reference, rtol=0, atol=0)
        finally:
            handle.remove()
        assert kept, module
        for out, copy in kept:
            assert torch.equal(out, copy), module


def test_an_input_a_pre_hook_kept_is_not_overwritten(in_place_always):
    # With nn.Identity as the output projection, the attention's output is the
    # projection's input: a pre-hook that kept that input must find it unchanged.
    model = _encoder()
    model.blocks[0].attn.out_proj = nn.Identity()
    ids = torch.randint(1, 50, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    kept: list = []
    model.blocks[0].attn.out_proj.register_forward_pre_hook(
        lambda m, args: kept.append((args[0], args[0].clone())))
    _encode(model, ids, mask)
    assert kept and all(torch.equal(x, copy) for x, copy in kept)


def test_a_layer_that_returns_its_input_is_not_written_through(in_place_always):
    # nn.Identity in place of a projection hands back its input: the activation and the
    # residual sum must not then change the tensor the caller passed in.
    model = _encoder()
    model.blocks[0].mlp.fc = nn.Identity()
    model.blocks[0].mlp.proj = nn.Identity()
    x = torch.randn(2, 5, 32)
    before = x.clone()
    with torch.inference_mode():
        out = model.blocks[0].mlp(x)
        torch.testing.assert_close(out, torch.nn.functional.gelu(before))
        assert torch.equal(x, before)
        hidden, _ = model.blocks[0](x, None, False)
    assert torch.equal(x, before)
    assert fused.may_overwrite(model.blocks[1].mlp, torch.randn(3), torch.randn(3))
    shared = torch.randn(4)
    assert not fused.may_overwrite(model.blocks[1].mlp, shared[1:], shared)


def test_a_gpt_block_sums_into_its_branch_only_where_nothing_else_holds_it(in_place_always):
    # GPT's blocks take the same in-place sums in inference (a prompt): the logits are
    # those of the training path, and a hook that kept the attention's output keeps it.
    model = _gpt(num_layers=2)
    ids = torch.randint(0, 61, (2, 11))
    with torch.inference_mode():
        fast = model(ids)
    torch.testing.assert_close(fast, _not_in_place(model, ids), rtol=0, atol=0)
    kept: list = []
    handle = model.blocks[1].attn.register_forward_hook(
        lambda m, args, out: kept.append((out, out.clone())))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), fast, rtol=0, atol=0)
    handle.remove()
    assert kept and all(torch.equal(out, copy) for out, copy in kept)
    calls = []
    original = torch.Tensor.add_

    def counting(self, *args, **kwargs):
        calls.append(self.shape)
        return original(self, *args, **kwargs)

    torch.Tensor.add_ = counting
    try:
        with torch.inference_mode():
            model(ids)
    finally:
        torch.Tensor.add_ = original
    assert len(calls) == 2 * len(model.blocks)  # each block's two sums, in place


def test_a_wrapped_forward_or_a_users_module_keeps_the_steps_off(in_place_always):
    # A forward put on the instance (accelerate's hooks, capture wrappers) may keep what
    # it returns, and so may a user's module (activation patching returns a recorded
    # tensor): the sums and the activation then allocate as before.
    model = _encoder()
    ids = torch.randint(1, 50, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    reference = _encode(model, ids, mask)
    fc = model.blocks[0].mlp.fc
    kept: list = []
    inner = fc.forward

    def recording(x):
        out = inner(x)
        kept.append((out, out.clone()))
        return out

    fc.forward = recording
    torch.testing.assert_close(_encode(model, ids, mask), reference, rtol=0, atol=0)
    assert kept and all(torch.equal(out, copy) for out, copy in kept)
    del fc.forward

    class Patched(nn.Module):  # returns the attention output it was given, every call
        def __init__(self, out):
            super().__init__()
            self.out = out

        def forward(self, x, **kwargs):
            return self.out

    with torch.inference_mode():
        block = model.blocks[0]
        recorded = block.attn(model.embed(ids), mask=mask)
        copy = recorded.clone()
        block.attn = Patched(recorded)
        first, second = model(ids, attention_mask=mask), model(ids, attention_mask=mask)
    assert torch.equal(recorded, copy)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
