"""check_invariants (vectorised: sorts and joins) against the per-rank loop it replaced, on valid and
randomly broken traces: the same problems, in the same order."""

from __future__ import annotations

import numpy as np
import pytest

from fourd_mpi.trace.events import COLLECTIVE_OPS, COPY_OPS, LANE_COMM0, LANE_HOST, LANE_STEP, P2P_OPS, lane_name
from fourd_mpi.trace.invariants import check_invariants
from fourd_mpi.trace.read import load_trace
from fourd_mpi.trace.recover import recover
from tests.trace.test_trace_units import OP, make_spool


def reference_invariants(trace):
    """The per-rank loop of check_invariants before it was vectorised (quadratic in ranks x events)."""
    problems = []
    ev, rs = trace.events, trace.rank_steps
    world = int(trace.metadata.get("world_size", trace.world_size))
    present = set(np.unique(trace.ranks["rank"]).tolist())
    if present != set(range(world)):
        problems.append(f"ranks present {sorted(present)} != world of {world}")
    for step in np.unique(rs["step"]):
        ranks_in_step = set(rs["rank"][rs["step"] == step].tolist())
        if ranks_in_step != set(range(world)):
            problems.append(f"step {step}: step records from ranks {sorted(ranks_in_step)} only")
    wait_code = trace.code("op", "wait")
    collective_codes = {trace.code("op", name) for name in COLLECTIVE_OPS + P2P_OPS if name in trace.vocab["ops"]}
    for rank in range(world):
        mine = ev[ev["rank"] == rank]
        for lane in np.unique(mine["lane"]):
            on_lane = mine[mine["lane"] == lane]
            order = np.argsort(on_lane["start_ns"], kind="stable")
            start, end = on_lane["start_ns"][order], on_lane["end_ns"][order]
            if (end < start).any():
                problems.append(f"rank {rank} lane {lane_name(lane)}: an event ends before it starts")
            overlap = np.nonzero(start[1:] < end[:-1] - 1)[0]
            if len(overlap):
                i = overlap[0]
                problems.append(f"rank {rank} lane {lane_name(lane)}: {len(overlap)} overlapping events, first at "
                                f"{start[i + 1]} ns < previous end {end[i]} ns")
        colls = mine[np.isin(mine["op"], list(collective_codes))]
        for w in mine[mine["op"] == wait_code]:
            same = colls[(colls["axis"] == w["axis"]) & (colls["step"] == w["step"])]
            if not ((same["issue_ns"] <= w["start_ns"]) & (w["end_ns"] <= same["complete_ns"])).any():
                problems.append(f"rank {rank} step {w['step']}: a wait [{w['start_ns']}, {w['end_ns']}] lies "
                                "outside every collective on its axis")
                break
        for name in COPY_OPS:
            if name not in trace.vocab["ops"]:
                continue
            for c in mine[mine["op"] == trace.code("op", name)]:
                same = colls[(colls["axis"] == c["axis"]) & (colls["step"] == c["step"]) & (colls["lane"] == c["lane"])]
                ordered = (c["end_ns"] <= same["issue_ns"]) if name == "d2h" else (c["start_ns"] >= same["complete_ns"])
                if not ordered.any():
                    problems.append(f"rank {rank} step {c['step']}: a {name} copy [{c['start_ns']}, {c['end_ns']}] is "
                                    f"not {'before' if name == 'd2h' else 'after'} any collective on its lane and axis")
                    break
        host = mine[mine["lane"] == LANE_HOST]
        for span in mine[mine["lane"] == LANE_STEP]:
            in_step = host[host["step"] == span["step"]]
            blocking = int((in_step["end_ns"] - in_step["start_ns"]).sum())
            if blocking > span["end_ns"] - span["start_ns"]:
                problems.append(f"rank {rank} step {span['step']}: blocking events sum to {blocking} ns, more than "
                                f"the step's {span['end_ns'] - span['start_ns']} ns")
            if len(in_step) and (in_step["start_ns"].min() < span["start_ns"]
                                 or in_step["end_ns"].max() > span["end_ns"]):
                problems.append(f"rank {rank} step {span['step']}: host events outside the step span")
    if (ev["bytes"][ev["lane"] >= LANE_COMM0] <= 0).any():
        problems.append("a collective with no bytes")
    return problems


@pytest.fixture(scope="module")
def base_trace(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inv")
    trace = load_trace(recover(make_spool(tmp, steps=(4, 4, 4), torn_step=False, world=3))["path"])
    assert check_invariants(trace) == reference_invariants(trace) == []
    return trace


def mutate(trace, rng):
    """A copy of ``trace`` with a few random faults: shifted times, changed ops (copies among them),
    lanes, steps or ranks, dropped events, dropped step records."""
    ev = trace.events.copy()
    n = len(ev)
    for _ in range(rng.integers(1, 6)):
        rows = rng.integers(0, n, size=rng.integers(1, 4))
        kind = rng.integers(0, 7)
        if kind == 0:
            column = rng.choice(["start_ns", "end_ns", "issue_ns", "complete_ns"])
            ev[column][rows] += rng.integers(-600, 600, size=len(rows))
        elif kind == 1:
            ev["op"][rows] = rng.choice([OP["wait"], OP["d2h"], OP["h2d"], OP["allgather"], OP["gemm"], OP["send"],
                                         OP["recv"]])
        elif kind == 2:
            ev["lane"][rows] = rng.integers(0, LANE_COMM0 + 2, size=len(rows))
        elif kind == 3:
            ev["step"][rows] = rng.integers(0, 5, size=len(rows))
        elif kind == 4:
            ev["rank"][rows] = rng.integers(0, 4, size=len(rows))  # rank 3: outside the world (not checked)
        elif kind == 5:
            ev = np.delete(ev, rows)
            n = len(ev)
        else:
            ev["axis"][rows] = rng.integers(0, 5, size=len(rows))
    trace.events = ev
    if rng.random() < 0.2:
        trace.rank_steps = np.delete(trace.rank_steps, rng.integers(0, len(trace.rank_steps)))
    return trace


def test_vectorised_invariants_match_the_per_rank_loop(base_trace):
    import copy

    rng = np.random.default_rng(19)
    seen = 0
    for trial in range(300):
        trace = mutate(copy.copy(base_trace), rng)
        expected = reference_invariants(trace)
        assert check_invariants(trace) == expected, trial
        seen += bool(expected)
    assert seen > 200  # most mutations break something: the comparison is not between empty lists


def test_vectorised_invariants_join_in_passes(base_trace, monkeypatch):
    """A join split into many passes (a small pair budget) finds the same matches."""
    import copy

    from fourd_mpi.trace import invariants

    rng = np.random.default_rng(7)
    original = invariants._any_match
    monkeypatch.setattr(invariants, "_any_match", lambda *a, **k: original(*a, **k, pairs_per_pass=3))
    for trial in range(40):
        trace = mutate(copy.copy(base_trace), rng)
        assert check_invariants(trace) == reference_invariants(trace), trial
