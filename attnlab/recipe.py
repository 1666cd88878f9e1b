"""The demo's recipe: the toy model, its corpus, where ``attnlab demo`` writes, its sentence.

It sits at the training layer, below :mod:`attnlab.interop` and
:mod:`attnlab.experiments`: the dropout-placement experiment trains this recipe, and
``--model``'s fallback (``./attnlab-demo``) and sample sentence come from here, while
:mod:`attnlab.demo` (the ``attnlab demo`` command's story: the worked example, the
training, the pictures) sits at the command line's level and uses it too.
"""

from __future__ import annotations

import torch

__all__ = ["train_demo_model", "DEMO_OUT", "SAMPLE"]


def train_demo_model(*, steps: int, seed: int, text: str | None = None,
                     eval_every: int | None = None, attn_dropout: float | None = None,
                     resid_dropout: float | None = None, log=None, **train_kw):
    """The demo's one training recipe: ``ToyAttnLM`` (d_model 32, one causal head)
    trained on characters, 32 windows of 24 tokens per step at lr 1e-2.

    Args:
        steps, seed: length of the run; ``seed`` fixes the corpus, the initial
            weights (``torch.manual_seed`` before the model is built) and the batches.
        text: the training text; default :func:`~attnlab.text.corpus.pattern_corpus`
            of ``seed``. The tokenizer is a ``CharTokenizer`` of its characters.
        eval_every: held-out evaluation interval (default ``steps // 8``, at least 1).
        attn_dropout, resid_dropout: when given, set on the head after it is built
            (dropout on the attention weights / on the attention output).
        log: where the one-line description of the run and training progress go
            (None: silent).
        train_kw: passed to :func:`attnlab.training.train` (``out``, ``progress``,
            ``meta``...); the tokenizer is saved with the model when ``out`` is given.

    Returns:
        ``(model, tokenizer, summary)``, ``summary`` as :func:`~attnlab.training.train`
        returns it.
    """
    from .models import ToyAttnLM, ToyConfig
    from .text import CharTokenizer
    from .text.corpus import PATTERNS, pattern_corpus
    from .training import TrainConfig, train

    corpus = f"repeating patterns {', '.join(PATTERNS)}" if text is None else "the given text"
    text = text or pattern_corpus(seed=seed)
    tokenizer = CharTokenizer.from_text(text)
    cfg = TrainConfig(steps=steps, batch_size=32, context=24, lr=1e-2, warmup=20,
                      eval_every=max(1, steps // 8) if eval_every is None else eval_every,
                      seed=seed)
    torch.manual_seed(seed)
    model = ToyAttnLM(ToyConfig(vocab_size=tokenizer.vocab_size, context_length=cfg.context,
                                d_model=32))
    if attn_dropout is not None:
        model.attn.dropout = attn_dropout
    if resid_dropout is not None:
        model.attn.resid_dropout = resid_dropout
    if log is not None:
        log(f"Training ToyAttnLM ({sum(p.numel() for p in model.parameters()):,} parameters, "
            f"one causal head) on {len(text):,} characters of {corpus}")
    summary = train(model, torch.tensor(tokenizer.encode(text)), cfg, tokenizer=tokenizer,
                    log=log, **train_kw)
    return model, tokenizer, summary


#: Where ``attnlab demo`` writes, and where ``attnlab show`` looks when given no model.
DEMO_OUT = "attnlab-demo"
#: The demo's sentence: only characters of its corpus (" abcdxyz"), so the demo model knows it.
SAMPLE = "ababab acacac xyzxyz"
