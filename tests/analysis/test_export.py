"""fourd_mpi.analysis.export on a real 8-rank trace: Perfetto JSON structure, Caliper JSON read by Hatchet and
Thicket."""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections import Counter, defaultdict

import numpy as np
import pytest
from conftest import mpirun

from fourd_mpi.analysis.export import (
    collective_instances,
    perfetto_ids,
    rank_coordinates,
    to_caliper_json,
    to_perfetto,
    write_caliper_json,
    write_perfetto,
)
from fourd_mpi.trace.events import LANE_COMM0, LANE_HOST, LANE_STEP, lane_name
from fourd_mpi.trace.read import load_trace

pytestmark = pytest.mark.mpi

RANKS = 8
STEPS = 3  # step 0 is warm-up (--warmup defaults to 1)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """An op-level trace of 8 ranks (2x2x2), 3 steps, every overlap option on: collectives in flight together."""
    results = tmp_path_factory.mktemp("export")
    proc = mpirun(RANKS, ["run", "--gx", 2, "--gy", 2, "--gz", 2, "--steps", STEPS, "--overlap", "all",
                          "--results-dir", results, "--display", "lines", "--peak-tflops", 1], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the run prints "trace: level op, ..." at the start and "trace: PATH" at the end
    paths = [line.split("trace:", 1)[1].strip() for line in proc.stdout.splitlines()
             if line.startswith("trace: ") and line.rstrip().endswith(".h5")]
    assert len(paths) == 1, proc.stdout
    loaded = load_trace(paths[0])
    assert (loaded.steps["warmup"] == 1).sum() == 1
    return loaded


@pytest.fixture(scope="module")
def perfetto(trace):
    return to_perfetto(trace)


def _by_phase(events, phase):
    return [e for e in events if e["ph"] == phase]


def _measured_steps(trace):
    return trace.steps["step"][trace.steps["warmup"] == 0]


def _ns(us):
    """A JSON time as Perfetto's importer reads it: microseconds times 1000, truncated to ns."""
    return int(us * 1000.0)


def _rank_lane(trace):
    """(pid, tid) of the export -> (rank, lane) of the trace."""
    out = {}
    for rank in range(RANKS):
        for lane in range(256):
            out[perfetto_ids(rank), int(perfetto_ids(rank, lane))] = (rank, lane)
    return out


# ----------------------------------------------------------------------------- Perfetto

def test_perfetto_top_level(trace, perfetto):
    assert perfetto["displayTimeUnit"] == "ns"
    meta = perfetto["metadata"]
    assert meta["run_id"] == trace.metadata["run_id"]
    assert (meta["grid"], meta["world_size"], meta["status"]) == ("1x2x2x2", RANKS, "complete")
    phases = {e["ph"] for e in perfetto["traceEvents"]}
    assert {"M", "X", "s", "f"} <= phases <= {"M", "X", "s", "t", "f"}  # "t" only on axes of > 2 ranks


#: the Chrome trace-event JSON format, for the events this exporter writes
EVENT_SCHEMA = {
    "type": "object",
    "required": ["ph", "pid"],
    "properties": {
        "ph": {"enum": ["M", "X", "s", "t", "f"]},
        "pid": {"type": "integer", "minimum": 1}, "tid": {"type": "integer", "minimum": 1},
        "name": {"type": "string"}, "cat": {"type": "string"}, "args": {"type": "object"},
        "ts": {"type": "number", "minimum": 0}, "dur": {"type": "number", "minimum": 0}, "id": {"type": "integer"},
        "bp": {"const": "e"},
    },
    "allOf": [
        {"if": {"properties": {"ph": {"const": "X"}}},
         "then": {"required": ["name", "cat", "ts", "dur", "args", "tid"]}},
        {"if": {"properties": {"ph": {"enum": ["s", "t", "f"]}}},
         "then": {"required": ["name", "cat", "id", "ts", "tid"]}},
        {"if": {"properties": {"ph": {"const": "f"}}}, "then": {"required": ["bp"]}},
        {"if": {"properties": {"ph": {"const": "M"}}}, "then": {
            "required": ["name", "args"],
            "properties": {"name": {"enum": ["process_name", "process_sort_index", "thread_name",
                                             "thread_sort_index"]}},
            "allOf": [
                {"if": {"properties": {"name": {"enum": ["thread_name", "thread_sort_index"]}}},
                 "then": {"required": ["tid"]}},
                {"if": {"properties": {"name": {"enum": ["process_name", "thread_name"]}}},
                 "then": {"properties": {"args": {"required": ["name"], "properties": {"name": {"type": "string"}}}}}},
                {"if": {"properties": {"name": {"enum": ["process_sort_index", "thread_sort_index"]}}},
                 "then": {"properties": {"args": {"required": ["sort_index"],
                                                  "properties": {"sort_index": {"type": "integer"}}}}}},
            ]}},
    ],
}


def test_perfetto_events_match_the_trace_event_schema(perfetto):
    import jsonschema

    validator = jsonschema.Draft202012Validator(EVENT_SCHEMA)
    for event in perfetto["traceEvents"]:
        validator.validate(event)


def test_perfetto_ids_avoid_what_perfetto_treats_specially():
    """pid/tid 0 is the kernel's idle task, a tid equal to its pid the process's main thread."""
    tids = {int(perfetto_ids(r, lane)) for r in range(300) for lane in range(256)}
    tids |= {int(perfetto_ids(r, phase_thread=True)) for r in range(300)}
    assert len(tids) == 300 * 257 and min(tids) > 0
    assert all(int(perfetto_ids(r, lane)) != perfetto_ids(r) for r in range(300) for lane in range(256))
    assert perfetto_ids(np.arange(3)).tolist() == [1, 2, 3]


def test_perfetto_processes_and_threads(trace, perfetto):
    meta = _by_phase(perfetto["traceEvents"], "M")
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert names == {r + 1: f"rank {r} ({trace.ranks['hostname'][r].decode()})" for r in range(RANKS)}
    sort = {e["pid"]: e["args"]["sort_index"] for e in meta if e["name"] == "process_sort_index"}
    assert sort == {r + 1: r for r in range(RANKS)}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    thread_sort = {(e["pid"], e["tid"]): e["args"]["sort_index"] for e in meta if e["name"] == "thread_sort_index"}
    assert set(thread_sort) == set(threads)
    for rank in range(RANKS):
        mine = sorted((thread_sort[key], key[1], name) for key, name in threads.items() if key[0] == rank + 1)
        ordered = [name for _, _, name in mine]
        assert ordered[:4] == ["step", "phase", "layer", "host"]
        assert ordered[4:] == [f"comm{i}" for i in range(len(ordered) - 4)] and len(ordered) > 4
        assert [tid for _, tid, _ in mine] == sorted(tid for _, tid, _ in mine)  # tids in the same order
    used = {(e["pid"], e["tid"]) for e in perfetto["traceEvents"] if e["ph"] != "M"}
    assert used == set(threads)


def test_perfetto_slices_per_thread_equal_events_per_lane(trace, perfetto):
    """What a trace processor query of slices per thread gives: one X slice per trace event
    on each (rank, lane), named after the lane; the phase thread aside."""
    x = _by_phase(perfetto["traceEvents"], "X")
    to_lane = _rank_lane(trace)
    per_thread = Counter(to_lane[e["pid"], e["tid"]] for e in x if e["cat"] != "phase")
    assert per_thread == Counter(zip(trace.events["rank"].tolist(), trace.events["lane"].tolist()))
    thread_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in perfetto["traceEvents"]
                    if e["name"] == "thread_name"}
    for (pid, tid), name in thread_names.items():
        if name != "phase":
            assert name == lane_name(to_lane[pid, tid][1])
    comm = [e for e in x if to_lane.get((e["pid"], e["tid"]), (0, 0))[1] >= LANE_COMM0]
    assert len(comm) == int((trace.events["lane"] >= LANE_COMM0).sum()) > 0 and {e["cat"] for e in comm} == {"comm"}
    host = trace.events[trace.events["lane"] == LANE_HOST]
    x_names = Counter(e["name"].split()[0] for e in x if thread_names[e["pid"], e["tid"]] == "host")
    assert x_names == Counter(trace.decode("op", host["op"]).tolist())
    steps = sorted(e["name"] for e in x if thread_names[e["pid"], e["tid"]] == "step")
    assert steps == sorted(f"step {s}" for s in trace.events["step"][trace.events["lane"] == LANE_STEP].tolist())


