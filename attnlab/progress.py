"""How a training run shows its progress on stderr: a bar on a terminal, lines in a pipe."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

#: Without a terminal (a pipe, a log file, CI) a progress line is printed at every
#: tenth of the run, and at least this often in seconds while a tenth takes longer.
PIPE_PROGRESS_SECONDS = 10.0


class Progress:
    """Where a run shows its progress on stderr: a tqdm bar on a terminal, else plain
    lines at a steady pace (a bar redrawn into a pipe would be one endless line)."""

    def __init__(self, total: int, step: int) -> None:
        self.total = total
        self.every = max(1, total // 10)
        self.last = time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=step, desc="train", unit="step",
                            leave=False)

    def through_bar(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """``log`` wrapped so the bar is cleared before the line and redrawn after it."""
        from tqdm import tqdm

        def write(msg: str) -> None:
            with tqdm.external_write_mode():
                log(msg)
        return write

    def step(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
            self.bar.update(1)
            return
        now = time.perf_counter()
        if step % self.every == 0 or step == self.total or now - self.last >= PIPE_PROGRESS_SECONDS:
            self.last = now
            width = len(str(self.total))
            print(f"train {step:{width}d}/{self.total} steps  loss {loss:.4f}  "
                  f"{tokens_per_s:,.0f} tok/s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
