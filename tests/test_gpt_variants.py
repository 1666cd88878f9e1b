"""GPTConfig's options for modern decoders (softcaps, ALiBi, sinks, a window on chosen layers,
a query scale, wider heads, Gemma's norms and MLP, scaled and normed embeddings): checked
like the other fields, kept by checkpoints, trainable, decoded exactly (through the fused
decoding step, which runs every one of them), and packed rows (document_ids) give
each document its own logits."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_decode import counting_fused_steps

import attnlab
from attnlab import _native
from attnlab.models import GPT, GPTConfig
from attnlab.models.decoding import _layer
from attnlab.models.gpt import Block

SMALL = dict(vocab_size=40, context_length=32, d_model=24, num_layers=3, num_heads=4,
             num_kv_heads=2)
# Each option as Gemma 2, BLOOM and gpt-oss use it (values large enough to matter).
OPTIONS = {
    "attn_softcap": dict(attn_softcap=0.5),
    "logit_softcap": dict(logit_softcap=0.3),
    "alibi": dict(positions="alibi"),
    "sinks": dict(sinks=True),
    "window_layers": dict(window=3, window_layers=[0, 2]),
    "attn_scale": dict(attn_scale=0.7),
    "head_dim": dict(head_dim=10),
    "post_norms": dict(post_norms=True),
    "rmsnorm_plus_one": dict(norm="rmsnorm_plus_one"),
    "geglu": dict(mlp="geglu"),
    "scale_embeddings": dict(scale_embeddings=True),
    "embed_norm": dict(embed_norm=True),
    "qk_norm": dict(qk_norm=True),
}
EVERYTHING = {k: v for opts in OPTIONS.values() for k, v in opts.items()}


def model_with(seed=0, **options) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**SMALL, "positions": "rope", **options})).eval()
    with torch.no_grad():  # sinks, norms and queries away from their initial values
        for name, p in model.named_parameters():
            if name.endswith("sinks") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
            elif "W_query" in name or "W_key" in name:
                p.mul_(8)
    return model


@pytest.mark.parametrize("bad, match", [
    (dict(window_layers=[0]), r"GPTConfig.window_layers=\[0\] needs a window"),
    (dict(window=3, window_layers=[3]), r"window_layers lists layers \[3\], but there are 3"),
    (dict(window=3, window_layers=[1, 1]), "lists a layer twice"),
    (dict(window=3, window_layers=[-1]), r"window_layers\[0\]"),
    (dict(window=3, window_layers="0,2"), "must be a list of layer indices"),
    (dict(attn_softcap=0.0), "GPTConfig.attn_softcap"),
    (dict(logit_softcap=float("inf")), "GPTConfig.logit_softcap"),
    (dict(attn_scale=-1.0), "GPTConfig.attn_scale"),
    (dict(head_dim=0), "GPTConfig.head_dim"),
    (dict(head_dim=5), "head_dim=5 must be even with positions='rope'"),
    (dict(sinks="yes"), "GPTConfig.sinks"),
    (dict(positions="nope"), r"'learned', 'rope', 'alibi'"),
    (dict(norm="gemma"), "rmsnorm_plus_one"),
    (dict(mlp="swish"), "geglu"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "GPTConfig.rope_scaling="),
    (dict(positions="learned", rope_scaling={"rope_type": "linear", "factor": 2.0}),
     "rope_scaling needs positions='rope'"),
    (dict(qk_norm="yes"), "GPTConfig.qk_norm"),
    (dict(window_rope_scaling={"rope_type": "linear", "factor": 2.0}),
     "window_rope_scaling needs window_rope_base"),
    (dict(positions="learned", window_rope_base=1e4), "window_rope_base needs positions='rope'"),
    (dict(rope_scaling={"rope_type": "factors", "factors": [1.0] * 2}),
     "GPTConfig.rope_scaling has 2 factors, expected one per frequency: head_dim / 2 = 3"),
])
def test_bad_options_are_refused_naming_the_field(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        GPTConfig(**{**SMALL, "positions": "rope", **bad})


def test_the_config_goes_through_json_and_a_checkpoint_unchanged(tmp_path):
    model = model_with(**EVERYTHING)
    cfg = model.config
    assert cfg.window_layers == (0, 2)
    assert GPTConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    attnlab.save_checkpoint(model, tmp_path / "ckpt")
    loaded = attnlab.load_checkpoint(tmp_path / "ckpt")
    assert loaded.config == cfg
    assert all(b.attn.sinks is not None for b in loaded.blocks)
    ids = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_a_rope_scaling_goes_through_a_checkpoint_and_reaches_every_layer(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    model = model_with(rope_scaling=scaling)
    assert all(b.attn.rotary.scaling == scaling for b in model.blocks)
    attnlab.save_checkpoint(model, tmp_path / "ckpt")
    loaded = attnlab.load_checkpoint(tmp_path / "ckpt")
    assert loaded.config == model.config and loaded.config.rope_scaling == scaling
    ids = torch.randint(0, 40, (1, 20))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
        assert not torch.allclose(model_with()(ids), model(ids))  # the scaling counts
        want = model(ids)
    torch.testing.assert_close(_cached_logits(model, ids, 3), want, atol=2e-5, rtol=2e-5)


def test_per_layer_windows_and_options_reach_each_attention():
    model = model_with(**EVERYTHING)
    attns = [b.attn for b in model.blocks]
    assert [a.window for a in attns] == [3, None, 3]
    assert all(a.softcap == 0.5 and a.scale == 0.7 and a.alibi and a.head_dim == 10
               for a in attns)
    assert model.blocks[0].attn.W_query.weight.shape == (40, 24)  # 4 heads of 10
    assert model.blocks[0].attn.out_proj.weight.shape == (24, 40)
    assert model.num_parameters() <= model.config.num_parameters()


def test_a_model_with_every_option_trains():
    # A logit cap that leaves room to learn (0.3 keeps every logit within 0.3 of 0).
    model = model_with(**{**EVERYTHING, "logit_softcap": 5.0}).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 40, (2, 13), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(12):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 40), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all()
                   for p in model.parameters())
        assert all(float(b.attn.sinks.grad.abs().max()) > 0 for b in model.blocks)
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.6 * losses[0], losses


def _cached_logits(model, ids, prompt_len):
    """Logits of the prompt at once, then of each later token alone, through caches."""
    caches = model.new_cache(1, ids.shape[1])
    with torch.no_grad():
        steps = [model(ids[:, :prompt_len], caches=caches)]
        steps += [model(ids[:, t:t + 1], caches=caches) for t in range(prompt_len, ids.shape[1])]
    return torch.cat(steps, dim=1)


@settings(max_examples=15, deadline=None)
@given(chosen=st.sets(st.sampled_from(sorted(OPTIONS)), min_size=1, max_size=4),
       prompt_len=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_decoding_with_caches_is_exact_and_the_fused_step_takes_every_variant(
        chosen, prompt_len, seed):
    """Token by token through the caches gives the logits of the whole sequence, for any
    mix of options, and the fused decoder layers (``_decode.Run``) take every block:
    softcap, ALiBi, sinks, a scale or head width of its own, post-norms, Gemma's norm and
    GeGLU run in the kernel (a Gemma 2 or gpt-oss-style model decodes through it)."""
    options = {k: v for name in chosen for k, v in OPTIONS[name].items()}
    model = model_with(seed, **options)
    ids = torch.randint(0, 40, (1, prompt_len + 7), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = model(ids)
        taken = [_layer(b, Block) is not None for b in model.blocks]
    with counting_fused_steps("layers") as fused:
        got = _cached_logits(model, ids, prompt_len)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert taken == [True] * 3
    steps = 7 + (prompt_len == 1)  # a one-token prompt decodes too
    assert fused[0] == (steps * 3 if _native.available() else 0)
    assert torch.equal(model.generate(ids[:, :prompt_len], 6, temperature=0),
                       model.generate(ids[:, :prompt_len], 6, temperature=0, use_cache=False))


@pytest.mark.parametrize("positions", ["learned", "rope", "alibi"])
def test_packed_rows_give_each_document_its_own_logits(positions):
    """Documents packed into one row with document_ids: each one's logits are those it
    gets alone (positions restart per document, nothing crosses a boundary)."""
    extra = {} if positions == "learned" else dict(attn_softcap=0.5, sinks=True, window=3,
                                                   window_layers=[1])
    model = model_with(positions=positions, **extra)
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 40, (n,), generator=g) for n in (5, 1, 7, 3)]
    row = torch.cat(docs)[None]
    doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    with torch.no_grad():
        packed = model(row, document_ids=doc_ids)[0]
        alone = torch.cat([model(d[None])[0] for d in docs])
        unpacked = model(row)[0]
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    assert float((unpacked[5:] - alone[5:]).abs().max()) > 1e-3  # the ids are what did it


def test_document_ids_are_checked():
    model = model_with()
    ids = torch.randint(0, 40, (2, 6))
    with pytest.raises(ValueError, match=r"document_ids must have the ids' shape \(2, 6\)"):
        model(ids, document_ids=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="document_ids must be an integer tensor"):
        model(ids, document_ids=torch.zeros(2, 6))
    with pytest.raises(ValueError, match="non-decreasing"):
        model(ids, document_ids=torch.tensor([[0, 0, 1, 0, 1, 1]] * 2))
    with pytest.raises(ValueError, match="document_ids is for packed rows scored whole"):
        model(ids, document_ids=torch.zeros(2, 6, dtype=torch.long),
              caches=model.new_cache(2, 8))


def test_wide_heads_and_their_norms_are_checked_and_counted():
    from attnlab.layouts.hf_llama import qwen3_config
    from attnlab.modules import MultiHeadAttention
    from attnlab.training import activation_bytes

    for eps, error in ((-1.0, ValueError), (float("nan"), ValueError), (None, TypeError)):
        with pytest.raises(error, match="qk_norm_eps"):
            MultiHeadAttention(32, 32, 4, qk_norm="rmsnorm", qk_norm_eps=eps)
    # a Qwen3 config.json without head_dim: transformers' default, 128
    qwen3 = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, num_hidden_layers=1, vocab_size=40,
                 max_position_embeddings=32, hidden_act="silu")
    assert qwen3_config(qwen3)["head_dim"] == 128
    assert qwen3_config({**qwen3, "head_dim": 16}).get("head_dim") is None  # 4 x 16 = 64
    # heads 8 times wider than d_model hold 8 times the activations
    wide, narrow = (GPTConfig(**{**SMALL, "positions": "rope", "head_dim": h}) for h in (48, 6))
    assert activation_bytes(wide, 8, 16) > 4 * activation_bytes(narrow, 8, 16)


def test_windowed_layers_turn_with_their_own_rope_and_decode_in_the_kernel(tmp_path):
    # Gemma 3: the sliding layers' RoPE (base 1e4) is not the global layers' (1e6)
    model = model_with(window=3, window_layers=[0, 2], rope_base=1e6, window_rope_base=1e4,
                       window_rope_scaling={"rope_type": "linear", "factor": 2.0})
    rotaries = [b.attn.rotary for b in model.blocks]
    assert [r.base for r in rotaries] == [1e4, 1e6, 1e4] and rotaries[0] is rotaries[2]
    assert rotaries[0].scaling == {"rope_type": "linear", "factor": 2.0}
    assert rotaries[1].scaling is None
    ids = torch.randint(0, 40, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids)
        taken = [_layer(b, Block) is not None for b in model.blocks]
    assert taken == [True] * 3
    with counting_fused_steps("layers") as fused:
        got = _cached_logits(model, ids, 4)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert fused[0] == (8 * 3 if _native.available() else 0)
    attnlab.save_checkpoint(model, tmp_path / "ckpt")
    assert attnlab.load_checkpoint(tmp_path / "ckpt").config == model.config
