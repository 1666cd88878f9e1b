"""Q/K/V ablations on the trained demo model: each does exactly what it claims."""

from __future__ import annotations

import json
import math

import pytest
import torch

from attnlab.checkpoint import load_checkpoint, load_checkpoint_tokenizer
from attnlab.demo import run_demo
from attnlab.experiments import ablation as E
from attnlab.models import GPT, GPTConfig


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    run_demo(str(out), steps=400, seed=0, log=lambda _m: None)
    model, tok = load_checkpoint(out), load_checkpoint_tokenizer(out)
    return model, tok, E.held_out_batch(tok, seed=0)


def test_ablation_measures_are_exact(trained):
    model, _, ids = trained
    r = E.qkv_ablation(model, ids)
    assert r["zero_v"]["max_abs_output"] == 0.0
    assert r["constant_k"]["max_dev_from_uniform"] < 1e-6
    assert r["constant_q"]["max_row_spread"] < 1e-9
    u = E.uniform_attention(model, ids)
    assert u["max_dev_from_uniform"] < 1e-6
    # Every knock-out costs the trained model something.
    for key in ("constant_q", "zero_v", "constant_k"):
        assert r[key]["loss"] > r["baseline"]["loss"] + 0.05, key
    assert u["loss"] > r["baseline"]["loss"] + 0.05
    # and the hooks are gone afterwards
    assert E.lm_loss(model, ids) == pytest.approx(r["baseline"]["loss"])


def test_measures_detect_an_untouched_model(trained):
    """The measures are not zero by construction: without the ablation they are large."""
    model, _, ids = trained
    record: dict = {}
    with E.ablated(model, None, record), torch.no_grad():
        _, attentions = model(ids[:, :-1], output_attentions=True)
    assert E._row_spread(record) > 1.0
    assert max(float(c.abs().max()) for c in record["context"]) > 0.1
    assert E._dev_from_uniform(attentions, record) > 0.3


def test_run_all_json_and_report(trained):
    model, _, ids = trained
    results = E.run_all(model, ids, dropout_steps=30)
    assert set(results) == {"baseline", "constant_q", "zero_v", "constant_k",
                            "uniform_attention", "dropout_placement"}
    assert set(results["dropout_placement"]) == {"none", "weights", "output"}
    for entry in [v for k, v in results.items() if k != "dropout_placement"] + list(
            results["dropout_placement"].values()):
        assert "loss" in entry
    json.dumps(results)
    report = E.format_report(results)
    rows = {line.split()[0]: line for line in report.splitlines()
            if line.strip() and line.split()[0] in set(results) | {"none", "weights", "output"}}
    # every row of the table and every dropout placement carries its own sentence
    for key in ("baseline", "constant_q", "zero_v", "constant_k", "uniform_attention"):
        assert rows[key].endswith(E._MEANING[key].format(**results[key])), key
    for placement, entry in results["dropout_placement"].items():
        vs_none = entry["eval_loss"] - results["dropout_placement"]["none"]["eval_loss"]
        sentence = E._DROPOUT_MEANING[placement].format(vs_none=vs_none)
        assert rows[placement].endswith(sentence), placement
    assert "attention weights" in rows["weights"] and "attention output" in rows["output"]
    # the study trains the demo's model, whatever model the table above measured: said so
    assert "the demo's toy model trained anew on the built-in pattern text, not the model " \
        "above" in report


def test_saliency_points_at_the_token_that_decides(trained):
    model, tok, _ = trained
    ids = torch.tensor(tok.encode("acacaca"))  # next is "c": decided by the "c" before "a"
    s = E.saliency(model, ids)
    assert s.shape == (7,) and torch.isfinite(s).all()
    assert float(s.sum()) == pytest.approx(1.0)
    assert int(s.argmax()) in (5, 6)  # the last "c" or the final "a"


def test_unknown_ablation_is_named(trained):
    model, _, _ = trained
    with pytest.raises(ValueError, match="ablation must be one of"), E.ablated(model, "zero_q"):
        pass


# ---------------------------------------------------------------- RoPE models


