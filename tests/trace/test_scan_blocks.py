"""The blockwise event checks of the reader (``_scan_events``: every check of a block of rows at once,
one pass through the records) against the column-at-a-time definitions they replaced, on sample
traces with random bad values, for block sizes from one row to the whole trace: the same first
error of ``_check_ranges`` and the same :func:`damage` messages (counts, first rows, order)."""

from __future__ import annotations

import os
from typing import List

import numpy as np
import pytest
from conftest import REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fourd_mpi.trace.read as read
import fourd_mpi.trace.scan as scanning
from fourd_mpi.trace.events import LANE_COMM0, LANE_HOST, LANE_LAYER, LANE_STEP
from fourd_mpi.trace.events import VOCAB_OF as _VOCAB_OF
from fourd_mpi.trace.read import Trace, _Invalid, load_trace
from fourd_mpi.trace.scan import NONNEGATIVE as _NONNEGATIVE

SAMPLES = [os.path.join(REPO, "results", "samples", name) for name in ("weak-1.h5", "weak-2.h5", "grid-1x1x2x4.h5")]


# ---- the definitions: one strided pass per column (the reader before the blockwise scan) -------------

def reference_ranges(events, rank_steps, ranks, vocab, world: int) -> None:
    if not np.array_equal(ranks["rank"], np.arange(world)):
        raise _Invalid(f"/ranks does not list ranks 0..{world - 1} in order")
    for table in (events, rank_steps):
        bad = np.nonzero(table["rank"] >= world)[0]
        if len(bad):
            name = "events" if table is events else "rank_steps"
            raise _Invalid(f"/{name} row {bad[0]}: rank {table['rank'][bad[0]]} outside the world of {world}")
    for column, words in _VOCAB_OF.items():
        codes = events[column].astype(np.int64)
        bad = np.nonzero((codes < 0) | (codes >= len(vocab[words])))[0]
        if len(bad):
            raise _Invalid(f"/events row {bad[0]}: {column} code {codes[bad[0]]} outside its vocabulary of "
                           f"{len(vocab[words])} words ({len(bad)} such rows)")
    read._check_rank_ranges(ranks, world, len(events))
    count = ranks["event_count"]
    owner = np.repeat(ranks["rank"][count > 0], count[count > 0])
    if len(events) and not np.array_equal(events["rank"], owner):
        first = int(np.nonzero(events["rank"] != owner)[0][0])
        raise _Invalid(f"/events row {first} (rank {events['rank'][first]}) lies outside that rank's "
                       "event_offset/event_count range")


def reference_damage(trace: Trace) -> List[str]:
    out: List[str] = []
    tables = {"events": trace.events, "rank_steps": trace.rank_steps, "steps": trace.steps, "ranks": trace.ranks}
    for name, columns in _NONNEGATIVE.items():
        table = tables[name]
        for column in columns:
            bad = np.nonzero(table[column] < 0)[0]
            if len(bad):
                out.append(f"/{name}: {len(bad)} row(s) with negative {column} (first: row {bad[0]})")
        if "end_ns" in table.dtype.names:
            bad = np.nonzero(table["end_ns"] < table["start_ns"])[0]
            if len(bad):
                out.append(f"/{name}: {len(bad)} row(s) ending before they start (first: row {bad[0]})")
    for name, column in (("events", "flops"), ("rank_steps", "seconds"), ("steps", "seconds")):
        values = tables[name][column]
        bad = np.nonzero(~np.isfinite(values) | (values < 0))[0]
        if len(bad):
            out.append(f"/{name}: {len(bad)} row(s) with NaN, infinite or negative {column} (first: row {bad[0]})")
    ev = trace.events
    bad = np.nonzero((ev["lane"] >= LANE_COMM0) & ((ev["complete_ns"] < ev["issue_ns"]) | (ev["issue_ns"] < 0)))[0]
    if len(bad):
        out.append(f"/events: {len(bad)} collective(s) completing before their issue (first: row {bad[0]})")
    return out + reference_completeness(trace)


