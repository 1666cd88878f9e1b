"""What each head does (attnlab.heads.classify): the probes against hand-computed patterns and
a loop-by-loop reference, a model whose weights were set to hold a previous-token head and a
sink head, and the proof that only the weights the model returns are read."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from attnlab import heads
from attnlab.cli import main
from attnlab.models import GPT, GPTConfig
from attnlab.text import CharTokenizer, WordTokenizer

ALPHABET = "abcdefghijklmnopqrstuvwxyz"


# --------------------------------------------------------------------------- the probes


def reference_scores(w: np.ndarray, ids: list[int]) -> dict[str, np.ndarray]:
    """The probes of attnlab.experiments.head_kinds, one row at a time: ``w`` is
    ``(heads, T, T)`` for one sequence ``ids``."""
    t = len(ids)
    rows = {k: [] for k in heads.KINDS}
    for i in range(1, t):
        rows["previous-token"].append(w[:, i, i - 1])
        rows["sink"].append(w[:, i, 0])
        rows["self"].append(w[:, i, i])
    for i in range(t):
        same = [j for j in range(i) if ids[j] == ids[i]]
        if same:
            rows["duplicate-token"].append(sum(w[:, i, j] for j in same))
        after = {j + 1 for j in range(i - 1) if ids[j] == ids[i]}
        if after:
            rows["induction"].append(sum(w[:, i, j] for j in after))
    return {k: np.mean(v, axis=0) if v else np.zeros(w.shape[0]) for k, v in rows.items()}


def patterns(ids: list[int]) -> np.ndarray:
    """``(6, T, T)`` rows that each follow one rule exactly, and a uniform causal head."""
    t = len(ids)
    w = np.zeros((6, t, t))
    for i in range(t):
        w[0, i, max(i - 1, 0)] = 1  # previous token (row 0: itself)
        w[1, i, 0] = 1  # sink
        w[2, i, i] = 1  # self
        after = [j + 1 for j in range(i - 1) if ids[j] == ids[i]]
        w[3, i, after[-1] if after else 0] = 1  # induction, else the first token
        same = [j for j in range(i) if ids[j] == ids[i]]
        w[4, i, same[-1] if same else i] = 1  # duplicate, else itself
        w[5, i, :i + 1] = 1 / (i + 1)  # uniform over what a causal head may see
    return w


def test_probes_score_hand_computed_patterns():
    ids = [7, 3, 9, 4, 7, 3, 9, 4]  # four tokens, repeated: rows 4..7 are the second copy
    got = heads.probe_scores(torch.tensor(patterns(ids))[None], torch.tensor([ids]))
    score = {k: v.numpy() for k, v in got.items()}
    uniform = sum(1 / (i + 1) for i in range(1, 8)) / 7  # rows 1..7 of the uniform head
    later = sum(1 / (i + 1) for i in range(4, 8)) / 4  # its rows 4..7, the second copy
    # each rule's own head scores 1; the others as counted by hand over the rows: e.g. the
    # sink head's row 1 is on position 0 = i - 1, one previous-token hit in 7 rows
    assert score["previous-token"] == pytest.approx([1, 1 / 7, 0, 1 / 7, 0, uniform])
    assert score["sink"] == pytest.approx([1 / 7, 1, 0, 3 / 7, 1 / 7, uniform])
    assert score["self"] == pytest.approx([0, 0, 1, 0, 3 / 7, uniform])
    # rows 4..7 repeat row i-4: induction targets i-3, duplicate-token targets i-4
    assert score["induction"] == pytest.approx([0, 0, 0, 1, 0, later])
    assert score["duplicate-token"] == pytest.approx([0, 1 / 4, 0, 0, 1, later])


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 12), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_probes_equal_a_row_by_row_reference(t, batch, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 4, size=(batch, t))  # small vocabulary: many repeats
    scores = rng.normal(size=(batch, 3, t, t)) * 2
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    got = heads.probe_scores(torch.tensor(w), torch.tensor(ids))
    for kind in heads.KINDS:  # rows of every sequence pooled: the reference of the batch
        per = [reference_scores(w[b], ids[b].tolist()) for b in range(batch)]
        counts = [_rows(kind, ids[b].tolist()) for b in range(batch)]
        want = sum(p[kind] * c for p, c in zip(per, counts)) / max(sum(counts), 1)
        np.testing.assert_allclose(got[kind].numpy(), want, atol=1e-12)


def _rows(kind: str, ids: list[int]) -> int:
    t = len(ids)
    if kind in ("previous-token", "sink", "self"):
        return t - 1
    if kind == "duplicate-token":
        return sum(any(ids[j] == ids[i] for j in range(i)) for i in range(t))
    return sum(any(ids[j] == ids[i] for j in range(i - 1)) for i in range(t))


def test_probe_input_is_two_copies_of_distinct_ordinary_tokens():
    tok = WordTokenizer(["the", "cat", "sat", "on", "mat", "a"])  # adds <pad> and <unk>
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=16, d_model=16,
                          num_layers=1, num_heads=2))
    result = heads.classify(model, tok, batch=3)
    assert result["probe"] == {"length": 6, "batch": 3, "seed": 0}  # the 6 words, not the 2
    ids = heads.probe_ids(range(6), 6, 3, seed=0)
    assert ids.shape == (3, 12) and torch.equal(ids[:, :6], ids[:, 6:])
    assert all(sorted(row[:6].tolist()) == list(range(6)) for row in ids)
    with pytest.raises(ValueError, match=r"length \(--length\) must be in \[2, 6\].*got 7"):
        heads.classify(model, tok, length=7)
    with pytest.raises(ValueError, match="min_score"):
        heads.classify(model, tok, min_score=1.5)
    # a context of 3 tokens has no room for a repeated pair: said so, not "in [2, 1]"
    short = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=3, d_model=16,
                          num_layers=1, num_heads=2))
    with pytest.raises(ValueError, match=r"context of 3 tokens leave no room") as info:
        heads.classify(short, tok)
    assert "[2, 1]" not in str(info.value)


# --------------------------------------------------------------------------- a model built to know


T_CTX, D_HEAD = 16, 16


def built_model(prev=(1, 2), sink=(0, 1)) -> tuple[GPT, CharTokenizer]:
    """A GPT whose weights make head ``prev`` attend to position i-1 and head ``sink`` to
    position 0: one-hot learned positions in the residual stream (no token embedding, no
    layer writes back, so every layer reads them), RMSNorm (which scales a one-hot vector
    by 8 and adds nothing), and for the built heads W_query = c I and W_key = c S (S: the
    shift by one position), or a rank-one pair that only position 0 answers."""
    tok = CharTokenizer.from_text(ALPHABET)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=T_CTX, d_model=64,
                          num_layers=2, num_heads=4, norm="rmsnorm")).eval()
    c = 2.0  # scores 64 c^2 / sqrt(16) = 64 on the chosen key, 0 on the others
    with torch.no_grad():
        model.tok_emb.weight.zero_()
        model.pos_emb.weight.zero_()
        model.pos_emb.weight[:, :T_CTX] = torch.eye(T_CTX)
        for block in model.blocks:
            for linear in (block.attn.out_proj, block.mlp.proj):
                linear.weight.zero_()
                linear.bias.zero_()
        layer, h = prev
        rows = slice(h * D_HEAD, (h + 1) * D_HEAD)
        attn = model.blocks[layer].attn
        attn.W_query.weight[rows] = 0
        attn.W_key.weight[rows] = 0
        attn.W_query.weight[rows, :T_CTX] = c * torch.eye(T_CTX)
        attn.W_key.weight[rows, :T_CTX] = c * torch.diag(torch.ones(T_CTX - 1), -1)
        layer, h = sink
        attn = model.blocks[layer].attn
        attn.W_query.weight[h * D_HEAD:(h + 1) * D_HEAD] = 0
        attn.W_key.weight[h * D_HEAD:(h + 1) * D_HEAD] = 0
        attn.W_query.weight[h * D_HEAD, :T_CTX] = c
        attn.W_key.weight[h * D_HEAD, 0] = c
    return model, tok


def test_a_built_previous_token_head_and_sink_head_are_found_exactly():
    model, tok = built_model(prev=(1, 2), sink=(0, 1))
    result = heads.classify(model, tok)
    prev, sink = np.array(result["scores"]["previous-token"]), np.array(result["scores"]["sink"])
    assert prev[1, 2] > 0.999 and sink[0, 1] > 0.999
    others = np.ones_like(prev, bool)
    others[1, 2] = others[0, 1] = False
    for kind in heads.KINDS:  # every other head stays near uniform (0.16 over 16 positions)
        assert np.array(result["scores"][kind])[others].max() < 0.3, kind
    assert result["kind"] == [["other", "sink", "other", "other"],
                              ["other", "other", "previous-token", "other"]]
    labels = heads.head_labels(result)
    assert labels[1][2] == "previous-token 1.00" and labels[0][1] == "sink 1.00"
    assert labels[0][0].startswith("other (")
    table = heads.format_kinds(result)
    assert "previous-token 1.00" in table and "found: 1 previous-token, 1 sink, 6 other" in table


class PatternModel(nn.Module):
    """No attention module at all: its forward returns hand-made weights built from the ids
    (layer 0: induction, duplicate-token, self, uniform), so the classifier can only have read
    what forward returned."""

    context_length = 20

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def forward(self, ids, **kw):
        self.calls.append(kw)
        w = torch.stack([torch.tensor(patterns(row.tolist())[[3, 4, 2, 5]]) for row in ids])
        return torch.zeros(*ids.shape, 30), [w.float()]


def test_the_classifier_reads_only_the_weights_the_model_returns():
    model = PatternModel().train()
    tok = CharTokenizer.from_text(ALPHABET)
    result = heads.classify(model, tok, seed=3)
    assert model.calls == [{"output_attentions": True}] and model.training  # put back
    assert result["kind"] == [["induction", "duplicate-token", "self", "other"]]
    assert result["score"][0][:3] == pytest.approx([1.0, 1.0, 1.0])
    # a real model whose returned weights are swapped for the self pattern: every head reads
    # "self" now, whatever its parameters (and hooks) would say
    gpt, _ = built_model()
    real = gpt.forward

    def swapped(ids, **kw):
        out, atts = real(ids, **kw)
        eye = torch.eye(ids.shape[1]).expand_as(atts[0])
        return out, [eye.clone() for _ in atts]

    gpt.forward = swapped
    assert heads.classify(gpt, tok)["kind"] == [["self"] * 4] * 2


def test_many_probe_sequences_run_a_few_at_a_time_with_the_same_scores(monkeypatch):
    """Helper-found: --batch 100000 asked for every layer's (batch, heads, T, T) weights at
    once (29 GB, a traceback). The probe now runs a few sequences a forward, and the sums
    over the rows add up to the scores of one forward over all of them."""
    from attnlab.experiments import head_kinds

    gpt, tok = built_model()
    whole = heads.classify(gpt, tok, batch=5, seed=1)
    calls = []
    real = gpt.forward

    def counted(ids, **kw):
        calls.append(ids.shape[0])
        return real(ids, **kw)

    gpt.forward = counted
    # room for two sequences' weights a forward (2 layers x 4 heads x T x T floats)
    t = 2 * whole["probe"]["length"]
    monkeypatch.setattr(head_kinds, "PROBE_BYTES", 2 * (2 * 4) * t * t * 4)
    parts = heads.classify(gpt, tok, batch=5, seed=1)
    assert calls == [2, 2, 1]
    for kind in whole["kinds"]:
        np.testing.assert_allclose(parts["scores"][kind], whole["scores"][kind], atol=1e-12)
    assert parts["kind"] == whole["kind"]


def test_a_model_that_returns_no_weights_is_refused():
    class Silent(nn.Module):
        context_length = 16

        def forward(self, ids, **kw):
            return torch.zeros(*ids.shape, 30)

    with pytest.raises(TypeError, match=r"output_attentions=True\) to return"):
        heads.classify(Silent(), CharTokenizer.from_text(ALPHABET))


# --------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def built_ckpt(tmp_path_factory):
    from attnlab import save_checkpoint

    model, tok = built_model()
    return save_checkpoint(model, tmp_path_factory.mktemp("ck") / "built", tokenizer=tok)


def test_heads_command_prints_the_table_and_writes_json_and_a_picture(built_ckpt, tmp_path,
                                                                      capsys):
    out = tmp_path / "h"
    assert main(["heads", "--ckpt", str(built_ckpt), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "    1 (" in printed and "previous-token 1.00" in printed and "sink 1.00" in printed
    saved = json.loads((out / "heads.json").read_text())
    assert saved["source"] == str(built_ckpt)
    assert saved["kind"][1][2] == "previous-token" and saved["kind"][0][1] == "sink"
    assert (out / "heads.png").read_bytes()[:4] == b"\x89PNG"
    # again, as SVG, into the folder it wrote: allowed; a folder of the user's: refused
    assert main(["heads", "--ckpt", str(built_ckpt), "--out", str(out), "--format", "svg"]) == 0
    assert b"<svg" in (out / "heads.svg").read_bytes()[:400]
    # the earlier run's PNG (signed: attnlab's) is gone, not left to show an older probe
    assert not (out / "heads.png").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["heads", "--ckpt", str(built_ckpt), "--out", str(tmp_path / "mine")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "notes.txt" in err[0]
    assert main(["heads", "--ckpt", str(built_ckpt), "--out", str(out), "--length", "9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--length" in err[0] and "got 9" in err[0]


def test_show_classify_labels_the_heads_in_the_picture_and_the_page(built_ckpt, tmp_path):
    out = tmp_path / "s"
    assert main(["show", "abcdefgh", "--ckpt", str(built_ckpt), "--classify", "--out",
                 str(out)]) == 0
    html = (out / "attention.html").read_text()
    payload = json.loads(html.split('id="attnlab-data">')[1].split("</script>")[0])
    assert payload["labels"][1][2] == "previous-token 1.00"
    assert payload["labels"][0][1] == "sink 1.00"
    assert (out / "attention.png").read_bytes()[:4] == b"\x89PNG"
