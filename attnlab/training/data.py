"""A run's data: the train/held-out split, batches drawn from a generator, the loss and
the held-out evaluation; one token stream, or documents packed into rows (``.packing``)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .distributed import _mean_across
from .packing import Packed, pack, packed_loss, split_documents
from .settings import TrainConfig


def split(tokens: torch.Tensor, context: int, eval_fraction: float = 0.1):
    """Train on the first 90% of the token stream, evaluate on the rest."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be a 1-D stream, got shape {tuple(tokens.shape)}")
    n_eval = max(context + 2, int(len(tokens) * eval_fraction))
    if len(tokens) - n_eval < context + 2:
        raise ValueError(
            f"text is too short: {len(tokens)} tokens, need at least {2 * (context + 2)} "
            f"for context {context} (a train and a held-out split); use a longer text or "
            "a smaller --context"
        )
    return tokens[:-n_eval], tokens[-n_eval:]


HELD_OUT_KEPT = 4096


def data_record(tokens, documents: bool) -> dict:
    """What a run's training state keeps of its text, so that a resume on another text is
    refused: the number of tokens and a SHA-256 of their ids as int64 (``documents``: a
    sequence of id sequences, each hashed with its length; else one stream, a tensor or
    a list of ids)."""
    digest = hashlib.sha256()

    def add(ids) -> int:
        ids = torch.as_tensor(ids).reshape(-1).to(torch.int64).cpu().contiguous()
        digest.update(ids.numpy())  # (the buffer itself: no copy of a big text)
        return ids.numel()

    if not documents:
        return {"tokens": add(tokens), "sha256": digest.hexdigest()}
    count = 0
    for doc in tokens:
        digest.update(len(doc).to_bytes(8, "little"))
        count += add(doc)
    return {"tokens": count, "sha256": digest.hexdigest()}


def held_out_record(eval_stream: torch.Tensor) -> dict:
    """What a checkpoint keeps of its held-out text (``config.json``'s ``held_out``), so
    experiments on it later measure on text it never trained on: the first
    :data:`HELD_OUT_KEPT` token ids of the held-out stream (the last 10% of the
    text), and how many tokens that stream had."""
    return {"ids": eval_stream[:HELD_OUT_KEPT].tolist(), "tokens": len(eval_stream),
            "part": "the last 10% of the training text (training.split)"}


def sample(stream: torch.Tensor, batch: int, context: int, gen: torch.Generator):
    """``batch`` random windows of ``context + 1`` tokens: ``(batch, context + 1)``."""
    # (randint's end is exclusive: the last window starts at len - context - 1)
    starts = torch.randint(0, len(stream) - context, (batch,), generator=gen)
    return torch.stack([stream[s:s + context + 1] for s in starts.tolist()])