def reference_completeness(trace: Trace) -> List[str]:
    out: List[str] = []
    ev, rs, world = trace.events, trace.rank_steps, trace.world_size
    steps = np.unique(rs["step"])
    n_steps = max(len(steps), 1)
    keys, first = np.unique(rs["rank"].astype(np.int64) * n_steps + np.searchsorted(steps, rs["step"]),
                            return_index=True)
    if len(keys) != len(rs):
        out.append(f"/rank_steps: {len(rs) - len(keys)} duplicate (rank, step) record(s)")
    if len(keys) != world * len(steps):
        per_step = np.bincount(np.searchsorted(steps, rs["step"]), minlength=len(steps))
        short = np.nonzero(per_step < world)[0]
        if len(short):
            out.append(f"step {steps[short[0]]}: records from {per_step[short[0]]} of {world} ranks"
                       + (f" ({len(short)} such steps)" if len(short) > 1 else ""))
    index = np.searchsorted(steps, ev["step"]) if len(steps) else np.zeros(len(ev), dtype=np.int64)
    known = (index < len(steps)) & (steps[np.minimum(index, len(steps) - 1)] == ev["step"]) if len(steps) \
        else np.zeros(len(ev), dtype=bool)
    if not known.all():
        out.append(f"/events: {int((~known).sum())} event(s) of steps without a step record")
    ev_key = ev["rank"].astype(np.int64)[known] * n_steps + index[known]
    lanes = ev["lane"][known]
    where = np.searchsorted(keys, ev_key)
    matched = (where < len(keys)) & (keys[np.minimum(where, max(len(keys) - 1, 0))] == ev_key) if len(keys) \
        else np.zeros(len(ev_key), dtype=bool)
    if not matched.all():
        out.append(f"/events: {int((~matched).sum())} event(s) of a rank in a step it has no record for")
    where, lanes = where[matched], lanes[matched]
    held = np.bincount(where, minlength=len(keys))
    bad = np.nonzero(held != rs["events"][first])[0]
    if len(bad):
        i = first[bad[0]]
        out.append(f"rank {rs['rank'][i]} step {rs['step'][i]}: {held[bad[0]]} events in /events, its record says "
                   f"{rs['events'][i]} (truncated?; {len(bad)} such rank-steps)")
    spans = np.bincount(where[lanes == LANE_STEP], minlength=len(keys))
    bad = np.nonzero(spans != 1)[0]
    if len(bad):
        i = first[bad[0]]
        out.append(f"rank {rs['rank'][i]} step {rs['step'][i]}: {spans[bad[0]]} step spans, expected 1 "
                   f"({len(bad)} such rank-steps)")
    level = trace.metadata.get("level")
    allowed = {"step": LANE_STEP, "layer": LANE_LAYER}.get(level)
    if allowed is not None and (lanes > allowed).any():
        out.append(f"level {level}: {int((lanes > allowed).sum())} event(s) of a finer level")
    if level == "op":
        bad = np.nonzero(np.bincount(where[lanes == LANE_HOST], minlength=len(keys)) == 0)[0]
        if len(bad):
            i = first[bad[0]]
            out.append(f"level op: rank {rs['rank'][i]} step {rs['step'][i]} has no host-lane event "
                       f"({len(bad)} such rank-steps)")
    return out


# ---- the comparison --------------------------------------------------------------------------------

def _outcome(check, *args):
    try:
        check(*args)
        return ("ok", None)
    except _Invalid as exc:
        return ("invalid", str(exc))


EVENT_COLUMNS = ("rank", "step", "layer", "phase", "op", "axis", "lane", "start_ns", "end_ns", "bytes", "wire_bytes",
                 "flops", "issue_ns", "complete_ns", "wait_ns", "mpi_ns", "overlap_ns")
VALUES = {"f": st.sampled_from([np.nan, np.inf, -np.inf, -1.0, 0.0, 1e300]),
          "i": st.sampled_from([-1, -2**15, 0, 1, 2, 3, 7, 200, 2**15 - 1]),
          "u": st.sampled_from([0, 1, 2, 3, 4, 5, 8, 9, 255, 2**31])}


