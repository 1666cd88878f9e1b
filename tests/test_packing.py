"""`attnlab train --pack`: documents (split at blank lines) packed into rows with document
ids. A packed batch's loss is the loss of its documents run one by one; packing keeps every
token once, saves padding, and a packed run resumes bit-exactly."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_training import _files, _interrupted_run_of

from attnlab.checkpoint import same_weights
from attnlab.cli import main
from attnlab.io import STATE_JSON
from attnlab.models import GPT, GPTConfig, ToyAttnLM, ToyConfig
from attnlab.text import CharTokenizer
from attnlab.training import TrainConfig, pack, packed_loss, split_documents, train


def test_documents_are_the_stretches_between_blank_lines():
    text = "\n\none\ntwo lines\n\n  \t\nthree\r\n\r\nfour  \n\n\n\n five\n"
    assert split_documents(text) == ["one\ntwo lines", "three", "four  ", " five"]
    assert split_documents("no blank line\nat all\n") == ["no blank line\nat all"]
    assert split_documents(" \n\n \n") == []


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 30), min_size=1, max_size=25), length=st.integers(2, 17))
def test_packing_keeps_every_document_whole_once_and_pads_less(sizes, length):
    docs = [[1 + (i * 7 + j) % 50 for j in range(n)] for i, n in enumerate(sizes)]
    pieces = [d[i:i + length] for d in docs for i in range(0, len(d), length)]
    pieces = [p for p in pieces if len(p) > 1]
    if not pieces:
        with pytest.raises(ValueError, match="no document of two tokens"):
            pack(docs, length)
        return
    packed = pack(docs, length)
    found = []
    for ids, doc_ids, labels in zip(packed.ids, packed.document_ids, packed.labels):
        assert bool((doc_ids[1:] >= doc_ids[:-1]).all())  # non-decreasing
        for d in doc_ids.unique().tolist():
            where = (doc_ids == d).nonzero().flatten()
            span = ids[where].tolist()
            if not any(span):  # the padding (documents hold no token 0): predicts nothing
                assert bool((labels[where[where < length - 1]] == -100).all())
                continue
            found.append(span)
            # each position is labelled with the next token of its document, the last none
            assert labels[where[:-1]].tolist() == span[1:]
            if int(where[-1]) < length - 1:
                assert int(labels[where[-1]]) == -100
    assert sorted(found) == sorted(pieces)  # every piece once, whole, in one row
    assert packed.tokens == sum(map(len, pieces)) and packed.documents == len(pieces)
    assert packed.padding == len(packed) * length - packed.tokens
    assert packed.padding_one_per_row == len(pieces) * length - packed.tokens
    assert packed.padding <= packed.padding_one_per_row
    assert torch.equal(pack(docs, length).ids, packed.ids)  # deterministic


def _docs(n=12, seed=0, vocab=30):
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.choice([2, 3, 5, 9, 14, 20]))]
            for _ in range(n)]


@pytest.mark.parametrize("make", [
    lambda: GPT(GPTConfig(vocab_size=30, context_length=24, d_model=24, num_layers=2,
                          num_heads=4, positions="rope", attn_softcap=2.0, sinks=True)),
    lambda: GPT(GPTConfig(vocab_size=30, context_length=24, d_model=24, num_layers=2,
                          num_heads=4, positions="learned")),
    lambda: ToyAttnLM(ToyConfig(vocab_size=30, context_length=24, d_model=16)),
], ids=["gpt-rope-softcap-sinks", "gpt-learned", "toy"])
def test_a_packed_batch_has_the_loss_of_its_documents_run_one_by_one(make):
    torch.manual_seed(0)
    model = make().eval()
    docs = _docs()
    packed = pack(docs, 25)  # context 24
    assert len(packed) < len(docs)  # several documents share a row
    with torch.no_grad():
        got = packed_loss(model, packed, torch.arange(len(packed)))
        total, count = 0.0, 0
        for d in docs:
            ids = torch.tensor(d)[None]
            logits = model(ids[:, :-1])
            total += float(F.cross_entropy(logits[0], ids[0, 1:], reduction="sum"))
            count += len(d) - 1
    assert abs(float(got) - total / count) < 1e-5


def test_shares_of_a_packed_batch_average_to_its_token_mean():
    """Under DDP each process scores its share of a step's rows and the gradients are
    averaged: weighted by the whole batch's token count, the mean of the shares' losses
    (and gradients) is the batch's own, though the shares hold different numbers of
    tokens (a process's own mean would weigh them otherwise)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=30, context_length=24, d_model=24, num_layers=1,
                          num_heads=4))
    packed = pack(_docs(n=30, seed=3), 25)
    counts = (packed.labels != -100).sum(1)
    order = torch.argsort(counts, descending=True)
    rows = torch.cat([order[:2], order[-2:]])  # the fullest rows, then the emptiest
    assert int(counts[rows[:2]].sum()) != int(counts[rows[2:]].sum())
    whole = packed_loss(model, packed, rows)
    want = torch.autograd.grad(whole, list(model.parameters()))
    shares = [packed_loss(model, packed, part, batch=rows) for part in (rows[:2], rows[2:])]
    assert float(sum(shares) / 2) == pytest.approx(float(whole), abs=1e-6)
    grads = [torch.autograd.grad(s, list(model.parameters())) for s in shares]
    for w, a, b in zip(want, *grads):
        torch.testing.assert_close((a + b) / 2, w, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_packed_training_in_two_processes_matches_one(tmp_path):
    from test_training import _one_and_two_processes

    text = "\n\n".join("".join(random.Random(i).choice("abcab xyz") for _ in range(n))
                       for i, n in enumerate([3, 30, 4, 17, 2, 12, 25, 6, 33, 5] * 4))
    (tmp_path / "docs.txt").write_text(text)
    one, two = _one_and_two_processes(tmp_path, [
        "train", "--model", "toy", "--steps", "6", "--context", "16", "--batch-size", "4",
        "--seed", "1", "--pack", "--text", str(tmp_path / "docs.txt")])
    assert [h[1] for h in one["history"]] == pytest.approx([h[1] for h in two["history"]],
                                                           abs=1e-5)


def _packed_setup(seed=0):
    text = "\n\n".join("".join(random.Random(i).choice("abcab xyz") for _ in range(n))
                       for i, n in enumerate([9, 30, 4, 17, 40, 12, 25, 6, 33, 21] * 3))
    tok = CharTokenizer.from_text(text)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=16, d_model=16,
                          num_layers=1, num_heads=2))
    return model, [tok.encode(d) for d in split_documents(text)], tok, None


