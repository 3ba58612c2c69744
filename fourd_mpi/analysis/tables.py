"""Analysis of trace files (pure pandas/NumPy, no MPI): the API behind ``fourd-mpi analyze TRACE...``.

>>> traces, problems = collect(["results/"])          # files, directories, globs; bad files -> problems
>>> runs = runs_table(traces)                          # one row per run
>>> breakdown(traces[0]); comm_table(traces[0])        # where the step time goes; collectives
>>> scaling(runs, "weak"); compare(runs)               # across runs
>>> steps_table(traces[0])                             # one row per (step, rank): do your own statistics
>>> print(format_table(runs, "table"))

Conventions shared by every function:

- *Measured steps* are those of ``/rank_steps`` with ``warmup == 0``; all steps if every step
  is warm-up (as :func:`fourd_mpi.trace.summary.summarize`, the run summary, which
  :func:`runs_table` calls so that its numbers agree with the summary stored in the trace).
- **One statistic**: a run's step time is :func:`fourd_mpi.trace.summary.step_stats`, the
  median over measured steps of the max over ranks of the step span, with the quartiles
  q1/q3 of the same per-step series as its spread (:data:`STEP_FORMULA`). The runs,
  compare, scaling and breakdown tables, the figures and the run summary all show it.
- "Per step" quantities of the comm table are averages over the measured (rank, step)
  records, i.e. per rank and per step, mean over ranks.
- "compute" is algorithm work only (:data:`~fourd_mpi.trace.events.COMPUTE_OPS`); harness
  work inside a step (:data:`~fourd_mpi.trace.summary.HARNESS_OPS`) is its own category.
- Times are seconds, sizes bytes, bandwidths GB/s (1e9 bytes/s = bytes/ns).

Everything is vectorized over events (integer codes, ``np.bincount``): a trace of 1024 ranks
with two million events is analysed in seconds.
"""

from __future__ import annotations

import glob
import io
import json
import logging
import math
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd

from fourd_mpi.algorithms.registry import DEFAULT_ALGORITHM, of_metadata
from fourd_mpi.errors import ConfigError, TraceError
from fourd_mpi.trace.summary import (HARNESS_OPS, SHARE_FORMULA, STEP_FORMULA, harness_and_bubble_ns, harness_ns,
                                     host_op_mask, measured_records, per_record_sums, step_stats, summarize)
from fourd_mpi.trace.read import Trace, load_trace
from fourd_mpi.trace.scan import gather_columns, in_codes
from fourd_mpi.core.colltable import BUSBW_FORMULA, wire_factor
from fourd_mpi.perf.peaks import stored_peaks, utilization_pct
from fourd_mpi.trace.events import COMPUTE_OPS, COPY_OPS, LANE_COMM0, LANE_HOST
from fourd_mpi.util.table import render
from fourd_mpi.util.text import format_number, short_label

log = logging.getLogger(__name__)

RUN_COLUMNS = [
    "run_id", "path", "status", "label", "algorithm", "model", "world_size", "grid", "gdata", "gz", "gy", "gx", "overlap",
    "progress", "level", "steps", "step_median_s", "step_min_s", "step_max_s", "step_q1_s", "step_q3_s",
    "compute_share", "wait_share", "harness_share", "other_share", "tflops_per_rank", "peak_tflops",
    "mfu_pct", "tokens_per_s", "imbalance", "tokens_per_step", "model_flops_per_step", "config_key",
    "recompute", "hardware_flops_per_step", "hardware_tflops_per_rank", "hfu_pct", "gemm_tflops", "gemm_pct",
]
BREAKDOWN_COLUMNS = ["run_id", "algorithm", "phase", "category", "axis", "seconds_per_step", "share", "step_s", "step_q1_s",
                     "step_q3_s"]
#: the grid axes of the per-axis MPI-time columns of :func:`steps_table`
STEP_AXES = ("data", "z", "y", "x")
STEPS_COLUMNS = (["run_id", "step", "rank", "warmup", "step_s", "step_max_s", "compute_s", "harness_s", "wait_s"]
                 + [f"wait_{a}_s" for a in STEP_AXES] + ["mpi_s", "loss"])
COMM_COLUMNS = [
    "run_id", "op", "axis", "placement", "node_span", "group_size", "messages_per_step", "bytes_per_step", "wire_bytes_per_step",
    "bytes_per_message", "inflight_median_s", "inflight_s_per_step", "wait_s_per_step", "mpi_s_per_step", "exposed_s_per_step", "algbw_gbps",
    "busbw_gbps", "overlap_pct", "outside_mpi_pct", "formula", "algorithm",
]
SCALING_COLUMNS = ["config_key", "algorithm", "world_size", "grid", "step_median_s", "speedup", "efficiency", "ideal_step_s",
                   "group", "run_id", "tokens_per_step", "step_q1_s", "step_q3_s"]
COMPARE_COLUMNS = [
    "model", "world_size", "tokens_per_step", "algorithm", "grid", "overlap", "progress", "label", "run_id", "step_median_s",
    "step_q1_s", "step_q3_s", "compute_share", "wait_share", "harness_share", "other_share", "imbalance",
    "tflops_per_rank", "mfu_pct", "gemm_pct", "vs_best",
]
FORMATS = ("table", "csv", "json", "markdown")
#: the breakdown's recompute column
RECOMPUTE_SHARE_FORMULA = ("recompute_% = 100 * sum of the shares of phase recompute (compute and exposed "
                           "communication of the forward work recompute repeats in backward; already counted in "
                           "the category columns)")

#: the runs table's columns on a terminal (csv and json keep all)
RUNS_SHOWN = ["run_id", "algorithm", "grid", "world_size", "overlap", "progress", "steps", "step_median_s", "step_q1_s",
              "step_q3_s", "compute_share", "wait_share", "harness_share", "other_share", "recompute",
              "tflops_per_rank", "mfu_pct", "hardware_tflops_per_rank", "hfu_pct", "gemm_pct", "tokens_per_s",
              "imbalance"]

