"""The per-run summary of a trace: statistics of the measured (post-warm-up) steps.

Written into the trace metadata by the run, recomputed by ``trace recover`` and by the
analysis from the per-rank step records. Pure NumPy: no MPI.

Step time of step s = max over ranks of (end - start); the printed step time is the
median over measured steps. Shares are sums over ranks and steps of the per-rank
compute and wait (time blocked in ``MPI_Wait``) times, divided by the sum of the
per-rank step spans. Data preparation happens before the first step and is reported on
its own line, never as part of a step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np


@dataclass
class Summary:
    """Statistics of the measured (post-warm-up) steps."""

    steps: int
    median_s: float
    min_s: float
    max_s: float
    q1_s: float
    q3_s: float
    compute_share: float
    wait_share: float
    other_share: float
    model_tflops_per_rank: float
    peak_tflops: float
    peak_source: str
    tokens_per_s: float
    #: seconds to prepare the synthetic batches before the first step (max over ranks; None: not recorded,
    #: traces of schema <= 2 made the data inside every step)
    data_prep_s: Optional[float] = None
    data_batches: Optional[int] = None

    @property
    def percent_of_peak(self) -> float:
        return 100.0 * self.model_tflops_per_rank / self.peak_tflops if self.peak_tflops else float("nan")

    def as_dict(self) -> Dict:
        return dict(self.__dict__, percent_of_peak=self.percent_of_peak)

    def lines(self) -> List[str]:
        spread = (f"min {self.min_s:.4f}, IQR {self.q1_s:.4f}-{self.q3_s:.4f}, max {self.max_s:.4f}")
        return [
            f"step time: median {self.median_s:.4f} s over {self.steps} step(s) ({spread})",
            f"time share (all ranks): compute {100 * self.compute_share:.1f}%, exposed communication "
            f"{100 * self.wait_share:.1f}%, other {100 * self.other_share:.1f}%",
            f"model FLOP/s per rank: {self.model_tflops_per_rank * 1e3:.3f} GFLOP/s = {self.percent_of_peak:.1f}% "
            f"of {self.peak_tflops * 1e3:.3f} GFLOP/s ({self.peak_source})",
            f"throughput: {self.tokens_per_s:,.0f} tokens/s",
        ] + ([f"data: {self.data_batches} synthetic batch(es) prepared before the first step in "
              f"{self.data_prep_s:.3f} s (max over ranks; in no step, not compute)"]
             if self.data_prep_s is not None else [])


def summarize(rank_steps: np.ndarray, world_size: int, flops_per_step: float, tokens_per_step: int,
              peak_tflops: float, peak_source: str, data_prep_s: Optional[float] = None,
              data_batches: Optional[int] = None) -> Summary:
    """Summary of the non-warm-up steps in ``rank_steps`` (every rank's step records).

    ``data_prep_s``, ``data_batches``: the run's data preparation before the steps (reported as is).
    """
    measured = rank_steps[rank_steps["warmup"] == 0]
    if not len(measured):
        measured = rank_steps
    spans = (measured["end_ns"] - measured["start_ns"]).astype(np.float64)
    per_step = {}
    for step, span in zip(measured["step"].tolist(), spans.tolist()):
        per_step[step] = max(per_step.get(step, 0.0), span * 1e-9)
    times = sorted(per_step.values())
    q = np.quantile(times, [0.25, 0.75])
    median = statistics.median(times)
    total = float(spans.sum()) or 1.0
    compute = float(measured["compute_ns"].sum()) / total
    wait = float(measured["wait_ns"].sum()) / total
    return Summary(steps=len(times), median_s=median, min_s=times[0], max_s=times[-1], q1_s=float(q[0]),
                   q3_s=float(q[1]), compute_share=compute, wait_share=wait,
                   other_share=max(0.0, 1.0 - compute - wait),
                   model_tflops_per_rank=flops_per_step / world_size / median / 1e12, peak_tflops=peak_tflops,
                   peak_source=peak_source, tokens_per_s=tokens_per_step / median, data_prep_s=data_prep_s,
                   data_batches=data_batches)
