"""The decoders that need attention's variants, saved with save_pretrained and loaded from
the folder: Gemma 2 (softcapped scores and logits, a window on every other layer, its
query scale, wider heads, four norms a layer), BLOOM (ALiBi, its per-head q|k|v, the
embedding norm), Qwen2 with a window on some layers only and Qwen3 (a norm over each
head's queries and keys, heads of their own width). Logits, hidden states and
greedy tokens equal transformers' (eager attention) on sequences longer than the window,
with weights large enough that every variant changes the numbers."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers as T  # noqa: E402
from test_cli_models import WORDS, _tokenizer  # noqa: E402
from test_decode import counting_fused_steps  # noqa: E402

from attnlab import _native  # noqa: E402
from attnlab.cli import main  # noqa: E402
from attnlab.layouts.common import ShapeMismatch  # noqa: E402
from attnlab.models import GPT  # noqa: E402
from attnlab.models.decoding import _layer  # noqa: E402
from attnlab.models.gpt import Block  # noqa: E402
from attnlab.modules.scores import alibi_slopes  # noqa: E402

VOCAB = len(WORDS)  # the CLI test's word-level tokenizer fits every model here
IDS = dict(pad_token_id=0, bos_token_id=0, eos_token_id=0)


def _sharpen(hf, *, norms=0.0, biases=0.0, qk=1.0, seed=0):
    """Weights away from their initialisation, so each variant moves the numbers: norm
    weights and biases random, queries and keys larger (scores of several units: the
    softcap bites, ALiBi's slopes and the window matter against them), the output layer
    8 times larger (logits of several units: the final softcap bites, greedy steps are
    not near-ties)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8)  # tied: the embedding too (the models norm it first)
        for name, p in hf.named_parameters():
            if norms and "norm" in name and name.endswith("weight"):
                p.add_(torch.randn(p.shape, generator=g) * norms)
            elif biases and name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=g) * biases)
            elif qk != 1.0 and any(k in name for k in ("q_proj", "k_proj",
                                                       "query_key_value")):
                p.mul_(qk)
    return hf.eval()


# The decoders' shared shape: 48 wide, 2 kv heads, a window of 4 on some layers, 64
# positions; each model's own fields beside it.
SMALL = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_key_value_heads=2,
             max_position_embeddings=64, sliding_window=4, attn_implementation="eager", **IDS)


def _made(config, model, fields: dict, kw: dict, **sharpen):
    torch.manual_seed(0)
    return _sharpen(model(config(**{**SMALL, **fields, **kw})), **sharpen)


def gemma2(**kw):
    return _made(T.Gemma2Config, T.Gemma2ForCausalLM, dict(
        num_hidden_layers=3, num_attention_heads=4, head_dim=16,  # 4 * 16 != 48
        query_pre_attn_scalar=24, attn_logit_softcapping=1.5, final_logit_softcapping=2.0),
        kw, norms=0.5, qk=12.0)


def bloom(**kw):
    torch.manual_seed(0)
    cfg = T.BloomConfig(**{**dict(vocab_size=VOCAB, hidden_size=48, n_layer=2, n_head=6,
                                  **IDS), **kw})  # 6 heads: the slopes of 4, then 2 more
    return _sharpen(T.BloomForCausalLM(cfg), norms=0.3, biases=0.3, qk=4.0)


def qwen2(**kw):
    return _made(T.Qwen2Config, T.Qwen2ForCausalLM, dict(
        num_hidden_layers=3, num_attention_heads=6, use_sliding_window=True,
        max_window_layers=1), kw, biases=0.5, qk=4.0)


def qwen3(**kw):
    return _made(T.Qwen3Config, T.Qwen3ForCausalLM, dict(
        num_hidden_layers=3, num_attention_heads=4, head_dim=16,  # 4 * 16 != 48
        use_sliding_window=True, max_window_layers=2), kw, norms=0.5, qk=4.0)


def gemma3(**kw):
    return _made(T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(
        num_hidden_layers=7, num_attention_heads=4, head_dim=16,  # 4 * 16 != 48
        query_pre_attn_scalar=24, final_logit_softcapping=2.0, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},  # global:
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}),
        kw, norms=0.5, qk=4.0)