OVERLAP_FORMULA = ("overlap_pct = 100 * sum(overlap_ns) / sum(complete_ns - call_ns)  [in flight: from the "
                   "return of the MPI_I* call to its first observed completion; overlap_ns: host compute (GEMMs, "
                   "attention, elementwise, optimizer; MPI polls inside them excluded) in that window]")
EXPOSED_FORMULA = ("exposed_s_per_step = sum((call_ns - issue_ns) + mpi_ns) / (ranks * steps)  [host time in MPI for "
                   "the collective: its own I* call, then tests and waits while it was in flight]")
HIDDEN_FORMULA = ("hidden_pct = 100 * clip(1 - exposed_s_per_step / exposed_s_per_step of the baseline run, 0, 1)  "
                  "[OSU's overlap with the baseline (a run without overlap) as t_pure: the communication time that "
                  "stopped being exposed]")
OUTSIDE_MPI_FORMULA = ("outside_mpi_pct = 100 * (1 - sum(mpi_ns) / sum(complete_ns - call_ns))  [mpi_ns: host time "
                       "inside MPI calls (I*, Test/Testsome, Wait) in the window; the rest is compute or harness]")
COMM_FORMULAS = {
    "overlap_pct": OVERLAP_FORMULA,
    "outside_mpi_pct": OUTSIDE_MPI_FORMULA,
    "exposed_s_per_step": EXPOSED_FORMULA,
    "algbw_gbps": "algbw = sum(bytes) / sum(complete_ns - issue_ns)  [bytes/ns = GB/s; nccl-tests size / time]",
    "busbw_gbps": BUSBW_FORMULA,
    "per_step": "messages/bytes/wire_bytes/inflight/wait/mpi per step = sum over measured steps and ranks "
                "/ (ranks * measured steps)",
    "placement": "inter-node when the issuing rank's communicator along the axis spans more than one node "
                 "(node_span > 1; the run's node assignment, trace metadata placement.node_span), else intra-node; "
                 "node_span = the most nodes one such communicator spans",
}
#: columns of :func:`comm_placement_table`
COMM_PLACEMENT_COLUMNS = ["run_id", "placement", "messages_per_step", "bytes_per_step", "bytes_pct", "wire_bytes_per_step",
                          "inflight_s_per_step", "inflight_pct", "exposed_s_per_step", "exposed_pct", "axes", "algorithm"]
COMM_PLACEMENT_FORMULAS = {
    "per_step": "the comm table's per-step sums (per rank and step) added over its rows of that placement",
    "*_pct": "100 * the placement's sum / the sum over both placements",
    "placement": COMM_FORMULAS["placement"],
}


# ---------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------

def _expand(path: str) -> Tuple[List[str], Optional[str]]:
    """Files named by one argument (file, directory of *.h5, or glob), or a reason it names none."""
    if os.path.isdir(path):
        found = sorted(p for p in glob.glob(os.path.join(glob.escape(path), "*.h5")) if os.path.isfile(p))
        return found, (None if found else "directory holds no *.h5 file")
    if os.path.exists(path):
        return [path], None
    if glob.has_magic(path):
        found = sorted(p for p in glob.glob(path) if os.path.isfile(p))
        return found, (None if found else "no file matches the pattern")
    from fourd_mpi.util.files import missing_reason

    return [], missing_reason(path)


def collect(paths: Union[str, Iterable[str]],
            allow_damaged: bool = False) -> Tuple[List[Trace], List[Tuple[str, str]]]:
    """Load every trace named by ``paths``: files, directories (their ``*.h5``, sorted) or globs.

    Returns ``(traces, problems)``; ``problems`` holds ``(path, reason)`` for every argument that
    names no file and every file :func:`~fourd_mpi.trace.read.load_trace` refused (the reason is the
    :class:`~fourd_mpi.errors.TraceError` message), damaged ones included unless ``allow_damaged``.
    Never raises for a bad file. A file named twice is loaded once.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    traces: List[Trace] = []
    problems: List[Tuple[str, str]] = []
    seen = set()
    for arg in paths:
        arg = os.fspath(arg)
        files, reason = _expand(arg)
        if reason is not None:
            problems.append((arg, reason))
        for path in files:
            key = os.path.realpath(path)
            if key in seen:
                continue
            seen.add(key)
            try:
                traces.append(load_trace(path, allow_damaged=allow_damaged))
            except TraceError as exc:
                problems.append((path, str(exc)))
            except Exception as exc:  # never raise for a bad file
                problems.append((path, f"{path} could not be read: {type(exc).__name__}: {exc}"))
    return traces, problems


def report_skipped(problems: Sequence[Tuple[str, str]]) -> None:
    """One warning per file :func:`collect` skipped: ``fourd-mpi: warning: skipped PATH: REASON`` (on stderr)."""
    for path, reason in problems:
        log.warning("skipped %s: %s", path, reason)


def collect_or_fail(paths: Sequence[str],
                    allow_damaged: bool = False) -> Tuple[List[Trace], List[Tuple[str, str]]]:
    """:func:`collect`, each skipped file reported (:func:`report_skipped`); a :class:`ConfigError`
    when no argument names a readable trace."""
    traces, problems = collect(paths, allow_damaged)
    report_skipped(problems)
    if not traces:
        raise ConfigError(f"no readable trace among {len(paths)} argument(s)")
    return traces, problems


# ---------------------------------------------------------------------------
# per-run facts
# ---------------------------------------------------------------------------

def _grid(trace: Trace) -> Dict[str, int]:
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


def _algorithm(trace: Trace) -> str:
    """The run's ``--algorithm`` (metadata; traces from before the algorithm axis: ``axonn4d``)."""
    return of_metadata(trace.metadata)


