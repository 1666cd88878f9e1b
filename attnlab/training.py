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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import checkpoint
from .checkpoint import (
    check_out_dir,
    has_checkpoint,
    nothing_to_resume,
    read_best,
    restore_training_state,
)
from .checks import (
    bounded_int,
    finite_float,
    fits_in_memory,
    is_int,
    non_negative_int,
    optional_positive_int,
    positive_int,
)
from .config import Config
from .io import BEST_DIR
from .io.locks import output_lock
from .progress import Progress

# The most steps of one run. Every step adds an entry (~70 bytes) to the loss history
# that training_state.json keeps for --resume, and that file is read back under
# io.reading.STATE_LIMIT (256 MiB): a million steps stay well inside it (and are
# days of CPU time for the smallest model); 10**23 is a typo, refused before any work.
MAX_STEPS = 10**6


def check_steps(name: str, value: object) -> int:
    """``value`` as a step count in ``[1, MAX_STEPS]`` (``--steps``, ``--checkpoint-every``)."""
    return bounded_int(name, value, 1, MAX_STEPS)


def check_seed(seed: object) -> int:
    """``seed`` if it is an int in ``[0, 2**63)``, else ValueError: the one rule for
    every seed (TrainConfig and the CLI). torch.manual_seed takes any int64, but a
    negative seed is a typo more often than a choice."""
    if not is_int(seed) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    return seed


@dataclass
class TrainConfig(Config):
    """Hyperparameters of a run. ``steps`` is the total, also when resuming."""

    steps: int = 300
    batch_size: int = 32
    context: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 4
    checkpoint_every: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        # Named as the CLI options, where these values usually come from.
        for name in ("steps", "batch_size", "context", "eval_every", "eval_batches"):
            positive_int(name.replace("_", "-"), getattr(self, name))
        check_steps("steps", self.steps)
        optional_positive_int("checkpoint-every", self.checkpoint_every)
        if self.checkpoint_every is not None:
            check_steps("checkpoint-every", self.checkpoint_every)
        finite_float("lr", self.lr, positive=True)
        non_negative_int("warmup", self.warmup)
        for name in ("weight_decay", "grad_clip"):
            if finite_float(name, getattr(self, name)) < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got "
                                 f"{getattr(self, name)!r}")
        if not 0 <= finite_float("min_lr_ratio", self.min_lr_ratio) <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        check_seed(self.seed)


