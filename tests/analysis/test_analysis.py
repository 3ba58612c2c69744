"""fourd_mpi.analysis.tables: hand-built traces with known answers, real traces from mpiexec runs, bad files."""

from __future__ import annotations

import json
import os
import shutil

import h5py
import numpy as np
import pandas as pd
import pytest

from fourd_mpi.analysis import tables as analysis
from fourd_mpi.analysis.tables import (
    BREAKDOWN_COLUMNS,
    COMM_COLUMNS,
    COMPARE_COLUMNS,
    RUN_COLUMNS,
    SCALING_COLUMNS,
    breakdown,
    collect,
    comm_table,
    compare,
    format_table,
    runs_table,
    scaling,
    steps_table,
)
from fourd_mpi.trace.events import (
    AXES,
    COMPUTE_OPS,
    EVENT_DTYPE,
    LANE_COMM0,
    LANE_HOST,
    LANE_STEP,
    OPS,
    PHASES,
    RANK_STEP_DTYPE,
)
from fourd_mpi.trace.invariants import check_invariants
from fourd_mpi.trace.read import load_trace
from fourd_mpi.trace.summary import harness_ns, step_stats, summarize
from fourd_mpi.trace.writer import TraceFileWriter, ranks_table

OP = {name: i for i, name in enumerate(OPS)}
PHASE = {name: i for i, name in enumerate(PHASES)}
AXIS = {name: i for i, name in enumerate(AXES)}
LAYERS = ["", "block0.fc1", "block0.fc2", "loss"]
MODEL = {"name": "gpt-tiny", "kind": "gpt", "layers": 2, "hidden": 64, "heads": 8, "ffn_hidden": 256, "seq": 16,
         "batch": 8}


# ---------------------------------------------------------------------------
# synthetic traces
# ---------------------------------------------------------------------------

def event(rank, step, op, lane, start, end, layer=0, phase="none", axis="none", nbytes=0, wire=0, flops=0.0,
          issue=0, complete=0, wait=0, call=None, mpi=None, overlap=None):
    """An EVENT_DTYPE tuple; ``call``/``mpi``/``overlap`` default to ``issue``/``wait``/the time not waited
    (the I* call returns at once, the host is in MPI only while it waits and computes otherwise)."""
    if overlap is None:
        overlap = max(complete - issue - wait, 0) if lane >= LANE_COMM0 else 0
    return (rank, step, layer, PHASE[phase], OP[op], AXIS[axis], lane, start, end, nbytes, wire, flops, issue,
            complete, wait, issue if call is None else call, wait if mpi is None else mpi,
            overlap)


