"""Figures of traces and of the frames of :mod:`fourd_mpi.analysis.tables` (matplotlib, Agg backend).

>>> plot_scaling(scaling(runs, "weak"), "weak.png", mode="weak")   # step time + efficiency vs ranks
>>> plot_breakdown(breakdown_df, runs, "breakdown.svg")             # stacked bars per run
>>> plot_timeline(load_trace("run.h5"), "timeline.pdf")              # Gantt chart of one step
>>> plot_overlap(comm_df, "overlap.png")                             # overlap_pct per collective

Every function writes one file, whose format comes from the suffix of ``path`` (``.png``,
``.svg`` or ``.pdf``), closes its figure and returns ``path``; with ``path=None`` it returns the open
figure instead (for inspection: the caller closes it). Invalid input (an empty
frame, a missing column, an unknown step, a rank out of range, another suffix) raises
``ValueError`` with the reason.

One style for every figure (:data:`_RC`), colour-blind safe: runs and lines take the Okabe-Ito palette
(:data:`PALETTE`, distinguishable with protanopia, deuteranopia and tritanopia), compute ops blues and
bluish greens, exposed communication (waits) vermillion/orange/yellow shades (one per grid axis) and
always hatched, so that no figure relies on telling red from green; collectives reddish purple, brown
and orange; harness work sand; everything else grey. Every axis label names its unit; every run is
labelled with its rank count and grid.

Step times are the one statistic of :func:`fourd_mpi.trace.summary.step_stats` (median over the
measured steps of the max over ranks of the step span), as in every table and the run summary;
error bars span its quartiles q1-q3 (of the same per-step max-over-ranks series).

One module per plot family (:mod:`.scaling`, :mod:`.breakdown`, :mod:`.timeline`, :mod:`.overlap`) and the
shared style and helpers (:mod:`._style`); every public name is importable from here.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg", force=False)  # no display needed; harmless if pyplot already chose Agg

from fourd_mpi.analysis.plots._style import (  # noqa: E402
    CATEGORY_COLORS,
    COLLECTIVE_COLORS,
    COMPUTE_COLORS,
    FORMATS,
    HARNESS_COLOR,
    HIDDEN_CAPTION,
    OP_COLORS,
    OTHER_COLOR,
    OVERLAP_CAPTION,
    PALETTE,
    RUN_AXIS_LABEL,
    STEP_CAPTION,
    WAIT_COLOR,
    WAIT_COLORS,
    algorithm_title,
    config_label,
    run_labels,
    sorted_runs,
)
from fourd_mpi.analysis.plots.breakdown import breakdown_data, breakdown_matrix, plot_breakdown  # noqa: E402
from fourd_mpi.analysis.plots.overlap import overlap_matrix, plot_overlap  # noqa: E402
from fourd_mpi.analysis.plots.scaling import plot_scaling  # noqa: E402
from fourd_mpi.analysis.plots.timeline import (  # noqa: E402, F401 (_select_ranks: its tests import it from here)
    _select_ranks,
    plot_timeline,
    timeline_events,
    timeline_figure,
)

__all__ = ["plot_scaling", "plot_breakdown", "plot_timeline", "plot_overlap", "FORMATS", "CATEGORY_COLORS",
           "COLLECTIVE_COLORS", "COMPUTE_COLORS", "HARNESS_COLOR", "HIDDEN_CAPTION", "OP_COLORS", "OTHER_COLOR",
           "OVERLAP_CAPTION", "PALETTE", "RUN_AXIS_LABEL", "STEP_CAPTION", "WAIT_COLOR", "WAIT_COLORS",
           "algorithm_title", "config_label", "run_labels", "sorted_runs", "breakdown_data", "breakdown_matrix",
           "overlap_matrix", "timeline_events", "timeline_figure"]
