"""fourd_mpi.analysis.export on a real 8-rank trace: Perfetto JSON structure, Caliper JSON read by Hatchet and Thicket."""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections import Counter, defaultdict

import numpy as np
import pytest

from conftest import mpirun
from fourd_mpi.analysis.export import to_caliper_json, to_perfetto, write_caliper_json, write_perfetto
from fourd_mpi.trace.read import load_trace
from fourd_mpi.trace.events import LANE_COMM0, LANE_HOST, LANE_LAYER, LANE_STEP

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
    "required": ["ph", "pid", "tid"],
    "properties": {
        "ph": {"enum": ["M", "X", "s", "t", "f"]},
        "pid": {"type": "integer", "minimum": 0}, "tid": {"type": "integer", "minimum": 0},
        "name": {"type": "string"}, "cat": {"type": "string"}, "args": {"type": "object"},
        "ts": {"type": "number"}, "dur": {"type": "number", "minimum": 0}, "id": {"type": "integer"},
        "bp": {"const": "e"},
    },
    "allOf": [
        {"if": {"properties": {"ph": {"const": "X"}}}, "then": {"required": ["name", "cat", "ts", "dur", "args"]}},
        {"if": {"properties": {"ph": {"enum": ["s", "t", "f"]}}}, "then": {"required": ["name", "cat", "id", "ts"]}},
        {"if": {"properties": {"ph": {"const": "M"}}}, "then": {"required": ["name", "args"]}},
    ],
}


def test_perfetto_events_match_the_trace_event_schema(perfetto):
    import jsonschema

    validator = jsonschema.Draft202012Validator(EVENT_SCHEMA)
    for event in perfetto["traceEvents"]:
        validator.validate(event)


def test_perfetto_processes_and_threads(trace, perfetto):
    meta = _by_phase(perfetto["traceEvents"], "M")
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert names == {r: f"rank {r} ({trace.ranks['hostname'][r].decode()})" for r in range(RANKS)}
    sort = {e["pid"]: e["args"]["sort_index"] for e in meta if e["name"] == "process_sort_index"}
    assert sort == {r: r for r in range(RANKS)}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    thread_sort = {(e["pid"], e["tid"]): e["args"]["sort_index"] for e in meta if e["name"] == "thread_sort_index"}
    for rank in range(RANKS):
        mine = sorted((thread_sort[key], name) for key, name in threads.items() if key[0] == rank)
        ordered = [name for _, name in mine]
        assert ordered[:4] == ["step", "phase", "layer", "host"]
        assert ordered[4:] == [f"comm{i}" for i in range(len(ordered) - 4)] and len(ordered) > 4
    used = {(e["pid"], e["tid"]) for e in perfetto["traceEvents"] if e["ph"] != "M"}
    assert used == set(threads)


def test_perfetto_slices_per_thread_equal_events_per_lane(trace, perfetto):
    """What a trace processor query of slices per thread would give: one X slice per trace event
    on each (rank, lane), the phase thread aside."""
    x = _by_phase(perfetto["traceEvents"], "X")
    per_thread = Counter((e["pid"], e["tid"]) for e in x if e["cat"] != "phase")
    assert per_thread == Counter(zip(trace.events["rank"].tolist(), trace.events["lane"].tolist()))
    comm = [e for e in x if e["tid"] >= LANE_COMM0 and e["cat"] == "comm"]
    assert len(comm) == int((trace.events["lane"] >= LANE_COMM0).sum()) > 0
    host = trace.events[trace.events["lane"] == LANE_HOST]
    x_names = Counter(e["name"].split()[0] for e in x if e["tid"] == LANE_HOST)
    assert x_names == Counter(trace.decode("op", host["op"]).tolist())
    steps = sorted(e["name"] for e in x if e["tid"] == LANE_STEP)
    assert steps == sorted(f"step {s}" for s in trace.events["step"][trace.events["lane"] == LANE_STEP].tolist())


def test_perfetto_times_are_aligned_microseconds(trace, perfetto):
    events = [e for e in _by_phase(perfetto["traceEvents"], "X") if e["cat"] != "phase"]
    ev = trace.events
    assert sorted((e["pid"], e["tid"], e["ts"]) for e in events) == sorted(
        zip(ev["rank"].tolist(), ev["lane"].tolist(), (ev["start_ns"] / 1000).tolist()))
    # durations: exact, but for the <= 1 ns trimmed off an event that touches its successor
    expected = sorted(((ev["end_ns"] - ev["start_ns"]) / 1000).tolist())
    got = sorted(e["dur"] for e in events)
    assert np.allclose(got, expected, rtol=0, atol=0.0011)


