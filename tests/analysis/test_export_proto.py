"""The Perfetto protobuf timeline (``export perfetto -o X.pftrace``) against the JSON export of the same trace.

Known answer: a real 3-rank op-level trace (``mpiexec -n 3 fourd-mpi run --gdata 3 --trace-level op``, an odd
size) and the 8-rank 2x2x2 trace with every overlap option on (collectives in flight together, flows over
3 axes). The protobuf file is parsed back with perfetto's own generated classes (``perfetto_trace_pb2``),
independently of the writer: interning tables per sequence, begin/end stacks per track.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter, defaultdict

import numpy as np
import pytest
from conftest import REPO, mpirun

from fourd_mpi.analysis.export import to_perfetto, write_perfetto, write_perfetto_proto
from fourd_mpi.trace.read import load_trace

pb = pytest.importorskip("perfetto.protos.perfetto.trace.perfetto_trace_pb2",
                         reason="the perfetto package is not installed (pip install 'fourd_mpi[perfetto]')")

pytestmark = pytest.mark.mpi


def _run(tmp_path_factory, name, nranks, args):
    results = tmp_path_factory.mktemp(name)
    proc = mpirun(nranks, ["run", *args, "--trace-level", "op", "--results-dir", results, "--display", "lines",
                           "--peak-tflops", 1], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    paths = [line.split("trace:", 1)[1].strip() for line in proc.stdout.splitlines()
             if line.startswith("trace: ") and line.rstrip().endswith(".h5")]
    assert len(paths) == 1, proc.stdout
    return paths[0]


@pytest.fixture(scope="module")
def trace3_path(tmp_path_factory):
    """3 ranks, data parallel (gpt-tiny, batch 6), 3 steps: an odd world size."""
    return _run(tmp_path_factory, "proto3", 3, ["--gdata", 3, "--batch", 6, "--steps", 3])


@pytest.fixture(scope="module")
def trace8(tmp_path_factory):
    """8 ranks (2x2x2), 3 steps, every overlap option on: several comm lanes, flows over z, y and x."""
    return load_trace(_run(tmp_path_factory, "proto8", 8, ["--gx", 2, "--gy", 2, "--gz", 2, "--steps", 3,
                                                            "--overlap", "all"]))


def fourd(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout)


def _ns(us):
    return int(us * 1000.0)


def read_proto(path):
    """The file as Perfetto's importer would see it, decoded here with the generated classes:
    ``tracks`` {uuid: (pid, tid or None, name)}, ``slices`` [(pid, tid, name, cat, begin_ns, end_ns, args)],
    ``flows`` {id: [(begin_ns, pid, kind)]}, and per-sequence facts for the structural checks."""
    trace = pb.Trace.FromString(open(path, "rb").read())
    tracks, slices, flows = {}, [], defaultdict(list)
    interned = {}  # sequence -> table -> {iid: text}
    open_slices = defaultdict(list)  # track uuid -> stack of begin packets
    last_time = {}
    sequences = []
    for packet in trace.packet:
        seq = packet.trusted_packet_sequence_id
        assert seq > 0
        if seq not in sequences:
            sequences.append(seq)
        if packet.HasField("track_descriptor"):
            d = packet.track_descriptor
            if d.HasField("thread"):
                tracks[d.uuid] = (d.thread.pid, d.thread.tid, d.thread.thread_name)
            else:
                tracks[d.uuid] = (d.process.pid, None, d.process.process_name)
            continue
        if packet.sequence_flags & pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED:
            assert seq not in interned, "a sequence's interning tables are reset once, at its start"
            interned[seq] = defaultdict(dict)
        assert packet.sequence_flags & pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
        tables = interned[seq]  # KeyError: an event before its sequence's state was set
        data = packet.interned_data
        for table in ("event_names", "event_categories", "debug_annotation_names"):
            for entry in getattr(data, table):
                assert entry.iid not in tables[table]
                tables[table][entry.iid] = entry.name
        for entry in data.debug_annotation_string_values:
            tables["strings"][entry.iid] = entry.str.decode()
        assert packet.timestamp >= last_time.get(seq, 0), "packets of a sequence in time order"
        last_time[seq] = packet.timestamp
        event = packet.track_event
        assert event.track_uuid in tracks, "a track is described before its events"
        if event.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
            assert not event.HasField("name") and event.name_iid  # interned, not inline
            open_slices[event.track_uuid].append((packet.timestamp, event, tables))
        else:
            assert event.type == pb.TrackEvent.TYPE_SLICE_END
            begin, opened, names = open_slices[event.track_uuid].pop()  # IndexError: an end without a begin
            assert not open_slices[event.track_uuid], "slices of a thread never nest (X events do not overlap)"
            args = {}
            for a in opened.debug_annotations:
                key = names["debug_annotation_names"][a.name_iid]
                value = a.WhichOneof("value")
                args[key] = names["strings"][a.string_value_iid] if value == "string_value_iid" else getattr(a, value)
            pid, tid, _ = tracks[event.track_uuid]
            cats = [names["event_categories"][i] for i in opened.category_iids]
            assert len(cats) == 1
            slices.append((pid, tid, names["event_names"][opened.name_iid], cats[0], begin, packet.timestamp, args))
            for fid in opened.flow_ids:
                flows[fid].append((begin, pid, "next"))
            for fid in opened.terminating_flow_ids:
                flows[fid].append((begin, pid, "last"))
    assert not any(open_slices.values()), "every begin has its end"
    return {"tracks": tracks, "slices": slices, "flows": flows, "sequences": sequences, "interned": interned}


def _json_slices(doc):
    return [(e["pid"], e["tid"], e["name"], e["cat"], _ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"]), e["args"])
            for e in doc["traceEvents"] if e["ph"] == "X"]


def _key(s):
    return (*s[:6], json.dumps(s[6], sort_keys=True))


def _assert_same_as_json(doc, got):
    """Slices (track, name, category, ns, args) and tracks (names) equal the JSON export's."""
    want = _json_slices(doc)
    assert len(got["slices"]) == len(want) > 0
    assert Counter(map(_key, got["slices"])) == Counter(map(_key, want))
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert {pid: name for pid, tid, name in got["tracks"].values() if tid is None} == processes
    assert {(pid, tid): name for pid, tid, name in got["tracks"].values() if tid is not None} == threads


