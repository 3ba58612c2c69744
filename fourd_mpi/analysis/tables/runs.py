"""The runs table (one row per run) and the per-run facts the other tables share."""

from __future__ import annotations

import os
from typing import Dict, Sequence

import numpy as np
import pandas as pd

from fourd_mpi.algorithms.registry import DEFAULT_ALGORITHM, of_metadata
from fourd_mpi.perf.peaks import stored_peaks, utilization_pct
from fourd_mpi.trace.read import Trace
from fourd_mpi.trace.summary import harness_and_bubble_ns, summarize
from fourd_mpi.util.text import short_label

RUN_COLUMNS = [
    "run_id", "path", "status", "label", "algorithm", "model", "world_size", "grid", "gdata", "gz", "gy", "gx",
    "overlap", "progress", "level", "steps", "step_median_s", "step_min_s", "step_max_s", "step_q1_s", "step_q3_s",
    "compute_share", "wait_share", "harness_share", "other_share", "tflops_per_rank", "peak_tflops",
    "mfu_pct", "tokens_per_s", "imbalance", "tokens_per_step", "model_flops_per_step", "config_key",
    "recompute", "hardware_flops_per_step", "hardware_tflops_per_rank", "hfu_pct", "gemm_tflops", "gemm_pct",
]
#: the runs table's columns on a terminal (csv and json keep all)
RUNS_SHOWN = ["run_id", "algorithm", "grid", "world_size", "overlap", "progress", "steps", "step_median_s", "step_q1_s",
              "step_q3_s", "compute_share", "wait_share", "harness_share", "other_share", "recompute",
              "tflops_per_rank", "mfu_pct", "hardware_tflops_per_rank", "hfu_pct", "gemm_pct", "tokens_per_s",
              "imbalance"]


def grid_of(trace: Trace) -> Dict[str, int]:
    """Axis sizes ``{"data", "z", "y", "x"}`` from metadata ``run_options`` (else the ``grid`` string)."""
    ro = trace.metadata.get("run_options") or {}
    g = ro.get("grid") if isinstance(ro, dict) else None
    if isinstance(g, dict) and all(k in g for k in ("data", "z", "y", "x")):
        return {k: int(g[k]) for k in ("data", "z", "y", "x")}
    text = str(trace.metadata.get("grid", ""))
    try:
        d, z, y, x = (int(v) for v in text.split("x"))
        return {"data": d, "z": z, "y": y, "x": x}
    except ValueError:
        return {"data": 0, "z": 0, "y": 0, "x": 0}


def _model_name(trace: Trace) -> str:
    """The model preset name; with its shape appended when it was changed from the preset's."""
    ro = trace.metadata.get("run_options") or {}
    model = ro.get("model") if isinstance(ro, dict) else None
    config = trace.metadata.get("config") or {}
    if not isinstance(model, dict):
        return str(config.get("model", "?"))
    name = str(model.get("name", config.get("model", "?")))
    fields = ("layers", "hidden", "heads", "ffn_hidden", "seq")
    try:
        from fourd_mpi.step.presets import PRESETS

        preset = PRESETS.get(name)
    except Exception:  # pragma: no cover - the presets are pure Python
        preset = None
    if preset is not None and all(model.get(f) == getattr(preset, f) for f in fields):
        return name
    if all(f in model for f in fields):
        return (f"{name}(L{model['layers']},h{model['hidden']},a{model['heads']},f{model['ffn_hidden']},"
                f"s{model['seq']})")
    return name


def _label(trace: Trace) -> str:
    config = trace.metadata.get("config") or {}
    label = config.get("label") if isinstance(config, dict) else None
    return "" if label in (None, "") else str(label)


def config_key(model: str, overlap: str, progress: str, label: str = "", algorithm: str = DEFAULT_ALGORITHM) -> str:
    """What a scaling line groups by: ``model[/algorithm]/overlap/progress[/label]`` (no rank count, no
    grid; the algorithm only when it is not the default ``axonn4d``, so older keys stay as they were)."""
    head = [model] + ([algorithm] if algorithm and algorithm != DEFAULT_ALGORITHM else [])
    return "/".join(head + [overlap or "none", progress or "?"] + ([label] if label else []))


def algorithm_of(trace: Trace) -> str:
    """The run's ``--algorithm`` (metadata; traces from before the algorithm axis: ``axonn4d``)."""
    return of_metadata(trace.metadata)