def test_perfetto_collectives_are_complete_events_with_their_accounting(perfetto):
    comm = [e for e in _by_phase(perfetto["traceEvents"], "X") if e["cat"] == "comm"]
    collectives = [e for e in comm if e["name"].split()[0] in ("allgather", "reduce_scatter", "allreduce")]
    assert collectives
    for e in collectives:
        assert e["tid"] >= LANE_COMM0 and e["name"].split()[1] in ("data", "z", "y", "x")
        assert {"bytes", "wire_bytes", "wait_ns", "mpi_ns", "overlap_ns", "call_return_ns"} <= set(e["args"])
        assert e["args"]["bytes"] > 0


def test_perfetto_flows_link_one_collective_across_its_ranks(trace, perfetto):
    """Every flow id: one "s" on its lowest rank, one "f" on its highest, "t" between, all on comm
    threads of the same step and op; as many pieces as the axis has ranks."""
    flows = defaultdict(list)
    for e in perfetto["traceEvents"]:
        if e["ph"] in ("s", "t", "f"):
            flows[e["id"]].append(e)
    assert flows
    sizes = {"data": 1, "z": 2, "y": 2, "x": 2}
    comm = {(e["pid"], e["tid"]): [] for e in _by_phase(perfetto["traceEvents"], "X")}
    for e in _by_phase(perfetto["traceEvents"], "X"):
        comm[e["pid"], e["tid"]].append(e)
    for pieces in flows.values():
        pieces.sort(key=lambda e: e["pid"])
        assert [p["ph"] for p in pieces] == ["s"] + ["t"] * (len(pieces) - 2) + ["f"]
        op, axis = pieces[0]["name"].split()
        assert len(pieces) == sizes[axis] and len({p["name"] for p in pieces}) == 1
        assert len({p["pid"] for p in pieces}) == len(pieces)
        for p in pieces:  # bound to a comm slice of the same collective on its thread
            assert p["tid"] >= LANE_COMM0
            enclosing = [x for x in comm[p["pid"], p["tid"]] if x["ts"] <= p["ts"] <= x["ts"] + x["dur"]]
            assert len(enclosing) == 1 and enclosing[0]["name"] == p["name"]


def test_perfetto_names_are_searchable(trace, perfetto):
    x = _by_phase(perfetto["traceEvents"], "X")
    layers = [e for e in x if e["tid"] == LANE_LAYER]
    assert layers and all(e["name"].startswith("layer ") for e in layers)
    first = layers[0]
    code = trace.vocab["layers"].index(first["args"]["layer"])
    assert first["name"] == f"layer {code} {first['args']['phase']} ({first['args']['layer']})"
    assert any(e["name"].startswith("layer ") and " backward (" in e["name"] for e in layers)
    phases = {e["name"].split()[-1] for e in x if e["cat"] == "phase"}
    assert {"forward", "backward"} <= phases


def test_perfetto_collectives_overlap_compute(perfetto):
    """With overlap on, collectives are in flight during host work (on their own threads)."""
    x = _by_phase(perfetto["traceEvents"], "X")
    flights = [(e["pid"], e["ts"], e["ts"] + e["dur"]) for e in x if e["cat"] == "comm"]
    gemms = [(e["pid"], e["ts"], e["ts"] + e["dur"]) for e in x if e["name"] == "gemm"]
    overlapped = sum(1 for pid, t0, t1 in gemms if any(p == pid and b < t0 and t1 < e for p, b, e in flights))
    assert overlapped > 0


def test_perfetto_complete_events_do_not_overlap(perfetto):
    per_thread = defaultdict(list)
    for e in _by_phase(perfetto["traceEvents"], "X"):
        assert e["dur"] >= 0
        per_thread[e["pid"], e["tid"]].append((round(e["ts"] * 1000), round((e["ts"] + e["dur"]) * 1000)))
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
    assert {e["pid"] for e in doc["traceEvents"]} == {0, 3}
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
    df = tk.dataframe.reset_index()
    assert sorted(df["rank"].unique().tolist()) == list(range(RANKS))
    expected = _host_seconds_per_step(trace, _measured_steps(trace))
    assert np.allclose(df.groupby("rank")["time"].sum().to_numpy(), expected, rtol=1e-12)
    depths = {len(path) for _, path in _hatchet_paths(tk.graph)}
    assert depths == {1, 2, 3, 4}