_measured_records = measured_records


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
    grid = _grid(trace)
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
    algorithm = _algorithm(trace)
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
    the model FLOPs for traces before schema 5, which recomputed nothing); ``recompute`` the run's ``--recompute`` (``none`` before schema 5);
    ``tokens_per_s`` = tokens per step / median step time.

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


def _as_runs(runs) -> pd.DataFrame:
    if isinstance(runs, pd.DataFrame):
        return runs
    return runs_table(list(runs))


# ---------------------------------------------------------------------------
# one run: where the step time goes, collectives
# ---------------------------------------------------------------------------

def _measured_select(measured: np.ndarray, lanes):
    """``select(block)`` for :func:`~fourd_mpi.trace.scan.gather_columns`: events of the measured steps
    (by step index) whose lane passes ``lanes(lane column)``."""
    steps = np.unique(measured["step"])
    contiguous = len(steps) and steps[-1] - steps[0] + 1 == len(steps)

    def select(block: np.ndarray) -> np.ndarray:
        step = np.ascontiguousarray(block["step"])  # read once (compared twice)
        mask = (step >= steps[0]) & (step <= steps[-1]) if contiguous else np.isin(step, steps)
        return mask & lanes(block["lane"])

    return select


def _run_id(trace: Trace) -> str:
    return str(trace.metadata.get("run_id") or trace.attrs.get("run_id") or os.path.basename(trace.path))


def breakdown(trace: Trace) -> pd.DataFrame:
    """Where the step time goes, long format: columns :data:`BREAKDOWN_COLUMNS`.

    The step time split is the run's one step time (:func:`~fourd_mpi.trace.summary.step_stats`,
    the median over measured steps of the max over ranks of the step span, as ``runs_table``'s
    ``step_median_s``), apportioned by the categories' shares of all ranks' measured time:

    - ``share`` = sum over the measured (rank, step) records of the category's time / sum of their
      step spans (``end_ns - start_ns``), so the shares of a run sum to 1, the compute rows sum to
      ``runs_table``'s ``compute_share`` and the ``exposed_comm`` rows to its ``wait_share``;
    - ``seconds_per_step`` = share * step_s, so the rows of a run sum to ``step_s``;
    - ``step_s``, ``step_q1_s``, ``step_q3_s``: the run's median step time and its quartiles (the
      same on every row of the run; the figures draw the quartiles as error bars).

    Level ``op`` (events):

    - ``category`` a compute op (:data:`~fourd_mpi.trace.events.COMPUTE_OPS`: algorithm work only),
      ``phase`` its phase, ``axis`` ``"none"``: sum of the op's event durations less the MPI calls
      made inside them (event column ``mpi_ns``: progress polls between GEMM chunks, schema >= 4),
      as in ``compute_ns``;
    - ``category`` ``harness``, ``phase`` its phase, ``axis`` ``"none"``: work of the benchmark
      harness inside the step (:data:`~fourd_mpi.trace.summary.HARNESS_OPS`: the synthetic data
      of schema <= 2 traces);
    - ``category`` ``exposed_comm``, ``axis`` ``x``/``y``/``z``/``data``, ``phase`` that of the
      collective: sum of ``wait`` event durations (time the main thread was blocked);
    - ``category`` ``other``, ``phase`` ``"all"``, ``axis`` ``"none"``: step span minus all of
      the above (Python overhead, buffer preparation, the ``MPI_I*`` calls and ``Test`` polls,
      ...; :func:`steps_table`'s ``mpi_s`` has all MPI time).

    Levels ``step``/``layer`` (no op events): three rows from ``/rank_steps`` with ``phase`` and
    ``axis`` ``"all"``: ``compute`` (``compute_ns``; harness work cannot be told apart there),
    ``exposed_comm`` (``wait_ns``) and ``other``. ``other`` is not clipped at 0 (it cannot be
    negative in a trace that passes ``check_invariants``).
    """
    run_id = _run_id(trace)
    measured = _measured_records(trace.rank_steps)
    if len(measured) == 0:
        return pd.DataFrame(columns=BREAKDOWN_COLUMNS)
    stats = step_stats(trace)
    total = float((measured["end_ns"] - measured["start_ns"]).astype(np.float64).sum())
    rows = []  # (phase, category, axis, ns summed over the measured records)
    ops, phases, axes = trace.vocab["ops"], trace.vocab["phases"], trace.vocab["axes"]
    if trace.metadata.get("level", "op") == "op" and "wait" in ops:
        # the host-lane events of the measured steps, their columns copied block by block (one pass
        # through the packed records; fancy-indexing whole records, or column by column, is slower)
        host = gather_columns(trace.events, ("op", "phase", "axis", "start_ns", "end_ns", "mpi_ns"),
                              _measured_select(measured, lambda lane: lane == LANE_HOST))
        dur = (host["end_ns"] - host["start_ns"]).astype(np.float64)
        op, phase, axis = host["op"], host["phase"], host["axis"]  # one-byte codes: widened where combined
        nop, nph, nax = len(ops), len(phases), len(axes)

        def by_phase_and(key, selected, radix):
            cell = phase[selected].astype(np.int64) * radix + key[selected]
            sums = np.bincount(cell, weights=dur[selected], minlength=nph * radix)
            counts = np.bincount(cell, minlength=nph * radix)
            return sums, counts

        compute_codes = [ops.index(name) for name in COMPUTE_OPS if name in ops]
        is_compute = in_codes(op, compute_codes)
        dur = np.where(is_compute, dur - host["mpi_ns"], dur)  # polls inside a GEMM are MPI time, not compute
        sums, counts = by_phase_and(op, is_compute, nop)
        for p in range(nph):
            for o in compute_codes:
                if counts[p * nop + o]:
                    rows.append((phases[p], ops[o], "none", sums[p * nop + o]))
        harness_codes = [ops.index(name) for name in HARNESS_OPS if name in ops]
        hsums, hcounts = by_phase_and(np.zeros_like(op), in_codes(op, harness_codes), 1)
        for p in range(nph):
            if hcounts[p]:
                rows.append((phases[p], "harness", "none", hsums[p]))
        if "bubble" in ops:  # pipeline runs: blocked waiting for another stage's message, a category of its own
            bsums, bcounts = by_phase_and(np.zeros_like(op), op == ops.index("bubble"), 1)
            for p in range(nph):
                if bcounts[p]:
                    rows.append((phases[p], "bubble", "inter", bsums[p]))
        wsums, wcounts = by_phase_and(axis, op == ops.index("wait"), nax)
        for p in range(nph):
            for a in range(nax):
                if wcounts[p * nax + a]:
                    rows.append((phases[p], "exposed_comm", axes[a], wsums[p * nax + a]))
        accounted = sum(r[3] for r in rows)
        rows.append(("all", "other", "none", total - accounted))
    else:
        compute = float(measured["compute_ns"].astype(np.float64).sum())
        wait = float(measured["wait_ns"].astype(np.float64).sum())
        rows = [("all", "compute", "all", compute), ("all", "exposed_comm", "all", wait),
                ("all", "other", "all", total - compute - wait)]
    df = pd.DataFrame(rows, columns=["phase", "category", "axis", "ns"])
    df["share"] = df["ns"] / total if total > 0 else float("nan")
    df["seconds_per_step"] = df["share"] * stats.median_s
    df["step_s"], df["step_q1_s"], df["step_q3_s"] = stats.median_s, stats.q1_s, stats.q3_s
    df.insert(0, "run_id", run_id)
    df.insert(1, "algorithm", _algorithm(trace))
    out = df[BREAKDOWN_COLUMNS]
    out.attrs["formulas"] = {"step_s": STEP_FORMULA, "share": SHARE_FORMULA,
                             "seconds_per_step": "seconds_per_step = share * step_s"}
    return out


