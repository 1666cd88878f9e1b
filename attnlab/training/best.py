"""The checkpoint of the lowest held-out loss (``OUT/best/``) and the one warning when
the held-out loss climbs away from it: overfitting."""

from __future__ import annotations

import math
import os

from torch import nn

from ..io import BEST_DIR

__all__ = ["Best"]


class Best:
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