def _imbalance(rank_steps: np.ndarray, harness: np.ndarray) -> float:
    """max over ranks / mean over ranks of per-rank compute time (``compute_ns`` less harness work)
    per measured step."""
    keep = rank_steps["warmup"] == 0
    if not keep.any():
        keep = np.ones(len(rank_steps), dtype=bool)
    measured = rank_steps[keep]
    if not len(measured):
        return float("nan")
    ranks, inverse = np.unique(measured["rank"], return_inverse=True)
    work = measured["compute_ns"].astype(np.float64) - harness[keep]
    busy = np.bincount(inverse, weights=work, minlength=len(ranks))
    steps = np.bincount(inverse, minlength=len(ranks))
    per_step = busy / np.maximum(steps, 1)
    mean = per_step.mean()
    return float(per_step.max() / mean) if mean > 0 else float("nan")


def run_row(trace: Trace) -> Dict:
    """One row of :func:`runs_table` (a dict with :data:`RUN_COLUMNS`)."""
    meta = trace.metadata
    grid = grid_of(trace)
    world = int(meta.get("world_size", trace.world_size) or trace.world_size)
    flops = float(meta.get("model_flops_per_step", float("nan")))
    recompute = str(meta.get("recompute") or "none")  # traces before schema 5 recomputed nothing
    hardware = float(meta.get("hardware_flops_per_step", flops))
    tokens = meta.get("tokens_per_step")
    tokens = int(tokens) if tokens is not None else 0
    stored = meta.get("summary") if isinstance(meta.get("summary"), dict) else {}
    peak, gemm = stored_peaks(stored)
    if peak is None and not stored:  # no summary (a recovered trace): the --peak-tflops the run was given
        config = meta.get("config") or {}
        peak = config.get("peak-tflops") if isinstance(config, dict) else None
    peak = float("nan") if peak is None else float(peak)
    gemm = float("nan") if gemm is None else float(gemm)
    model = _model_name(trace)
    overlap = short_label(meta.get("overlap") or (meta.get("run_options") or {}).get("overlap"), "none")
    progress = short_label(meta.get("progress") or (meta.get("run_options") or {}).get("progress"), "?")
    label = _label(trace)
    algorithm = algorithm_of(trace)
    nan = float("nan")
    row = dict(run_id=str(meta.get("run_id") or trace.attrs.get("run_id") or os.path.basename(trace.path)),
               path=trace.path, status=trace.status, label=label, algorithm=algorithm, model=model, world_size=world,
               grid=str(meta.get("grid") or "x".join(str(grid[k]) for k in ("data", "z", "y", "x"))),
               gdata=grid["data"], gz=grid["z"], gy=grid["y"], gx=grid["x"], overlap=overlap, progress=progress,
               level=str(meta.get("level", "")), steps=0, step_median_s=nan, step_min_s=nan, step_max_s=nan,
               step_q1_s=nan, step_q3_s=nan, compute_share=nan, wait_share=nan, harness_share=nan, other_share=nan,
               tflops_per_rank=nan, peak_tflops=peak, mfu_pct=nan, tokens_per_s=nan, imbalance=nan,
               tokens_per_step=tokens, model_flops_per_step=flops,
               config_key=config_key(model, overlap, progress, label, algorithm), recompute=recompute,
               hardware_flops_per_step=hardware, hardware_tflops_per_rank=nan, hfu_pct=nan, gemm_tflops=gemm,
               gemm_pct=nan)
    if len(trace.rank_steps):
        harness, bubble = harness_and_bubble_ns(trace)
        s = summarize(trace.rank_steps, world, flops, tokens, peak, "", harness=harness, bubble=bubble)
        row.update(steps=s.steps, step_median_s=s.median_s, step_min_s=s.min_s, step_max_s=s.max_s,
                   step_q1_s=s.q1_s, step_q3_s=s.q3_s, compute_share=s.compute_share, wait_share=s.wait_share,
                   harness_share=s.harness_share, other_share=s.other_share,
                   tflops_per_rank=s.model_tflops_per_rank,
                   mfu_pct=utilization_pct(flops, s.median_s, world, peak if peak > 0 else None),
                   gemm_pct=(100.0 * s.model_tflops_per_rank / gemm if gemm > 0 else nan),
                   tokens_per_s=s.tokens_per_s, imbalance=_imbalance(trace.rank_steps, harness))
        row["hardware_tflops_per_rank"] = hardware / world / s.median_s / 1e12 if s.median_s > 0 else nan
        row["hfu_pct"] = utilization_pct(hardware, s.median_s, world, peak if peak > 0 else None)
        if trace.schema_version <= 2 and row["level"] != "op":  # data made in the steps, not told apart
            row["harness_share"] = nan
    return row


