"""The per-run summary of a trace, and the one step-time statistic every table, plot and summary uses.

Written into the trace metadata by the run, recomputed by ``trace recover`` and by the
analysis from the per-rank step records. Pure NumPy: no MPI.

**The step time of a run** (:func:`step_stats`, the only place it is computed): for each
measured (non-warm-up) step ``s``, ``T[s]`` = max over ranks of the rank's span
``end_ns - start_ns`` (the slowest rank finishes the step); the run's step time is the
**median** of ``T`` over the measured steps, its spread the quartiles ``q1``/``q3`` of ``T``
(NumPy's default linear interpolation), with ``min`` and ``max``. The run summary, every
table of ``fourd-mpi analyze`` and every figure of ``fourd-mpi plot`` show these numbers.

**Shares** are sums over ranks and measured steps of the per-rank times, divided by the sum
of the per-rank step spans: ``compute`` (algorithm work only: the host-lane ops
:data:`~fourd_mpi.trace.events.COMPUTE_OPS`, i.e. ``compute_ns`` less the harness time),
``wait`` (time blocked in ``MPI_Wait``, "exposed communication"), ``harness`` (work of the
benchmark harness inside a step: :data:`HARNESS_OPS`, the synthetic data that traces of
schema <= 2 made inside every step), ``bubble`` (pipeline runs, schema >= 6: time blocked waiting for
another stage's message, host-lane ``bubble`` events; its own category, not exposed communication) and
``other`` (the rest). Data preparation before the
first step (schema >= 3) is reported on its own line, never as part of a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from fourd_mpi.perf.peaks import GEMM_PCT_FORMULA, HFU_FORMULA, MFU_FORMULA
from fourd_mpi.trace.events import BUBBLE_OPS, LANE_HOST
from fourd_mpi.util.text import format_number
from fourd_mpi.util.units import MIB

#: host-lane ops that are work of the benchmark harness, not of the algorithm (``data``: synthetic
#: batches made inside every step by traces of schema <= 2; the tracer counted them in ``compute_ns``)
HARNESS_OPS = ("data",)

STEP_FORMULA = ("step time = median over measured steps of (max over ranks of the rank's step span "
                "end_ns - start_ns); spread: quartiles q1/q3 of the same per-step series")
SHARE_FORMULA = "share = sum over ranks and measured steps of the time / sum of the ranks' step spans"
#: the two FLOP rates (Narayanan et al., SC'21; AxoNN and Megatron-LM report "% of peak" with the second)
MODEL_FLOPS_FORMULA = ("model FLOP/s per rank = model FLOPs per step / ranks / median step time; model FLOPs = "
                       "72 B s l h^2 (1 + s/6h) for a GPT (6 x tokens x weights + 12 B s^2 h per block), whatever "
                       "is recomputed")
HARDWARE_FLOPS_FORMULA = ("hardware FLOP/s per rank = FLOPs the step executes / ranks / median step time; "
                          "executed = model FLOPs + recomputed forward FLOPs: full recompute 96 B s l h^2 "
                          "(1 + s/6h), selective + 4 B s^2 h per block, none = model FLOPs")


def measured_records(rank_steps: np.ndarray) -> np.ndarray:
    """The non-warm-up step records; all of them if every step is warm-up."""
    measured = rank_steps[rank_steps["warmup"] == 0]
    return measured if len(measured) else rank_steps


@dataclass(frozen=True)
class StepStats:
    """:data:`STEP_FORMULA` over the measured steps: ``per_step_s[i]`` is the max over ranks of the
    span of step ``steps_index[i]`` (both sorted by step); NaN statistics when there is no step."""

    steps: int
    median_s: float
    q1_s: float
    q3_s: float
    min_s: float
    max_s: float
    steps_index: np.ndarray = field(repr=False)
    per_step_s: np.ndarray = field(repr=False)


def step_stats(source) -> StepStats:
    """The run's step-time statistics (:data:`STEP_FORMULA`) from a trace (anything with
    ``rank_steps``) or a ``/rank_steps`` array (:data:`~fourd_mpi.trace.events.RANK_STEP_DTYPE`)."""
    rank_steps = getattr(source, "rank_steps", source)
    measured = measured_records(rank_steps)
    if not len(measured):
        nan = float("nan")
        return StepStats(0, nan, nan, nan, nan, nan, np.zeros(0, np.int64), np.zeros(0))
    spans = (measured["end_ns"] - measured["start_ns"]).astype(np.float64) * 1e-9
    steps, inverse = np.unique(measured["step"], return_inverse=True)
    per_step = np.full(len(steps), -np.inf)
    np.maximum.at(per_step, inverse, spans)
    q1, median, q3 = np.quantile(per_step, [0.25, 0.5, 0.75])
    return StepStats(steps=len(steps), median_s=float(median), q1_s=float(q1), q3_s=float(q3),
                     min_s=float(per_step.min()), max_s=float(per_step.max()), steps_index=steps.astype(np.int64),
                     per_step_s=per_step)


def per_record_sums(rank_steps: np.ndarray, events: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """For every record of ``rank_steps``, the summed durations (ns, float) of the events selected by
    ``mask`` with that record's ``(rank, step)``; events of no record are ignored. Shape ``(len(rank_steps),)``."""
    out = np.zeros(len(rank_steps))
    if not len(rank_steps) or not mask.any():
        return out
    picked = np.flatnonzero(mask)
    width = int(max(int(rank_steps["step"].max()), int(events["step"][picked].max()))) + 2
    rec_key = rank_steps["rank"].astype(np.int64) * width + (rank_steps["step"].astype(np.int64) + 1)
    ev_key = events["rank"][picked].astype(np.int64) * width + (events["step"][picked].astype(np.int64) + 1)
    order = np.argsort(rec_key, kind="stable")
    pos = np.searchsorted(rec_key[order], ev_key)
    pos = np.minimum(pos, len(order) - 1)
    hit = rec_key[order][pos] == ev_key
    dur = (events["end_ns"][picked] - events["start_ns"][picked]).astype(np.float64)
    np.add.at(out, order[pos[hit]], dur[hit])
    return out