def test_proto_equals_the_json_export_3_ranks(trace3_path, tmp_path):
    trace = load_trace(trace3_path)
    path = tmp_path / "t.pftrace"
    n = write_perfetto_proto(trace, str(path))
    got = read_proto(path)
    assert n == len(got["slices"])
    _assert_same_as_json(to_perfetto(trace), got)
    assert got["sequences"] == [1, 2, 3]  # one sequence per rank (rank + 1), in rank order
    assert {pid for pid, _, _ in got["tracks"].values()} == {1, 2, 3}


def test_proto_equals_the_json_export_8_ranks_with_overlap(trace8, tmp_path):
    path = tmp_path / "t.pftrace"
    write_perfetto_proto(trace8, str(path))
    got = read_proto(path)
    doc = to_perfetto(trace8)
    _assert_same_as_json(doc, got)
    # several comm lanes: the same lane names as the JSON
    assert {"comm0", "comm1"} <= {name for _, tid, name in got["tracks"].values() if tid is not None}


def test_proto_names_are_interned_once_per_sequence(trace8, tmp_path):
    path = tmp_path / "t.pftrace"
    write_perfetto_proto(trace8, str(path))
    got = read_proto(path)
    for seq, tables in got["interned"].items():
        names = list(tables["event_names"].values())
        assert len(names) == len(set(names)), seq
        # every name of this rank's slices is in its table, and nothing else
        pid = seq  # sequence = rank + 1 = pid
        assert set(names) == {s[2] for s in got["slices"] if s[0] == pid}


def test_proto_flows_link_each_collective_across_its_ranks(trace8, tmp_path):
    """Per collective instance (2 ranks per axis here): one flow id, on the earlier piece as ``flow_ids``
    and on the later one as ``terminating_flow_ids``, on different ranks; as many arrows as the JSON's."""
    path = tmp_path / "t.pftrace"
    write_perfetto_proto(trace8, str(path))
    flows = read_proto(path)["flows"]
    doc = to_perfetto(trace8)
    json_flows = defaultdict(list)
    for e in doc["traceEvents"]:
        if e["ph"] in ("s", "t", "f"):
            json_flows[e["id"]].append(e)
    arrows = sum(len(v) - 1 for v in json_flows.values())
    assert sum(len(v) - 1 for v in flows.values()) == arrows > 0
    for pieces in flows.values():
        pieces.sort()
        assert [kind for _, _, kind in pieces] == ["next"] * (len(pieces) - 1) + ["last"]
        assert len({pid for _, pid, _ in pieces}) == len(pieces)


def test_proto_selection_and_size(trace8, tmp_path):
    path, js = tmp_path / "s.pftrace", tmp_path / "s.json"
    write_perfetto_proto(trace8, str(path), steps=[1], ranks=iter([0, 3]))
    write_perfetto(trace8, str(js), steps=[1], ranks=[0, 3])
    got = read_proto(path)
    _assert_same_as_json(to_perfetto(trace8, steps=[1], ranks=[0, 3]), got)
    assert {s[0] for s in got["slices"]} == {1, 4} and {s[6]["step"] for s in got["slices"]} == {1}
    assert path.stat().st_size < js.stat().st_size / 2  # the point of the format
    with pytest.raises(ValueError, match="ranks"):
        write_perfetto_proto(trace8, str(path), ranks=[99])