def write_trace(path, events, world, grid=None, warmup=1, level="op", label=None, overlap="none",
                progress="poll", tokens=64, flops=1e6, peak=1.0, model=None, compute_ops=COMPUTE_OPS, algorithm=None,
                hosts=None, extra_meta=None):
    """Write ``events`` (a list of ``event`` tuples, any order) as a complete trace; ``/rank_steps`` is
    derived from them: span from the step event, ``compute_ns``/``wait_ns``/``mpi_ns`` from the host-lane
    events (compute less the MPI polls inside compute events, as the schema-4 recorder counts).
    ``hosts``: each rank's host name (default ``node0`` for all); ``extra_meta``: more metadata keys."""
    grid = grid or {"data": 1, "z": 1, "y": 1, "x": world}
    ev = np.array(events, dtype=EVENT_DTYPE)
    compute_codes = [OP[o] for o in compute_ops]
    steps = sorted(set(ev["step"].tolist()))
    rs = []
    for step in steps:
        spans = {}
        for rank in range(world):
            mine = ev[(ev["rank"] == rank) & (ev["step"] == step)]
            span = mine[mine["op"] == OP["step"]][0]
            dur = mine["end_ns"] - mine["start_ns"]
            is_compute = np.isin(mine["op"], compute_codes)
            polls = int(mine["mpi_ns"][is_compute].sum())  # MPI calls inside compute events: not compute
            kept = len(mine) if level == "op" else int((mine["op"] == OP["step"]).sum())  # events the file keeps
            spans[rank] = (span, int(dur[is_compute].sum()) - polls, int(dur[mine["op"] == OP["wait"]].sum()),
                           kept, polls)
        seconds = max(s["end_ns"] - s["start_ns"] for s, *_ in spans.values()) * 1e-9
        for rank, (span, compute, wait, count, polls) in spans.items():
            rs.append((rank, step, step < warmup, span["start_ns"], span["end_ns"], 1.0, seconds, compute, wait,
                       count, wait + polls))
    rank_steps = np.array(rs, dtype=RANK_STEP_DTYPE)
    if level != "op":  # the events of lower levels: step spans only (rank_steps keeps the totals)
        ev = ev[ev["op"] == OP["step"]]
    run_id = os.path.basename(str(path))[:-3]
    model = dict(model or MODEL, batch=tokens // (model or MODEL)["seq"])
    config = {"model": model["name"], "batch": model["batch"], "gdata": grid["data"], "gz": grid["z"],
              "gy": grid["y"], "gx": grid["x"], "overlap": overlap, "progress": progress, "label": label,
              "trace-level": level, "peak-tflops": peak}
    summary = summarize(rank_steps, world, flops, tokens, peak, "--peak-tflops").as_dict()
    meta = {"run_id": run_id, "level": level, "config": config,
            "run_options": {"model": model, "grid": grid, "overlap": overlap, "progress": progress,
                            "warmup": warmup},
            "grid": "{data}x{z}x{y}x{x}".format(**grid), "world_size": world, "overlap": overlap,
            "progress": {"poll": "poll (Testsome between GEMM chunks of 1e+07 FLOPs)"}.get(progress, progress),
            "layers": LAYERS, "warmup_steps": warmup, "model_flops_per_step": flops, "tokens_per_step": tokens,
            "summary": summary}
    if algorithm is not None:  # traces before the algorithm axis have no key
        meta["algorithm"] = meta["run_options"]["algorithm"] = algorithm
    meta.update(extra_meta or {})
    writer = TraceFileWriter(str(path))
    for rank in range(world):
        mine = ev[ev["rank"] == rank]
        writer.append_events(rank, mine[np.argsort(mine["start_ns"], kind="stable")])
    metas = [{"rank": r, "hostname": hosts[r] if hosts else "node0", "coords": {"data": 0, "z": 0, "y": 0, "x": r}}
             for r in range(world)]
    return writer.finish(meta, ranks_table(metas), rank_steps, LAYERS, "complete")


# The hand-placed trace: 2 ranks on x (group size 2), steps 0 (warm-up), 1, 2. Per rank and step (ns after t0):
#   step span     [0, SPAN[rank][step]]
#   data          [10, 60]                                    phase none      50
#   gemm fwd      [100, 200]                                  forward        100
#   allreduce x   issue 200, complete 200 + FLIGHT[rank], 4096 bytes, wait WAIT[rank]   (comm lane 0)
#   wait x        [complete - WAIT[rank], complete]           forward
#   allgather x   issue 1250, complete 1290, 2048 bytes, no wait                     (comm lane 1)
#   gemm bwd      [1700, 1700 + BWD[rank]]                    backward
# The warm-up step is different everywhere (long span, 8192-byte all-reduce, long gemm), so any leak shows.
SPAN = {0: {0: 20000, 1: 2000, 2: 2000}, 1: {0: 30000, 1: 2500, 2: 3000}}
FLIGHT = {0: 1000, 1: 1500}
WAIT = {0: 400, 1: 600}
BWD = {0: 300, 1: 500}


def hand_events(world=2):
    events = []
    for rank in range(world):
        for step in range(3):
            t0 = 1_000_000 + step * 100_000
            warm = step == 0
            complete = t0 + 200 + FLIGHT[rank]
            nbytes = 8192 if warm else 4096
            bwd = 5000 if warm else BWD[rank]
            events += [
                event(rank, step, "step", LANE_STEP, t0, t0 + SPAN[rank][step]),
                event(rank, step, "optimizer", LANE_HOST, t0 + 10, t0 + 60),
                event(rank, step, "gemm", LANE_HOST, t0 + 100, t0 + 200, layer=1, phase="forward", flops=1e5),
                event(rank, step, "allreduce", LANE_COMM0, t0 + 200, complete, layer=1, phase="forward", axis="x",
                      nbytes=nbytes, wire=nbytes, issue=t0 + 200, complete=complete, wait=WAIT[rank]),
                event(rank, step, "wait", LANE_HOST, complete - WAIT[rank], complete, layer=1, phase="forward",
                      axis="x", nbytes=nbytes),
                event(rank, step, "allgather", LANE_COMM0 + 1, t0 + 1250, t0 + 1290, layer=2, phase="forward",
                      axis="x", nbytes=2048, wire=1024, issue=t0 + 1250, complete=t0 + 1290),
                event(rank, step, "gemm", LANE_HOST, t0 + 1700, t0 + 1700 + bwd, layer=2, phase="backward",
                      flops=2e5),
            ]
    return events


@pytest.fixture(scope="module")
def hand(tmp_path_factory):
    path = write_trace(tmp_path_factory.mktemp("hand") / "hand-run.h5", hand_events(), world=2, label="hand")
    trace = load_trace(path)
    assert check_invariants(trace) == []
    return trace


def step_trace(path, world, step_ns, tokens, grid=None, **kw):
    """A step-level trace whose measured steps all take ``step_ns`` (rank 0 is the slowest)."""
    events = []
    for rank in range(world):
        for step in range(3):
            t0 = 10_000_000 * (step + 1)
            span = (3 * step_ns if step == 0 else step_ns) - (0 if rank == 0 else 10)
            events.append(event(rank, step, "step", LANE_STEP, t0, t0 + span))
    return write_trace(path, events, world, grid=grid, level="step", tokens=tokens, **kw)


# ---------------------------------------------------------------------------
# known answers
# ---------------------------------------------------------------------------

def test_runs_table_known_answers(hand):
    df = runs_table([hand])
    assert list(df.columns) == RUN_COLUMNS
    row = df.iloc[0]
    assert (row.run_id, row.status, row.label, row.model, row.world_size, row.grid) == \
        ("hand-run", "complete", "hand", "gpt-tiny", 2, "1x1x1x2")
    assert (row.gdata, row.gz, row.gy, row.gx, row.overlap, row.progress, row.level, row.steps) == \
        (1, 1, 1, 2, "none", "poll", "op", 2)
    # step times (max over ranks): step 1 2500 ns, step 2 3000 ns
    assert row.step_median_s == pytest.approx(2.75e-6)
    assert (row.step_min_s, row.step_max_s) == (pytest.approx(2.5e-6), pytest.approx(3.0e-6))
    assert (row.step_q1_s, row.step_q3_s) == (pytest.approx(2.625e-6), pytest.approx(2.875e-6))
    # compute: rank 0 50+100+300 = 450, rank 1 50+100+500 = 650 per step; spans 2000+2000+2500+3000 = 9500
    assert row.compute_share == pytest.approx(2 * (450 + 650) / 9500)
    assert row.wait_share == pytest.approx(2 * (400 + 600) / 9500)
    assert row.other_share == pytest.approx(1 - 4200 / 9500)
    assert row.tflops_per_rank == pytest.approx(1e6 / 2 / 2.75e-6 / 1e12)
    assert row.peak_tflops == 1.0
    assert row.mfu_pct == pytest.approx(100 * 1e6 / 2 / 2.75e-6 / 1e12)  # --peak-tflops 1: the peak
    assert np.isnan(row.gemm_tflops) and np.isnan(row.gemm_pct)
    assert row.tokens_per_s == pytest.approx(64 / 2.75e-6)
    assert row.imbalance == pytest.approx(650 / 550)
    assert (row.tokens_per_step, row.model_flops_per_step) == (64, 1e6)
    assert row.config_key == "gpt-tiny/none/poll/hand"
    summary = hand.metadata["summary"]
    for column, key in (("step_median_s", "median_s"), ("compute_share", "compute_share"),
                        ("tflops_per_rank", "model_tflops_per_rank"), ("mfu_pct", "mfu_pct")):
        assert row[column] == pytest.approx(summary[key], rel=1e-12)


def test_breakdown_known_answers(hand):
    df = breakdown(hand)
    assert list(df.columns) == BREAKDOWN_COLUMNS
    got = {(r.phase, r.category, r.axis): r.share for r in df.itertuples()}
    mean_span = 9500 / 4
    expected = {("none", "optimizer", "none"): 50, ("forward", "gemm", "none"): 100,
                ("backward", "gemm", "none"): (300 + 500) / 2, ("forward", "exposed_comm", "x"): (400 + 600) / 2,
                ("all", "other", "none"): mean_span - 50 - 100 - 400 - 500}
    assert got.keys() == expected.keys()
    # share = the category's time over all measured (rank, step) records / the sum of their spans
    for key, ns in expected.items():
        assert got[key] == pytest.approx(ns / mean_span), key
    assert df.share.sum() == pytest.approx(1.0)
    # seconds = share * the run's step time (median over steps 1, 2 of the max over ranks: 2500, 3000 ns)
    assert (df.step_s == runs_table([hand]).step_median_s[0]).all()
    assert list(df.step_s) == pytest.approx([2.75e-6] * len(df))
    assert list(df.step_q1_s) == pytest.approx([2.625e-6] * len(df))
    assert list(df.step_q3_s) == pytest.approx([2.875e-6] * len(df))
    assert list(df.seconds_per_step) == pytest.approx(list(df.share * 2.75e-6), rel=1e-15)
    assert df.seconds_per_step.sum() == pytest.approx(2.75e-6, rel=1e-12)
    assert (df.run_id == "hand-run").all()
    compute = df[~df.category.isin(["exposed_comm", "other"])].share.sum()
    runs = runs_table([hand])
    assert compute == pytest.approx(runs.compute_share[0])
    assert df.step_s[0] == runs.step_median_s[0]
    wide = analysis.breakdown_wide(df)
    assert wide.step_s[0] == runs.step_median_s[0]
    assert wide["other_%"][0] == pytest.approx(100 * (mean_span - 1050) / mean_span)


def test_polls_inside_compute_are_not_compute(tmp_path):
    """Schema 4: MPI polls made inside a GEMM (event column ``mpi_ns``) are MPI time, not compute,
    in the breakdown as in ``compute_ns`` (the runs table and the summary)."""
    events = [e if not (e[4] == OP["gemm"] and e[3] == PHASE["backward"]) else e[:16] + (40,) + e[17:]
              for e in hand_events()]  # 40 ns of polls inside every backward GEMM
    trace = load_trace(write_trace(tmp_path / "polls.h5", events, world=2))
    df = breakdown(trace)
    row = runs_table([trace]).iloc[0]
    assert row.compute_share == pytest.approx(2 * (450 + 650 - 2 * 40) / 9500)
    compute = df[~df.category.isin(["exposed_comm", "other"])].share.sum()
    assert compute == pytest.approx(row.compute_share, rel=1e-12)
    assert df.share[df.category == "other"].sum() == pytest.approx(row.other_share, rel=1e-12)
    steps = steps_table(trace)
    assert list(steps.mpi_s * 1e9) == pytest.approx([WAIT[r] + 40 for _ in range(3) for r in range(2)])


def test_step_stats_is_the_median_of_the_max_over_ranks(hand):
    stats = step_stats(hand)
    assert (stats.steps, list(stats.steps_index), list(stats.per_step_s)) == (2, [1, 2], [2.5e-6, 3.0e-6])
    assert (stats.median_s, stats.q1_s, stats.q3_s, stats.min_s, stats.max_s) == \
        pytest.approx((2.75e-6, 2.625e-6, 2.875e-6, 2.5e-6, 3.0e-6), rel=1e-12)
    again = step_stats(hand.rank_steps)
    assert (again.median_s, again.q1_s, again.q3_s) == (stats.median_s, stats.q1_s, stats.q3_s)
    empty = step_stats(hand.rank_steps[:0])
    assert empty.steps == 0 and np.isnan(empty.median_s)


def test_harness_work_is_not_compute(tmp_path):
    """Schema <= 2 traces made the synthetic data inside every step and counted it in ``compute_ns``:
    the analysis and the summary put it in its own category."""
    events = hand_events()
    for rank in range(2):
        for step in range(3):
            t0 = 1_000_000 + step * 100_000
            events.append(event(rank, step, "data", LANE_HOST, t0 + 65, t0 + 95))  # 30 ns of harness work
    trace = load_trace(write_trace(tmp_path / "harness.h5", events, world=2, compute_ops=COMPUTE_OPS + ("data",)))
    assert check_invariants(trace) == []
    row = runs_table([trace]).iloc[0]
    assert row.compute_share == pytest.approx(2 * (450 + 650) / 9500)      # as without the data ops
    assert row.harness_share == pytest.approx(4 * 30 / 9500)
    assert row.other_share == pytest.approx(1 - (2200 + 2000 + 120) / 9500)
    assert row.imbalance == pytest.approx(650 / 550)
    df = breakdown(trace)
    harness = df[df.category == "harness"]
    assert list(harness.phase) == ["none"] and harness.share.iloc[0] == pytest.approx(120 / 9500)
    assert df.share[~df.category.isin(["exposed_comm", "other", "harness"])].sum() == pytest.approx(row.compute_share)
    summary = summarize(trace.rank_steps, 2, 1e6, 64, 1.0, "x", harness=harness_ns(trace))
    assert (summary.compute_share, summary.harness_share) == pytest.approx((row.compute_share, row.harness_share))
    assert "harness 1.3%" in summary.lines()[1]
    steps = steps_table(trace)
    assert list(steps.harness_s * 1e9) == pytest.approx([30] * 6)
    # optimizer 50 + forward gemm 100 + backward gemm (5000 in the warm-up step), without the data ops
    assert list(steps.compute_s * 1e9) == pytest.approx([150 + (5000 if s == 0 else BWD[r])
                                                         for s in range(3) for r in range(2)])


def test_comm_table_known_answers(hand):
    df = comm_table(hand)
    assert list(df.columns) == COMM_COLUMNS
    assert list(zip(df.op, df.axis)) == [("allgather", "x"), ("allreduce", "x")]
    ag, ar = df.iloc[0], df.iloc[1]
    # all-reduce: 4 measured messages (2 ranks x 2 steps) of 4096 bytes, in flight 1000 (rank 0) / 1500 ns
    assert (ar.group_size, ar.messages_per_step, ar.bytes_per_step, ar.wire_bytes_per_step) == (2, 1, 4096, 4096)
    assert ar.bytes_per_message == 4096
    assert ar.inflight_median_s == pytest.approx(1250e-9)
    assert ar.inflight_s_per_step == pytest.approx(1250e-9)
    assert ar.wait_s_per_step == pytest.approx(500e-9)
    assert ar.algbw_gbps == pytest.approx(4 * 4096 / 5000)           # total bytes / total in-flight ns
    assert ar.busbw_gbps == pytest.approx(4 * 4096 / 5000 * 2 * 1 / 2)
    assert ar.overlap_pct == pytest.approx(100 * (1 - 2000 / 5000))
    # all-gather: 2048 bytes in 40 ns, never waited for
    assert (ag.messages_per_step, ag.bytes_per_step, ag.wire_bytes_per_step) == (1, 2048, 1024)
    assert ag.algbw_gbps == pytest.approx(2048 / 40)
    assert ag.busbw_gbps == pytest.approx(2048 / 40 / 2)
    assert ag.overlap_pct == pytest.approx(100.0)
    assert ag.inflight_median_s == pytest.approx(40e-9)
    assert df.formula[0] == analysis.OVERLAP_FORMULA and "overlap_pct" in df.attrs["formulas"]
    by_phase = comm_table(hand, by=("op", "axis", "phase"))
    assert list(by_phase.phase) == ["forward", "forward"]
    with pytest.raises(ValueError):
        comm_table(hand, by=("op", "rank"))


def test_step_level_breakdown_and_empty_comm_table(tmp_path):
    trace = load_trace(write_trace(tmp_path / "lvl.h5", hand_events(), world=2, level="step"))
    df = breakdown(trace)
    assert list(df.category) == ["compute", "exposed_comm", "other"]
    assert set(df.axis) == {"all"} and set(df.phase) == {"all"}
    assert list(df.share) == pytest.approx([2200 / 9500, 2000 / 9500, 5300 / 9500])
    assert list(df.seconds_per_step * 1e9) == pytest.approx([2750 * 2200 / 9500, 2750 * 2000 / 9500,
                                                             2750 * 5300 / 9500])
    assert df.share.sum() == pytest.approx(1.0)
    assert comm_table(trace).empty and list(comm_table(trace).columns) == COMM_COLUMNS
    assert runs_table([trace]).level[0] == "step"


@pytest.fixture(scope="module")
def scaling_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("scaling")
    g = lambda x, y=1, z=1: {"data": 1, "z": z, "y": y, "x": x}  # noqa: E731
    paths = [
        # weak: 32 tokens per rank; 1000, 1250, 2000 ns
        step_trace(d / "weak2.h5", 2, 1000, 64, g(2), label="weak"),
        step_trace(d / "weak4.h5", 4, 1250, 128, g(4), label="weak"),
        step_trace(d / "weak8.h5", 8, 2000, 256, g(8), label="weak"),
        # not weak: tokens per rank 32, 16
        step_trace(d / "bad2.h5", 2, 1000, 64, g(2), label="bad"),
        step_trace(d / "bad4.h5", 4, 900, 64, g(4), label="bad"),
        # strong: 64 tokens; 1000, 600, 400 ns
        step_trace(d / "strong2.h5", 2, 1000, 64, g(2), label="strong"),
        step_trace(d / "strong4.h5", 4, 600, 64, g(4), label="strong"),
        step_trace(d / "strong8.h5", 8, 400, 64, g(8), label="strong"),
        # compare, 8 ranks, 256 tokens
        step_trace(d / "cmp-a.h5", 8, 2000, 256, g(2, 2, 2), label="cmp"),
        step_trace(d / "cmp-b.h5", 8, 1600, 256, g(4, 2), label="cmp", overlap="oag,ors"),
        step_trace(d / "cmp-c.h5", 8, 2400, 256, g(8), label="cmp", progress="thread"),
    ]
    traces, problems = collect([str(d)])
    assert problems == [] and len(traces) == len(paths)
    return runs_table(traces)


def test_scaling_weak(scaling_runs):
    df = scaling(scaling_runs, "weak")
    assert list(df.columns) == SCALING_COLUMNS
    weak = df[df.config_key == "gpt-tiny/none/poll/weak"]
    assert list(weak.world_size) == [2, 4, 8]
    assert list(weak.step_median_s) == pytest.approx([1e-6, 1.25e-6, 2e-6])
    assert list(weak.efficiency) == pytest.approx([1, 0.8, 0.5])
    assert list(weak.speedup) == pytest.approx([1, 1.6, 2.0])
    assert list(weak.ideal_step_s) == pytest.approx([1e-6] * 3)
    assert list(weak.grid) == ["1x1x1x2", "1x1x1x4", "1x1x1x8"]
    assert "gpt-tiny/none/poll/bad" not in set(df.config_key)
    reasons = dict(df.attrs["dropped"])
    assert "same tokens per rank" in reasons["gpt-tiny/none/poll/bad"]
    assert "16, 32" in reasons["gpt-tiny/none/poll/bad"]


def test_scaling_strong(scaling_runs):
    df = scaling(scaling_runs, "strong")
    strong = df[df.config_key == "gpt-tiny/none/poll/strong"]
    assert list(strong.world_size) == [2, 4, 8]
    assert list(strong.speedup) == pytest.approx([1, 1000 / 600, 2.5])
    assert list(strong.efficiency) == pytest.approx([1, 1000 / 600 / 2, 2.5 / 4])
    assert list(strong.ideal_step_s) == pytest.approx([1e-6, 0.5e-6, 0.25e-6])
    assert set(strong.group) == {"gpt-tiny/none/poll/strong/tokens=64"}
    # "bad" (same total work, fewer tokens per rank) is no weak line but a fine strong one
    bad = df[df.config_key == "gpt-tiny/none/poll/bad"]
    assert list(bad.speedup) == pytest.approx([1, 1000 / 900])
    # grouped by the total work too: the weak runs (different batches) are one-run groups, no lines
    assert (df.config_key == "gpt-tiny/none/poll/weak").sum() == 0
    reasons = dict(df.attrs["dropped"])
    assert sorted(g for g in reasons if g.startswith("gpt-tiny/none/poll/weak/")) == [
        f"gpt-tiny/none/poll/weak/tokens={t}" for t in (128, 256, 64)]
    assert all("one rank count only" in reasons[g] for g in reasons if "/weak/" in g)
    with pytest.raises(ValueError):
        scaling(scaling_runs, "sideways")


def test_compare(scaling_runs):
    df = compare(scaling_runs[scaling_runs.label == "cmp"])
    assert list(df.columns) == COMPARE_COLUMNS
    assert list(df.grid) == ["1x1x2x4", "1x2x2x2", "1x1x1x8"]
    assert list(df.overlap) == ["oag,ors", "none", "none"]
    assert list(df.progress) == ["poll", "poll", "thread"]
    assert list(df.vs_best) == pytest.approx([1.0, 1.25, 1.5])
    everything = compare(scaling_runs)
    for _, group in everything.groupby(["model", "world_size", "tokens_per_step"]):
        assert group.vs_best.min() == pytest.approx(1.0)
        assert list(group.step_median_s) == sorted(group.step_median_s)


def test_format_table_all_formats(hand):
    df = runs_table([hand])
    text = format_table(df, "table")
    lines = text.splitlines()
    assert lines[0].split() == RUN_COLUMNS and set(lines[1]) <= {"-", " "}
    assert "2.75e-06" in text and "hand-run" in text
    csv = format_table(df, "csv")
    assert csv.splitlines()[0] == ",".join(RUN_COLUMNS)
    records = json.loads(format_table(df, "json"))
    assert records[0]["step_median_s"] == pytest.approx(2.75e-6) and records[0]["world_size"] == 2
    nan_json = json.loads(format_table(pd.DataFrame({"a": [float("nan")]}), "json"))
    assert nan_json == [{"a": None}]
    md = format_table(breakdown(hand), "markdown").splitlines()
    assert md[0].startswith("| run_id") and md[1].startswith("|") and "---" in md[1]
    assert len(md) == 2 + len(breakdown(hand))
    assert "-" in format_table(pd.DataFrame({"x": [float("nan"), 1.5]}), "table").splitlines()[2]
    with pytest.raises(ValueError):
        format_table(df, "xml")


# ---------------------------------------------------------------------------
# bad files
# ---------------------------------------------------------------------------

def test_collect_names_every_bad_file(tmp_path):
    good_dir = tmp_path / "mixed"
    good_dir.mkdir()
    good = write_trace(good_dir / "a-good.h5", hand_events(), world=2)
    write_trace(good_dir / "b-good.h5", hand_events(), world=2, label="b")
    raw = open(good, "rb").read()
    (good_dir / "c-truncated.h5").write_bytes(raw[: len(raw) // 2])
    (good_dir / "d-corrupted.h5").write_bytes(b"\0" * 1024 + raw[1024:])
    shutil.copy(good, good_dir / "e-future.h5")
    with h5py.File(good_dir / "e-future.h5", "r+") as f:
        f.attrs["schema_version"] = 99
    (good_dir / "notes.txt").write_text("not a trace, not *.h5: ignored")
    (good_dir / "f-empty.h5").write_bytes(b"")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()

    traces, problems = collect([str(good_dir), str(good_dir / "a-good.h5"), str(empty_dir),
                                str(tmp_path / "missing.h5"), str(tmp_path / "nothing*.h5")])
    assert [os.path.basename(t.path) for t in traces] == ["a-good.h5", "b-good.h5"]
    reasons = {os.path.basename(p): r for p, r in problems}
    assert set(reasons) == {"c-truncated.h5", "d-corrupted.h5", "e-future.h5", "f-empty.h5", "empty",
                            "missing.h5", "nothing*.h5"}
    for name in ("c-truncated.h5", "d-corrupted.h5", "f-empty.h5"):
        assert name in reasons[name] and "not a readable HDF5 file" in reasons[name], reasons[name]
    assert "schema v99" in reasons["e-future.h5"]
    assert "no *.h5" in reasons["empty"]
    assert "no such file" in reasons["missing.h5"]
    assert "no file matches" in reasons["nothing*.h5"]
    # globs, and a single path given as a string
    by_glob, none = collect(str(good_dir / "?-good.h5"))
    assert len(by_glob) == 2 and none == []


# ---------------------------------------------------------------------------
# real traces
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real(tmp_path_factory):
    from conftest import mpirun

    results = tmp_path_factory.mktemp("real")
    runs = [(2, ["--gx", "2", "--batch", "4", "--label", "weak"]),
            (4, ["--gx", "4", "--batch", "8", "--label", "weak"]),
            (8, ["--gx", "8", "--batch", "16", "--label", "weak"]),
            (4, ["--gx", "2", "--gz", "2", "--batch", "8", "--overlap", "all", "--label", "ovl"]),
            (4, ["--gdata", "2", "--gy", "2", "--batch", "8", "--trace-level", "layer", "--label", "lyr"])]
    for nranks, args in runs:
        proc = mpirun(nranks, ["run", "--results-dir", results, "--display", "quiet", "--peak-tflops", "1",
                               "--steps", "4", *args], timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    traces, problems = collect(str(results))
    assert problems == [] and len(traces) == len(runs)
    return traces


@pytest.mark.mpi
def test_real_runs_table_agrees_with_the_stored_summary(real):
    df = runs_table(real)
    assert list(df.columns) == RUN_COLUMNS and len(df) == 5
    for trace, row in zip(real, df.itertuples()):
        s = trace.metadata["summary"]
        assert row.step_median_s == pytest.approx(s["median_s"], rel=1e-12)
        assert (row.step_min_s, row.step_max_s, row.step_q1_s, row.step_q3_s) == pytest.approx(
            (s["min_s"], s["max_s"], s["q1_s"], s["q3_s"]), rel=1e-12)
        assert (row.compute_share, row.wait_share, row.other_share) == pytest.approx(
            (s["compute_share"], s["wait_share"], s["other_share"]), rel=1e-12)
        assert row.tflops_per_rank == pytest.approx(s["model_tflops_per_rank"], rel=1e-12)
        assert row.mfu_pct == pytest.approx(s["mfu_pct"], rel=1e-12)
        assert row.gemm_pct == pytest.approx(s["gemm_pct"], rel=1e-12) and row.gemm_tflops == s["gemm_tflops"] > 0
        assert row.tokens_per_s == pytest.approx(s["tokens_per_s"], rel=1e-12)
        assert row.steps == s["steps"] == 3 and row.imbalance >= 1.0
        assert row.world_size == trace.world_size and row.peak_tflops == 1.0
    assert set(df.config_key) == {"gpt-tiny/none/poll/weak", "gpt-tiny/oag,ors,oar,dp,od,oup/poll/ovl",
                                  "gpt-tiny/none/poll/lyr"}


@pytest.mark.mpi
def test_real_breakdown_shares_sum_to_one(real):
    for trace in real:
        df = breakdown(trace)
        assert df.share.sum() == pytest.approx(1.0)
        assert (df.seconds_per_step[df.category != "other"] >= 0).all()
        row = runs_table([trace]).iloc[0]
        if trace.metadata["level"] == "op":
            assert set(df.category) - {"exposed_comm", "other"} <= set(COMPUTE_OPS)
            assert set(df.axis[df.category == "exposed_comm"]) <= {"x", "y", "z", "data"}
            compute = df.share[~df.category.isin(["exposed_comm", "other"])].sum()
            assert compute == pytest.approx(row.compute_share, rel=1e-9)
            assert df.share[df.category == "exposed_comm"].sum() == pytest.approx(row.wait_share, rel=1e-9)
        else:
            assert list(df.category) == ["compute", "exposed_comm", "other"]
            assert list(df.share[:2]) == pytest.approx([row.compute_share, row.wait_share], rel=1e-9)


@pytest.mark.mpi
def test_real_comm_table_matches_the_events(real):
    for trace in real:
        df = comm_table(trace)
        if trace.metadata["level"] != "op":
            assert df.empty
            continue
        ev = trace.events_frame()
        measured = set(trace.rank_steps["step"][trace.rank_steps["warmup"] == 0].tolist())
        coll = ev[ev.step.isin(measured) & ev.lane.astype(str).str.startswith("comm")]
        records = trace.world_size * len(measured)
        sums = coll.groupby(["op", "axis"], observed=True).agg(n=("bytes", "size"), b=("bytes", "sum"),
                                                                w=("wire_bytes", "sum"), wait=("wait_ns", "sum"))
        assert len(df) == len(sums)
        grid = trace.metadata["run_options"]["grid"]
        for row in df.itertuples():
            s = sums.loc[(row.op, row.axis)]
            assert row.messages_per_step == pytest.approx(s.n / records)
            assert row.bytes_per_step == pytest.approx(s.b / records)
            assert row.wire_bytes_per_step == pytest.approx(s.w / records)
            assert row.group_size == grid[row.axis] > 1
            k = 2 if row.op == "allreduce" else 1
            assert row.busbw_gbps == pytest.approx(row.algbw_gbps * k * (row.group_size - 1) / row.group_size)
            assert 0 <= row.overlap_pct <= 100
        # exposed communication: the waits of the collectives are the wait events of the breakdown
        # (comm: per rank and step, mean over the records; breakdown: share of the records' spans)
        waits = breakdown(trace)
        rs = trace.rank_steps[trace.rank_steps["warmup"] == 0]
        mean_span = float((rs["end_ns"] - rs["start_ns"]).mean()) * 1e-9
        assert (df.wait_s_per_step.sum() == pytest.approx(waits.share[waits.category == "exposed_comm"].sum()
                                                          * mean_span, rel=1e-9))


@pytest.mark.mpi
def test_real_weak_scaling_and_compare(real):
    runs = runs_table(real)
    df = scaling(runs, "weak")
    weak = df[df.config_key == "gpt-tiny/none/poll/weak"]
    assert list(weak.world_size) == [2, 4, 8] and weak.efficiency.iloc[0] == pytest.approx(1.0)
    assert list(weak.efficiency) == pytest.approx(list(weak.step_median_s.iloc[0] / weak.step_median_s))
    assert all("one rank count only" in why for _, why in df.attrs["dropped"])  # the single-size series
    cmp = compare(runs)
    four = cmp[(cmp.world_size == 4) & (cmp.tokens_per_step == 128)]
    assert len(four) == 3 and four.vs_best.iloc[0] == 1.0 and list(four.vs_best) == sorted(four.vs_best)
    for fmt in analysis.FORMATS:
        assert format_table(cmp, fmt)