def breakdown_wide(long: pd.DataFrame) -> pd.DataFrame:
    """One row per run: ``step_s`` (the run's median step time, :func:`breakdown`) and the share (%)
    of each category, summed over phases; exposed communication as ``comm_<axis>``; ``recompute_%``
    (:data:`RECOMPUTE_SHARE_FORMULA`): the part of those shares spent in phase ``recompute`` (the
    forward work that activation recompute repeats in the backward pass; 0 without recompute). For
    terminals; :func:`breakdown` is the long form."""
    if not len(long):
        return pd.DataFrame(columns=["run_id", "step_s"])
    key = np.where(long["category"] == "exposed_comm", "comm_" + long["axis"].astype(str), long["category"])
    key = np.where(key == "comm_all", "exposed_comm", key)
    table = (long.assign(key=key).pivot_table(index="run_id", columns="key", values="share", aggfunc="sum",
                                              sort=False) * 100)
    order = [c for c in (*COMPUTE_OPS, "compute", "harness", "comm_x", "comm_y", "comm_z", "comm_data",
                         "comm_inter", "exposed_comm", "bubble", "other") if c in table.columns]
    order += [c for c in table.columns if c not in order]
    step = long.groupby("run_id", sort=False)["step_s"].first()
    wide = table[order].rename(columns=lambda c: f"{c}_%")
    wide.insert(0, "step_s", step.reindex(wide.index))
    if "algorithm" in long.columns:
        wide.insert(0, "algorithm", long.groupby("run_id", sort=False)["algorithm"].first().reindex(wide.index))
    recompute = long[long["phase"].astype(str) == "recompute"].groupby("run_id", sort=False)["share"].sum() * 100
    wide["recompute_%"] = recompute.reindex(wide.index).fillna(0.0)  # a part of the columns before it
    return wide.reset_index()


def steps_table(trace: Trace) -> pd.DataFrame:
    """One row per (step, rank) of the trace, warm-up steps included: columns :data:`STEPS_COLUMNS`,
    sorted by step, then rank. For users' own statistics.

    - ``step_s`` = this rank's span ``(end_ns - start_ns) * 1e-9`` (``/rank_steps``);
      ``step_max_s`` = the max over ranks of ``step_s`` for that step (the per-step series whose
      median over the measured steps is the run's step time);
    - ``compute_s`` = ``compute_ns * 1e-9`` less ``harness_s`` (algorithm work only);
      ``harness_s`` = harness work inside the step (host-lane ``data`` events; 0 below level op);
    - ``wait_s`` = ``wait_ns * 1e-9`` (time blocked in waits, all axes); ``wait_<axis>_s`` = sum of
      the durations of the host-lane ``wait`` events of collectives on that axis (NaN for traces
      below level op, which have no such events);
    - ``mpi_s`` = ``mpi_ns * 1e-9``: all host time inside MPI calls (``MPI_I*``, ``Test``/``Testsome``,
      ``Wait``; schema >= 4, older traces recorded waits only: there it equals ``wait_s``);
    - ``loss`` as recorded; ``warmup`` a bool.
    """
    rs = trace.rank_steps
    order = np.lexsort((rs["rank"], rs["step"]))
    rs = rs[order]
    n = len(rs)
    ev = trace.events
    op_level = trace.metadata.get("level", "op") == "op" and "wait" in trace.vocab.get("ops", ())
    harness = harness_ns(trace)[order] if n else np.zeros(0)
    out = pd.DataFrame({"run_id": [_run_id(trace)] * n, "step": rs["step"].astype(np.int64),
                        "rank": rs["rank"].astype(np.int64), "warmup": rs["warmup"].astype(bool)})
    span = (rs["end_ns"] - rs["start_ns"]).astype(np.float64) * 1e-9
    out["step_s"] = span
    out["step_max_s"] = pd.Series(span).groupby(out["step"].to_numpy()).transform("max").to_numpy() if n else span
    out["compute_s"] = (rs["compute_ns"].astype(np.float64) - harness) * 1e-9
    out["harness_s"] = harness * 1e-9
    out["wait_s"] = rs["wait_ns"].astype(np.float64) * 1e-9
    waits = host_op_mask(ev, trace.vocab.get("ops", ()), ("wait",))
    axes = trace.vocab.get("axes", [])
    for a in STEP_AXES:
        if op_level and a in axes:
            out[f"wait_{a}_s"] = per_record_sums(rs, ev, waits & (ev["axis"] == axes.index(a))) * 1e-9
        else:
            out[f"wait_{a}_s"] = float("nan") if not op_level else 0.0
    out["mpi_s"] = rs["mpi_ns"].astype(np.float64) * 1e-9
    out["loss"] = rs["loss"].astype(np.float64)
    return out[STEPS_COLUMNS].reset_index(drop=True)