def runs_table(traces: Sequence[Trace]) -> pd.DataFrame:
    """One row per trace, columns :data:`RUN_COLUMNS` (in that order).

    Step statistics are those of :func:`fourd_mpi.trace.summary.summarize` over the measured
    (non-warm-up) steps, recomputed from ``/rank_steps``, so they equal the summary of the run:
    :func:`~fourd_mpi.trace.summary.step_stats`, i.e. a step's time is the maximum over ranks of
    its span, ``step_median_s`` the median over measured steps, ``step_q1_s``/``step_q3_s``
    NumPy's linear-interpolation quartiles of the same series; ``compute_share``/``wait_share`` =
    sum of algorithm compute (``compute_ns`` less harness work) / ``wait_ns`` over ranks and steps
    / sum of the step spans; ``harness_share`` the same for harness work inside the steps (the
    ``data`` ops of schema <= 2 op-level traces; NaN for schema <= 2 traces below level op, whose
    ``compute_ns`` holds it and cannot tell it apart; 0 otherwise), ``other_share`` = max(0, 1 - all
    three); ``tflops_per_rank`` = model FLOPs per step / world size / median step time
    (:data:`~fourd_mpi.trace.summary.MODEL_FLOPS_FORMULA`: the 72 convention, whatever is recomputed);
    ``hardware_tflops_per_rank`` the same with the FLOPs the step executes, recompute included
    (:data:`~fourd_mpi.trace.summary.HARDWARE_FLOPS_FORMULA`; metadata ``hardware_flops_per_step``, equal to
    the model FLOPs for traces before schema 5, which recomputed nothing); ``recompute`` the run's
    ``--recompute`` (``none`` before schema 5); ``tokens_per_s`` = tokens per step / median step time.

    - ``steps``: number of measured steps.
    - ``peak_tflops``: the data-sheet peak per rank of the trace's summary (:mod:`fourd_mpi.perf.peaks` or
      ``--peak-tflops``; NaN when there is none: CPU runs, recovered traces, older traces that measured the GEMM);
      ``mfu_pct`` = :data:`~fourd_mpi.perf.peaks.MFU_FORMULA`, ``hfu_pct`` = :data:`~fourd_mpi.perf.peaks.HFU_FORMULA`.
    - ``gemm_tflops``: the standalone GEMM the run measured (NaN: not measured); ``gemm_pct`` =
      :data:`~fourd_mpi.perf.peaks.GEMM_PCT_FORMULA`.
    - ``imbalance`` = max over ranks / mean over ranks of the per-rank busy (compute) time per
      measured step (``compute_ns`` of ``/rank_steps`` less harness work); 1.0 is perfectly balanced.
    - ``overlap`` and ``progress`` are the short forms (``"oag,ors,oar,dp,od"``, ``"poll"``);
      ``model`` is the preset name, with ``(L..,h..,a..,f..,s..)`` appended if its shape was changed.
    - ``algorithm``: the run's ``--algorithm`` (:func:`~fourd_mpi.algorithms.registry.of_metadata`:
      ``axonn4d`` for traces written before the algorithm axis).
    - ``config_key`` = ``model[/algorithm]/overlap/progress[/label]``: what a scaling line groups by
      (independent of rank count, grid and batch; the algorithm when it is not ``axonn4d``).
    - A trace without step records has NaN statistics and ``steps`` 0.
    """
    rows = [run_row(t) for t in traces]
    df = pd.DataFrame(rows, columns=RUN_COLUMNS)
    for column in ("world_size", "gdata", "gz", "gy", "gx", "steps", "tokens_per_step"):
        df[column] = df[column].astype(np.int64)
    return df


def as_runs(runs) -> pd.DataFrame:
    if isinstance(runs, pd.DataFrame):
        return runs
    return runs_table(list(runs))


def measured_select(measured: np.ndarray, lanes):
    """``select(block)`` for :func:`~fourd_mpi.trace.scan.gather_columns`: events of the measured steps
    (by step index) whose lane passes ``lanes(lane column)``."""
    steps = np.unique(measured["step"])
    contiguous = len(steps) and steps[-1] - steps[0] + 1 == len(steps)

    def select(block: np.ndarray) -> np.ndarray:
        step = np.ascontiguousarray(block["step"])  # read once (compared twice)
        mask = (step >= steps[0]) & (step <= steps[-1]) if contiguous else np.isin(step, steps)
        return mask & lanes(block["lane"])

    return select


def run_id_of(trace: Trace) -> str:
    return str(trace.metadata.get("run_id") or trace.attrs.get("run_id") or os.path.basename(trace.path))
