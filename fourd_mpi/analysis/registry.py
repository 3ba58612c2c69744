"""The analyses of ``fourd-mpi analyze --what``: one :class:`Analysis` each, in the order the output
shows them (:data:`ANALYSES`). ``analyze`` iterates this list; a new analysis is one entry here
(and its function in :mod:`fourd_mpi.analysis.tables`).

An analysis works either per trace (:data:`PER_TRACE`: ``table(trace) -> frame``; the frames of
the traces are concatenated, traces without rows left out) or over the runs (:data:`PER_RUNS`:
``table(runs, scaling) -> [(title, frame), ...]`` from the runs table, one row per run
(:func:`~fourd_mpi.analysis.tables.runs.runs_table`); ``scaling``: the modes asked for). Under each
table the text output prints its ``formulas`` (every printed figure names its formula); ``wide``
is its terminal and markdown view (csv and json keep the full frame).

This module imports nothing of the tables: the functions and formulas are named here and found in
:mod:`fourd_mpi.analysis.tables.analyses` when an analysis runs, so building the command line (which
lists the analyses in ``analyze --help``) does not load pandas.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional, Tuple

PER_TRACE = "trace"
PER_RUNS = "runs"
#: where the names of an entry are found
FUNCTIONS = "fourd_mpi.analysis.tables.analyses"


@dataclass(frozen=True)
class Analysis:
    """One ``--what`` word; every other field names an attribute of :data:`FUNCTIONS` (``None``: none).

    - ``name``: the word, and the title of its table;
    - ``scope``: :data:`PER_TRACE` or :data:`PER_RUNS` (the module docstring says what ``table`` takes);
    - ``formulas``: column (or column pattern) -> its formula, printed under the table in text output;
    - ``wide``: ``wide(frame)``, the frame shown on a terminal and in markdown;
    - ``auto``: part of ``--what auto``;
    - ``need``: ``need(runs)`` -> why these runs give no such table, or ``None``; asked for by name,
      the reason is the error; under ``auto`` the table is left out;
    - ``companion``: ``(title, function, formulas)``: a second table ``function(frame)`` of this one's
      frame, after it (not in csv, which writes one table);
    - ``against``: ``against(frame, reference)``: the table held against a baseline run's (``--baseline``).
    """

    name: str
    scope: str
    table: str
    formulas: Optional[str] = None
    wide: Optional[str] = None
    auto: bool = True
    need: Optional[str] = None
    companion: Optional[Tuple[str, str, str]] = None
    against: Optional[str] = None

    def get(self, field: str):
        """The object the field ``field`` names (``None`` where it names none; formulas: ``{}``)."""
        value = getattr(self, field)
        if value is None:
            return {} if field == "formulas" else None
        functions = importlib.import_module(FUNCTIONS)
        if field == "companion":
            title, function, formulas = value
            return title, getattr(functions, function), getattr(functions, formulas)
        return getattr(functions, value)


ANALYSES: Tuple[Analysis, ...] = (
    Analysis("runs", PER_RUNS, "runs_sections", formulas="RUNS_FORMULAS", wide="runs_wide"),
    Analysis("breakdown", PER_TRACE, "breakdown", formulas="BREAKDOWN_FORMULAS", wide="breakdown_wide"),
    Analysis("comm", PER_TRACE, "comm_table", formulas="COMM_FORMULAS", wide="comm_wide",
             companion=("comm by placement", "comm_placement_table", "COMM_PLACEMENT_FORMULAS"),
             against="hidden_vs_baseline"),
    Analysis("compare", PER_RUNS, "compare_sections", formulas="COMPARE_FORMULAS", need="need_compare"),
    Analysis("scaling", PER_RUNS, "scaling_sections", need="need_scaling"),
    Analysis("steps", PER_TRACE, "steps_table", auto=False),
)
#: the ``--what`` words, in output order
NAMES = tuple(a.name for a in ANALYSES)
#: what ``--what auto`` shows (``steps``, a row per step and rank, only when asked for)
AUTO = tuple(a.name for a in ANALYSES if a.auto)