_COMM_BY = ("op", "axis", "phase", "layer")


def _groups(key: np.ndarray, span: int):
    """``np.unique(key, return_inverse=True)`` for keys in ``[0, span)``: by counting when ``span`` is
    small (at most the number of keys, or 2**16), instead of sorting."""
    if not len(key) or span > max(len(key), 1 << 16) or int(key.min()) < 0:
        return np.unique(key, return_inverse=True)
    present = np.bincount(key, minlength=span) > 0
    return np.flatnonzero(present), (np.cumsum(present) - 1)[key]


def _group_medians(values: np.ndarray, inverse: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Per group ``j`` of ``inverse`` (``count[j]`` members, every group non-empty): the median of its
    ``values``, the mean of its two middle order statistics (``(count - 1) // 2`` and ``count // 2``,
    as the median of the sorted group). A stable sort by group, then a selection per group."""
    narrow = inverse.astype(np.uint16) if len(count) <= 1 << 16 else inverse  # 16-bit keys: radix sort
    grouped = values[np.argsort(narrow, kind="stable")]
    starts = np.concatenate([[0], np.cumsum(count)[:-1]])
    median = np.empty(len(count))
    for j, (start, n) in enumerate(zip(starts.tolist(), count.tolist())):
        lo, hi = (n - 1) // 2, n // 2
        part = np.partition(grouped[start:start + n], (lo, hi))
        median[j] = 0.5 * (part[lo] + part[hi])
    return median


def comm_table(trace: Trace, by: Sequence[str] = ("op", "axis")) -> pd.DataFrame:
    """Collectives of the measured steps per ``(op, axis)``: columns :data:`COMM_COLUMNS`.

    ``by`` may add ``"phase"`` and/or ``"layer"`` (extra columns after ``axis``). Collectives are
    the events on ``comm<i>`` lanes (the blocking loss all-reduces included: 8 bytes, all wait).
    In staged runs the comm lanes also hold the staging copies (ops ``d2h``, ``h2d``): they get
    their own rows, with ``algbw_gbps`` the copy bandwidth and NaN bus bandwidth and overlap.

    - ``messages_per_step``, ``bytes_per_step``, ``wire_bytes_per_step``, ``inflight_s_per_step``,
      ``wait_s_per_step``: sums over the measured steps and all ranks / (ranks * steps), i.e. per
      rank and step. ``bytes`` is the message size in the nccl-tests "size" convention;
      ``wire_bytes`` the ring-model volume a rank sends.
    - ``bytes_per_message`` = total bytes / messages; ``inflight_median_s``: median over the
      messages of the in-flight time ``complete_ns - issue_ns``.
    - ``algbw_gbps`` = sum(bytes) / sum(complete_ns - issue_ns) (GB/s = bytes/ns): the nccl-tests
      algorithm bandwidth, aggregated as total bytes / total in-flight time (a message-weighted
      harmonic mean, not the mean of per-message bandwidths).
    - ``busbw_gbps`` = algbw * (n-1)/n for allgather and reduce_scatter, * 2(n-1)/n for allreduce,
      ``n`` = ``group_size``, the size of the axis (metadata ``run_options.grid``).
    - ``overlap_pct`` = 100 * sum(overlap_ns) / sum(complete_ns - call_ns): the part of the
      in-flight time (from the return of the ``MPI_I*`` call to the first observed completion)
      during which the host computed (compute ops; MPI polls made inside them excluded): 100 = fully
      hidden behind compute, 0 = nothing computed while it was in flight. Work done inside the
      collective's own ``I*`` call is not in its window. An upper bound of the communication
      hidden: the trace cannot see whether MPI progressed the collective during that compute
      (OSU's formula, which needs the collective's standalone time, can; bench/overlap_probe.py).
    - ``outside_mpi_pct`` = 100 * (1 - sum(mpi_ns) / sum(complete_ns - call_ns)): the part of the
      window in which the host was not inside an MPI call (the ``I*`` calls of other collectives,
      ``Test``/``Testsome`` polls, ``Wait``); it exceeds ``overlap_pct`` by the harness's own Python
      between calls. ``mpi_s_per_step``: the ``mpi_ns`` sum per rank and step.
    - Traces of schema <= 3 have no ``call_ns``/``mpi_ns``/``overlap_ns`` (:func:`load_trace` fills
      them with ``issue_ns``, ``wait_ns`` and the not-waited time): both percentages then equal
      their old ``1 - wait / (complete - issue)``.
    - ``placement``: ``intra-node`` or ``inter-node``, a grouping key after ``by``: a collective is inter-node
      when the issuing rank's communicator along its axis spans more than one node (metadata
      ``placement.node_span[axis][rank]`` > 1: the launcher's node assignment recorded by the run,
      :meth:`~fourd_mpi.trace.read.Trace.placement`); ``node_span`` the most nodes one such communicator spans.
      An axis whose communicators all lie on one node has only intra-node rows; one that crosses nodes
      everywhere only inter-node rows; an uneven placement both. :func:`comm_placement_table` sums them.
    - ``formula`` repeats the overlap formula; ``df.attrs["formulas"]`` has all of them.

    In-flight times are observed (section 13 of docs/trace-format.md): the bandwidths are lower
    bounds. Empty frame for traces below level ``op``.
    """
    by = list(by)
    bad = [c for c in by if c not in _COMM_BY]
    if bad or "op" not in by or "axis" not in by:
        raise ValueError(f"comm_table: by must contain 'op' and 'axis' and only {', '.join(_COMM_BY)}")
    columns = COMM_COLUMNS[:3] + [c for c in by if c not in ("op", "axis")] + COMM_COLUMNS[3:]
    run_id = _run_id(trace)
    measured = _measured_records(trace.rank_steps)
    n_records = len(measured)
    ev = trace.events
    wanted = set(by) | {"op", "axis", "rank", "issue_ns", "complete_ns", "start_ns", "end_ns", "bytes", "wire_bytes", "wait_ns",
                        "call_ns", "mpi_ns", "overlap_ns"}
    # the comm-lane events of the measured steps, block by block (see breakdown)
    coll = gather_columns(ev, wanted, _measured_select(measured, lambda lane: lane >= LANE_COMM0)) if n_records \
        else {c: ev[c][:0] for c in wanted}
    if not len(coll["bytes"]):
        out = pd.DataFrame(columns=columns)
        out.attrs["formulas"] = dict(COMM_FORMULAS)
        return out
    vocab_of = {"op": "ops", "axis": "axes", "phase": "phases", "layer": "layers"}
    span = _event_node_span(trace, coll["axis"], coll["rank"])
    codes = [coll[c].astype(np.int64) for c in by] + [(span > 1).astype(np.int64)]
    radices = [max(len(trace.vocab[vocab_of[c]]), int(k.max()) + 1) for c, k in zip(by, codes)] + [2]
    key = np.zeros(len(coll["bytes"]), dtype=np.int64)
    for k, r in zip(codes, radices):
        key = key * r + k
    uniq, inverse = _groups(key, math.prod(radices))
    g = len(uniq)
    copy_codes = [trace.vocab["ops"].index(o) for o in COPY_OPS if o in trace.vocab["ops"]]
    is_copy = in_codes(coll["op"], copy_codes)  # copies: their own duration (no issue/completion)
    inflight = np.where(is_copy, coll["end_ns"] - coll["start_ns"],
                        coll["complete_ns"] - coll["issue_ns"]).astype(np.float64)
    count = np.bincount(inverse, minlength=g)
    nbytes = np.bincount(inverse, weights=coll["bytes"].astype(np.float64), minlength=g)
    wire = np.bincount(inverse, weights=coll["wire_bytes"].astype(np.float64), minlength=g)
    tflight = np.bincount(inverse, weights=inflight, minlength=g)
    twait = np.bincount(inverse, weights=coll["wait_ns"].astype(np.float64), minlength=g)
    window = np.where(is_copy, 0, coll["complete_ns"] - np.maximum(coll["call_ns"], coll["issue_ns"]))
    twindow = np.bincount(inverse, weights=window.astype(np.float64), minlength=g)
    tmpi = np.bincount(inverse, weights=np.where(is_copy, 0, coll["mpi_ns"]).astype(np.float64), minlength=g)
    tover = np.bincount(inverse, weights=np.where(is_copy, 0, coll["overlap_ns"]).astype(np.float64), minlength=g)
    own_call = np.maximum(coll["call_ns"] - coll["issue_ns"], 0)
    texposed = np.bincount(inverse, weights=np.where(is_copy, 0, own_call + coll["mpi_ns"]).astype(np.float64),
                           minlength=g)
    median = _group_medians(inflight, inverse, count)
    # decode the group keys back into codes
    decoded = []
    rest = uniq.copy()
    for r in reversed(radices):
        decoded.append(rest % r)
        rest = rest // r
    decoded = dict(zip(by + ["placement"], reversed(decoded)))
    grid = _grid(trace)
    out = pd.DataFrame(index=pd.RangeIndex(g))
    for c in by:
        words = trace.vocab[vocab_of[c]]
        out[c] = [words[i] if i < len(words) else str(i) for i in decoded[c]]
    out["placement"] = np.where(decoded["placement"] == 1, "inter-node", "intra-node")
    widest = np.ones(g, dtype=np.int64)
    np.maximum.at(widest, inverse, span)
    out["node_span"] = widest
    out["run_id"] = run_id
    sizes = np.array([grid.get(a, 0) for a in out["axis"]], dtype=np.int64)
    # staging copies (d2h, h2d) share the comm lanes: copy bandwidth, but no bus bandwidth or overlap
    copy = out["op"].isin(COPY_OPS).to_numpy()
    factor = np.array([wire_factor(o, int(s)) if s > 0 and o not in COPY_OPS else float("nan")
                       for o, s in zip(out["op"], sizes)])
    with np.errstate(divide="ignore", invalid="ignore"):
        algbw = np.where(tflight > 0, nbytes / tflight, np.nan)
        out["group_size"] = sizes
        out["messages_per_step"] = count / n_records
        out["bytes_per_step"] = nbytes / n_records
        out["wire_bytes_per_step"] = wire / n_records
        out["bytes_per_message"] = nbytes / count
        out["inflight_median_s"] = median * 1e-9
        out["inflight_s_per_step"] = tflight / n_records * 1e-9
        out["wait_s_per_step"] = twait / n_records * 1e-9
        out["mpi_s_per_step"] = tmpi / n_records * 1e-9
        out["exposed_s_per_step"] = np.where(copy, np.nan, texposed / n_records * 1e-9)
        out["algbw_gbps"] = algbw
        out["busbw_gbps"] = algbw * factor
        out["overlap_pct"] = np.where((twindow > 0) & ~copy, 100.0 * tover / twindow, np.nan)
        out["outside_mpi_pct"] = np.where((twindow > 0) & ~copy, 100.0 * (1.0 - tmpi / twindow), np.nan)
    out["formula"] = OVERLAP_FORMULA
    out["algorithm"] = _algorithm(trace)
    out = out[columns]
    out.attrs["formulas"] = dict(COMM_FORMULAS)
    return out


def _event_node_span(trace: Trace, axis_codes: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Per event: the nodes spanned by its rank's communicator along its axis (:meth:`Trace.placement`; axis
    ``none``, the world-wide loss all-reduce: the run's node count; an axis the placement lacks: 1)."""
    if not len(axis_codes):
        return np.ones(0, dtype=np.int64)
    placement = trace.placement()
    world = max(len(placement.nodes), int(ranks.max()) + 1)
    words = trace.vocab["axes"]
    table = np.ones((max(len(words), int(axis_codes.max()) + 1), world), dtype=np.int64)
    for code, word in enumerate(words):
        spans = placement.spans.get(word)
        if spans:
            spans = spans[:world]
            table[code, :len(spans)] = spans
    return table[axis_codes.astype(np.int64), ranks.astype(np.int64)]


