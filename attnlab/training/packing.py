"""Training on documents packed into rows (``attnlab train --pack``).

A document is a stretch of the text between blank lines (lines holding nothing but
whitespace): paragraphs, stories, functions, as plain-text corpora separate them. Without
packing, a run draws windows from the text as one stream, and a window mixes the end of
one document with the start of the next; one document per row instead would pad every
short one to the row's length. Packing fills each row of ``context + 1`` tokens with whole
documents (best fit, longest first; one longer than a row is cut into rows of its own) and
gives each token its document's id: the model attends within a document only
(``attnlab.attention(..., document_ids=...)``), each document's positions start at 0, and
no token is trained to predict the first token of the next document. So the loss of a
packed row is the loss of its documents run one by one, at the cost of little padding.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["split_documents", "pack", "Packed", "packed_loss", "IGNORE"]

# The label of a position that predicts nothing (a document's last token, padding): what
# cross_entropy skips.
IGNORE = -100

# A newline, then one or more lines of nothing but whitespace.
_BLANK_LINES = re.compile(r"\r?\n(?:[^\S\n]*\r?\n)+")


def split_documents(text: str) -> list[str]:
    """The documents of ``text``: the stretches between blank lines, without the
    newlines that end or start them; blank stretches are not documents."""
    parts = (part.strip("\r\n") for part in _BLANK_LINES.split(text))
    return [part for part in parts if part.strip()]


@dataclass(frozen=True)
class Packed:
    """Rows of packed documents.

    ``ids`` ``(rows, length)`` token ids (padding is token 0 at the end of a row);
    ``document_ids`` ``(rows, length)``, non-decreasing along each row (the padding is a
    document of its own); ``labels`` ``(rows, length - 1)``: the token each position is
    trained to predict, :data:`IGNORE` where the next one starts another document or is
    padding. ``documents`` and ``tokens`` count what was packed (pieces of a document
    cut to fit a row counted each), ``padding`` the padding tokens in the rows, and
    ``padding_one_per_row`` those that one document (piece) per row would need."""

    ids: torch.Tensor
    document_ids: torch.Tensor
    labels: torch.Tensor
    documents: int
    tokens: int
    padding: int
    padding_one_per_row: int

    def __len__(self) -> int:
        return self.ids.shape[0]

    @property
    def padding_saved(self) -> int:
        return self.padding_one_per_row - self.padding

    def describe(self) -> str:
        """One line: what was packed and the padding it saved."""
        length = self.ids.shape[1]
        return (f"packed {self.documents:,} documents ({self.tokens:,} tokens) into "
                f"{len(self):,} rows of {length} tokens: {self.padding:,} padding tokens, "
                f"against {self.padding_one_per_row:,} with one document per row (saved "
                f"{self.padding_saved:,})")


def _pieces(documents: Sequence[Sequence[int]], length: int) -> list[list[int]]:
    """Each document as is, or cut into pieces of ``length`` tokens when longer; pieces of
    one token are dropped (they predict nothing)."""
    out = []
    for doc in documents:
        doc = [int(t) for t in doc]
        out += [doc[i:i + length] for i in range(0, len(doc), length)]
    return [piece for piece in out if len(piece) > 1]


def _best_fit(sizes: list[int], length: int) -> list[list[int]]:
    """Indices of ``sizes`` grouped into rows of at most ``length``: the longest first,
    each into the row it fills best (ties: the row opened last), a new row when none has
    room. Deterministic, O(n * length)."""
    rows: list[list[int]] = []
    by_space: list[list[int]] = [[] for _ in range(length + 1)]  # free space -> rows
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: text order
        size = sizes[i]
        space = next((c for c in range(size, length + 1) if by_space[c]), None)
        if space is None:
            rows.append([])
            row, space = len(rows) - 1, length
        else:
            row = by_space[space].pop()
        rows[row].append(i)
        by_space[space - size].append(row)
    return rows


def pack(documents: Sequence[Sequence[int]], length: int, pad_id: int = 0) -> Packed:
    """``documents`` (token id sequences) packed into rows of ``length`` tokens (a training
    row: ``context + 1``)."""
    if length < 2:
        raise ValueError(f"length must be at least 2 (a token and the next), got {length}")
    pieces = _pieces(documents, length)
    if not pieces:
        raise ValueError("no document of two tokens or more (a token and the next to "
                         "predict): nothing to pack")
    rows = _best_fit([len(p) for p in pieces], length)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    doc_ids = torch.empty((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length - 1), IGNORE, dtype=torch.long)
    for r, members in enumerate(rows):
        start = 0
        for d, i in enumerate(members):
            piece = torch.tensor(pieces[i], dtype=torch.long)
            end = start + len(piece)
            ids[r, start:end] = piece
            doc_ids[r, start:end] = d
            labels[r, start:end - 1] = piece[1:]
            start = end
        doc_ids[r, start:] = len(members)  # the padding: a document of its own
    tokens = sum(len(p) for p in pieces)
    return Packed(ids, doc_ids, labels, documents=len(pieces), tokens=tokens,
                  padding=len(rows) * length - tokens,
                  padding_one_per_row=len(pieces) * length - tokens)


def packed_loss(model: nn.Module, packed: Packed, rows: torch.Tensor,
                batch: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token loss of ``packed``'s ``rows`` (indices), over the positions that
    predict a token of their own document.

    ``batch``: the whole step's rows, when ``rows`` is one process's equal share of them
    under DistributedDataParallel. Rows hold different numbers of such positions, so each
    process's own mean would weigh its tokens otherwise than one process does; this
    process's sum is divided by the whole batch's count instead, times the number of
    shares, so that DDP's mean over the processes is the batch's token mean."""
    device = next(model.parameters()).device
    ids = packed.ids[rows, :-1].to(device)
    logits = model(ids, document_ids=packed.document_ids[rows, :-1].to(device))
    labels = packed.labels[rows].to(device)
    if batch is None:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=IGNORE)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                            ignore_index=IGNORE, reduction="sum")
    counted = int((packed.labels[batch] != IGNORE).sum())
    return total * (len(batch) / len(rows)) / counted
