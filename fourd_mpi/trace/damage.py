"""Damage: a trace whose file is sound but whose values are impossible, and why (:func:`damage`).

:func:`fourd_mpi.trace.read.load_trace` refuses a damaged trace (:class:`~fourd_mpi.errors.DamagedTraceError`)
unless ``allow_damaged``; ``Trace.damage`` keeps the reasons. ``trace`` below is a
:class:`~fourd_mpi.trace.read.Trace` (by duck type: the reader imports this module).
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from fourd_mpi.trace.events import LANE_HOST, LANE_LAYER, LANE_STEP
from fourd_mpi.trace.scan import NONNEGATIVE, Scan, record_keys, scan_events


def damage(trace, scan: Scan = None) -> List[str]:
    """Why a structurally valid trace cannot be analysed as it is (empty: it can).

    - NaN, infinite or negative times: every ``*_ns`` column but ``clock_offset_ns``, ``bytes``,
      ``wire_bytes``, ``flops`` and the ``seconds`` of steps and rank-steps; an event, step or
      rank-step that ends before it starts; a collective that completes before its issue;
    - per-rank completeness against the trace level: every step has one record per rank, every
      event belongs to a recorded (rank, step), each rank-step's ``events`` count equals its events
      in ``/events``, and each holds exactly one step span; level ``step`` keeps step spans only,
      ``layer`` step and layer spans only, ``op`` at least one host-lane event per rank-step.

    The event checks are those of :func:`~fourd_mpi.trace.scan.scan_events` (one pass over the records, block by
    block); ``scan``: its result for these events and rank-steps, when already made
    (:func:`~fourd_mpi.trace.read.load_trace`).
    """
    out: List[str] = []
    if scan is None:
        scan = scan_events(trace.events, trace.rank_steps)
    tables = {"events": trace.events, "rank_steps": trace.rank_steps, "steps": trace.steps, "ranks": trace.ranks}

    def failing(name: str, check: str, bad) -> Tuple[int, int]:
        """(count, first row) of the rows of table ``name`` failing ``check`` (``bad()``: their mask)."""
        if name == "events":
            found = scan[check]
            return found.count, found.first
        rows = np.nonzero(bad())[0]
        return len(rows), (rows[0] if len(rows) else -1)

    for name, columns in NONNEGATIVE.items():
        table = tables[name]
        for column in columns:
            count, first = failing(name, column, lambda: table[column] < 0)
            if count:
                out.append(f"/{name}: {count} row(s) with negative {column} (first: row {first})")
        if "end_ns" in table.dtype.names:
            count, first = failing(name, "end_ns<start_ns", lambda: table["end_ns"] < table["start_ns"])
            if count:
                out.append(f"/{name}: {count} row(s) ending before they start (first: row {first})")
    for name, column in (("events", "flops"), ("rank_steps", "seconds"), ("steps", "seconds")):
        values = tables[name][column]
        count, first = failing(name, column, lambda: ~np.isfinite(values) | (values < 0))
        if count:
            out.append(f"/{name}: {count} row(s) with NaN, infinite or negative {column} (first: row {first})")
    found = scan["issue"]
    if found.count:
        out.append(f"/events: {found.count} collective(s) completing before their issue (first: row {found.first})")
    out += _completeness(trace, scan)
    return out


def _completeness(trace, scan: Scan = None) -> List[str]:
    """The completeness part of :func:`damage` (vectorised: sorts, no loop over ranks or steps; the
    events counted per rank-step and lane class by :func:`scan_events`)."""
    out: List[str] = []
    if scan is None:
        scan = scan_events(trace.events, trace.rank_steps)
    rs, world = trace.rank_steps, trace.world_size
    steps, keys, first = record_keys(rs)
    if len(keys) != len(rs):
        out.append(f"/rank_steps: {len(rs) - len(keys)} duplicate (rank, step) record(s)")
    if len(keys) != world * len(steps):
        per_step = np.bincount(np.searchsorted(steps, rs["step"]), minlength=len(steps))
        short = np.nonzero(per_step < world)[0]
        if len(short):
            out.append(f"step {steps[short[0]]}: records from {per_step[short[0]]} of {world} ranks"
                       + (f" ({len(short)} such steps)" if len(short) > 1 else ""))
    if scan["unknown"].count:
        out.append(f"/events: {scan['unknown'].count} event(s) of steps without a step record")
    if scan["unmatched"].count:
        out.append(f"/events: {scan['unmatched'].count} event(s) of a rank in a step it has no record for")
    by_key = scan.by_key  # matched events per record key; columns: step span, layer span, host, comm lanes
    held = by_key.sum(axis=1)
    expected = rs["events"][first]
    bad = np.nonzero(held != expected)[0]
    if len(bad):
        i = first[bad[0]]
        out.append(f"rank {rs['rank'][i]} step {rs['step'][i]}: {held[bad[0]]} events in /events, its record says "
                   f"{rs['events'][i]} (truncated?; {len(bad)} such rank-steps)")
    spans = by_key[:, LANE_STEP]
    bad = np.nonzero(spans != 1)[0]
    if len(bad):
        i = first[bad[0]]
        out.append(f"rank {rs['rank'][i]} step {rs['step'][i]}: {spans[bad[0]]} step spans, expected 1 "
                   f"({len(bad)} such rank-steps)")
    level = trace.metadata.get("level")
    allowed = {"step": LANE_STEP, "layer": LANE_LAYER}.get(level)
    finer = int(by_key[:, allowed + 1:].sum()) if allowed is not None else 0
    if finer:
        out.append(f"level {level}: {finer} event(s) of a finer level")
    if level == "op":
        bad = np.nonzero(by_key[:, LANE_HOST] == 0)[0]
        if len(bad):
            i = first[bad[0]]
            out.append(f"level op: rank {rs['rank'][i]} step {rs['step'][i]} has no host-lane event "
                       f"({len(bad)} such rank-steps)")
    return out