PACKED = TrainConfig(steps=6, batch_size=4, context=16, checkpoint_every=2, eval_every=3,
                     eval_batches=2, pack=True)


def test_a_packed_run_reports_the_padding_saved_and_resumes_bit_exactly(tmp_path):
    ref, docs, _, _ = _packed_setup()
    lines = []
    want = train(ref, docs, PACKED, progress=False, log=lines.append)
    saved = want["packing"]
    assert saved["padding_saved"] == saved["padding_one_per_row"] - saved["padding"] > 0
    assert lines[0].startswith(f"packed {saved['documents']} documents")
    assert f"saved {saved['padding_saved']:,})" in lines[0]
    _interrupted_run_of(_packed_setup, tmp_path / "run", PACKED, stop_after=4)
    model, _, tok, _ = _packed_setup(seed=7)  # its weights come from the checkpoint
    got = train(model, docs, PACKED, out=tmp_path / "run", resume=True, tokenizer=tok,
                progress=False, log=None)
    assert got["resumed_from"] == 4
    assert same_weights(model, ref)
    assert got["history"] == want["history"]


def test_resume_refuses_to_switch_packing_and_reads_older_checkpoints_as_unpacked(tmp_path):
    model, docs, tok, _ = _packed_setup()
    out = tmp_path / "run"
    train(model, docs, PACKED, out=out, tokenizer=tok, progress=False, log=None)
    before = _files(out)
    stream = torch.tensor([t for d in docs for t in d])
    unpacked = TrainConfig(**{**PACKED.to_dict(), "pack": False, "steps": 8})
    with pytest.raises(ValueError, match="--pack True in the checkpoint, False now"):
        train(model, stream, unpacked, out=out, resume=True, progress=False, log=None)
    assert _files(out) == before
    # A checkpoint written before --pack existed names no "pack": it trained unpacked.
    plain = tmp_path / "plain"
    first = TrainConfig(**{**unpacked.to_dict(), "steps": 2})
    train(model, stream, first, out=plain, tokenizer=tok, progress=False, log=None)
    state = json.loads((plain / STATE_JSON).read_text())
    del state["train_config"]["pack"]
    (plain / STATE_JSON).write_text(json.dumps(state))
    got = train(model, stream, TrainConfig(**{**first.to_dict(), "steps": 3}), out=plain,
                resume=True, progress=False, log=None)
    assert got["resumed_from"] == 2 and got["steps"] == 3


