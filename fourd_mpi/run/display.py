"""Rank 0's console output during a run: a progress bar or one line per step."""

from __future__ import annotations

import sys
from typing import Callable

DISPLAYS = ("auto", "bar", "lines", "quiet")


class StepDisplay:
    """Rank 0's per-step output: a tqdm bar (step, loss, step time) or one line per step.

    The step time shown is the max over ranks of the step's span: the per-step series whose median
    over the measured steps is the run's step time (:func:`fourd_mpi.trace.summary.step_stats`)."""

    def __init__(self, mode: str, steps: int, warmup: int, say: Callable[[str], None], active: bool):
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode if active else "quiet"
        self.say = say
        self.warmup = warmup
        self.bar = None
        if self.mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=steps, unit="step", file=sys.stderr, dynamic_ncols=True, desc="training")
        elif self.mode == "lines":
            say(f"{'step':>6} {'loss':>14} {'time (s)':>10}")

    def update(self, step: int, loss: float, seconds: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"step {step}, loss {loss:.6g}, {seconds:.4f} s/step"
                                     + (" (warm-up)" if step < self.warmup else ""), refresh=False)
            self.bar.update(1)
        elif self.mode == "lines":
            tag = "  (warm-up)" if step < self.warmup else ""
            self.say(f"{step:>6} {loss:>14.8g} {seconds:>10.4f}{tag}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