def test_perfetto_times_read_back_as_the_trace_nanoseconds(trace, perfetto):
    """As Perfetto reads them (us * 1000, truncated), starts are the trace's exact ns, and so are ends
    (but for the <= 1 ns trimmed off an event that touches its successor)."""
    events = [e for e in _by_phase(perfetto["traceEvents"], "X") if e["cat"] != "phase"]
    to_lane = _rank_lane(trace)
    ev = trace.events
    got = sorted((*to_lane[e["pid"], e["tid"]], _ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"])) for e in events)
    want = sorted(zip(ev["rank"].tolist(), ev["lane"].tolist(), ev["start_ns"].tolist(), ev["end_ns"].tolist()))
    assert [g[:3] for g in got] == [w[:3] for w in want]
    assert all(0 <= w[3] - g[3] <= 1 for g, w in zip(got, want))


def test_us_reads_back_exactly():
    from fourd_mpi.analysis.export.perfetto import _us

    ns = np.random.default_rng(0).integers(0, 10 ** 13, 200_000)
    us = _us(ns)
    assert (np.trunc(us * 1000.0).astype(np.int64) == ns).all()
    assert np.allclose(us, ns / 1000, rtol=1e-15, atol=0)
    assert [_ns(v) for v in json.loads(json.dumps(us[:1000].tolist()))] == ns[:1000].tolist()


def test_perfetto_collectives_are_complete_events_with_their_accounting(perfetto):
    comm = [e for e in _by_phase(perfetto["traceEvents"], "X") if e["cat"] == "comm"]
    collectives = [e for e in comm if e["name"].split()[0] in ("allgather", "reduce_scatter", "allreduce")]
    assert collectives
    for e in collectives:
        assert e["name"].split()[1] in ("data", "z", "y", "x")
        assert {"bytes", "wire_bytes", "wait_ns", "mpi_ns", "overlap_ns", "call_return_ns"} <= set(e["args"])
        assert e["args"]["bytes"] > 0


def test_rank_coordinates_from_the_grid_match_the_recorded_ones(trace):
    coords = rank_coordinates(trace)
    for axis in ("data", "z", "y", "x"):
        assert coords[axis][trace.ranks["rank"]].tolist() == trace.ranks[f"coord_{axis}"].tolist()
    # without a usable grid in the metadata: the recorded coordinates
    broken = dataclasses.replace(trace, metadata={**trace.metadata, "grid": "?", "run_options": {}})
    fallback = rank_coordinates(broken)
    assert all(fallback[a].tolist() == coords[a].tolist() for a in coords)


def test_collective_instances_group_one_collective_over_its_communicator(trace):
    ev = trace.events
    ids = collective_instances(trace, ev)
    coll = np.isin(trace.decode("op", ev["op"]), ["allgather", "reduce_scatter", "allreduce"])
    assert (ids[coll] >= 0).all() and (ids[~coll] == -1).all()
    sizes = {"data": 1, "z": 2, "y": 2, "x": 2}
    coords = rank_coordinates(trace)
    for instance in np.unique(ids[coll]).tolist():
        piece = ev[ids == instance]
        axis = trace.decode("axis", piece["axis"][:1])[0]
        assert len(piece) == sizes[axis] == len(np.unique(piece["rank"]))  # each rank of the communicator once
        assert len(np.unique(piece["step"])) == len(np.unique(piece["op"])) == len(np.unique(piece["bytes"])) == 1
        for other in ("data", "z", "y", "x"):
            if other != axis:
                assert len(np.unique(coords[other][piece["rank"]])) == 1
        assert len(np.unique(coords[axis][piece["rank"]])) == sizes[axis]


def test_perfetto_flows_link_one_collective_across_its_ranks(trace, perfetto):
    """Every flow id, read in time order as Perfetto does: "s", then "t"s, then "f", at strictly increasing
    times, each strictly inside a comm slice of the same collective on its thread; one piece per rank
    of the axis communicator."""
    flows = defaultdict(list)
    for e in perfetto["traceEvents"]:
        if e["ph"] in ("s", "t", "f"):
            flows[e["id"]].append(e)
    assert flows
    sizes = {"data": 1, "z": 2, "y": 2, "x": 2}
    slices = defaultdict(list)
    for e in _by_phase(perfetto["traceEvents"], "X"):
        slices[e["pid"], e["tid"]].append(e)
    coll = ~np.isin(trace.decode("op", trace.events["op"]), ["d2h", "h2d"]) & (trace.events["lane"] >= LANE_COMM0)
    assert len(flows) * 2 == int(coll.sum())  # every collective instance (2 ranks each here) has its flow
    for pieces in flows.values():
        pieces.sort(key=lambda e: _ns(e["ts"]))
        times = [_ns(p["ts"]) for p in pieces]
        assert times == sorted(set(times))
        assert [p["ph"] for p in pieces] == ["s"] + ["t"] * (len(pieces) - 2) + ["f"]
        assert pieces[-1]["bp"] == "e"
        op, axis = pieces[0]["name"].split()
        assert len(pieces) == sizes[axis] and len({p["name"] for p in pieces}) == 1
        assert len({p["pid"] for p in pieces}) == len(pieces) and {p["cat"] for p in pieces} == {"collective"}
        steps = set()
        for p in pieces:  # bound to a comm slice of the same collective on its thread
            t = _ns(p["ts"])
            enclosing = [x for x in slices[p["pid"], p["tid"]]
                         if _ns(x["ts"]) < t < _ns(x["ts"]) + _ns(x["dur"])]
            assert len(enclosing) == 1 and enclosing[0]["name"] == p["name"] and enclosing[0]["cat"] == "comm"
            steps.add(enclosing[0]["args"]["step"])
        assert len(steps) == 1


def test_flow_points_are_ordered_inside_their_slices():
    from fourd_mpi.analysis.export.perfetto import _flow_points

    # middles out of rank order, a tie, and a slice too short to follow the others
    start = np.array([100, 0, 40, 40, 50])
    end = np.array([200, 100, 80, 80, 50])
    order, points = _flow_points(start, end)
    assert order.tolist() == [1, 2, 3, 0] and points.tolist() == [50, 60, 61, 150]
    assert all(start[i] < p < end[i] for i, p in zip(order.tolist(), points.tolist()))
    order, points = _flow_points(np.array([5]), np.array([5]))
    assert order.tolist() == [0] and points.tolist() == [5]


def test_perfetto_names_are_searchable(trace, perfetto):
    x = _by_phase(perfetto["traceEvents"], "X")
    layers = [e for e in x if e["cat"] == "layer"]
    assert layers and all(e["name"].startswith("layer ") for e in layers)
    first = layers[0]
    code = trace.vocab["layers"].index(first["args"]["layer"])
    assert first["name"] == f"layer {code} {first['args']['phase']} ({first['args']['layer']})"
    assert any(e["name"].startswith("layer ") and " backward (" in e["name"] for e in layers)
    assert any(e["name"] == "step 1" for e in x if e["cat"] == "step")
    phases = {e["name"].split()[-1] for e in x if e["cat"] == "phase"}
    assert {"forward", "backward"} <= phases


def test_perfetto_collectives_overlap_compute(perfetto):
    """With overlap on, collectives are in flight during host work (on their own threads)."""
    x = _by_phase(perfetto["traceEvents"], "X")
    flights = [(e["pid"], e["ts"], e["ts"] + e["dur"]) for e in x if e["cat"] == "comm"]
    gemms = [(e["pid"], e["ts"], e["ts"] + e["dur"]) for e in x if e["name"] == "gemm"]
    overlapped = sum(1 for pid, t0, t1 in gemms if any(p == pid and b < t0 and t1 < e for p, b, e in flights))
    assert overlapped > 0


def test_comm_lanes_never_overlap(trace):
    """The recorder's lane packing: collectives on one comm lane of a rank are disjoint in time
    (docs/trace-format.md section 8, 1 ns rounding slack)."""
    ev = trace.events[trace.events["lane"] >= LANE_COMM0]
    order = np.lexsort((ev["start_ns"], ev["lane"], ev["rank"]))
    ev = ev[order]
    same = (ev["rank"][1:] == ev["rank"][:-1]) & (ev["lane"][1:] == ev["lane"][:-1])
    assert same.any() and (ev["end_ns"][:-1][same] - ev["start_ns"][1:][same] <= 1).all()
    assert len(np.unique(ev["lane"])) > 1  # collectives were in flight together


def test_perfetto_complete_events_do_not_overlap(perfetto):
    """On every thread, as Perfetto reads the times: slices disjoint (so none is dropped or nested)."""
    per_thread = defaultdict(list)
    for e in _by_phase(perfetto["traceEvents"], "X"):
        assert e["dur"] >= 0
        per_thread[e["pid"], e["tid"]].append((_ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"])))
    for spans in per_thread.values():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start


def test_perfetto_args(perfetto):
    x = _by_phase(perfetto["traceEvents"], "X")
    gemm = next(e for e in x if e["name"] == "gemm")
    assert gemm["args"]["flops"] > 0 and gemm["args"]["phase"] in ("forward", "backward") and "layer" in gemm["args"]
    wait = next(e for e in x if e["name"].startswith("wait "))
    assert wait["args"]["bytes"] > 0 and wait["args"]["axis"] in ("data", "z", "y", "x")


def test_perfetto_filter_steps_and_ranks(trace):
    doc = to_perfetto(trace, steps=[1], ranks=iter([0, 3]))  # any iterable
    body = [e for e in doc["traceEvents"] if e["ph"] != "M"]
    assert {e["pid"] for e in doc["traceEvents"]} == {1, 4}
    assert {e["args"]["step"] for e in body if "args" in e} == {1}
    ev = trace.events
    kept = ev[(ev["step"] == 1) & np.isin(ev["rank"], [0, 3])]
    assert len([e for e in _by_phase(body, "X") if e["cat"] != "phase"]) == len(kept)
    with pytest.raises(ValueError, match="ranks"):
        to_perfetto(trace, ranks=[RANKS])
    with pytest.raises(ValueError, match="steps"):
        to_perfetto(trace, steps=[STEPS])


@pytest.mark.parametrize("name", ["trace.json", "trace.json.gz"])
def test_write_perfetto_round_trip(trace, tmp_path, name):
    path = tmp_path / name
    write_perfetto(trace, str(path), steps=[2])
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rt") as f:
        written = json.load(f)
    assert written == json.loads(json.dumps(to_perfetto(trace, steps=[2])))


def _trace_processor_binary():
    """A trace_processor_shell binary: $PERFETTO_TRACE_PROCESSOR, on PATH, or in the perfetto package's
    download cache (its own download needs network access, which tests do not assume)."""
    import glob
    import os
    import shutil

    found = os.environ.get("PERFETTO_TRACE_PROCESSOR") or shutil.which("trace_processor_shell") \
        or shutil.which("trace_processor")
    if not found:
        cached = sorted(glob.glob(os.path.expanduser("~/.local/share/perfetto/prebuilts/trace_processor_shell*")))
        found = next((c for c in cached if not c.endswith(".tmp") and os.access(c, os.X_OK)), None)
    return found


def trace_processor_or_skip():
    """``(perfetto.trace_processor, binary path)``, or a skip saying what is missing."""
    tp_api = pytest.importorskip("perfetto.trace_processor", reason="the perfetto package is not installed")
    binary = _trace_processor_binary()
    if binary is None:
        pytest.skip("no trace_processor_shell binary (set PERFETTO_TRACE_PROCESSOR or put it on PATH; "
                    "the perfetto package would download it, which needs network access)")
    return tp_api, binary


def test_perfetto_trace_processor_reads_the_export(trace, tmp_path):
    """Perfetto's own importer: slices per thread equal the trace's events per lane, the flows
    link the collective pieces, and nothing is dropped (import stats)."""
    tp_api, binary = trace_processor_or_skip()
    path = tmp_path / "trace.json"
    write_perfetto(trace, str(path))
    tp = tp_api.TraceProcessor(trace=str(path), config=tp_api.TraceProcessorConfig(bin_path=binary))
    try:
        rows = tp.query("select thread.tid as tid, count(*) as n from slice "
                        "join thread_track on slice.track_id = thread_track.id "
                        "join thread on thread_track.utid = thread.utid group by thread.tid").as_pandas_dataframe()
        flows = tp.query("select count(*) as n from flow").as_pandas_dataframe()
        names = tp.query("select tid, name from thread where tid > 0").as_pandas_dataframe()
        stats = tp.query("select name, value from stats where value > 0 and (name like 'flow%' or name in "
                         "('misplaced_end_event', 'json_parser_failure', 'json_tokenizer_failure'))"
                         ).as_pandas_dataframe()
    finally:
        tp.close()
    ev = trace.events
    want = Counter(int(perfetto_ids(int(r), int(lane))) for r, lane in zip(ev["rank"], ev["lane"]))
    got = dict(zip(rows["tid"].tolist(), rows["n"].tolist()))
    for tid, n in want.items():
        assert got[tid] == n
    coll = ~np.isin(trace.decode("op", ev["op"]), ["d2h", "h2d"]) & (ev["lane"] >= LANE_COMM0)
    assert int(flows["n"][0]) == int(coll.sum()) // 2  # one arrow per 2-rank instance
    assert {"step", "phase", "layer", "host", "comm0"} <= set(names["name"])
    assert stats.empty, stats


# ----------------------------------------------------------------------------- Caliper JSON

@pytest.fixture(scope="module")
def profile(trace):
    return to_caliper_json(trace)


def _host_seconds_per_step(trace, steps):
    """Hand-computed: each rank's host-lane time (compute ops + waits) per step, in seconds."""
    ev = trace.events
    host = ev[(ev["lane"] == LANE_HOST) & np.isin(ev["step"], steps)]
    total = np.bincount(host["rank"], weights=(host["end_ns"] - host["start_ns"]).astype(float), minlength=RANKS)
    return total / len(steps) / 1e9


def _node_paths(profile):
    nodes = profile["nodes"]

    def path(i):
        node = nodes[i]
        return (path(node["parent"]) if "parent" in node else ()) + (node["label"],)

    return [path(i) for i in range(len(nodes))]


def test_caliper_structure(trace, profile):
    assert {"data", "columns", "column_metadata", "nodes"} <= set(profile)
    columns = profile["columns"]
    assert columns[:3] == ["Node order", "path", "mpi.rank"]
    assert {"sum#time.duration", "count", "bytes", "flops"} <= set(columns)
    assert len(profile["column_metadata"]) == len(columns)
    assert all(len(row) == len(columns) for row in profile["data"])
    assert len(profile["data"]) == len(profile["nodes"]) * RANKS
    for key in ("run_id", "grid", "world_size", "model", "overlap", "status"):
        assert isinstance(profile[key], (str, int, float)), key
    assert profile["run_id"] == trace.metadata["run_id"] and profile["world_size"] == RANKS
    assert profile["profiled_steps"] == STEPS - 1
    paths = _node_paths(profile)
    assert paths[0] == ("step",) and all(p[0] == "step" for p in paths)
    # (no phase "none": since trace schema 3 the data is prepared before the steps, no op is outside a phase)
    assert {p[1] for p in paths if len(p) > 1} == {"forward", "backward", "optimizer"}
    assert ("step", "forward", "block0.qkv", "gemm") in paths
    assert ("step", "optimizer", "optimizer") in paths  # an op outside any layer hangs from its phase
    assert ("step", "backward", "block0.qkv", "allreduce data") not in paths  # grid has no data axis
    assert max(len(p) for p in paths) == 4
    json.dumps(profile, allow_nan=False)


def test_caliper_totals_match_the_trace(trace, profile):
    col = {name: i for i, name in enumerate(profile["columns"])}
    rows = np.array(profile["data"], dtype=float)
    per_rank = lambda metric: np.bincount(rows[:, col["mpi.rank"]].astype(int), weights=rows[:, col[metric]])
    steps = _measured_steps(trace)
    expected = _host_seconds_per_step(trace, steps)
    assert np.allclose(per_rank("sum#time.duration"), expected, rtol=1e-12, atol=0)
    # the same from the per-step totals the ranks kept themselves (compute_ns + wait_ns)
    rs = trace.rank_steps[np.isin(trace.rank_steps["step"], steps)]
    kept = np.bincount(rs["rank"], weights=(rs["compute_ns"] + rs["wait_ns"]).astype(float)) / len(steps) / 1e9
    assert np.allclose(per_rank("sum#time.duration"), kept, rtol=1e-9)
    root = rows[rows[:, col["path"]] == 0]
    assert np.allclose(root[np.argsort(root[:, col["mpi.rank"]]), col["inclusive#sum#time.duration"]], expected)
    ev = trace.events[np.isin(trace.events["step"], steps)]
    comm = ev[ev["lane"] >= LANE_COMM0]
    assert np.allclose(per_rank("bytes"), np.bincount(comm["rank"], weights=comm["bytes"]) / len(steps))
    assert np.allclose(per_rank("flops"), np.bincount(ev["rank"], weights=ev["flops"]) / len(steps))
    assert np.allclose(per_rank("count"), np.bincount(ev["rank"]) / len(steps))


def test_caliper_collectives_have_inflight_not_host_time(profile):
    col = {name: i for i, name in enumerate(profile["columns"])}
    labels = [n["label"] for n in profile["nodes"]]
    for row in profile["data"]:
        label = labels[row[col["path"]]]
        if label.split()[0] in ("allgather", "reduce_scatter", "allreduce"):
            assert row[col["sum#time.duration"]] == 0 and row[col["comm.inflight"]] > 0
        else:
            assert row[col["comm.inflight"]] == 0


def test_caliper_include_warmup(trace):
    with_warmup = to_caliper_json(trace, include_warmup=True)
    assert with_warmup["profiled_steps"] == STEPS
    col = with_warmup["columns"].index("sum#time.duration")
    total = np.bincount([r[2] for r in with_warmup["data"]], weights=[r[col] for r in with_warmup["data"]])
    assert np.allclose(total, _host_seconds_per_step(trace, trace.steps["step"]))


def test_caliper_needs_op_level(trace):
    layer_level = dataclasses.replace(trace, metadata={**trace.metadata, "level": "layer"})
    with pytest.raises(ValueError, match="level 'op'"):
        to_caliper_json(layer_level)


def _hatchet_paths(graph):
    """(node, names from the root) for every node, walking down from the roots.

    Hatchet's Caliper reader links nodes with ``add_child`` only, so ``node.parents`` is empty.
    """
    out, todo = [], [(root, (root.frame["name"],)) for root in graph.roots]
    while todo:
        node, path = todo.pop()
        out.append((node, path))
        todo += [(child, path + (child.frame["name"],)) for child in node.children]
    return out


def test_caliper_json_loads_in_hatchet(trace, tmp_path):
    hatchet = pytest.importorskip("hatchet", reason="llnl-hatchet is not installed (pip install llnl-hatchet)")
    path = tmp_path / "profile.json"
    write_caliper_json(trace, str(path))
    gf = hatchet.GraphFrame.from_caliper(str(path))
    assert "time" in gf.exc_metrics and "time (inc)" in gf.inc_metrics
    assert gf.metadata["run_id"] == trace.metadata["run_id"]
    paths = [path for _, path in _hatchet_paths(gf.graph)]
    assert len(gf.graph.roots) == 1 and gf.graph.roots[0].frame["name"] == "step"
    assert ("step", "backward", "block1.fc1", "gemm") in paths
    assert sorted(paths) == sorted(_node_paths(to_caliper_json(trace)))
    df = gf.dataframe.reset_index()
    assert sorted(df["rank"].unique().tolist()) == list(range(RANKS))
    assert len(df) == len(paths) * RANKS
    expected = _host_seconds_per_step(trace, _measured_steps(trace))
    assert np.allclose(df.groupby("rank")["time"].sum().to_numpy(), expected, rtol=1e-12)
    root = df[df["node"] == gf.graph.roots[0]].sort_values("rank")
    assert np.allclose(root["time (inc)"].to_numpy(), expected)


def test_caliper_json_loads_in_thicket(trace, tmp_path):
    thicket = pytest.importorskip("thicket", reason="llnl-thicket is not installed (pip install llnl-thicket)")
    path = tmp_path / "profile.json"
    write_caliper_json(trace, str(path))
    tk = thicket.Thicket.from_caliper(str(path), disable_tqdm=True)
    assert tk.metadata["run_id"].tolist() == [trace.metadata["run_id"]]
    assert tk.metadata["grid"].tolist() == ["1x2x2x2"]
    assert tk.metadata["jobsize"].tolist() == [RANKS] and tk.metadata["numhosts"].tolist() == [1]  # Adiak's names
    df = tk.dataframe.reset_index()
    assert sorted(df["rank"].unique().tolist()) == list(range(RANKS))
    expected = _host_seconds_per_step(trace, _measured_steps(trace))
    assert np.allclose(df.groupby("rank")["time"].sum().to_numpy(), expected, rtol=1e-12)
    depths = {len(path) for _, path in _hatchet_paths(tk.graph)}
    assert depths == {1, 2, 3, 4}


# ----------------------------------------------------------------------------- Adiak names

@pytest.mark.parametrize("host, cluster", [("quartz1234.llnl.gov", "quartz"), ("nid001234", "nid"),
                                           ("lassen708", "lassen"), ("vm", "vm"), ("", "")])
def test_adiak_cluster_follows_adiaks_rule(host, cluster):
    from fourd_mpi.analysis.export import adiak_cluster

    assert adiak_cluster(host) == cluster


def test_caliper_metadata_carries_adiaks_names():
    """jobsize, numhosts, hostname, cluster, user, launchdate (Adiak's adiak_collect_all names) next to
    our own keys, from a committed real trace (results/baselines)."""
    import datetime

    from conftest import REPO

    from fourd_mpi.analysis.export.thicket import _caliper_run_metadata

    trace = load_trace(str(REPO / "results" / "baselines" / "baseline-gpt-tiny-np2.h5"))
    trace.metadata["user"] = "alice"  # recorded by runs from this version on
    meta = _caliper_run_metadata(trace, [2, 3])
    start = datetime.datetime.fromisoformat(trace.metadata["start_time"])
    assert meta["jobsize"] == meta["world_size"] == 2 and meta["numhosts"] == meta["num_nodes"] == 1
    assert meta["hostname"] == meta["launch_host"] == trace.metadata["launch_host"]
    assert meta["cluster"] == "".join(c for c in meta["hostname"].split(".")[0] if not c.isdigit())
    assert meta["user"] == "alice" and meta["launchdate"] == int(start.timestamp())
    assert abs(meta["launchdate"]
               - datetime.datetime(2026, 11, 24, 0, 44, tzinfo=datetime.timezone.utc).timestamp()) < 60
    del trace.metadata["user"]
    assert "user" not in _caliper_run_metadata(trace, [2])  # not recorded: left out, not invented