def test_packing_needs_documents_not_a_stream():
    model, docs, _, _ = _packed_setup()
    with pytest.raises(TypeError, match="pack=True trains on documents"):
        train(model, torch.tensor(docs[0] * 20), PACKED, progress=False, log=None)
    with pytest.raises(ValueError, match="--pack needs at least two documents"):
        train(model, docs[:1], PACKED, progress=False, log=None)


def test_train_pack_on_the_command_line(tmp_path, capsys):
    text = tmp_path / "docs.txt"
    text.write_text("\n\n".join(f"document {i} " + "ab " * (i % 7 + 1) for i in range(40)))
    assert main(["train", "--text", str(text), "--pack", "--steps", "1", "--context", "24",
                 "--batch-size", "2", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "padding tokens, against" in out and "with one document per row (saved" in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["packing"]["padding_saved"] > 0
    one = tmp_path / "one.txt"
    one.write_text("a single document\nwith no blank line\n")
    assert main(["train", "--text", str(one), "--pack", "--steps", "2",
                 "--out", str(tmp_path / "one")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "--pack: the text holds 1 document(s); documents are separated by blank lines, and "
        "training needs two or more")


def _small_encoder(positions: str = "index"):
    from attnlab.models import Encoder, EncoderConfig

    torch.manual_seed(0)
    return Encoder(EncoderConfig(vocab_size=40, context_length=12, d_model=16, num_layers=2,
                                 num_heads=2, d_ff=32, positions=positions, pad_id=1)).eval()


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 10), min_size=1, max_size=6),  # RoBERTa: 12 - 2
       positions=st.sampled_from(["index", "roberta"]), seed=st.integers(0, 99))
def test_an_encoder_row_of_packed_sentences_gives_each_its_hidden_states_alone(
        lengths, positions, seed):
    # Packed rows (document_ids) are FlashAttention's varlen inputs: each sentence attends
    # to its own tokens and counts its positions from 0, so its hidden states are those it
    # gets alone, though the packed row may be longer than the model's context.
    model = _small_encoder(positions)
    g = torch.Generator().manual_seed(seed)
    sentences = [torch.randint(2, 40, (1, n), generator=g) for n in lengths]
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    with torch.no_grad():
        packed = model(torch.cat(sentences, dim=1), document_ids=docs)[0]
        alone = torch.cat([model(s)[0] for s in sentences])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_encoder_packing_errors_name_the_argument():
    model = _small_encoder()
    ids = torch.randint(2, 40, (1, 20))
    with pytest.raises(ValueError, match="attention_mask .* or document_ids"):
        model(ids, attention_mask=torch.ones(1, 20), document_ids=torch.zeros(1, 20).long())
    with pytest.raises(ValueError, match="document of 13 tokens is longer than context_length=12"):
        model(ids, document_ids=torch.tensor([[0] * 7 + [1] * 13]))
    with pytest.raises(ValueError, match="document_ids must have the ids' shape"):
        model(ids, document_ids=torch.zeros(1, 19).long())
    with pytest.raises(ValueError, match="sequence of 20 tokens is longer than context_length=12"):
        model(ids)  # unpacked, the row is one sequence


def test_a_held_out_part_of_short_documents_is_named_as_such():
    # Helper-found: long training documents and one-token held-out ones were refused as
    # "no document has two tokens or more", which the text plainly had.
    from attnlab.training.data import packed_split

    docs = [list(range(1, 40))] * 3 + [[7]] * 40
    with pytest.raises(ValueError, match=r"--pack: the held-out part \(the last 15 documents of "
                                         r"the text\) has no document of two tokens"):
        packed_split(docs, 8)
