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

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import CONFIG_FILE, write_model_files
from .io import (
    CheckpointError,
    atomic_dir,
    atomic_write_json,
    load_tensors,
    read_json,
    recover_dir,
    save_tensors,
)

STATE_TENSORS = "training_state.safetensors"
STATE_JSON = "training_state.json"


@dataclass
class TrainConfig:
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
        for name in ("steps", "batch_size", "context", "eval_every", "eval_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be a positive integer, "
                                 f"got {value!r}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(f"checkpoint-every must be a positive integer, got "
                             f"{self.checkpoint_every!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


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


def _dist_setup(device: torch.device) -> tuple[int, int]:
    """Join the torchrun group: nccl for a model on a GPU, gloo for one on the CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world


def _mean_across(value: torch.Tensor, world: int) -> float:
    value = value.detach()
    if world > 1:
        import torch.distributed as dist

        value = value.clone()
        dist.all_reduce(value)
        value /= world
    return float(value)


# ------------------------------------------------------------------ checkpoint state


def _save(out: Path, model, optimizer, gen, step, cfg, history, tokenizer, meta):
    tensors = {"rng.torch": torch.get_rng_state(), "rng.batches": gen.get_state()}
    opt = optimizer.state_dict()
    for index, state in opt["state"].items():
        for key, value in state.items():
            tensors[f"optim.{index}.{key}"] = torch.as_tensor(value)
    groups = [{k: v for k, v in g.items()} for g in opt["param_groups"]]
    with atomic_dir(out) as tmp:
        write_model_files(tmp, model, tokenizer=tokenizer, **meta)
        save_tensors(tmp / STATE_TENSORS, tensors)
        atomic_write_json(tmp / STATE_JSON, {"step": step, "train_config": asdict(cfg),
                                             "param_groups": groups, "history": history})


def _restore(out: Path, model, optimizer, gen) -> tuple[int, dict]:
    from .checkpoint import load_checkpoint

    saved = load_checkpoint(out)
    try:
        model.load_state_dict(saved.state_dict())
    except RuntimeError as exc:
        detail = str(exc).splitlines()[-1].strip() if str(exc) else ""
        raise CheckpointError(
            f"--resume: the {type(saved).__name__} checkpoint in {str(out)!r} does not fit the "
            f"{type(model).__name__} being trained ({detail}); resume with the model and "
            "context it was trained with, or choose another --out") from None
    state = read_json(out / STATE_JSON)
    tensors = load_tensors(out / STATE_TENSORS)
    per_param: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith("optim."):
            _, index, key = name.split(".", 2)
            per_param.setdefault(int(index), {})[key] = value
    try:
        optimizer.load_state_dict({"state": per_param, "param_groups": state["param_groups"]})
        torch.set_rng_state(tensors["rng.torch"])
        gen.set_state(tensors["rng.batches"])
        return int(state["step"]), state
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"--resume: the training state in {str(out)!r} is damaged or "
                              f"incomplete ({type(exc).__name__}: {exc})") from None


def check_out_dir(out: str | os.PathLike) -> None:
    """Refuse an ``out`` that holds anything but an attnlab checkpoint.

    A checkpoint replaces its directory as a whole (atomically), so writing one
    into a folder of other files would delete them.
    """
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file; expected a directory for the checkpoint")
    if (out / CONFIG_FILE).exists() or not any(out.iterdir()):
        return
    raise ValueError(
        f"--out {str(out)!r} holds files that are not an attnlab checkpoint; expected a new or "
        "empty directory (a checkpoint replaces its directory as a whole)")


def has_checkpoint(out: str | os.PathLike) -> bool:
    out = Path(out)
    recover_dir(out)  # a writer killed between its two renames left the copy beside it
    return (out / STATE_JSON).exists() and (out / CONFIG_FILE).exists()


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
            at the end); None = no checkpoints.
        resume: continue from the checkpoint in ``out``.
        tokenizer: saved beside the model as ``tokenizer.json``.
        progress: show a tqdm bar (on a terminal, rank 0).
        log: where eval lines go (rank 0); None for silence.
        meta: extra JSON fields for ``config.json``.

    Returns:
        ``{"steps", "final_loss", "eval_loss", "seconds", "tokens_per_s", "history",
        "resumed_from"}`` where history is ``[[step, train_loss, eval_loss|None], ...]``.
    """
    device = next(model.parameters()).device
    rank, world = _dist_setup(device)
    if cfg.batch_size % world:
        raise ValueError(f"batch-size {cfg.batch_size} must be divisible by the number of "
                         f"processes ({world})")
    if cfg.context > model.context_length:
        raise ValueError(f"context {cfg.context} is longer than the model's context_length "
                         f"{model.context_length}")
    train_stream, eval_stream = split(tokens, cfg.context)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.weight_decay)
    step, history, resumed_from = 0, [], None
    if out is not None and rank == 0:
        check_out_dir(out)
    if resume:
        if out is None or not has_checkpoint(out):
            raise CheckpointError(f"--resume: no checkpoint to resume in {str(out)!r} (a run "
                                  "stopped before its first checkpoint starts again without "
                                  "--resume)")
        step, state = _restore(Path(out), model, optimizer, gen)
        history, resumed_from = state["history"], step
    wrapped = model
    if world > 1:
        wrapped = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    per_rank = cfg.batch_size // world
    say = log if (log is not None and rank == 0) else (lambda _msg: None)
    bar = None
    if progress and rank == 0 and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=step, desc="train", unit="step", leave=False)
    meta = {**(meta or {}), "train_config": asdict(cfg)}
    start, start_step = time.perf_counter(), step
    model.train()
    while step < cfg.steps:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        rows = sample(train_stream, cfg.batch_size, cfg.context, gen)
        rows = rows[rank * per_rank:(rank + 1) * per_rank]
        loss = lm_loss(wrapped, rows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        step += 1
        train_loss = _mean_across(loss, world)
        eval_loss = None
        if step % cfg.eval_every == 0 or step == cfg.steps:
            eval_loss = evaluate(model, eval_stream, cfg)
            say(f"step {step:5d}  loss {train_loss:.4f}  eval {eval_loss:.4f}")
        history.append([step, train_loss, eval_loss])
        if bar is not None:
            elapsed = time.perf_counter() - start
            tps = (step - start_step) * cfg.batch_size * cfg.context / max(elapsed, 1e-9)
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tps:,.0f}")
            bar.update(1)
        due = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
        if out is not None and rank == 0 and (due or step == cfg.steps):
            _save(Path(out), model, optimizer, gen, step, cfg, history, tokenizer, meta)
    if bar is not None:
        bar.close()
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
    }
