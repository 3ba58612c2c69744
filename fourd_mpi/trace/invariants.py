"""The invariants of a trace (``fourd-mpi trace check``): what every sound trace of a run satisfies.

:func:`check_invariants` lists the violations: ranks and step records complete, no overlap within a lane, waits
and staging copies inside their collective's in-flight window, blocking time within the step span, ``/steps``
seconds the max over ranks of the step spans (:func:`step_time_problems`). Vectorised: sorts and joins over all
events, no loop over ranks or events.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from fourd_mpi.trace.events import COLLECTIVE_OPS, COPY_OPS, LANE_COMM0, LANE_HOST, LANE_STEP, P2P_OPS, lane_name
from fourd_mpi.trace.read import Trace


def check_invariants(trace: Trace) -> List[str]:
    """Consistency checks a trace must pass; returns the violations (empty: all good).

    - every rank of the world is present, with one step record per step;
    - events of one rank on one lane do not overlap (1 ns slack for clock rounding);
    - every wait lies between the issue and the completion of some collective of that rank
      on that axis;
    - a rank's step span is at least the sum of its blocking (host-lane) events in that step,
      and contains them;
    - staging copies: every ``d2h`` ends before the issue, every ``h2d`` starts after the
      completion, of some collective of that rank, step and axis on the same lane.

    Vectorised (sorts and joins over all events, no loop over ranks or events): O(N log N) for N
    events. Per rank the problems come in the order lanes, waits, copies, step spans (at most one
    wait problem and one per copy op per rank: the first in file order).
    """
    problems: List[str] = []
    ev, rs = trace.events, trace.rank_steps
    world = int(trace.metadata.get("world_size", trace.world_size))
    present = set(np.unique(trace.ranks["rank"]).tolist())
    if present != set(range(world)):
        problems.append(f"ranks present {sorted(present)} != world of {world}")
    steps = np.unique(rs["step"])
    for step in steps:
        ranks_in_step = set(rs["rank"][rs["step"] == step].tolist())
        if ranks_in_step != set(range(world)):
            problems.append(f"step {step}: step records from ranks {sorted(ranks_in_step)} only")
    wait_code = trace.code("op", "wait")
    # what a wait can wait for: collectives, and (schema >= 6) point-to-point messages between pipeline stages
    collective_codes = [trace.code("op", name) for name in COLLECTIVE_OPS + P2P_OPS if name in trace.vocab["ops"]]
    index = np.nonzero(ev["rank"] < world)[0]  # events of ranks outside the world: not checked
    tab = _Columns(ev, index)  # positions below index the checked events; index[p] is the row in ev
    found: List[Tuple[int, int, int, str]] = []  # (rank, kind, order within kind, message)
    _lane_problems(tab, found)
    op = tab["op"]
    colls = np.nonzero(np.isin(op, collective_codes))[0]
    key_columns = ("rank", "axis", "step")

    def first_per_rank(rows: np.ndarray, kind: int, message) -> None:
        if len(rows):
            _, first = np.unique(tab["rank"][rows], return_index=True)  # rows in file order: the first per rank
            for i in rows[first]:
                found.append((int(tab["rank"][i]), kind, 0, message(ev[index[i]])))

    waits = np.nonzero(op == wait_code)[0]
    inside = _any_match(tab, waits, colls, key_columns, ("start_ns", "end_ns"), ("issue_ns", "complete_ns"),
                        lambda w, c: (c[0] <= w[0]) & (w[1] <= c[1]))
    first_per_rank(waits[~inside], 1, lambda w: f"rank {w['rank']} step {w['step']}: a wait [{w['start_ns']}, "
                                                f"{w['end_ns']}] lies outside every collective on its axis")
    for k, name in enumerate(COPY_OPS):  # staged mode: copies sit on their collective's lane, before / after it
        if name not in trace.vocab["ops"]:
            continue
        copies = np.nonzero(op == trace.code("op", name))[0]
        if name == "d2h":
            ordered = _any_match(tab, copies, colls, key_columns + ("lane",), ("end_ns",), ("issue_ns",),
                                 lambda x, c: x[0] <= c[0])
        else:
            ordered = _any_match(tab, copies, colls, key_columns + ("lane",), ("start_ns",), ("complete_ns",),
                                 lambda x, c: x[0] >= c[0])
        first_per_rank(copies[~ordered], 2 + k, lambda c, name=name: (
            f"rank {c['rank']} step {c['step']}: a {name} copy [{c['start_ns']}, {c['end_ns']}] is not "
            f"{'before' if name == 'd2h' else 'after'} any collective on its lane and axis"))
    _span_problems(tab, found)
    found.sort(key=lambda item: item[:3])
    problems += [message for *_, message in found]
    comm_lanes = ev["lane"] >= LANE_COMM0
    if (ev["bytes"][comm_lanes] <= 0).any():
        problems.append("a collective with no bytes")
    problems += step_time_problems(trace.steps, rs)
    return problems


#: how far ``/steps`` seconds may differ from the per-rank maximum it is computed from (float rounding)
STEP_TIME_SLACK_S = 2e-9


def rank_max_seconds(steps: np.ndarray, rank_steps: np.ndarray) -> np.ndarray:
    """Per row of ``steps``: the max over ranks of the step span (``end_ns - start_ns``, seconds) in
    ``rank_steps``, the definition of a step's time; NaN for a step no rank recorded."""
    out = np.full(len(steps), np.nan)
    if not len(steps) or not len(rank_steps):
        return out
    order = np.argsort(steps["step"], kind="stable")
    where = np.searchsorted(steps["step"][order], rank_steps["step"])
    known = where < len(steps)
    known[known] &= steps["step"][order][where[known]] == rank_steps["step"][known]
    spans = (rank_steps["end_ns"].astype(np.int64) - rank_steps["start_ns"].astype(np.int64)) * 1e-9
    best = np.full(len(steps), -np.inf)
    np.maximum.at(best, where[known], spans[known])
    out[order] = np.where(np.isfinite(best), best, np.nan)
    return out