MODELS = {"gemma2": gemma2, "bloom": bloom, "qwen2-window-on-some-layers": qwen2,
          "qwen3": qwen3, "gemma3": gemma3}


def _diff(a, b) -> float:
    return float((a - b).abs().max())


@pytest.fixture(scope="module", params=sorted(MODELS))
def loaded(request, tmp_path_factory):
    hf = MODELS[request.param]()
    folder = tmp_path_factory.mktemp("hf") / request.param
    hf.save_pretrained(folder)
    _tokenizer(folder)
    return request.param, hf, GPT.from_hf(folder), folder


def _left_padded():
    """Two rows of 14 tokens (longer than the windows), the second left-padded by 5."""
    ids = torch.randint(4, VOCAB, (2, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return ids.masked_fill(mask == 0, 0), mask, (mask.cumsum(1) - 1).clamp(min=0)


def test_logits_and_hidden_states_are_transformers(loaded):
    name, hf, ours, _ = loaded
    ids, mask, positions = _left_padded()
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
        got, hidden = ours(ids, attention_mask=mask, positions=positions,
                           output_hidden_states=True)
    real = mask.bool()
    assert _diff(got[real], want.logits[real]) < 1e-4, name
    assert len(hidden) == len(want.hidden_states)
    for i, (h, w) in enumerate(zip(hidden, want.hidden_states)):
        assert _diff(h[real], w[real]) < 1e-4, (name, i)


def test_a_live_model_loads_as_its_folder(loaded):
    _, hf, from_folder, _ = loaded
    live = GPT.from_hf(hf)
    assert live.config == from_folder.config
    ids = torch.randint(4, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(live(ids), from_folder(ids))


@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_tokens_are_transformers(loaded, batch):
    name, hf, ours, _ = loaded
    prompt = torch.randint(4, VOCAB, (batch, 5), generator=torch.Generator().manual_seed(2))
    got = ours.generate(prompt, 12, temperature=0)  # 17 tokens: past every window
    want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                       do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(got, want), name


def test_the_options_map_and_each_one_matters(loaded):
    """The config says what transformers' does, and undoing any one option moves the
    logits: the match above is not one of numbers too small to tell."""
    name, hf, ours, _ = loaded
    cfg = ours.config
    ids = torch.randint(4, VOCAB, (1, 14), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base = ours(ids)
    undo = []
    if name == "gemma2":
        assert (cfg.head_dim, cfg.attn_softcap, cfg.logit_softcap) == (16, 1.5, 2.0)
        assert cfg.attn_scale == 24 ** -0.5 and cfg.window == 4 and cfg.window_layers == (0, 2)
        assert cfg.norm == "rmsnorm_plus_one" and cfg.mlp == "geglu" and cfg.post_norms
        undo = ["softcap", "scale", "window", "logit_softcap"]
    elif name == "bloom":
        assert cfg.positions == "alibi" and cfg.embed_norm and cfg.num_heads == 6
        undo = ["_alibi_slopes"]
    elif name == "gemma3":  # five local layers to one global, each with its RoPE
        assert cfg.qk_norm and cfg.head_dim == 16 and cfg.attn_softcap is None
        assert cfg.window == 4 and cfg.window_layers == (0, 1, 2, 3, 4, 6)
        assert (cfg.window_rope_base, cfg.window_rope_scaling) == (1e4, None)
        assert (cfg.rope_base, cfg.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
        assert cfg.logit_softcap == 2.0 and cfg.norm == "rmsnorm_plus_one" and cfg.post_norms
        one_rope = GPT(dataclasses.replace(cfg, window_rope_base=None))
        one_rope.load_state_dict(ours.state_dict())
        with torch.no_grad():  # the local layers' own RoPE counts
            assert _diff(one_rope(ids), base) > 1e-3
        undo = ["q_norm", "k_norm", "window", "logit_softcap"]
    elif name == "qwen3":
        assert cfg.qk_norm and cfg.head_dim == 16 and not cfg.qkv_bias and not cfg.out_bias
        assert cfg.window == 4 and cfg.window_layers == (2,)
        undo = ["q_norm", "k_norm", "window"]
    else:
        assert cfg.window == 4 and cfg.window_layers == (1, 2)
        undo = ["window"]
    for attr in undo:  # each option set to None (its default), one at a time
        owners = ([ours.config] if attr == "logit_softcap" else
                  [b.attn for b in ours.blocks if getattr(b.attn, attr) is not None])
        kept = [getattr(o, attr) for o in owners]
        for o in owners:
            setattr(o, attr, None)
        try:
            with torch.no_grad():
                assert _diff(ours(ids), base) > 1e-3, (name, attr)
        finally:
            for o, v in zip(owners, kept):
                setattr(o, attr, v)


def test_the_fused_decoding_step_takes_every_block_and_decodes_the_hf_tokens(loaded):
    """Gemma 2's softcap, query scale, post-norms, (1 + weight) RMSNorm and GeGLU, BLOOM's
    ALiBi, Qwen2's per-layer windows and Qwen3's q/k norms all run in the fused decoder
    layers: every block is taken, and greedy decoding through them gives transformers'
    tokens."""
    name, hf, ours, _ = loaded
    with torch.no_grad():  # the step decodes without gradients
        taken = [_layer(b, Block) is not None for b in ours.blocks]
    assert taken == [True] * len(taken)
    prompt = torch.tensor([[4, 5, 6]])
    with counting_fused_steps("layers") as fused:
        got = ours.generate(prompt, 8, temperature=0)
    assert fused[0] == (7 * len(taken) if _native.available() else 0)  # the 1st from the prompt
    want = hf.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                       pad_token_id=0, eos_token_id=None)
    assert torch.equal(got, want), name


def test_generate_from_the_folder_on_the_command_line(loaded, capsys):
    name, hf, ours, folder = loaded
    assert main(["generate", "--model", str(folder), "--prompt", "the cat sat",
                 "--max-new-tokens", "8", "--temperature", "0"]) == 0
    out = capsys.readouterr().out.split()
    want = hf.generate(torch.tensor([[4, 5, 6]]), max_new_tokens=8, min_new_tokens=8,
                       do_sample=False, pad_token_id=0, eos_token_id=None)[0, 3:].tolist()
    # the CLI stops at end-of-text (0; a plain word of this tokenizer, so printed)
    want = want[:want.index(0) + 1] if 0 in want else want
    assert out == ["the", "cat", "sat", *(WORDS[i] for i in want)], name


@pytest.mark.parametrize("heads", range(1, 41))
def test_alibi_slopes_are_blooms_for_any_head_count(heads):
    # build_alibi_tensor is public in every transformers release (its slope helper is
    # private and came later): the bias at distance 1 is each head's slope.
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    bias = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)  # (heads, 1, 2)
    assert torch.equal(alibi_slopes(heads), bias[:, 0, 1])


def test_bloom_with_the_residual_after_the_norm_is_refused_naming_it(tmp_path):
    bloom(apply_residual_connection_post_layernorm=True).save_pretrained(tmp_path / "b")
    with pytest.raises(ValueError, match="apply_residual_connection_post_layernorm=True is "
                                         "not supported"):
        GPT.from_hf(tmp_path / "b")


def test_a_bloom_query_key_value_of_the_wrong_width_is_refused_naming_it():
    hf = bloom()
    state = hf.state_dict()
    state["transformer.h.1.self_attention.query_key_value.weight"] = torch.zeros(96, 48)

    class Wrong:
        config = hf.config

        def state_dict(self):
            return state

    with pytest.raises(ShapeMismatch, match=r"'transformer.h.1.self_attention.query_key_value"
                                            r".weight' has shape \(96, 48\), expected "
                                            r"\(144, 48\)"):
        GPT.from_hf(Wrong())


def test_gemma2_with_another_activation_or_bidirectional_attention_is_refused():
    with pytest.raises(ValueError, match="config hidden_activation='silu' is not supported"):
        GPT.from_hf(gemma2(hidden_activation="silu"))
    with pytest.raises(ValueError, match="use_bidirectional_attention=True is not supported"):
        GPT.from_hf(gemma2(use_bidirectional_attention=True))



def test_a_gemma3_config_in_the_older_fields_maps_as_transformers_reads_it():
    # config.json files on the Hub still carry rope_theta, rope_local_base_freq,
    # rope_scaling and sliding_window_pattern instead of rope_parameters and layer_types
    from attnlab.layouts.hf_gemma2 import gemma3_config

    older = dict(model_type="gemma3_text", vocab_size=VOCAB, hidden_size=48,
                 intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=16, sliding_window=512,
                 sliding_window_pattern=4, rope_theta=1e6, rope_local_base_freq=1e4,
                 rope_scaling={"rope_type": "linear", "factor": 8.0},
                 attn_logit_softcapping=None, final_logit_softcapping=None)
    got = gemma3_config(older)
    want = T.Gemma3TextConfig(**{k: v for k, v in older.items() if k != "model_type"})
    assert tuple(got["window_layers"]) == tuple(
        i for i, kind in enumerate(want.layer_types) if kind == "sliding_attention") == (
        0, 1, 2, 4, 5, 6)
    assert (got["rope_base"], got["rope_scaling"]) == (
        want.rope_parameters["full_attention"]["rope_theta"], {"rope_type": "linear",
                                                                "factor": 8.0})
    assert got["window_rope_base"] == want.rope_parameters["sliding_attention"]["rope_theta"]
    assert got["qk_norm"] and got["logit_softcap"] is None and got["attn_softcap"] is None
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        gemma3_config({**older, "use_bidirectional_attention": True})


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3", "gemma2"])
def test_absent_window_fields_take_transformers_defaults(model_type):
    # config.json files written by hand or by older tools leave sliding_window or
    # max_window_layers out: transformers' config classes fill in 4096 and 28 (30 layers
    # here, so two slide); an explicit null stays full attention
    from attnlab.layouts.hf_gemma2 import gemma2_config
    from attnlab.layouts.hf_llama import mistral_config, qwen2_config, qwen3_config

    read = dict(mistral=mistral_config, qwen2=qwen2_config, qwen3=qwen3_config,
                gemma2=gemma2_config)[model_type]
    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=30,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               max_position_embeddings=8192)
    if model_type.startswith("qwen"):
        cfg["use_sliding_window"] = True
    want = T.AutoConfig.for_model(model_type, **cfg)
    windows = {i for i, kind in enumerate(getattr(want, "layer_types", None) or [])
               if kind == "sliding_attention"} if model_type != "mistral" else None
    got = read(cfg)
    assert got["window"] == want.sliding_window == 4096
    if windows is not None:
        assert set(got["window_layers"]) == windows
        if model_type.startswith("qwen"):
            assert windows == {28, 29}
    assert read({**cfg, "sliding_window": None})["window"] is None


def test_gemma3s_rope_fields_are_read_as_transformers_reads_them(tmp_path):
    # beside rope_parameters per layer kind: a rope_scaling scales the global layers, the
    # older base fields give the bases the kinds leave out, and a llama3 scaling takes the
    # model's own context; a null sliding_window with sliding layers is refused
    import json

    hf = gemma3()
    folder = tmp_path / "g3"
    hf.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    ids = torch.randint(4, VOCAB, (1, 20), generator=torch.Generator().manual_seed(4))
    edits = [
        {"rope_scaling": {"rope_type": "linear", "factor": 3.0}},
        {"rope_parameters": {"full_attention": {"rope_type": "default"},
                             "sliding_attention": {"rope_type": "default"}},
         "rope_theta": 777.0, "rope_local_base_freq": 55.0},
        {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "llama3", "factor": 8.0,
                                                   "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0,
                                                   "rope_theta": 100.0}}},
    ]
    for edit in edits:
        (folder / "config.json").write_text(json.dumps({**config, **edit}))
        peer = T.Gemma3ForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        with torch.no_grad():
            assert _diff(GPT.from_hf(folder)(ids), peer(ids).logits) < 1e-4, edit
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    with pytest.raises(ValueError, match="sliding_window=None with sliding layers"):
        GPT.from_hf(folder)
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gemma3"}))
    with pytest.raises(ValueError, match="image-and-text model"):
        GPT.from_hf(folder)