def host_op_mask(events: np.ndarray, ops_vocab: Sequence[str], names: Sequence[str]) -> np.ndarray:
    """Events on the host lane whose op is one of ``names`` (by name: codes differ between schemas)."""
    return host_op_masks(events, ops_vocab, names)[0]


def host_op_masks(events: np.ndarray, ops_vocab: Sequence[str], *groups: Sequence[str]) -> List[np.ndarray]:
    """:func:`host_op_mask` of each group of op names, in one pass through the events (block by block)."""
    from fourd_mpi.trace.scan import blocks, in_codes

    codes = [[i for i, name in enumerate(ops_vocab) if name in names] for names in groups]
    out = [np.zeros(len(events), dtype=bool) for _ in groups]
    if not any(codes) or not len(events):
        return out
    for a, b in blocks(len(events)):  # the columns of a block read while its records are in cache
        block = events[a:b]
        host, op = block["lane"] == LANE_HOST, block["op"]
        for mask, group in zip(out, codes):
            if group:
                mask[a:b] = host & in_codes(op, group)
    return out


def bubble_ns(trace) -> np.ndarray:
    """Per record of ``trace.rank_steps``: ns blocked waiting for another pipeline stage's message (host-lane
    ``bubble`` events, :data:`~fourd_mpi.trace.events.BUBBLE_OPS`; zeros without them)."""
    mask = host_op_mask(trace.events, trace.vocab.get("ops", ()), BUBBLE_OPS)
    return per_record_sums(trace.rank_steps, trace.events, mask)


def harness_ns(trace) -> np.ndarray:
    """Per record of ``trace.rank_steps``: ns of harness work (:data:`HARNESS_OPS`) inside the step, from
    the host-lane events (zeros for traces below level ``op``, which cannot tell it apart)."""
    mask = host_op_mask(trace.events, trace.vocab.get("ops", ()), HARNESS_OPS)
    return per_record_sums(trace.rank_steps, trace.events, mask)


def harness_and_bubble_ns(trace):
    """``(harness_ns(trace), bubble_ns(trace))``, both masks made in one pass through the events."""
    masks = host_op_masks(trace.events, trace.vocab.get("ops", ()), HARNESS_OPS, BUBBLE_OPS)
    return tuple(per_record_sums(trace.rank_steps, trace.events, mask) for mask in masks)