def lm_loss(model: nn.Module, rows: torch.Tensor, split=None) -> torch.Tensor:
    """Mean next-token loss of ``rows (batch, context + 1)``. With ``split`` (a
    :class:`~attnlab.distributed.ContextParallel`) the model sees this rank's shard of
    each sequence, and the result is this rank's share of the mean times the split's
    size: averaged over the split's ranks (as DistributedDataParallel averages the
    gradients) it is the mean over the whole sequences."""
    rows = rows.to(next(model.parameters()).device)  # batches are drawn on the CPU
    if split is None:
        logits = model(rows[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
    logits = model(split.shard(rows[:, :-1]))
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                            split.shard(rows[:, 1:]).reshape(-1), reduction="sum")
    return total * split.world_size / rows[:, 1:].numel()


class Stream:
    """Training data as one token stream: each row a random window of ``context + 1``."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def sample(self, batch: int, context: int, gen: torch.Generator) -> torch.Tensor:
        return sample(self.tokens, batch, context, gen)

    def loss(self, model: nn.Module, rows: torch.Tensor, split=None,
             batch: torch.Tensor | None = None) -> torch.Tensor:
        # Every row predicts context tokens: a process's mean weighs them as the batch's.
        return lm_loss(model, rows, split)


class PackedRows:
    """Training data as documents packed into rows (:func:`.packing.pack`): a batch is
    ``batch`` rows drawn at random (their indices, which slice across processes as a
    stream's rows do)."""

    def __init__(self, packed: Packed) -> None:
        self.packed = packed

    def __len__(self) -> int:
        return self.packed.tokens

    def sample(self, batch: int, context: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randint(0, len(self.packed), (batch,), generator=gen)

    def loss(self, model: nn.Module, rows: torch.Tensor, split=None,
             batch: torch.Tensor | None = None) -> torch.Tensor:
        """``batch``: the whole step's rows where ``rows`` is this process's share of
        them (see :func:`.packing.packed_loss`)."""
        if split is not None:  # train() refuses pack with context_parallel first
            raise ValueError("packed rows are not supported with context_parallel")
        return packed_loss(model, self.packed, rows, batch)


def training_tokens(text: str, tokenizer, *, pack: bool = False,
                    resumed_from: str | None = None):
    """``text`` as :func:`attnlab.training.train` takes it: one id stream, or with
    ``pack`` a list of its documents' ids (stretches between blank lines, two or more).
    ``resumed_from``: the run whose tokenizer this is, named where the text has characters
    it lacks (the run was trained on another text)."""
    try:
        if not pack:
            return torch.tensor(tokenizer.encode(text))
        documents = split_documents(text)
        if len(documents) < 2:
            raise ValueError(f"--pack: the text holds {len(documents)} document(s); documents "
                             "are separated by blank lines, and training needs two or more")
        return [tokenizer.encode(doc) for doc in documents]
    except ValueError as exc:
        if resumed_from is None or "not in the tokenizer's vocabulary" not in str(exc):
            raise
        lacking = str(exc).split("vocabulary: ", 1)[-1]
        raise ValueError(f"--resume: the run in {resumed_from!r} was trained on another text "
                         f"(this one has characters its tokenizer lacks: {lacking}); give "
                         "--text the run's own, or choose another --out") from None


def split_documents_held_out(documents: Sequence[Sequence[int]], context: int,
                             eval_fraction: float = 0.1):
    """Train on the first documents, evaluate on the last ones: as many as make 10% of the
    tokens (at least ``context + 2``, so a held-out row is a full one where it can be).
    Returns the two lists of documents."""
    sizes = [len(d) for d in documents]
    total = sum(sizes)
    want = max(context + 2, int(total * eval_fraction))
    held, n = 0, len(documents)
    while n > 1 and held < want:
        n -= 1
        held += sizes[n]
    if n < 1 or len(documents) < 2 or total - held < 2:
        raise ValueError(
            f"--pack needs at least two documents (a train and a held-out part; documents "
            f"are separated by blank lines), got {len(documents)} of {total} tokens")
    return list(documents[:n]), list(documents[n:])


def packed_split(documents: Sequence[Sequence[int]], context: int):
    """(train, held-out) :class:`PackedRows` of ``documents`` and the held-out tokens as
    one stream (what a checkpoint records of them)."""
    train_docs, eval_docs = split_documents_held_out(documents, context)
    held_out = torch.tensor([t for d in eval_docs for t in d], dtype=torch.long)
    parts = []
    for name, docs in (("training", train_docs), ("held-out", eval_docs)):
        try:
            parts.append(PackedRows(pack(docs, context + 1)))
        except ValueError as exc:  # say which part: the text as a whole may have them
            which = "first" if name == "training" else "last"
            count = f"{len(docs)} document{'' if len(docs) == 1 else 's'}"
            raise ValueError(f"--pack: the {name} part (the {which} {count} of the text) has "
                             f"{exc}") from None
    return parts[0], parts[1], held_out


@torch.no_grad()
def evaluate(model: nn.Module, stream: torch.Tensor | Stream | PackedRows,
             cfg: TrainConfig, split=None) -> float:
    """Mean loss on fixed held-out batches (their own generator: training RNG untouched)
    of a token stream (windows) or of packed rows; with ``split``, every rank of it gets
    the whole sequences' mean."""
    data = Stream(stream) if isinstance(stream, torch.Tensor) else stream
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    was_training = model.training
    model.eval()
    ranks = 1 if split is None else split.world_size
    group = None if split is None else split.group
    try:
        losses = [_mean_across(data.loss(model, data.sample(cfg.batch_size, cfg.context, gen),
                                         split), ranks, group)
                  for _ in range(cfg.eval_batches)]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)