def step_time_problems(steps: np.ndarray, rank_steps: np.ndarray) -> List[str]:
    """``/steps`` seconds that disagree with the max over ranks of their step spans (the first, and a count)."""
    expected = rank_max_seconds(steps, rank_steps)
    stored = steps["seconds"].astype(np.float64)
    bad = np.nonzero(~np.isnan(expected)
                     & ~(np.abs(stored - expected) <= STEP_TIME_SLACK_S + 1e-9 * np.abs(expected)))[0]
    if not len(bad):
        return []
    i = int(bad[0])
    return [f"step {int(steps['step'][i])}: /steps says {stored[i]:.9g} s, the max over ranks of the step spans is "
            f"{expected[i]:.9g} s ({len(bad)} such step(s))"]


class _Columns:
    """Contiguous copies of the columns of ``events[index]``, made on first use (a column of a
    structured array is strided: sorting or gathering it directly is several times slower)."""

    def __init__(self, events: np.ndarray, index: np.ndarray):
        self.events, self.index, self._cache = events, index, {}
        self.full = len(index) == len(events)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._cache:
            column = self.events[name]
            self._cache[name] = np.ascontiguousarray(column) if self.full else column[self.index]
        return self._cache[name]


def _lane_problems(tab: _Columns, found: list) -> None:
    """Per (rank, lane), events sorted by start (stable): one that ends before it starts, and
    overlaps of consecutive events beyond 1 ns. Events already in (rank, start) order (what the
    writers store) are taken lane by lane without sorting; others are sorted first."""
    if not len(tab):
        return
    rank, start, end, lanes = tab["rank"], tab["start_ns"], tab["end_ns"], tab["lane"]
    if ((rank[1:] > rank[:-1]) | ((rank[1:] == rank[:-1]) & (start[1:] >= start[:-1]))).all():
        order = None
    else:
        order = np.lexsort((start, lanes, rank))  # stable: file order among equal starts
    for lane in np.nonzero(np.bincount(lanes, minlength=256))[0]:
        pick = np.nonzero(lanes == lane)[0] if order is None else order[lanes[order] == lane]
        r, s, e = rank[pick], start[pick], end[pick]
        bad = np.nonzero(e < s)[0]
        for i in np.unique(r[bad], return_index=True)[1]:
            found.append((int(r[bad[i]]), 0, 2 * int(lane), f"rank {r[bad[i]]} lane {lane_name(int(lane))}: an "
                                                             "event ends before it starts"))
        pair = np.nonzero((s[1:] < e[:-1] - 1) & (r[1:] == r[:-1]))[0]  # pair i: events i and i + 1
        if len(pair):
            ranks, first, counts = np.unique(r[pair], return_index=True, return_counts=True)
            for who, f, n in zip(ranks, first, counts):
                i = pair[f]
                found.append((int(who), 0, 2 * int(lane) + 1,
                              f"rank {who} lane {lane_name(int(lane))}: {n} overlapping events, first at "
                              f"{s[i + 1]} ns < previous end {e[i]} ns"))


