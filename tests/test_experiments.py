"""Q/K/V ablations on the trained demo model: each does exactly what it claims."""

from __future__ import annotations

import json

import pytest
import torch

from attnlab import experiments as E
from attnlab.checkpoint import load_checkpoint, load_checkpoint_tokenizer
from attnlab.demo import run_demo


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
    for key in ("baseline", "constant_q", "zero_v", "constant_k", "uniform_attention"):
        assert key in report


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