def _positive(value: Optional[float]) -> bool:
    """A usable divisor: a number > 0 (None and NaN are not)."""
    return value is not None and value > 0


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
    #: the data-sheet peak per rank (TFLOP/s; :mod:`fourd_mpi.perf.peaks` or ``--peak-tflops``; None: none, e.g.
    #: on a CPU) and where it comes from (or why there is none)
    peak_tflops: Optional[float]
    peak_source: str
    tokens_per_s: float
    #: seconds to prepare the synthetic batches before the first step (max over ranks; None: not recorded,
    #: traces of schema <= 2 made the data inside every step)
    data_prep_s: Optional[float] = None
    data_batches: Optional[int] = None
    #: share of harness work inside the steps (:data:`HARNESS_OPS`; 0 from schema 3 on)
    harness_share: float = 0.0
    #: (schema 5) FLOP/s per rank counting recomputed forward work (:data:`HARDWARE_FLOPS_FORMULA`; None: not
    #: recorded, equal to the model rate for traces without recompute), the activation recompute mode, the
    #: formulas of both rates for this model, and the activations kept between forward and backward
    hardware_tflops_per_rank: Optional[float] = None
    recompute: Optional[str] = None
    model_flops_formula: Optional[str] = None
    hardware_flops_formula: Optional[str] = None
    #: ``{"saved_bytes_max", "saved_bytes_min", "peak_bytes_max"}`` per rank, measured from the arrays held
    activations: Optional[Dict] = None
    #: (schema 6) share of pipeline bubbles: time blocked waiting for another stage's message (0: none)
    bubble_share: float = 0.0
    #: the standalone TFLOP/s of the step's largest local GEMM, median over ranks (None: not measured)
    gemm_tflops: Optional[float] = None

    @property
    def mfu_pct(self) -> float:
        """:data:`~fourd_mpi.perf.peaks.MFU_FORMULA` (NaN without a data-sheet peak)."""
        return 100.0 * self.model_tflops_per_rank / self.peak_tflops if _positive(self.peak_tflops) else float("nan")

    @property
    def hfu_pct(self) -> float:
        """:data:`~fourd_mpi.perf.peaks.HFU_FORMULA`: the hardware FLOPs (recompute counted; the model FLOPs
        when the trace has none recorded: nothing recomputed) over the data-sheet peak."""
        hardware = (self.model_tflops_per_rank if self.hardware_tflops_per_rank is None
                    else self.hardware_tflops_per_rank)
        return 100.0 * hardware / self.peak_tflops if _positive(self.peak_tflops) else float("nan")

    @property
    def gemm_pct(self) -> float:
        """:data:`~fourd_mpi.perf.peaks.GEMM_PCT_FORMULA` (NaN when the GEMM was not measured)."""
        return 100.0 * self.model_tflops_per_rank / self.gemm_tflops if _positive(self.gemm_tflops) else float("nan")

    def as_dict(self) -> Dict:
        return dict(self.__dict__, mfu_pct=self.mfu_pct, hfu_pct=self.hfu_pct, gemm_pct=self.gemm_pct)

    def flops_lines(self) -> List[str]:
        """The FLOP/s lines, then MFU, HFU and % of measured GEMM, each naming its formula."""
        model = f"model FLOP/s per rank: {self.model_tflops_per_rank * 1e3:.3f} GFLOP/s"
        lines = [model + f"  [{self.model_flops_formula or MODEL_FLOPS_FORMULA}; / ranks / median step time]"]
        if self.hardware_tflops_per_rank is not None:
            lines.append(f"hardware FLOP/s per rank: {self.hardware_tflops_per_rank * 1e3:.3f} GFLOP/s  [recompute "
                         f"{self.recompute}: {self.hardware_flops_formula or HARDWARE_FLOPS_FORMULA}; / ranks / "
                         f"median step time]")
        if _positive(self.peak_tflops):
            peak = f"peak {self.peak_tflops:g} TFLOP/s per rank, {self.peak_source}"
            lines.append(f"MFU: {self.mfu_pct:.2f}%  [{MFU_FORMULA}; {peak}]")
            lines.append(f"HFU: {self.hfu_pct:.2f}%  [{HFU_FORMULA}]")
        else:
            why = self.peak_source if self.peak_source.startswith("not ") else f"not reported ({self.peak_source})"
            lines.append(f"MFU, HFU: {why}")
        if _positive(self.gemm_tflops):
            lines.append(f"% of measured GEMM: {self.gemm_pct:.1f}% of {self.gemm_tflops * 1e3:.3f} GFLOP/s  "
                         f"[{GEMM_PCT_FORMULA}]")
        return lines

    def activation_lines(self) -> List[str]:
        if not self.activations:
            return []
        a = self.activations
        mib = 1.0 / MIB
        return [f"activations kept from forward for backward: {a['saved_bytes_max'] * mib:.3f} MiB per rank (max "
                f"over ranks; min {a['saved_bytes_min'] * mib:.3f}); most held at once in backward "
                f"{a['peak_bytes_max'] * mib:.3f} MiB (recompute {self.recompute}; measured: bytes of the distinct "
                f"arrays held, last step)"]

    def lines(self) -> List[str]:
        """The run summary. Step times are printed as the analysis tables print them
        (:func:`~fourd_mpi.util.text.format_number`), so the numbers agree digit for digit."""
        f = format_number
        spread = f"min {f(self.min_s)}, q1 {f(self.q1_s)}, q3 {f(self.q3_s)}, max {f(self.max_s)}"
        harness = f", harness {100 * self.harness_share:.1f}%" if self.harness_share else ""
        harness += f", pipeline bubbles {100 * self.bubble_share:.1f}%" if self.bubble_share else ""
        return [
            f"step time: median {f(self.median_s)} s over {self.steps} step(s) ({spread}; a step's time is "
            f"the max over ranks)",
            f"time share (sum over ranks and steps / sum of step spans): compute {100 * self.compute_share:.1f}%, "
            f"exposed communication {100 * self.wait_share:.1f}%{harness}, other {100 * self.other_share:.1f}%",
            *self.flops_lines(),
            f"throughput: {self.tokens_per_s:,.0f} tokens/s",
            *self.activation_lines(),
        ] + ([f"data: {self.data_batches} synthetic batch(es) prepared before the first step in "
              f"{self.data_prep_s:.3f} s (max over ranks; in no step, not compute)"]
             if self.data_prep_s is not None else [])