def comm_placement_table(comm: pd.DataFrame) -> pd.DataFrame:
    """The comm table (:func:`comm_table`, one or more runs) split into intra- and inter-node: per run and
    placement the per-step sums of its rows (messages, bytes, wire bytes, in-flight and exposed seconds), each
    with its share of the run's total (``*_pct``), and the axes involved. Columns :data:`COMM_PLACEMENT_COLUMNS`."""
    if not len(comm):
        out = pd.DataFrame(columns=COMM_PLACEMENT_COLUMNS)
        out.attrs["formulas"] = dict(COMM_PLACEMENT_FORMULAS)
        return out
    rows = comm[~comm["op"].isin(COPY_OPS)]
    sums = ["messages_per_step", "bytes_per_step", "wire_bytes_per_step", "inflight_s_per_step", "exposed_s_per_step"]
    grouped = rows.groupby(["run_id", "placement"], sort=True)
    out = grouped[sums].sum().reset_index()
    out["axes"] = grouped["axis"].agg(lambda a: ",".join(dict.fromkeys(a))).to_numpy()
    out["algorithm"] = grouped["algorithm"].first().to_numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        for col, pct in (("bytes_per_step", "bytes_pct"), ("inflight_s_per_step", "inflight_pct"),
                         ("exposed_s_per_step", "exposed_pct")):
            total = out.groupby("run_id")[col].transform("sum")
            out[pct] = np.where(total > 0, 100.0 * out[col] / total, np.nan)
    out = out[COMM_PLACEMENT_COLUMNS]
    out.attrs["formulas"] = dict(COMM_PLACEMENT_FORMULAS)
    return out


