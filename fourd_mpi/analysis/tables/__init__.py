"""Analysis of trace files (pure pandas/NumPy, no MPI): the API behind ``fourd-mpi analyze TRACE...``.

One module per table family: :mod:`.load` (files), :mod:`.runs` (one row per run), :mod:`.breakdown`
(where the step time goes; per step and rank), :mod:`.comm` (collectives), :mod:`.across` (scaling,
compare), :mod:`.format` (rendering); :mod:`.registry` lists the analyses ``analyze --what`` offers.
Every name below is importable from this package.

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

from fourd_mpi.analysis.tables.across import COMPARE_COLUMNS, SCALING_COLUMNS, compare, scaling
from fourd_mpi.analysis.tables.breakdown import (
                                                 BREAKDOWN_COLUMNS,
                                                 RECOMPUTE_SHARE_FORMULA,
                                                 STEP_AXES,
                                                 STEPS_COLUMNS,
                                                 breakdown,
                                                 breakdown_wide,
                                                 steps_table,
)
from fourd_mpi.analysis.tables.comm import (
                                                 COMM_COLUMNS,
                                                 COMM_FORMULAS,
                                                 COMM_PLACEMENT_COLUMNS,
                                                 COMM_PLACEMENT_FORMULAS,
                                                 EXPOSED_FORMULA,
                                                 HIDDEN_FORMULA,
                                                 OUTSIDE_MPI_FORMULA,
                                                 OVERLAP_FORMULA,
                                                 comm_placement_table,
                                                 comm_table,
                                                 hidden_vs_baseline,
)
from fourd_mpi.analysis.tables.format import FORMATS, format_table
from fourd_mpi.analysis.tables.load import collect, collect_or_fail, report_skipped
from fourd_mpi.analysis.tables.runs import RUN_COLUMNS, RUNS_SHOWN, config_key, run_row, runs_table
from fourd_mpi.trace.summary import SHARE_FORMULA, STEP_FORMULA

__all__ = [
    "BREAKDOWN_COLUMNS", "COMM_COLUMNS", "COMM_FORMULAS", "COMM_PLACEMENT_COLUMNS", "COMM_PLACEMENT_FORMULAS",
    "COMPARE_COLUMNS", "EXPOSED_FORMULA", "FORMATS", "HIDDEN_FORMULA", "OUTSIDE_MPI_FORMULA", "OVERLAP_FORMULA",
    "RECOMPUTE_SHARE_FORMULA", "RUNS_SHOWN", "RUN_COLUMNS", "SCALING_COLUMNS", "SHARE_FORMULA", "STEPS_COLUMNS",
    "STEP_AXES", "STEP_FORMULA", "breakdown", "breakdown_wide", "collect", "collect_or_fail", "comm_placement_table",
    "comm_table", "compare", "config_key", "format_table", "hidden_vs_baseline", "report_skipped", "run_row",
    "runs_table", "scaling", "steps_table",
]