def summarize(rank_steps: np.ndarray, world_size: int, flops_per_step: float, tokens_per_step: int,
              peak_tflops: Optional[float], peak_source: str, data_prep_s: Optional[float] = None,
              data_batches: Optional[int] = None, harness: Optional[np.ndarray] = None,
              hardware_flops_per_step: Optional[float] = None, recompute: Optional[str] = None,
              formulas: Optional[Sequence[str]] = None, activations: Optional[Dict] = None,
              bubble: Optional[np.ndarray] = None, gemm_tflops: Optional[float] = None) -> Summary:
    """Summary of the non-warm-up steps in ``rank_steps`` (every rank's step records).

    Step statistics: :func:`step_stats`. ``harness``: per record of ``rank_steps``, ns of harness work
    counted in ``compute_ns`` (:func:`harness_ns`; None: none). ``data_prep_s``, ``data_batches``: the
    run's data preparation before the steps (reported as is). ``hardware_flops_per_step``: FLOPs the step
    executes, recompute included (``ModelConfig.hardware_flops_per_step``; None: not reported), with
    ``recompute`` its mode and ``formulas`` the ``(model, hardware)`` formulas in words; ``activations``:
    the measured activation bytes (stored as is). ``bubble``: per record of ``rank_steps``, ns blocked waiting for
    another pipeline stage's message (:func:`bubble_ns`; None: none), a share of its own. ``peak_tflops``: the
    data-sheet peak per rank (None: none; ``peak_source`` then says why), ``gemm_tflops`` the measured standalone
    GEMM (None: not measured): MFU, HFU and % of measured GEMM divide by them (:mod:`fourd_mpi.perf.peaks`).
    """
    stats = step_stats(rank_steps)
    keep = rank_steps["warmup"] == 0
    if not keep.any():
        keep = np.ones(len(rank_steps), dtype=bool)
    measured = rank_steps[keep]
    spans = (measured["end_ns"] - measured["start_ns"]).astype(np.float64)
    total = float(spans.sum()) or 1.0
    extra = float(np.asarray(harness, dtype=np.float64)[keep].sum()) if harness is not None else 0.0
    compute = (float(measured["compute_ns"].astype(np.float64).sum()) - extra) / total
    wait = float(measured["wait_ns"].astype(np.float64).sum()) / total
    harness_share = extra / total
    bubble_share = float(np.asarray(bubble, dtype=np.float64)[keep].sum()) / total if bubble is not None else 0.0
    median = stats.median_s
    return Summary(steps=stats.steps, median_s=median, min_s=stats.min_s, max_s=stats.max_s, q1_s=stats.q1_s,
                   q3_s=stats.q3_s, compute_share=compute, wait_share=wait,
                   other_share=max(0.0, 1.0 - compute - wait - harness_share - bubble_share),
                   model_tflops_per_rank=flops_per_step / world_size / median / 1e12, peak_tflops=peak_tflops,
                   peak_source=peak_source, tokens_per_s=tokens_per_step / median, data_prep_s=data_prep_s,
                   data_batches=data_batches, harness_share=harness_share,
                   hardware_tflops_per_rank=(None if hardware_flops_per_step is None
                                             else hardware_flops_per_step / world_size / median / 1e12),
                   recompute=recompute, model_flops_formula=formulas[0] if formulas else None,
                   hardware_flops_formula=formulas[1] if formulas else None, activations=activations,
                   bubble_share=bubble_share, gemm_tflops=gemm_tflops)