def _rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Llama's half-split rotation of ``(B, H, T, D)`` at positions 0..T-1, written here
    independently of attnlab.rope."""
    d = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(x.shape[-2], dtype=torch.float64)[:, None] * inv_freq
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@pytest.fixture(scope="module")
def rope_gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, context_length=32, d_model=32, num_layers=2,
                          num_heads=4, num_kv_heads=2, positions="rope")).eval()
    with torch.no_grad():  # sharpen the scores, which random init keeps near zero
        for mha in E.attention_layers(model):
            mha.W_query.weight.mul_(4)
    ids = torch.randint(0, 50, (2, 13), generator=torch.Generator().manual_seed(0))
    return model, ids


def _scores_from_rotated_qk(model, ids, kind):
    """Per layer, the pre-softmax scores built here from the raw projections (rotated,
    then ablated as ``kind`` defines), and the model's real attention weights."""
    modules = E.attention_layers(model)
    raw: dict = {"q": [], "k": []}
    hooks = [m.W_query.register_forward_hook(lambda _m, _i, o: raw["q"].append(o))
             for m in modules]
    hooks += [m.W_key.register_forward_hook(lambda _m, _i, o: raw["k"].append(o))
              for m in modules]
    try:
        with E.ablated(model, kind), torch.no_grad():
            _, weights = model(ids, output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    scores = []
    for mha, q, k in zip(modules, raw["q"], raw["k"]):
        b, t, _ = q.shape
        q = _rope(q.double().view(b, t, mha.num_heads, mha.head_dim).transpose(1, 2))
        k = _rope(k.double().view(b, t, mha.num_kv_heads, mha.head_dim).transpose(1, 2))
        k = k.repeat_interleave(mha.num_heads // mha.num_kv_heads, dim=1)
        if kind == "constant_q":
            q = q[:, :, :1].expand_as(q)
        elif kind == "constant_k":
            k = k[:, :, :1].expand_as(k)
        scores.append(q @ k.transpose(-1, -2) / math.sqrt(mha.head_dim))
    return scores, weights


@pytest.mark.parametrize("kind", [None, "constant_q", "constant_k"])
def test_rope_measures_match_scores_from_rotated_qk(rope_gpt, kind):
    """On a RoPE model the ablations and measures act on the rotated q/k attention sees."""
    model, ids = rope_gpt
    x = ids[:, :-1]
    scores, weights = _scores_from_rotated_qk(model, x, kind)
    causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
    spread = 0.0
    for s, w in zip(scores, weights):
        # these are the real scores: their softmax is the model's attention
        torch.testing.assert_close(s.masked_fill(~causal, -math.inf).softmax(-1), w.double(),
                                   atol=1e-5, rtol=1e-5)
        hi = s.masked_fill(~causal, -math.inf).amax(dim=-2)
        lo = s.masked_fill(~causal, math.inf).amin(dim=-2)
        spread = max(spread, float((hi - lo).max()))
    record: dict = {}
    with E.ablated(model, kind, record), torch.no_grad():
        model(x)
    assert E._row_spread(record) == pytest.approx(spread, abs=1e-6)
    r = E.qkv_ablation(model, ids)
    if kind is None:
        assert spread > 0.1  # rows differ: the measure is not zero by construction
    elif kind == "constant_q":
        assert spread < 1e-9
        assert r["constant_q"]["max_row_spread"] == pytest.approx(spread, abs=1e-9)
    else:
        assert r["constant_k"]["max_dev_from_uniform"] < 1e-6


@pytest.mark.slow
def test_cli_ablate_without_ckpt_trains_the_demo_model_first(tmp_path, monkeypatch, capsys):
    import attnlab.cli.ablate
    from attnlab.cli import main

    # What only this test checks is the path without --ckpt: the demo model is trained
    # first and the report is written. That the ablations raise the loss is
    # test_ablation_measures_are_exact's job, on a trained model; a short run suffices here.
    monkeypatch.setattr(attnlab.cli.ablate, "_DEMO_STEPS", 40)
    monkeypatch.chdir(tmp_path)  # the demo model goes to ./attnlab-demo by default
    assert main(["ablate", "--json", "ab.json"]) == 0
    out = capsys.readouterr().out
    assert "training the demo model first (40 steps" in out
    assert (tmp_path / "attnlab-demo" / "model.safetensors").exists()
    results = json.loads((tmp_path / "ab.json").read_text())
    assert results.pop("written_by") == f"attnlab {attnlab.__version__}"  # its signature
    assert set(results) == {"baseline", "constant_q", "zero_v", "constant_k",
                            "uniform_attention", "dropout_placement"}
    assert set(results["dropout_placement"]) == {"none", "weights", "output"}


def test_the_uniform_ablations_are_uniform_on_an_alibi_model_with_sinks():
    # constant_k and uniform_attention promise equal weights: ALiBi's distance penalty
    # and the sinks are set aside while they run, and come back after.
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=30, context_length=16, d_model=32, num_layers=2,
                          num_heads=4, positions="alibi", sinks=True)).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.sinks.fill_(1.5)
    ids = torch.randint(0, 30, (2, 12), generator=torch.Generator().manual_seed(0))
    before = E.lm_loss(model, ids)
    r = E.qkv_ablation(model, ids)
    assert r["constant_k"]["max_dev_from_uniform"] < 1e-6
    assert E.uniform_attention(model, ids)["max_dev_from_uniform"] < 1e-6
    assert E.lm_loss(model, ids) == before
    assert all(float(b.attn.sinks.min()) == 1.5 for b in model.blocks)
