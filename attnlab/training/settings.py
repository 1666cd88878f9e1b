"""A run's settings: ``TrainConfig``, the checks of steps and seed, what fits in memory,
the learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..checks import (
    boolean,
    bounded_int,
    finite_float,
    fits_in_memory,
    is_int,
    non_negative_int,
    optional_positive_int,
    positive_int,
)
from ..config import Config

_FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max

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
    """Hyperparameters of a run. ``steps`` is the total, also when resuming. ``pack``:
    train on documents packed into rows with document ids (:mod:`.packing`) instead of
    windows of one token stream."""

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
    pack: bool = False

    def __post_init__(self) -> None:
        # Named as the CLI options, where these values usually come from.
        for name in ("steps", "batch_size", "context", "eval_every", "eval_batches"):
            positive_int(name.replace("_", "-"), getattr(self, name))
        check_steps("steps", self.steps)
        optional_positive_int("checkpoint-every", self.checkpoint_every)
        if self.checkpoint_every is not None:
            check_steps("checkpoint-every", self.checkpoint_every)
        # (the optimiser holds it in float32: a larger one failed inside Adam's step)
        if finite_float("lr", self.lr, positive=True) > _FLOAT32_MAX:
            raise ValueError(f"lr must be a positive finite float32 number, got {self.lr!r}")
        non_negative_int("warmup", self.warmup)
        for name in ("weight_decay", "grad_clip"):
            if finite_float(name, getattr(self, name)) < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got "
                                 f"{getattr(self, name)!r}")
        if not 0 <= finite_float("min_lr_ratio", self.min_lr_ratio) <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        check_seed(self.seed)
        boolean("pack", self.pack)


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
    and ``num_layers``/``num_heads``/``head_dim`` where there are several)."""
    config = getattr(model, "config", model)
    d, vocab = config.d_model, config.vocab_size
    layers, heads = getattr(config, "num_layers", 1), getattr(config, "num_heads", 1)
    width = max(d, heads * (getattr(config, "head_dim", None) or d // heads))  # (wide heads)
    per_token = 3 * vocab + 24 * width * layers
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