def hidden_vs_baseline(comm: pd.DataFrame, baseline: pd.DataFrame) -> pd.DataFrame:
    """``comm`` with a ``hidden_pct`` column: the share of each collective's exposed time in
    ``baseline`` (the comm table of a run without overlap, same model and grid) that is no longer
    exposed: ``100 * clip(1 - exposed / exposed_baseline, 0, 1)`` (:data:`HIDDEN_FORMULA`), i.e.
    OSU's overlap with the baseline as ``t_pure``. Rows are matched on every key column both
    tables share (op, axis, and phase/layer where both have them); unmatched rows get NaN.
    """
    keys = [c for c in ("op", "axis", "placement", "phase", "layer") if c in comm.columns and c in baseline.columns]
    ref = baseline[keys + ["exposed_s_per_step"]].rename(columns={"exposed_s_per_step": "_baseline"})
    out = comm.merge(ref, on=keys, how="left")
    with np.errstate(divide="ignore", invalid="ignore"):
        out["hidden_pct"] = 100.0 * np.clip(1.0 - out["exposed_s_per_step"] / out["_baseline"], 0.0, 1.0)
    out = out.drop(columns=["_baseline"])
    out.attrs["formulas"] = dict(comm.attrs.get("formulas", COMM_FORMULAS), hidden_pct=HIDDEN_FORMULA)
    return out


# ---------------------------------------------------------------------------
# across runs
# ---------------------------------------------------------------------------