@settings(max_examples=150, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(sample=st.sampled_from(SAMPLES), data=st.data(), level=st.sampled_from(["op", "layer", "step", None]),
       rows=st.sampled_from([1, 3, 64, 1 << 20]))
def test_blockwise_checks_equal_the_column_definitions(sample, data, level, rows):
    trace = load_trace(sample)
    ev, rs, ranks = trace.events.copy(), trace.rank_steps.copy(), trace.ranks.copy()
    for _ in range(data.draw(st.integers(0, 4), label="changes")):
        what = data.draw(st.sampled_from(["events"] * 6 + ["rank_steps", "ranks", "drop", "relane", "no records"]),
                         label="what")
        if what == "no records":
            rs = rs[:0]
            continue
        if what == "relane":  # every event of one lane of a rank-step moved to another lane
            if not len(rs):
                continue
            record = rs[data.draw(st.integers(0, len(rs) - 1))]
            lane_from, lane_to = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 4))
            ev["lane"][(ev["rank"] == record["rank"]) & (ev["step"] == record["step"])
                       & (ev["lane"] == lane_from)] = lane_to
            continue
        if what == "drop":  # rows missing (a truncated rank, a lost step span)
            keep = np.ones(len(ev), dtype=bool)
            keep[data.draw(st.lists(st.integers(0, len(ev) - 1), min_size=1, max_size=20))] = False
            ev = ev[keep]
            continue
        table = {"events": ev, "rank_steps": rs, "ranks": ranks}.get(what, ev)
        if not len(table):
            continue
        column = data.draw(st.sampled_from(EVENT_COLUMNS if table is ev else
                                           ("rank", "step", "events") if table is rs else ("event_count",)))
        value = data.draw(VALUES[table.dtype[column].kind])
        picked = data.draw(st.lists(st.integers(0, len(table) - 1), min_size=1, max_size=4))
        with np.errstate(over="ignore"):
            try:
                table[column][picked] = value
            except (OverflowError, ValueError):
                pass  # the value does not fit this column
    mutated = Trace(path="t.h5", status="complete", schema_version=trace.schema_version,
                    metadata={} if level is None else {"level": level}, vocab=trace.vocab, events=ev, steps=trace.steps,
                    rank_steps=rs, ranks=ranks)
    expected_ranges = _outcome(reference_ranges, ev, rs, ranks, trace.vocab, trace.world_size)
    expected_damage = reference_damage(mutated)
    old_rows = scanning.SCAN_ROWS
    scanning.SCAN_ROWS = rows
    try:
        assert _outcome(read._check_ranges, ev, rs, ranks, trace.vocab, trace.world_size) == expected_ranges
        assert read.damage(mutated) == expected_damage
        if expected_ranges[0] == "ok":  # load_trace's way: the scan of the range checks reused by damage
            scan = read._check_ranges(ev, rs, ranks, trace.vocab, trace.world_size)
            assert read.damage(mutated, scan) == expected_damage
    finally:
        scanning.SCAN_ROWS = old_rows


@pytest.mark.parametrize("rows", [1, 7, 1 << 20])
def test_gather_columns_equals_masked_columns(rows):
    trace = load_trace(SAMPLES[1])
    ev = trace.events
    columns = ("op", "start_ns", "flops", "lane")
    got = scanning.gather_columns(ev, columns, lambda block: (block["lane"] >= LANE_COMM0) & (block["step"] % 2 == 0),
                              rows=rows)
    mask = (ev["lane"] >= LANE_COMM0) & (ev["step"] % 2 == 0)
    assert mask.any() and not mask.all()
    for c in columns:
        assert got[c].dtype == ev.dtype[c] and got[c].flags.c_contiguous
        np.testing.assert_array_equal(got[c], ev[c][mask])
    empty = scanning.gather_columns(ev, columns, lambda block: np.zeros(len(block), bool), rows=rows)
    assert all(len(v) == 0 and v.dtype == ev.dtype[c] for c, v in empty.items())


def test_in_codes_equals_isin():
    values = np.arange(256, dtype=np.uint8)
    for codes in ([], [0], [3, 5, 255], [300, 7, -1]):
        np.testing.assert_array_equal(scanning.in_codes(values, codes), np.isin(values, codes))
    np.testing.assert_array_equal(scanning.in_codes(np.array([-1, 3, 700], np.int16), [3, 700]), [False, True, True])