def _keys(tab: _Columns, columns: Tuple[str, ...], *row_sets: np.ndarray) -> List[np.ndarray]:
    """One int64 key per event of each of ``row_sets``, equal iff the events agree in every column of
    ``columns``: the columns' offsets from their minimum in mixed radix, or (when that could
    overflow) dense codes combined column by column."""
    rows = np.concatenate(row_sets)
    values = [tab[column][rows].astype(np.int64) for column in columns]
    lows = [int(v.min(initial=0)) for v in values]
    radix = [int(v.max(initial=0)) - lo + 1 for v, lo in zip(values, lows)]
    key = np.zeros(len(rows), dtype=np.int64)
    if float(np.prod([float(r) for r in radix])) < 2.0 ** 62:
        for v, lo, r in zip(values, lows, radix):
            key = key * r + (v - lo)
    else:
        for v in values:
            _, codes = np.unique(v, return_inverse=True)
            key = np.unique(key * (int(codes.max(initial=0)) + 1) + codes.reshape(-1),
                            return_inverse=True)[1].reshape(-1)
    return np.split(key, np.cumsum([len(r) for r in row_sets])[:-1])


def _any_match(tab: _Columns, rows: np.ndarray, candidates: np.ndarray, columns: Tuple[str, ...],
               row_columns: Tuple[str, ...], candidate_columns: Tuple[str, ...], test,
               pairs_per_pass: int = 1 << 22) -> np.ndarray:
    """For each event of ``rows``: does ``test(row values, candidate values)`` hold for some event of
    ``candidates`` equal to it in every column of ``columns``? ``test`` gets the ``row_columns`` of
    the rows and the ``candidate_columns`` of the candidates, pair by pair (lists of arrays). Boolean
    array like ``rows``. A join: the candidates sorted by key, each row paired with every candidate of
    its key (at most about ``pairs_per_pass`` pairs in memory at a time)."""
    out = np.zeros(len(rows), dtype=bool)
    if not len(rows) or not len(candidates):
        return out
    key_rows, key_cands = _keys(tab, columns, rows, candidates)
    order = np.argsort(key_cands)
    candidates, key_cands = candidates[order], key_cands[order]
    lo = np.searchsorted(key_cands, key_rows, side="left")
    n = np.searchsorted(key_cands, key_rows, side="right") - lo
    row_values = [tab[c][rows] for c in row_columns]
    cand_values = [tab[c][candidates] for c in candidate_columns]
    done = 0
    while done < len(rows):
        stop = done + max(1, int(np.searchsorted(np.cumsum(n[done:]), pairs_per_pass, side="right")))
        counts = n[done:stop]
        who = np.repeat(np.arange(done, stop), counts)
        cand = np.arange(len(who)) + np.repeat(lo[done:stop] - (np.cumsum(counts) - counts), counts)
        hit = test([v[who] for v in row_values], [v[cand] for v in cand_values])
        out[who[hit]] = True
        done = stop
    return out


def _span_problems(tab: _Columns, found: list) -> None:
    """Per step span: the host-lane events of its rank and step sum to at most its length and lie
    inside it."""
    lane = tab["lane"]
    hosts, spans = np.nonzero(lane == LANE_HOST)[0], np.nonzero(lane == LANE_STEP)[0]
    if not len(spans):
        return
    key_hosts, key_spans = _keys(tab, ("rank", "step"), hosts, spans)
    if (key_hosts[1:] < key_hosts[:-1]).any():  # a trace in (rank, time) order needs no sort
        order = np.argsort(key_hosts, kind="stable")
        hosts, key_hosts = hosts[order], key_hosts[order]
    begin = np.concatenate([[0], np.nonzero(key_hosts[1:] != key_hosts[:-1])[0] + 1]) if len(hosts) \
        else np.zeros(0, dtype=np.int64)
    keys = key_hosts[begin]
    span_start, span_end = tab["start_ns"][spans], tab["end_ns"][spans]
    if len(keys):
        h_start, h_end = tab["start_ns"][hosts], tab["end_ns"][hosts]
        total = np.add.reduceat(h_end - h_start, begin)  # int64: exact
        lo, hi = np.minimum.reduceat(h_start, begin), np.maximum.reduceat(h_end, begin)
        pos = np.minimum(np.searchsorted(keys, key_spans), len(keys) - 1)
        has = keys[pos] == key_spans
        blocking = np.where(has, total[pos], 0)
        outside = has & ((lo[pos] < span_start) | (hi[pos] > span_end))
    else:
        blocking, outside = np.zeros(len(spans), dtype=np.int64), np.zeros(len(spans), dtype=bool)
    for j in np.nonzero((blocking > span_end - span_start) | outside)[0]:
        span = tab.events[tab.index[spans[j]]]
        if blocking[j] > span_end[j] - span_start[j]:
            found.append((int(span["rank"]), 10, 2 * int(spans[j]),
                          f"rank {span['rank']} step {span['step']}: blocking events sum to {blocking[j]} ns, more "
                          f"than the step's {span['end_ns'] - span['start_ns']} ns"))
        if outside[j]:
            found.append((int(span["rank"]), 10, 2 * int(spans[j]) + 1,
                          f"rank {span['rank']} step {span['step']}: host events outside the step span"))