def scaling(runs, mode: str = "weak") -> pd.DataFrame:
    """Scaling lines from :func:`runs_table` rows (or a list of traces): columns :data:`SCALING_COLUMNS`.

    Runs are grouped by ``config_key`` (model, algorithm, overlap, progress, label); in ``strong`` mode also by
    the total work (``tokens_per_step``; the model is part of the key). Within a group, rows are
    sorted by ``world_size`` (then step time); every run is a row (several grids of one size may
    appear). Base = the smallest world size of the group; ``T(base)`` its fastest median step time.
    ``step_median_s``, ``step_q1_s``, ``step_q3_s``: the runs' step time and quartiles (:data:`STEP_FORMULA`).

    - ``weak`` (fixed work per rank): requires ``tokens_per_step / world_size`` to be the same for
      every run of the group, else the group is dropped. ``efficiency = T(base) / T(N)``,
      ``speedup = efficiency * N / base`` (scaled speedup: the throughput ratio),
      ``ideal_step_s = T(base)``.
    - ``strong`` (fixed total work): ``speedup = T(base) / T(N)``,
      ``efficiency = speedup * base / N``, ``ideal_step_s = T(base) * base / N``.

    ``group`` is the line's identifier (``config_key``; strong: ``config_key/tokens=T``).
    Groups with a single rank count are no line and are dropped. Runs without a step time are left out. Dropped groups and left-out runs are listed in
    ``df.attrs["dropped"]`` as ``(group, reason)``.
    """
    if mode not in ("weak", "strong"):
        raise ValueError(f"scaling mode must be 'weak' or 'strong', got {mode!r}")
    df = _as_runs(runs)
    dropped: List[Tuple[str, str]] = []
    bad = df[~np.isfinite(df["step_median_s"].astype(float))]
    for _, row in bad.iterrows():
        dropped.append((row["config_key"], f"run {row['run_id']} has no measured step time"))
    df = df[np.isfinite(df["step_median_s"].astype(float))]
    keys = ["config_key"] if mode == "weak" else ["config_key", "tokens_per_step"]
    pieces = []
    for key, group in df.groupby(keys, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        name = key[0] if mode == "weak" else f"{key[0]}/tokens={key[1]}"
        group = group.sort_values(["world_size", "step_median_s"], kind="stable")
        if group["world_size"].nunique() < 2:
            dropped.append((name, f"one rank count only ({int(group['world_size'].iloc[0])})"))
            continue
        world = group["world_size"].to_numpy(dtype=np.float64)
        times = group["step_median_s"].to_numpy(dtype=np.float64)
        if mode == "weak":
            per_rank = group["tokens_per_step"].to_numpy(dtype=np.float64) / world
            if not np.allclose(per_rank, per_rank[0], rtol=1e-9, atol=0):
                values = ", ".join(f"{v:g}" for v in sorted(set(per_rank.tolist())))
                dropped.append((name, f"weak scaling needs the same tokens per rank in every run; got {values}"))
                continue
        base = world[0]
        t_base = times[world == base].min()
        if mode == "weak":
            efficiency = t_base / times
            speedup = efficiency * world / base
            ideal = np.full(len(times), t_base)
        else:
            speedup = t_base / times
            efficiency = speedup * base / world
            ideal = t_base * base / world
        pieces.append(pd.DataFrame({
            "config_key": group["config_key"].to_numpy(), "algorithm": (group["algorithm"].to_numpy() if "algorithm" in group.columns
                                                            else DEFAULT_ALGORITHM),
            "world_size": group["world_size"].to_numpy(),
            "grid": group["grid"].to_numpy(), "step_median_s": times, "speedup": speedup,
            "efficiency": efficiency, "ideal_step_s": ideal, "group": name,
            "run_id": group["run_id"].to_numpy(), "tokens_per_step": group["tokens_per_step"].to_numpy(),
            "step_q1_s": group["step_q1_s"].to_numpy(dtype=np.float64),
            "step_q3_s": group["step_q3_s"].to_numpy(dtype=np.float64)}))
    out = (pd.concat(pieces, ignore_index=True) if pieces else pd.DataFrame(columns=SCALING_COLUMNS))
    out = out[SCALING_COLUMNS]
    out.attrs["dropped"] = dropped
    out.attrs["mode"] = mode
    return out


def compare(runs) -> pd.DataFrame:
    """Algorithms, grid shapes and overlap modes side by side: columns :data:`COMPARE_COLUMNS`.

    Runs of the same model, world size and total work (``tokens_per_step``) form a group, whatever
    their algorithm (``megatron1d`` against the best ``axonn4d`` grid is the comparison asked for),
    sorted by ``step_median_s``; ``vs_best`` = step_median_s / the group's smallest (1.0 = best,
    1.25 = 25 % slower). Groups are ordered by model, world size, tokens. Runs without a step time
    are left out.
    """
    df = _as_runs(runs)
    df = df[np.isfinite(df["step_median_s"].astype(float))].copy()
    if not len(df):
        return pd.DataFrame(columns=COMPARE_COLUMNS)
    keys = ["model", "world_size", "tokens_per_step"]
    df["vs_best"] = df["step_median_s"] / df.groupby(keys)["step_median_s"].transform("min")
    df = df.sort_values(keys + ["step_median_s", "run_id"], kind="stable").reset_index(drop=True)
    return df[COMPARE_COLUMNS]


# ---------------------------------------------------------------------------
# formatting
# ---------------------------------------------------------------------------

def _cell(value) -> str:
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return format_number(float(value))
    return format_number(value) if value is None else str(value)


def _is_numeric(series: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(series) and not pd.api.types.is_bool_dtype(series)


def _cells(df: pd.DataFrame) -> List[List[str]]:
    return [[_cell(v) for v in row] for row in df.itertuples(index=False, name=None)]


def format_table(df: pd.DataFrame, fmt: str = "table") -> str:
    """Render a frame of this module: ``table`` (aligned plain text), ``csv``, ``json`` (a list of
    records; NaN -> null) or ``markdown`` (a GitHub pipe table), the tables by
    :func:`fourd_mpi.util.table.render` (numeric columns aligned right). ``table`` and ``markdown``
    round floats to about 4 significant digits and show NaN as ``-``; ``csv`` and ``json`` keep full
    precision."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if fmt == "csv":
        buf = io.StringIO()
        df.to_csv(buf, index=False)
        return buf.getvalue()
    if fmt == "json":
        records = json.loads(df.to_json(orient="records", double_precision=15))
        return json.dumps(records, indent=1)
    headers = [str(c) for c in df.columns]
    if not headers:
        return "(no columns)"
    align = ["right" if _is_numeric(df[c]) else "left" for c in df.columns]
    text = render(_cells(df), headers, "markdown" if fmt == "markdown" else "table", align)
    return text if len(df) or fmt == "markdown" else text + "\n(no rows)"
