"""Training: AdamW, warmup + cosine, clipping, eval, checkpoints that resume bit-exactly.

A run is a function of (model init, data, TrainConfig). Everything that makes
step n+1 depend on steps 0..n lives in the checkpoint: weights, AdamW moments,
the step, the batch sampler's generator and torch's RNG (dropout). So a run
killed at any moment and resumed from its last checkpoint ends with exactly
the weights of a run never interrupted. Nothing is pickled: tensors go to
safetensors, the rest to JSON, and the whole directory is swapped in atomically.

Under ``torchrun`` (``WORLD_SIZE`` > 1) the model is wrapped in
DistributedDataParallel (gloo on CPU, nccl on GPU); every rank draws the same
global batch and trains on its slice of rows; only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch import nn

from .. import checkpoint
from ..checkpoint import (
    check_out_dir,
    has_checkpoint,
    nothing_to_resume,
    planned_steps,
    read_best,
    restore_training_state,
)
from ..io import BEST_DIR
from ..io.locks import output_lock
from ..progress import Progress
from .data import (
    PackedRows,
    Stream,
    data_record,
    evaluate,
    held_out_record,
    packed_split,
    split,
)
from .distributed import _dist_setup, _leave_group, _mean_across, context_split
from .settings import (
    TrainConfig,
    check_training_fits,
    default_checkpoint_every,
    lr_at,
)


def train(
    model: nn.Module,
    tokens: torch.Tensor,
    cfg: TrainConfig,
    *,
    out: str | os.PathLike | None = None,
    resume: bool = False,
    tokenizer=None,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
    meta: dict | None = None,
    context_parallel: int = 1,
) -> dict:
    """Train ``model`` (a decoder: ids -> logits) on a 1-D token stream, or on documents
    packed into rows (``cfg.pack``).

    Args:
        model: ToyAttnLM or GPT, freshly initialised (seed it yourself) or anything
            a resume will overwrite.
        tokens: ``(n,)`` token ids; the last 10% are held out for eval loss. With
            ``cfg.pack``: the documents, a list of token id sequences (the text's, split
            by :func:`attnlab.training.packing.split_documents`), packed into rows of
            ``cfg.context + 1`` (:func:`~attnlab.training.packing.pack`); the last
            documents, 10% of the tokens, are held out.
        cfg: hyperparameters; ``cfg.steps`` is the total number of steps.
        out: checkpoint directory (written every ``cfg.checkpoint_every`` steps, every
            tenth of the run where that is None (:func:`default_checkpoint_every`), and
            at the end); None = no checkpoints.
            An existing ``out`` must be empty or attnlab's (:func:`check_out_dir`).
        resume: continue from the checkpoint in ``out``; with none there yet (a run
            killed before its first checkpoint) start from step 0, with a note on
            stderr. The saved settings must match ``cfg`` (see RESUMABLE_CHANGES).
        tokenizer: saved beside the model as ``tokenizer.json``.
        progress: show progress on stderr (rank 0): a tqdm bar on a terminal, with the
            eval lines written above it; else a plain line at every tenth of the run
            and at least every :data:`PIPE_PROGRESS_SECONDS`.
        log: where eval lines go (rank 0); None for silence.
        meta: extra JSON fields for ``config.json``.
        context_parallel: split each sequence over this many ranks (under torchrun; a
            GPT): ring attention over zig-zag shards, the same losses and weights as one
            process up to float rounding. The processes beyond one split train on other
            rows (data parallelism); ``context_parallel`` must divide their number.

    Returns:
        ``{"steps", "final_loss", "eval_loss", "seconds", "tokens_per_s", "history",
        "resumed_from", "best_step", "best_eval_loss", "overfitting"}`` where history is
        ``[[step, train_loss, eval_loss|None], ...]``; with ``cfg.pack`` also ``"packing"``
        (the documents, tokens and padding of the training rows, and the padding saved).

    With ``out``, every checkpoint also holds ``out/best/``: the checkpoint (a model
    folder :func:`attnlab.load_checkpoint` reads) of the step with the lowest held-out
    loss so far, its step and loss in its ``config.json`` (``"best"``). When the
    held-out loss climbs well above its best for two evals, one warning line goes to
    ``log``: the model is overfitting its text.
    """
    device = next(model.parameters()).device
    rank, world, created = _dist_setup(device)
    try:
        sharding = context_split(model, world, rank, context_parallel, cfg.context)
        if sharding is not None:
            model.context_parallel = sharding
        summary = _train(model, tokens, cfg, rank, world, device, out=out, resume=resume,
                         tokenizer=tokenizer, progress=progress, log=log, meta=meta,
                         sharding=sharding)
    except BaseException:
        if created:  # no barrier: the other ranks may never come to it
            _leave_group(wait=False)
        raise
    finally:
        if context_parallel != 1 and hasattr(model, "context_parallel"):
            model.context_parallel = None  # its group goes with this run
    if created:
        _leave_group(wait=True)
    return summary


def _train(model, tokens, cfg, rank, world, device, *, out, resume, tokenizer, progress, log,
           meta, sharding) -> dict:
    rows_world = world // (1 if sharding is None else sharding.world_size)  # data parallelism
    if cfg.batch_size % rows_world:
        raise ValueError(f"batch-size {cfg.batch_size} must be divisible by the number of "
                         f"processes ({world})" if sharding is None else
                         f"batch-size {cfg.batch_size} must be divisible by the number of "
                         f"context-parallel groups ({rows_world})")
    if cfg.context > model.context_length:
        raise ValueError(f"context {cfg.context} is longer than the model's context_length "
                         f"{model.context_length}")
    check_training_fits(model, cfg.batch_size, cfg.context, world)
    if cfg.pack:
        if sharding is not None:
            raise ValueError("--pack (pack=True) is not supported with --context-parallel "
                             "(context_parallel > 1): packed rows need each document's "
                             "positions from the whole row")
        if isinstance(tokens, torch.Tensor):
            raise TypeError("pack=True trains on documents: give a list of token id "
                            "sequences (split_documents(text), each encoded), not one "
                            f"stream of shape {tuple(tokens.shape)}")
        train_data, eval_data, held_out = packed_split(tokens, cfg.context)
    else:
        train_stream, held_out = split(tokens, cfg.context)
        train_data, eval_data = Stream(train_stream), Stream(held_out)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.weight_decay)
    with contextlib.ExitStack() as stack:
        if out is not None and rank == 0:
            # Held for the whole run: a second run on the same --out is refused, not
            # interleaved with this one.
            check_out_dir(out)
            stack.enter_context(output_lock(out))
        return _run(model, train_data, eval_data, held_out, cfg, optimizer, gen, rank, world,
                    device, out=out, resume=resume, tokenizer=tokenizer, progress=progress,
                    log=log, meta=meta, sharding=sharding,
                    data=None if out is None else data_record(tokens, documents=cfg.pack))


def _stop(step: int, what: str, value: float, out, saved: int | None) -> ValueError:
    kept = (f"the last good checkpoint in {str(out)!r} (step {saved}) is kept" if saved
            else "no checkpoint was written by this run")
    return TrainingDiverged(
        f"training stopped at step {step}: the {what} is {value} (not finite); {kept}; "
        "lower --lr or check the data and the resumed state")


class TrainingDiverged(ValueError):
    """The loss, a gradient or a weight stopped being finite: nothing more is saved."""


class _Best:
    """The lowest held-out loss so far and the weights that had it (kept in memory, on
    the CPU, and written as ``out/best/`` with every checkpoint), and the one warning
    when the held-out loss climbs away from it while training goes on: overfitting."""

    # Warn once the latest eval is this many evals past the best and this much above it:
    # one noisy eval is not a trend.
    EVALS_PAST, RISE = 2, 0.02

    def __init__(self, keep: bool, saved: dict | None = None) -> None:
        self.keep = keep
        self.step, self.loss, self.weights = None, math.inf, None
        if saved is not None:
            self.step, self.loss, self.weights = (saved["step"], saved["eval_loss"],
                                                  saved["weights"])
        self.evals_past = 0
        self.warned = False

    def update(self, step: int, eval_loss: float, model: nn.Module) -> None:
        if eval_loss < self.loss:
            self.step, self.loss, self.evals_past = step, eval_loss, 0
            if self.keep:
                self.weights = {k: v.detach().to("cpu", copy=True)
                                for k, v in model.state_dict().items()}
        else:
            self.evals_past += 1

    def replay(self, history: list) -> None:
        """``evals_past`` and ``warned`` as the run had them when it saved: they are not in
        the checkpoint, its history gives them back (a resumed run then warns once, when
        and as the whole run does)."""
        loss = math.inf
        for _, _, eval_loss in history:
            if eval_loss is None:
                continue
            if eval_loss < loss:
                loss, self.evals_past = eval_loss, 0
                continue
            self.evals_past += 1
            self.warned |= self._risen(eval_loss, loss)

    def _risen(self, eval_loss: float, best: float) -> bool:
        """Whether ``eval_loss`` is far enough past and above the ``best`` to warn."""
        return self.evals_past >= self.EVALS_PAST and eval_loss >= best * (1 + self.RISE) + \
            self.RISE

    def record(self) -> dict | None:
        if not self.keep or self.weights is None:
            return None
        return {"step": self.step, "eval_loss": self.loss, "weights": self.weights}

    def overfitting(self, step: int, eval_loss: float, train_loss: float, n_tokens: int,
                    vocab: int | None, out) -> str | None:
        """The warning, the first time the held-out loss has risen well above its best."""
        if self.warned or not self._risen(eval_loss, self.loss):
            return None
        self.warned = True
        uniform = ""
        if vocab and eval_loss > math.log(vocab):
            uniform = (f", worse than a uniform guess over its {vocab} tokens "
                       f"(ln {vocab} = {math.log(vocab):.2f}),")
        kept = (f"; the checkpoint of the lowest held-out loss is kept in "
                f"{os.path.join(out, BEST_DIR)}/" if out is not None else "")
        return (f"warning: overfitting: the held-out loss rose from {self.loss:.2f} "
                f"(step {self.step}) to {eval_loss:.2f} (step {step}){uniform} while the "
                f"training loss fell to {train_loss:.3f}: the model is memorising its "
                f"{n_tokens:,}-token text. Train on more text, or use fewer --steps or a "
                f"smaller --context{kept}")


def _run(model, train_data, eval_data, held_out, cfg, optimizer, gen, rank, world, device, *,
         out, resume, tokenizer, progress, log, meta, sharding, data) -> dict:
    step, history, resumed_from = 0, [], None
    settings = {**asdict(cfg), "data": data}  # what a resume must find the same
    say = log if (log is not None and rank == 0) else (lambda _msg: None)
    packing = None
    if isinstance(train_data, PackedRows):
        packed = train_data.packed
        packing = {"documents": packed.documents, "tokens": packed.tokens,
                   "rows": len(packed), "padding": packed.padding,
                   "padding_one_per_row": packed.padding_one_per_row,
                   "padding_saved": packed.padding_saved}
        say(packed.describe())
    best = _Best(keep=out is not None and rank == 0)
    if resume:
        if out is not None and has_checkpoint(out):
            step, history = restore_training_state(Path(out), model, optimizer, gen, settings)
            planned = planned_steps(Path(out))
            best = _Best(keep=rank == 0, saved=read_best(Path(out)))
            best.replay(history)
            resumed_from = step
            say(f"resumed from step {step} of {cfg.steps} (checkpoint in {out})")
            if planned not in (None, cfg.steps) and 0 < step < cfg.steps:  # said, not silent
                was = lr_at(step - 1, replace(cfg, steps=planned))
                say(f"note: the run was planned for {planned} steps; its learning rate now "
                    f"follows the schedule of {cfg.steps} ({lr_at(step, cfg):.3g} at step "
                    f"{step}, after {was:.3g})")
        elif rank == 0:
            nothing_to_resume(out, log)
    wrapped = model
    if world > 1:
        wrapped = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    per_split = 1 if sharding is None else sharding.world_size
    per_rank = cfg.batch_size * per_split // world  # rows of each split
    first = rank // per_split * per_rank
    show = Progress(cfg.steps, step) if progress and rank == 0 else None
    if show is not None and show.bar is not None:
        say = show.through_bar(say)  # lines above the bar, never through it
    meta = {**(meta or {}), "train_config": asdict(cfg), "held_out": held_out_record(held_out)}
    start, start_step = time.perf_counter(), step
    saved = step or None  # the step of the last checkpoint known good
    model.train()
    while step < cfg.steps:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        rows = train_data.sample(cfg.batch_size, cfg.context, gen)
        loss = train_data.loss(wrapped, rows[first:first + per_rank], sharding,
                               batch=rows if world > 1 else None)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # The mean over ranks: a NaN on any rank stops every rank at the same step.
        train_loss = _mean_across(loss, world)
        if not math.isfinite(train_loss):
            raise _stop(step + 1, "loss", train_loss, out, saved)
        norm = float(nn.utils.clip_grad_norm_(model.parameters(),
                                              cfg.grad_clip or float("inf")))
        if not math.isfinite(norm):
            raise _stop(step + 1, "gradient norm", norm, out, saved)
        optimizer.step()
        step += 1
        eval_loss = None
        if step % cfg.eval_every == 0 or step == cfg.steps:
            eval_loss = evaluate(model, eval_data, cfg, sharding)
            if not math.isfinite(eval_loss):  # weights that overflow on held-out text
                raise _stop(step, "eval loss", eval_loss, out, saved)
            say(f"step {step:5d}  loss {train_loss:.4f}  eval {eval_loss:.4f}")
            best.update(step, eval_loss, model)
            warning = best.overfitting(step, eval_loss, train_loss,
                                       len(train_data) + len(eval_data),
                                       getattr(getattr(model, "config", None), "vocab_size",
                                               None), out)
            if warning is not None:
                say(warning)
        history.append([step, train_loss, eval_loss])
        if show is not None:
            elapsed = time.perf_counter() - start
            show.step(step, train_loss,
                      (step - start_step) * cfg.batch_size * cfg.context / max(elapsed, 1e-9))
        due = step % (cfg.checkpoint_every or default_checkpoint_every(cfg.steps)) == 0
        if out is not None and rank == 0 and (due or step == cfg.steps):
            bad = next((n for n, p in model.named_parameters()
                        if not bool(torch.isfinite(p).all())), None)
            if bad is not None:  # a NaN moment or an absurd weight decay: never save it
                raise _stop(step, f"weight {bad!r}", float("nan"), out, saved)
            # best goes positionally: tests wrap this function as (..., *rest)
            try:
                checkpoint.save_training_state(Path(out), model, optimizer, gen, step,
                                               settings, history, tokenizer, meta,
                                               best.record())
            except OSError as exc:  # a full disk: say where, when, and what is kept
                kept = (f"the checkpoint of step {saved} is kept" if saved
                        else "no checkpoint was written")
                raise OSError(exc.errno, f"writing the checkpoint of step {step} in "
                                         f"{str(out)!r}: {exc.strerror or exc}; {kept}") from exc
            saved = step
    if show is not None:
        show.close()
    seconds = time.perf_counter() - start
    trained = step - start_step
    evals = [h[2] for h in history if h[2] is not None]
    return {
        **({} if packing is None else {"packing": packing}),
        "steps": step,
        "final_loss": history[-1][1] if history else None,
        "eval_loss": evals[-1] if evals else None,
        "seconds": seconds,
        "tokens_per_s": trained * cfg.batch_size * cfg.context / seconds if trained else 0.0,
        "history": history,
        "resumed_from": resumed_from,
        "world_size": world,
        "best_step": best.step,
        "best_eval_loss": best.loss if best.step is not None else None,
        "overfitting": best.warned,
    }