def test_export_command_picks_the_format_by_suffix(trace3_path, tmp_path):
    import gzip

    for name in ("t.pftrace", "t.perfetto-trace", "t.pftrace.gz", "t.json"):
        proc = fourd("export", "perfetto", trace3_path, "-o", tmp_path / name)
        assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "t.json").read_text())
    _assert_same_as_json(doc, read_proto(tmp_path / "t.pftrace"))
    assert (tmp_path / "t.pftrace").read_bytes() == (tmp_path / "t.perfetto-trace").read_bytes()
    assert gzip.decompress((tmp_path / "t.pftrace.gz").read_bytes()) == (tmp_path / "t.pftrace").read_bytes()
    proc = fourd("export", "perfetto", trace3_path, "-o", tmp_path / "t.pftrace")
    assert proc.returncode == 2 and "already exists" in proc.stderr  # the output rule, as for the JSON
    proc = fourd("export", "perfetto", trace3_path, "-o", tmp_path / "t.txt")
    assert proc.returncode == 2 and ".pftrace" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "t.txt").exists()


def test_export_without_the_perfetto_package_says_what_to_install(trace3_path, tmp_path):
    """The package made unimportable (``sys.modules[name] = None``): one line naming the extra, exit 2."""
    out = tmp_path / "t.pftrace"
    code = ("import sys; sys.modules['perfetto'] = None; from fourd_mpi.cli.main import main; "
            f"sys.exit(main(['export', 'perfetto', {str(trace3_path)!r}, '-o', {str(out)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "pip install 'fourd_mpi[perfetto]'" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
    json_out = tmp_path / "t.json"  # the JSON export does not need it
    code = code.replace(str(out), str(json_out))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and json_out.exists(), proc.stderr


def test_perfetto_trace_processor_reads_the_proto(trace8, tmp_path):
    """Perfetto's own importer (where a trace_processor_shell binary is at hand): slices per thread, flows,
    and no import errors."""
    from test_export import trace_processor_or_skip

    tp_api, binary = trace_processor_or_skip()
    path = tmp_path / "t.pftrace"
    write_perfetto_proto(trace8, str(path))
    doc = to_perfetto(trace8)
    tp = tp_api.TraceProcessor(trace=str(path), config=tp_api.TraceProcessorConfig(bin_path=binary))
    try:
        rows = tp.query("select thread.tid as tid, count(*) as n from slice "
                        "join thread_track on slice.track_id = thread_track.id "
                        "join thread on thread_track.utid = thread.utid group by thread.tid").as_pandas_dataframe()
        flows = tp.query("select count(*) as n from flow").as_pandas_dataframe()
        stats = tp.query("select name, value from stats where value > 0 and severity in ('error', 'data_loss')"
                         ).as_pandas_dataframe()
    finally:
        tp.close()
    want = Counter(e["tid"] for e in doc["traceEvents"] if e["ph"] == "X")
    assert dict(zip(rows["tid"].tolist(), rows["n"].tolist())) == dict(want)
    assert int(flows["n"][0]) == sum(1 for e in doc["traceEvents"] if e["ph"] in ("t", "f"))
    assert stats.empty, stats


def test_the_benchmark_tiles_a_real_step(trace8, tmp_path):
    """bench/timeline_formats.py's synthetic trace (known answer): ranks x steps copies of one measured step of
    the 8-rank trace, each rank's events those of its source rank shifted in time, on a grid that makes the
    copies separate communicators; both exports of it agree."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("timeline_formats", REPO / "bench" / "timeline_formats.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tiled = bench.tile(trace8, 16, 3)
    step = int(trace8.steps["step"][trace8.steps["warmup"] == 0][0])
    one = trace8.events[trace8.events["step"] == step]
    assert len(tiled.events) == 3 * 2 * len(one) and tiled.world_size == 16
    for rank in (0, 13):
        source = one[one["rank"] == rank % 8]
        first, last = (tiled.events[(tiled.events["rank"] == rank) & (tiled.events["step"] == k)] for k in (0, 2))
        assert len(first) == len(last) == len(source)
        assert len(np.unique(np.sort(first["start_ns"]) - np.sort(source["start_ns"]))) == 1  # one shift
        later = np.unique(np.sort(last["start_ns"]) - np.sort(first["start_ns"]))
        assert len(later) == 1 and later[0] > first["end_ns"].max() - first["start_ns"].min()  # steps in turn
    assert tiled.metadata["grid"] == "2x2x2x2"
    path = tmp_path / "t.pftrace"
    write_perfetto_proto(tiled, str(path))
    _assert_same_as_json(to_perfetto(tiled), read_proto(path))
