"""Index lines from traces: a loaded trace's line in the results index (:func:`entry_of_trace`) and a
directory's index rebuilt from its traces (:func:`reindex`, ``fourd-mpi results reindex``).

The index itself (its lines, locking, appends and the in-place rewrite) is :mod:`fourd_mpi.results.index`, which
reads no trace: it sits below the trace package, and these two, which read traces (:mod:`fourd_mpi.trace.read`,
the run summary :func:`fourd_mpi.trace.summary.step_stats`), sit here (docs/design.md section 7).
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

from fourd_mpi.errors import TraceError
from fourd_mpi.results.index import expand_traces, index_file, make_entry, refuse_foreign_link, rewrite_index
from fourd_mpi.trace.read import load_trace
from fourd_mpi.trace.summary import step_stats


def entry_of_trace(trace, index_dir: str) -> Dict:
    """The index line of a loaded :class:`~fourd_mpi.trace.read.Trace`."""
    return make_entry(trace.metadata, trace.status, trace.path, index_dir, stats=step_stats(trace))


def reindex(directory: str, output: Optional[str] = None,
            allow_damaged: bool = False) -> Tuple[List[Dict], List[Tuple[str, str]]]:
    """Rebuild the index of ``directory`` from its ``*.h5`` traces (read by the validating reader);
    written to ``output`` (default ``directory/index.jsonl``), entries sorted by time and run id.

    Returns ``(entries, problems)``: ``problems`` holds ``(path, reason)`` for every trace skipped.
    The file is replaced in place under the exclusive lock that runs append under
    (:func:`~fourd_mpi.results.index.rewrite_index`); an entry appended since the scan whose trace exists and was
    not scanned is kept.
    """
    output = output or index_file(directory)
    refuse_foreign_link(output)
    index_dir = os.path.dirname(os.path.abspath(output))
    files, why = expand_traces(directory)
    problems = [(directory, why)] if why is not None and not os.path.isdir(directory) else []
    entries = []
    for path in files:
        try:
            entries.append(entry_of_trace(load_trace(path, allow_damaged=allow_damaged), index_dir))
        except TraceError as exc:
            problems.append((path, str(exc)))
    return rewrite_index(output, entries, {os.path.realpath(p) for p in files}), problems