def default_checkpoint_every(steps: int) -> int:
    """Checkpoint interval when none is given: every tenth of the run.

    A kill then loses at most ~10% of the work, and the ~10 checkpoints (a few MB
    of safetensors each for the CLI's models) cost little next to the training
    steps between them.
    """
    return max(1, steps // 10)


def activation_bytes(model: object, batch: int, context: int) -> int:
    """A rough upper estimate of what one training step holds besides the weights:
    per token, the logits (and their gradient and softmax) and each layer's
    activations; per layer and head, the attention weights. Checked before the
    first step, so ``--batch-size 10**12`` is one line and not an allocator failure.
    ``model``: a model, or its config (anything with ``d_model`` and ``vocab_size``,
    and ``num_layers``/``num_heads`` where there are several)."""
    config = getattr(model, "config", model)
    d, vocab = config.d_model, config.vocab_size
    layers, heads = getattr(config, "num_layers", 1), getattr(config, "num_heads", 1)
    per_token = 3 * vocab + 24 * d * layers
    return 4 * batch * context * (per_token + 2 * heads * layers * context)


def check_training_fits(model: object, batch_size: int, context: int, world: int = 1) -> None:
    """Refuse, before anything is allocated, a step that needs more memory than this
    machine has (:func:`activation_bytes` of one process's share of the batch, out of
    ``world``; ``model`` may be a config). The CLI checks this before it builds the
    model, so an absurd ``--context`` is named as such, not as a model too large."""
    fits_in_memory(f"training with batch-size {batch_size} and context {context}",
                   activation_bytes(model, batch_size // world, context))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


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


def held_out_record(eval_stream: torch.Tensor) -> dict:
    """What a checkpoint keeps of its held-out text (``config.json``'s ``held_out``), so
    experiments on it later measure on text it never trained on: the first
    :data:`HELD_OUT_KEPT` token ids of the held-out stream (the last 10% of the
    text), and how many tokens that stream had."""
    return {"ids": eval_stream[:HELD_OUT_KEPT].tolist(), "tokens": len(eval_stream),
            "part": "the last 10% of the training text (training.split)"}


def sample(stream: torch.Tensor, batch: int, context: int, gen: torch.Generator):
    """``batch`` random windows of ``context + 1`` tokens: ``(batch, context + 1)``."""
    starts = torch.randint(0, len(stream) - context - 1, (batch,), generator=gen)
    return torch.stack([stream[s:s + context + 1] for s in starts.tolist()])


def lm_loss(model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    rows = rows.to(next(model.parameters()).device)  # batches are drawn on the CPU
    logits = model(rows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, stream: torch.Tensor, cfg: TrainConfig) -> float:
    """Mean loss on fixed held-out windows (their own generator: training RNG untouched)."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    was_training = model.training
    model.eval()
    try:
        losses = [float(lm_loss(model, sample(stream, cfg.batch_size, cfg.context, gen)))
                  for _ in range(cfg.eval_batches)]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)


# ------------------------------------------------------------------ distributed


def train_device() -> torch.device:
    """Where a CLI run trains: under torchrun with GPUs, this process's own GPU
    (``LOCAL_RANK``); otherwise the CPU, as before."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _dist_setup(device: torch.device) -> tuple[int, int, bool]:
    """Join the torchrun group: nccl for a model on a GPU, gloo for one on the CPU.
    Returns (rank, world size, whether this call created the group)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, False
    import torch.distributed as dist

    if device.type == "cuda":
        # nccl binds each rank to the current device; without this every rank
        # would talk through cuda:0.
        torch.cuda.set_device(device)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world, created


def _leave_group(wait: bool) -> None:
    """Leave the group ``_dist_setup`` created; after a finished run (``wait``), once
    gloo's worker threads are idle.

    A gloo worker frees each collective's work item right after running it; when that
    drops the last reference to a tensor Python has seen (DDP's, ours), freeing it
    takes the GIL. If the main thread was already finalising the interpreter, the
    worker was unwound there and the rank aborted ("terminate called without an
    active exception", exit status -6: about one two-rank run in 15 here). The
    barrier returns once every queued collective has run, and waits with the GIL
    released, so the workers finish freeing before this process goes on to exit."""
    import torch.distributed as dist

    if wait:
        dist.barrier()
    dist.destroy_process_group()


def _mean_across(value: torch.Tensor, world: int) -> float:
    value = value.detach()
    if world > 1:
        import torch.distributed as dist

        value = value.clone()
        dist.all_reduce(value)
        value /= world
    return float(value)


# ------------------------------------------------------------------ the loop


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
) -> dict:
    """Train ``model`` (a decoder: ids -> logits) on a 1-D token stream.

    Args:
        model: ToyAttnLM or GPT, freshly initialised (seed it yourself) or anything
            a resume will overwrite.
        tokens: ``(n,)`` token ids; the last 10% are held out for eval loss.
        cfg: hyperparameters; ``cfg.steps`` is the total number of steps.
        out: checkpoint directory (written every ``cfg.checkpoint_every`` steps and
            at the end; see :func:`default_checkpoint_every`); None = no checkpoints.
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

    Returns:
        ``{"steps", "final_loss", "eval_loss", "seconds", "tokens_per_s", "history",
        "resumed_from", "best_step", "best_eval_loss", "overfitting"}`` where history is
        ``[[step, train_loss, eval_loss|None], ...]``.

    With ``out``, every checkpoint also holds ``out/best/``: the checkpoint (a model
    folder :func:`attnlab.load_checkpoint` reads) of the step with the lowest held-out
    loss so far, its step and loss in its ``config.json`` (``"best"``). When the
    held-out loss climbs well above its best for two evals, one warning line goes to
    ``log``: the model is overfitting its text.
    """
    device = next(model.parameters()).device
    rank, world, created = _dist_setup(device)
    try:
        summary = _train(model, tokens, cfg, rank, world, device, out=out, resume=resume,
                         tokenizer=tokenizer, progress=progress, log=log, meta=meta)
    except BaseException:
        if created:  # no barrier: the other ranks may never come to it
            _leave_group(wait=False)
        raise
    if created:
        _leave_group(wait=True)
    return summary


def _train(model, tokens, cfg, rank, world, device, *, out, resume, tokenizer, progress, log,
           meta) -> dict:
    if cfg.batch_size % world:
        raise ValueError(f"batch-size {cfg.batch_size} must be divisible by the number of "
                         f"processes ({world})")
    if cfg.context > model.context_length:
        raise ValueError(f"context {cfg.context} is longer than the model's context_length "
                         f"{model.context_length}")
    check_training_fits(model, cfg.batch_size, cfg.context, world)
    train_stream, eval_stream = split(tokens, cfg.context)
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
        return _run(model, train_stream, eval_stream, cfg, optimizer, gen, rank, world,
                    device, out=out, resume=resume, tokenizer=tokenizer, progress=progress,
                    log=log, meta=meta)


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

    def record(self) -> dict | None:
        if not self.keep or self.weights is None:
            return None
        return {"step": self.step, "eval_loss": self.loss, "weights": self.weights}

    def overfitting(self, step: int, eval_loss: float, train_loss: float, n_tokens: int,
                    vocab: int | None, out) -> str | None:
        """The warning, the first time the held-out loss has risen well above its best."""
        if (self.warned or self.evals_past < self.EVALS_PAST
                or eval_loss < self.loss * (1 + self.RISE) + self.RISE):
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


def _run(model, train_stream, eval_stream, cfg, optimizer, gen, rank, world, device, *,
         out, resume, tokenizer, progress, log, meta) -> dict:
    step, history, resumed_from = 0, [], None
    say = log if (log is not None and rank == 0) else (lambda _msg: None)
    best = _Best(keep=out is not None and rank == 0)
    if resume:
        if out is not None and has_checkpoint(out):
            step, history = restore_training_state(Path(out), model, optimizer, gen, asdict(cfg))
            best = _Best(keep=rank == 0, saved=read_best(Path(out)))
            resumed_from = step
            say(f"resumed from step {step} of {cfg.steps} (checkpoint in {out})")
        elif rank == 0:
            nothing_to_resume(out, log)
    wrapped = model
    if world > 1:
        wrapped = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    per_rank = cfg.batch_size // world
    show = Progress(cfg.steps, step) if progress and rank == 0 else None
    if show is not None and show.bar is not None:
        say = show.through_bar(say)  # lines above the bar, never through it
    meta = {**(meta or {}), "train_config": asdict(cfg), "held_out": held_out_record(eval_stream)}
    start, start_step = time.perf_counter(), step
    saved = step or None  # the step of the last checkpoint known good
    model.train()
    while step < cfg.steps:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        rows = sample(train_stream, cfg.batch_size, cfg.context, gen)
        rows = rows[rank * per_rank:(rank + 1) * per_rank]
        loss = lm_loss(wrapped, rows)
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
            eval_loss = evaluate(model, eval_stream, cfg)
            if not math.isfinite(eval_loss):  # weights that overflow on held-out text
                raise _stop(step, "eval loss", eval_loss, out, saved)
            say(f"step {step:5d}  loss {train_loss:.4f}  eval {eval_loss:.4f}")
            best.update(step, eval_loss, model)
            warning = best.overfitting(step, eval_loss, train_loss,
                                       len(train_stream) + len(eval_stream),
                                       getattr(getattr(model, "config", None), "vocab_size",
                                               None), out)
            if warning is not None:
                say(warning)
        history.append([step, train_loss, eval_loss])
        if show is not None:
            elapsed = time.perf_counter() - start
            show.step(step, train_loss,
                      (step - start_step) * cfg.batch_size * cfg.context / max(elapsed, 1e-9))
        due = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
        if out is not None and rank == 0 and (due or step == cfg.steps):
            bad = next((n for n, p in model.named_parameters()
                        if not bool(torch.isfinite(p).all())), None)
            if bad is not None:  # a NaN moment or an absurd weight decay: never save it
                raise _stop(step, f"weight {bad!r}", float("nan"), out, saved)
            saved = step
            # best goes positionally: tests wrap this function as (..., *rest)
            checkpoint.save_training_state(Path(out), model, optimizer, gen, step, asdict(cfg),
                                           history, tokenizer, meta, best.record())
    if show is not None:
        show.close()
    seconds = time.perf_counter() - start
    trained = step - start_step
    evals = [h[2] for h in history if h[2] is not None]
    return {
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
