"""One run: where the step time goes (:func:`breakdown`, its wide view) and one row per (step, rank)
(:func:`steps_table`)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from fourd_mpi.analysis.tables.runs import algorithm_of, measured_select, run_id_of
from fourd_mpi.trace.events import COMPUTE_OPS, LANE_HOST
from fourd_mpi.trace.read import Trace
from fourd_mpi.trace.scan import gather_columns, in_codes
from fourd_mpi.trace.summary import (
    HARNESS_OPS,
    SHARE_FORMULA,
    STEP_FORMULA,
    harness_ns,
    host_op_mask,
    measured_records,
    per_record_sums,
    step_stats,
)

BREAKDOWN_COLUMNS = ["run_id", "algorithm", "phase", "category", "axis", "seconds_per_step", "share", "step_s",
                     "step_q1_s", "step_q3_s"]
#: the grid axes of the per-axis MPI-time columns of :func:`steps_table`
STEP_AXES = ("data", "z", "y", "x")
STEPS_COLUMNS = (["run_id", "step", "rank", "warmup", "step_s", "step_max_s", "compute_s", "harness_s", "wait_s"]
                 + [f"wait_{a}_s" for a in STEP_AXES] + ["mpi_s", "loss"])
#: the breakdown's recompute column
RECOMPUTE_SHARE_FORMULA = ("recompute_% = 100 * sum of the shares of phase recompute (compute and exposed "
                           "communication of the forward work recompute repeats in backward; already counted in "
                           "the category columns)")


def _op_level_rows(trace, measured, total: float) -> list:
    """The rows ``(phase, category, axis, ns summed over the measured records)`` of a trace at level ``op``:
    compute per op (less the MPI polls inside it), harness, pipeline bubbles, exposed communication per axis
    (waits), each per phase, then ``other``: ``total`` less all of them."""
    rows = []
    ops, phases, axes = trace.vocab["ops"], trace.vocab["phases"], trace.vocab["axes"]
    # the host-lane events of the measured steps, their columns copied block by block (one pass
    # through the packed records; fancy-indexing whole records, or column by column, is slower)
    host = gather_columns(trace.events, ("op", "phase", "axis", "start_ns", "end_ns", "mpi_ns"),
                          measured_select(measured, lambda lane: lane == LANE_HOST))
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
    return rows


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
    run_id = run_id_of(trace)
    measured = measured_records(trace.rank_steps)
    if len(measured) == 0:
        return pd.DataFrame(columns=BREAKDOWN_COLUMNS)
    stats = step_stats(trace)
    total = float((measured["end_ns"] - measured["start_ns"]).astype(np.float64).sum())
    ops = trace.vocab["ops"]
    if trace.metadata.get("level", "op") == "op" and "wait" in ops:
        rows = _op_level_rows(trace, measured, total)
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
    df.insert(1, "algorithm", algorithm_of(trace))
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
    out = pd.DataFrame({"run_id": [run_id_of(trace)] * n, "step": rs["step"].astype(np.int64),
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
