"""One pass over a trace's events: every elementwise check of a block of rows while it is in cache.

A column of a structured array is a strided view, so checking or copying the columns one at a time over all
rows would pull every record through memory once per column. :func:`scan_events` makes the reader's range checks
(:func:`fourd_mpi.trace.read.load_trace`) and the damage checks (:mod:`fourd_mpi.trace.damage`) in one pass,
block by block (:data:`SCAN_ROWS` rows); :func:`gather_columns` and :func:`in_codes` serve the analyses the same
way (:mod:`fourd_mpi.analysis.tables`, :mod:`fourd_mpi.trace.summary`).
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np

from fourd_mpi.trace.events import LANE_COMM0, VOCAB_OF

#: time columns that are never negative, per dataset (``clock_offset_ns`` may be)
NONNEGATIVE = {
    "events": ("start_ns", "end_ns", "bytes", "wire_bytes", "wait_ns", "mpi_ns", "overlap_ns"),
    "rank_steps": ("start_ns", "end_ns", "compute_ns", "wait_ns", "mpi_ns"),
    "steps": ("start_ns", "end_ns", "compute_ns_max", "wait_ns_max"),
    "ranks": ("clock_uncertainty_ns", "clock_residual_ns"),
}

#: rows per block of :func:`scan_events` and :func:`gather_columns` (8192 records of 102 bytes: 0.8 MiB,
#: within a core's L2): a column of a structured array is a strided view, so checking or copying the
#: columns one at a time over all rows would pull every record through memory once per column
SCAN_ROWS = 8192


def blocks(n: int, rows: int = None):
    """``(start, stop)`` of consecutive blocks of ``rows`` rows (default :data:`SCAN_ROWS`) covering
    ``range(n)``."""
    rows = max(int(SCAN_ROWS if rows is None else rows), 1)
    return ((a, min(a + rows, n)) for a in range(0, n, rows))


def gather_columns(events: np.ndarray, columns, select, rows: int = None) -> Dict[str, np.ndarray]:
    """``{column: events[column][mask]}`` (contiguous copies, rows in file order) for the rows where
    ``select(block)`` is true: ``select`` gets a block of ``events`` (a slice, ``rows`` rows at most) and
    returns its boolean mask. One pass through the records, block by block (instead of one strided
    pass per column)."""
    pieces: Dict[str, List[np.ndarray]] = {c: [] for c in columns}
    for a, b in blocks(len(events), rows):
        block = events[a:b]
        picked = np.flatnonzero(select(block))
        if len(picked):
            for c in columns:
                pieces[c].append(block[c][picked])
    out = {}
    for c in list(pieces):  # each column's pieces freed once joined
        p = pieces.pop(c)
        out[c] = np.concatenate(p) if p else np.zeros(0, dtype=events.dtype[c])
    return out


def in_codes(values: np.ndarray, codes) -> np.ndarray:
    """``np.isin(values, codes)``; for one-byte unsigned ``values`` (the op, phase, axis and lane
    columns) by a 256-entry lookup table instead of a sort."""
    if values.dtype != np.uint8:
        return np.isin(values, codes)
    table = np.zeros(256, dtype=bool)
    table[[int(c) for c in codes if 0 <= int(c) < 256]] = True
    return table[values]


class Tally:
    """How many rows fail one check, the first of them, and its value (``values[row]`` at that row)."""

    __slots__ = ("count", "first", "value")

    def __init__(self):
        self.count, self.first, self.value = 0, -1, None

    def add(self, bad: np.ndarray, offset: int, values=None) -> None:
        n = int(np.count_nonzero(bad))
        if n:
            if not self.count:
                i = int(np.argmax(bad))
                self.first, self.value = offset + i, (values[i] if values is not None else None)
            self.count += n


class Scan:
    """What :func:`scan_events` found: one :class:`Tally` per check, and per (rank, step) record key
    the matched events by lane class (columns: step span, layer span, host, comm lanes)."""

    def __init__(self):
        self.tally: Dict[str, Tally] = {}
        self.by_key: np.ndarray = np.zeros((0, 4), dtype=np.int64)

    def __getitem__(self, name: str) -> Tally:
        return self.tally.setdefault(name, Tally())


def record_keys(rank_steps: np.ndarray):
    """``(steps, keys, first)``: the distinct steps of ``/rank_steps``; the distinct record keys
    ``rank * max(len(steps), 1) + step index`` (sorted) and the first record of each."""
    steps = np.unique(rank_steps["step"])
    n_steps = max(len(steps), 1)
    rs_key = rank_steps["rank"].astype(np.int64) * n_steps + np.searchsorted(steps, rank_steps["step"])
    keys, first = np.unique(rs_key, return_index=True)
    return steps, keys, first


#: the event columns :func:`scan_events` reads
_SCANNED = frozenset(("rank", "step", "lane", "start_ns", "end_ns", "flops", "issue_ns", "complete_ns")
                     + tuple(VOCAB_OF) + NONNEGATIVE["events"])


def scan_events(events: np.ndarray, rank_steps: np.ndarray, world=None, vocab=None, counts=None,
                 rows: int = None) -> Scan:
    """Every elementwise check of ``events`` in one pass, block by block (:data:`SCAN_ROWS`).

    Always (for :func:`~fourd_mpi.trace.damage.damage`): negative values of the non-negative columns, rows
    ending before they start, NaN/infinite/negative ``flops``, collectives completing before their issue; events
    of a step without a record (``unknown``), of a rank-step without a record (``unmatched``), and the matched
    events counted per record key and lane class (:func:`~fourd_mpi.trace.damage._completeness`). With ``world``
    and ``vocab`` (for :func:`~fourd_mpi.trace.read._check_ranges`): ranks outside the world, codes outside their
    vocabularies; with ``counts`` (``/ranks`` ``event_count``, already checked) rows outside their rank's range.
    """
    scan = Scan()
    steps, keys, _ = record_keys(rank_steps)
    n_steps, n_keys = max(len(steps), 1), len(keys)
    contiguous = len(steps) > 0 and int(steps[-1]) - int(steps[0]) + 1 == len(steps)
    dense = n_keys > 0 and int(keys[0]) == 0 and int(keys[-1]) == n_keys - 1  # keys == arange(n_keys)
    by_key = np.zeros((n_keys, 4), dtype=np.int64)
    codes = []
    if world is not None:
        for column, words in VOCAB_OF.items():
            info = np.iinfo(events.dtype[column])
            codes.append((column, len(vocab[words]), info.min < 0, len(vocab[words]) <= info.max))
    if counts is not None:
        owners = np.arange(len(counts))[counts > 0]
        ends = np.cumsum(counts[counts > 0])
    columns = [c for c in events.dtype.names if c in _SCANNED]
    for a, b in blocks(len(events), rows):
        records = events[a:b]
        block = {c: np.ascontiguousarray(records[c]) for c in columns}  # each column read once, from cache
        rank, lane = block["rank"], block["lane"]
        if world is not None:
            scan["rank"].add(rank >= world, a, rank)
            for column, n_words, signed, bounded in codes:
                code = block[column]
                if signed and bounded:
                    scan[column].add((code < 0) | (code >= n_words), a, code)
                elif signed:
                    scan[column].add(code < 0, a, code)
                elif bounded:
                    scan[column].add(code >= n_words, a, code)
        if counts is not None:
            lo, hi = np.searchsorted(ends, a, side="right"), np.searchsorted(ends, b, side="left") + 1
            starts = np.concatenate([[a], ends[lo:hi - 1]])
            stops = np.minimum(ends[lo:hi], b)
            scan["owner"].add(rank != np.repeat(owners[lo:hi], stops - starts), a)
        for column in NONNEGATIVE["events"]:
            scan[column].add(block[column] < 0, a)
        start, end = block["start_ns"], block["end_ns"]
        scan["end_ns<start_ns"].add(end < start, a)
        flops = block["flops"]
        scan["flops"].add(~np.isfinite(flops) | (flops < 0), a)
        issue = block["issue_ns"]
        scan["issue"].add((lane >= LANE_COMM0) & ((block["complete_ns"] < issue) | (issue < 0)), a)
        step = block["step"]
        if contiguous:
            known = (step >= steps[0]) & (step <= steps[-1])
            index = step.astype(np.int64) - int(steps[0])
        elif len(steps):
            index = np.searchsorted(steps, step)
            known = (index < len(steps)) & (steps[np.minimum(index, len(steps) - 1)] == step)
        else:
            known, index = np.zeros(b - a, dtype=bool), np.zeros(b - a, dtype=np.int64)
        scan["unknown"].add(~known, a)
        key = rank.astype(np.int64) * n_steps + index
        if dense:
            where, matched = key, known & (key >= 0) & (key < n_keys)
        elif n_keys:
            where = np.searchsorted(keys, key)
            matched = known & (where < n_keys) & (keys[np.minimum(where, n_keys - 1)] == key)
        else:
            where, matched = key, np.zeros(b - a, dtype=bool)
        scan["unmatched"].add(known & ~matched, a)
        where = where[matched]
        if len(where):
            low = int(where.min())
            cell = (where - low) * 4 + np.minimum(lane[matched], LANE_COMM0)
            part = np.bincount(cell, minlength=4 * (int(where.max()) - low + 1)).reshape(-1, 4)
            by_key[low:low + len(part)] += part
    scan.by_key = by_key
    return scan
