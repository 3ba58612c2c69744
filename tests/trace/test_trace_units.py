"""Single-process unit tests of the trace subsystem: config files, session helpers, spool and HDF5 store,
the in-process tracer and the reader's error handling (no mpiexec)."""

from __future__ import annotations

import json
import os
import re
import time

import h5py
import numpy as np
import pytest

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

from fourd_mpi.cli.main import build_parser
from fourd_mpi.cli.run import run_options, run_parser
from fourd_mpi.core.collectives import CommRecord
from fourd_mpi.core.colltable import wire_factor
from fourd_mpi.errors import ConfigError, TraceError
from fourd_mpi.run.configfile import config_tokens, dump_toml, load_config_file
from fourd_mpi.run.options import resolved_config
from fourd_mpi.run.session import Fault, TraceOptions
from fourd_mpi.trace.events import (
    AXES,
    EVENT_DTYPE,
    LANE_COMM0,
    LANE_HOST,
    LANE_LAYER,
    LANE_STEP,
    OPS,
    PHASES,
    RANK_STEP_DTYPE,
    SCHEMA_VERSION,
    Tracer,
)
from fourd_mpi.trace.files import check_name, new_run_id
from fourd_mpi.trace.invariants import check_invariants
from fourd_mpi.trace.read import load_trace
from fourd_mpi.trace.recover import recover
from fourd_mpi.trace.spool import RankSpool, prepare_spool, read_records
from fourd_mpi.trace.summary import summarize
from fourd_mpi.trace.writer import TraceFileWriter
from fourd_mpi.util.files import RUN_META

OP = {name: i for i, name in enumerate(OPS)}
PHASE = {name: i for i, name in enumerate(PHASES)}
AXIS = {name: i for i, name in enumerate(AXES)}
LAYERS = ["", "block0.qkv", "block0.proj"]  # a tracer's layer_names: code 0 is "no layer"


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def event(rank, step, op, lane, start, end, layer=0, phase=0, axis=0, nbytes=0, wire=0, flops=0.0,
          issue=0, complete=0, wait=0, call=None, mpi=None, overlap=None):
    """An EVENT_DTYPE tuple; ``call``/``mpi``/``overlap`` default to ``issue``/``wait``/the time not waited
    (the I* call returns at once, the host is in MPI only while it waits and computes otherwise)."""
    if overlap is None:
        overlap = max(complete - issue - wait, 0) if lane >= LANE_COMM0 else 0
    return (rank, step, layer, phase, OP[op], AXIS[axis] if isinstance(axis, str) else axis, lane, start, end,
            nbytes, wire, flops, issue, complete, wait, issue if call is None else call, wait if mpi is None else mpi,
            overlap)


def step_events(rank: int, step: int, t0: int) -> np.ndarray:
    """One realistic step of one rank: step span, a layer span, two GEMMs and a wait on the host lane
    (disjoint), and the all-gather the wait blocked on (comm lane)."""
    return np.array([
        event(rank, step, "step", LANE_STEP, t0, t0 + 1000),
        event(rank, step, "layer", LANE_LAYER, t0 + 10, t0 + 900, layer=1, phase=PHASE["forward"]),
        event(rank, step, "gemm", LANE_HOST, t0 + 20, t0 + 200, layer=1, phase=1, flops=2e6),
        event(rank, step, "allgather", LANE_COMM0, t0 + 100, t0 + 400, layer=1, phase=1, axis="z",
              nbytes=1024, wire=512, issue=t0 + 100, complete=t0 + 400, wait=100),
        event(rank, step, "wait", LANE_HOST, t0 + 300, t0 + 400, layer=1, phase=1, axis="z", nbytes=1024),
        event(rank, step, "gemm", LANE_HOST, t0 + 450, t0 + 800, layer=1, phase=1, flops=4e6),
    ], dtype=EVENT_DTYPE)


EVENTS_PER_STEP = len(step_events(0, 0, 0))


def rank_step(rank: int, step: int, t0: int, warmup: bool = False) -> np.ndarray:
    rec = np.zeros(1, dtype=RANK_STEP_DTYPE)
    rec[0] = (rank, step, warmup, t0, t0 + 1000, 5.0 - step, 1e-6, 530, 100, EVENTS_PER_STEP, 100)
    return rec


def step_start(rank: int, step: int) -> int:
    return 10**9 + step * 2000 + rank * 7


def make_spool(tmp_path, steps=(3, 2), torn_step: bool = True, failed_rank=None, world=2) -> str:
    """A crashed run's spool directory built by hand: rank r completed ``steps[r]`` steps; with
    ``torn_step`` each rank short of the maximum also has the events (no record) of its next step."""
    spool_dir = tmp_path / "run-x.ranks"
    spool_dir.mkdir()
    (spool_dir / RUN_META).write_text(json.dumps({
        "run_id": "run-x", "world_size": world, "layers": LAYERS, "level": "op",
        "trace_path": str(tmp_path / "run-x.h5"), "config": {"gx": world}}))
    for rank in range(world):
        meta = {"rank": rank, "hostname": f"node{rank}", "node": rank, "local_rank": 0,
                "coords": {"data": 0, "z": 0, "y": 0, "x": rank}, "pid": 100 + rank,
                "clock_offset_ns": 3 * rank, "clock_uncertainty_ns": 2}
        spool = RankSpool(str(spool_dir), rank, meta)
        for step in range(steps[rank]):
            spool.append(step_events(rank, step, step_start(rank, step)),
                         rank_step(rank, step, step_start(rank, step), warmup=step == 0))
        if torn_step and steps[rank] < max(steps):  # killed after writing the events, before the record
            with open(spool.events_path, "ab") as fh:
                fh.write(step_events(rank, steps[rank], step_start(rank, steps[rank])).tobytes())
            with open(spool.steps_path, "ab") as fh:
                fh.write(rank_step(rank, steps[rank], 0).tobytes()[:11])
        if rank == failed_rank:
            spool.mark_failed("RuntimeError: injected")
        spool.close()
    return str(spool_dir)


def rank_steps_table(durations, warmup_steps=1, compute_ns=600_000_000, wait_ns=300_000_000):
    """RANK_STEP_DTYPE records from ``durations[rank][step]`` in seconds."""
    rows = []
    for rank, per_step in enumerate(durations):
        for step, seconds in enumerate(per_step):
            warm = step < warmup_steps
            start = 10**12 + step * 10**11
            rows.append((rank, step, warm, start, start + int(round(seconds * 1e9)), 1.0, seconds,
                         0 if warm else compute_ns, 0 if warm else wait_ns, 10, 0 if warm else wait_ns))
    return np.array(rows, dtype=RANK_STEP_DTYPE)


def valid_trace(tmp_path) -> str:
    return recover(make_spool(tmp_path))["path"]


# ---------------------------------------------------------------------------
# runconfig
# ---------------------------------------------------------------------------

def test_toml_sections_are_flattened_and_underscores_become_dashes(tmp_path):
    path = write(tmp_path / "c.toml", 'model = "gpt-small"\ntrace_level = "layer"\ncheck_buffers = true\n'
                                      '[grid]\ngx = 2\ngy = 4\n[more.deep]\nffn_hidden = 64\n')
    assert load_config_file(path) == {"model": "gpt-small", "trace-level": "layer", "check-buffers": True,
                                      "gx": 2, "gy": 4, "ffn-hidden": 64}


def test_yaml_config_and_empty_yaml(tmp_path):
    path = write(tmp_path / "c.YML", "steps: 3\ngrid:\n  gx: 2\nlr: 0.5\npoll_flops: 1.0e+6\n")
    assert load_config_file(path) == {"steps": 3, "gx": 2, "lr": 0.5, "poll-flops": 1e6}
    assert load_config_file(write(tmp_path / "empty.yaml", "")) == {}


@pytest.mark.parametrize("name, text", [
    ("dup.toml", "gx = 2\n[grid]\ngx = 3\n"),
    ("dup2.toml", "ffn_hidden = 2\nffn-hidden = 3\n"),
    ("dup.yaml", "grid:\n  gx: 2\nother:\n  gx: 3\n"),
])
def test_a_key_given_twice_is_an_error(tmp_path, name, text):
    with pytest.raises(ConfigError, match=r"(gx|ffn-hidden) given twice"):
        load_config_file(write(tmp_path / name, text))


@pytest.mark.parametrize("name, text, message", [
    ("bad.toml", "gx = [2\n", "is malformed"),
    ("bad.yaml", "gx: [2\n", r"bad\.yaml:2: not valid YAML"),  # the line of the error
    ("c.ini", "gx = 2\n", "unknown format .ini"),
    ("config", "gx = 2\n", r"unknown format \(no extension\)"),
    ("list.yaml", "- gx\n- 2\n", "expected a mapping"),
    ("scalar.yaml", "just text\n", "expected a mapping"),
])
def test_bad_config_files(tmp_path, name, text, message):
    path = write(tmp_path / name, text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config_file(path)
    assert path in str(info.value) and "\n" not in str(info.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file .*nope.toml"):
        load_config_file(str(tmp_path / "nope.toml"))


def test_config_tokens_become_options_that_argparse_accepts():
    parser = run_parser()
    tokens = config_tokens({"gx": 2, "model": "gpt-small", "check-buffers": True, "cache-weights": False,
                            "poll-flops": 1e6, "trace-level": "step"}, "c.toml")
    assert tokens == ["--gx=2", "--model=gpt-small", "--check-buffers", "--poll-flops=1000000.0",
                      "--trace-level=step"]
    args = parser.parse_args(tokens)
    assert (args.gx, args.check_buffers, args.cache_weights, args.poll_flops) == (2, True, False, 1e6)


@pytest.mark.parametrize("config, message", [
    ({"bogus": 1}, r"unknown option 'bogus' \(known: .*\bgx\b"),
    ({"help": True}, "unknown option 'help'"),
    ({"config": "other.toml"}, "unknown option 'config'"),
    ({"check-buffers": "yes"}, "check-buffers must be true or false, got 'yes'"),
    ({"check-buffers": 1}, "check-buffers must be true or false"),
    ({"overlap": ["oag", "ors"]}, "overlap must be a single value"),
    ({"gx": {"a": 1}}, "gx must be a single value"),
    ({"label": None}, "label must be a single value"),
])
def test_config_tokens_errors(config, message):
    with pytest.raises(ConfigError, match=message) as info:
        config_tokens(config, "c.toml")
    assert "c.toml" in str(info.value)


def test_unknown_option_lists_the_known_ones_but_not_config_or_help():
    with pytest.raises(ConfigError) as info:
        config_tokens({"gz_size": 2}, "c.toml")
    known = str(info.value).split("known: ", 1)[1]
    assert {"gx", "steps", "trace-level", "force"} <= set(known.rstrip(")").split(", "))
    assert "config" not in known.split(", ") and "help" not in known.split(", ")


def test_dump_toml_round_trips_through_tomllib():
    config = {"model": "gpt-small", "steps": 20, "lr": 1e-3, "poll-flops": 1e20, "check-buffers": False,
              "cache-weights": True, "label": None, "results-dir": 'a "quoted"\\path/é\tx', "seed": -3}
    text = dump_toml(config)
    assert "label" not in text
    assert tomllib.loads(text) == {k: v for k, v in config.items() if v is not None}
    parsed = tomllib.loads(text)
    assert type(parsed["steps"]) is int and type(parsed["lr"]) is float and parsed["check-buffers"] is False


def test_resolved_config_is_a_config_file_that_gives_the_same_config(tmp_path):
    """resolved config -> dump_toml -> --config file -> parse -> the same resolved config."""
    parser = build_parser()

    def resolve(argv):
        args = parser.parse_args(argv)
        options = run_options(args, 4)
        trace = TraceOptions(args.trace_level, args.results_dir, args.run_id, args.label, args.force)
        return resolved_config(args.model, options, {"trace_level": trace.level, "results_dir": trace.results_dir,
                                                     "label": trace.label, "display": args.display,
                                                     "peak_tflops": args.peak_tflops})

    first = resolve(["run", "--gx", "2", "--lr", "0.01", "--overlap", "all", "--check-buffers", "--label", "a"])
    path = write(tmp_path / "again.toml", dump_toml(first))
    assert resolve(["run", *config_tokens(load_config_file(path), path)]) == first


# ---------------------------------------------------------------------------
# session: fault injection, trace options, summary
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, fault", [
    ("3:2", Fault(3, 2, "kill")), ("0:0:raise", Fault(0, 0, "raise")), ("7:11:kill", Fault(7, 11, "kill")),
])
def test_fault_parse(text, fault):
    assert Fault.parse(text) == fault


@pytest.mark.parametrize("text", ["", "3", "3:", "a:2", "3:2.5", "3:2:boom", "3:2:", "3:2:kill:x", "-1:2",
                                  "3:-2"])
def test_fault_parse_rejects(text):
    with pytest.raises(ConfigError, match="inject-fault"):
        Fault.parse(text)


def test_trace_options_validate():
    options = TraceOptions("layer", "res", "20260101-000000-a-abcdef", "my_label.2")
    assert options.validate() is options
    with pytest.raises(ConfigError, match="unknown trace level 'ops'"):
        TraceOptions(level="ops").validate()
    with pytest.raises(TraceError, match="invalid run id 'a/b'"):
        TraceOptions(run_id="a/b").validate()
    with pytest.raises(TraceError, match="invalid label '-x'"):
        TraceOptions(label="-x").validate()


def test_summarize_statistics():
    # step 0 is warm-up (huge spans, no compute): it must not count anywhere
    durations = [[9.0, 1.0, 2.0, 1.5, 3.0],
                 [8.0, 1.2, 1.8, 1.5, 2.5]]
    s = summarize(rank_steps_table(durations), world_size=2, flops_per_step=8e12, tokens_per_step=4096,
                  peak_tflops=10.0, peak_source="test")
    # per-step max over ranks: 1.2, 2.0, 1.5, 3.0
    assert s.steps == 4
    assert (s.median_s, s.min_s, s.max_s) == pytest.approx((1.75, 1.2, 3.0))
    assert (s.q1_s, s.q3_s) == pytest.approx((1.425, 2.25))
    total = 1.0 + 2.0 + 1.5 + 3.0 + 1.2 + 1.8 + 1.5 + 2.5  # shares are total/total, not a mean of ratios
    assert s.compute_share == pytest.approx(8 * 0.6 / total)
    assert s.wait_share == pytest.approx(8 * 0.3 / total)
    assert s.other_share == pytest.approx(1 - 8 * 0.9 / total)
    assert s.model_tflops_per_rank == pytest.approx(8e12 / 2 / 1.75 / 1e12)
    assert s.tokens_per_s == pytest.approx(4096 / 1.75)
    assert s.mfu_pct == pytest.approx(100 * s.model_tflops_per_rank / 10.0)
    assert s.as_dict()["mfu_pct"] == s.mfu_pct and np.isnan(s.gemm_pct)  # no GEMM measured
    assert "median 1.750 s over 4 step(s) (min 1.200, q1 1.425, q3 2.250, max 3;" in s.lines()[0]


def test_summarize_with_only_warmup_steps_uses_them():
    s = summarize(rank_steps_table([[2.0, 4.0]], warmup_steps=2), 1, 1e12, 10, 0.0, "none")
    assert s.steps == 2 and s.median_s == pytest.approx(3.0) and np.isnan(s.mfu_pct)


# ---------------------------------------------------------------------------
# tracestore: names, records, spool files
# ---------------------------------------------------------------------------

def test_new_run_id_format_and_uniqueness():
    stamp = time.strftime("%Y%m%d", time.gmtime())
    plain, labelled = new_run_id(), new_run_id("demo")
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", plain), plain
    assert re.fullmatch(r"\d{8}-\d{6}-demo-[0-9a-f]{6}", labelled), labelled
    assert plain[:8] in (stamp, time.strftime("%Y%m%d", time.gmtime(time.time() - 5)))
    assert check_name("run id", labelled) == labelled
    assert len({new_run_id("x") for _ in range(20)}) == 20


@pytest.mark.parametrize("name", ["a", "run-1", "20260101-000000-x_y.z-abcdef", "A9"])
def test_check_name_accepts(name):
    assert check_name("run id", name) == name


@pytest.mark.parametrize("name", ["", ".hidden", "-dash", "a/b", "a b", "../up", "x\n", "a:b"])
def test_check_name_rejects(name):
    with pytest.raises(TraceError, match="invalid label"):
        check_name("label", name)


def test_read_records_drops_a_torn_last_record(tmp_path):
    records = np.concatenate([rank_step(0, s, 100 * s) for s in range(3)])
    path = tmp_path / "r.steps"
    path.write_bytes(records.tobytes() + b"\x01\x02\x03\x04\x05")
    got = read_records(str(path), RANK_STEP_DTYPE)
    assert got.dtype == RANK_STEP_DTYPE and np.array_equal(got, records)
    got["step"][0] = 99  # a copy, writable, not a view of a read-only buffer
    assert len(read_records(str(tmp_path / "missing"), EVENT_DTYPE)) == 0


def test_rank_spool_append_close_remove(tmp_path):
    spool = RankSpool(str(tmp_path), 5, {"rank": 5})
    assert json.loads((tmp_path / "rank000005.json").read_text()) == {"rank": 5}
    for step in range(2):
        spool.append(step_events(5, step, 1000 * step), rank_step(5, step, 1000 * step))
    assert spool.events_written == 2 * EVENTS_PER_STEP
    spool.close()
    spool.close()  # idempotent
    events = read_records(spool.events_path, EVENT_DTYPE)
    assert np.array_equal(events, np.concatenate([step_events(5, s, 1000 * s) for s in range(2)]))
    assert read_records(spool.steps_path, RANK_STEP_DTYPE)["step"].tolist() == [0, 1]
    spool.mark_failed("ValueError: boom")
    failed = json.loads((tmp_path / "rank000005.failed.json").read_text())
    assert failed["rank"] == 5 and failed["error"] == "ValueError: boom" and failed["time"]
    spool.remove()
    assert os.listdir(tmp_path) == []


def test_rank_spool_never_reopens_existing_files(tmp_path):
    RankSpool(str(tmp_path), 0, {"rank": 0}).close()
    with pytest.raises(TraceError, match="rank 0 cannot write its trace files"):
        RankSpool(str(tmp_path), 0, {"rank": 0})
    with pytest.raises(TraceError, match="rank 1 cannot write"):
        RankSpool(str(tmp_path / "no-such-dir"), 1, {"rank": 1})


def test_prepare_spool(tmp_path):
    results = tmp_path / "results" / "sub"
    spool_dir = prepare_spool(str(results), "r1", False, {"run_id": "r1", "world_size": 2})
    assert spool_dir == str(results / "r1.ranks") and os.path.isdir(spool_dir)
    meta = json.loads((results / "r1.ranks" / RUN_META).read_text())
    assert meta == {"run_id": "r1", "world_size": 2, "trace_path": str(results / "r1.h5")}
    # the same run id again: the spool directory is taken
    with pytest.raises(TraceError, match="run id r1 is in use"):
        prepare_spool(str(results), "r1", True, {})


def test_prepare_spool_existing_trace_needs_force(tmp_path):
    (tmp_path / "r2.h5").write_bytes(b"x")
    with pytest.raises(TraceError, match="r2.h5 already exists"):
        prepare_spool(str(tmp_path), "r2", False, {})
    assert not (tmp_path / "r2.ranks").exists()
    assert prepare_spool(str(tmp_path), "r2", True, {}) == str(tmp_path / "r2.ranks")


@pytest.mark.parametrize("under", ["file", "file/sub"])
def test_prepare_spool_results_dir_under_a_regular_file(tmp_path, under):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(TraceError, match="cannot create the results directory"):
        prepare_spool(str(tmp_path / under), "r3", False, {})


# ---------------------------------------------------------------------------
# tracestore: HDF5 writer and recovery, read back with traceread
# ---------------------------------------------------------------------------

def test_recover_keeps_the_steps_every_rank_completed(tmp_path):
    spool_dir = make_spool(tmp_path, steps=(3, 2))
    result = recover(spool_dir)
    assert result["path"] == str(tmp_path / "run-x.h5")  # run.json's planned trace path
    assert result["status"] == "partial" and result["steps"] == [0, 1] and result["failures"] == []
    # step 2: rank 0 completed it, rank 1 wrote its events but not its record
    assert result["events_dropped"] == 2 * EVENTS_PER_STEP
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]

    trace = load_trace(result["path"])
    assert trace.status == "partial" and trace.schema_version == SCHEMA_VERSION
    assert trace.world_size == 2 and trace.ranks["rank"].tolist() == [0, 1]
    assert trace.ranks["hostname"].tolist() == [b"node0", b"node1"] and trace.ranks["pid"].tolist() == [100, 101]
    assert trace.ranks["clock_offset_ns"].tolist() == [0, 3]
    meta = trace.metadata
    assert meta["run_id"] == "run-x" and meta["world_size"] == 2 and meta["config"] == {"gx": 2}
    assert meta["steps_kept"] == 2 and meta["events_dropped"] == 2 * EVENTS_PER_STEP
    assert meta["failures"] == [] and meta["ranks_without_metadata"] == []
    assert meta["recovered_from"] == os.path.abspath(spool_dir) and "trace_path" not in meta
    assert trace.vocab["layers"] == LAYERS and trace.vocab["ops"] == list(OPS)
    assert trace.attrs["events"] == len(trace.events) == 2 * 2 * EVENTS_PER_STEP

    assert sorted(set(trace.events["step"].tolist())) == [0, 1]
    for rank in (0, 1):
        first, count = trace.ranks["event_offset"][rank], trace.ranks["event_count"][rank]
        mine = trace.events[first:first + count]
        assert count == 2 * EVENTS_PER_STEP and (mine["rank"] == rank).all()
        assert (np.diff(mine["start_ns"]) >= 0).all()  # time-sorted per rank
    assert trace.rank_steps[["step", "rank"]].tolist() == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert trace.steps["step"].tolist() == [0, 1] and trace.steps["warmup"].tolist() == [1, 0]
    assert trace.steps["loss"].tolist() == [5.0, 4.0]
    assert trace.steps["start_ns"].tolist() == [step_start(0, 0), step_start(0, 1)]
    assert trace.steps["end_ns"].tolist() == [step_start(1, 0) + 1000, step_start(1, 1) + 1000]
    assert trace.select(op="gemm", rank=1).shape == (4,)
    assert check_invariants(trace) == []


def test_check_invariants_sees_broken_synthetic_traces(tmp_path):
    trace = load_trace(valid_trace(tmp_path))
    broken = trace.events.copy()
    gemm = np.nonzero((broken["op"] == OP["gemm"]) & (broken["rank"] == 0))[0][0]
    broken["end_ns"][gemm] += 200  # runs into the wait that follows it on the host lane
    trace.events = broken
    assert any("lane host: 1 overlapping events" in p for p in check_invariants(trace))
    trace.events = trace.events[trace.events["op"] != OP["allgather"]]  # waits without their collective
    assert any("outside every collective" in p for p in check_invariants(trace))
    trace.rank_steps = trace.rank_steps[trace.rank_steps["rank"] == 0]
    assert "step 0: step records from ranks [0] only" in check_invariants(trace)


def test_recover_marks_a_failed_rank(tmp_path):
    result = recover(make_spool(tmp_path, steps=(2, 3), failed_rank=0), output=str(tmp_path / "out.h5"))
    assert result["path"] == str(tmp_path / "out.h5") and result["status"] == "failed"
    assert [f["rank"] for f in result["failures"]] == [0] and result["steps"] == [0, 1]
    trace = load_trace(result["path"])
    assert trace.status == "failed" and trace.metadata["failures"][0]["error"] == "RuntimeError: injected"
    assert check_invariants(trace) == []


def test_recover_never_overwrites_without_force(tmp_path):
    spool_dir = make_spool(tmp_path)
    path = recover(spool_dir)["path"]
    before = os.path.getmtime(path), os.path.getsize(path)
    with pytest.raises(TraceError, match="run-x.h5 already exists"):
        recover(spool_dir)
    assert (os.path.getmtime(path), os.path.getsize(path)) == before
    (tmp_path / "run-x.ranks" / "rank000001.failed.json").write_text(json.dumps({"rank": 1, "error": "late"}))
    assert recover(spool_dir, force=True)["status"] == "failed"
    assert load_trace(path).status == "failed"
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def test_recover_rank_without_metadata_or_steps(tmp_path):
    spool_dir = make_spool(tmp_path, steps=(2, 0), torn_step=False)
    os.remove(os.path.join(spool_dir, "rank000001.json"))
    result = recover(spool_dir)
    assert result["steps"] == [] and result["events_dropped"] == 2 * EVENTS_PER_STEP
    trace = load_trace(result["path"])
    assert trace.metadata["ranks_without_metadata"] == [1] and len(trace.events) == 0
    assert len(trace.steps) == 0 and trace.ranks["rank"].tolist() == [0, 1]


def test_recover_rejects_what_is_not_a_spool(tmp_path):
    with pytest.raises(TraceError, match="is not a directory"):
        recover(str(tmp_path / "nope.ranks"))
    with pytest.raises(TraceError, match="no run.json"):
        recover(str(tmp_path))
    (tmp_path / RUN_META).write_text("{not json")
    with pytest.raises(TraceError, match="run.json is unreadable"):
        recover(str(tmp_path))
    (tmp_path / RUN_META).write_text("{}")
    with pytest.raises(TraceError, match="has no world_size"):
        recover(str(tmp_path))


def test_trace_file_writer_abort_leaves_nothing(tmp_path):
    writer = TraceFileWriter(str(tmp_path / "t.h5"))
    writer.append_events(0, step_events(0, 0, 0))
    assert os.path.exists(writer.tmp_path)
    writer.abort()
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------
# tracing: the in-process tracer
# ---------------------------------------------------------------------------

def comm_record(op, axis, issue, complete, nbytes=1000, wait=0, wait_start=0, layer=1, phase=1):
    return CommRecord(op=op, axis=axis, nbytes=nbytes, issue_ns=issue, complete_ns=complete, wait_ns=wait,
                      wait_start_ns=wait_start, layer=layer, phase=phase)


GROUPS = {"none": 1, "data": 1, "z": 2, "y": 4, "x": 3}


@pytest.mark.parametrize("op, expected", [
    ("allgather", (0.0, 0.5, 2 / 3, 0.75)),
    ("reduce_scatter", (0.0, 0.5, 2 / 3, 0.75)),
    ("allreduce", (0.0, 1.0, 4 / 3, 1.5)),
])
def test_wire_factor(op, expected):
    assert tuple(wire_factor(op, p) for p in (1, 2, 3, 4)) == pytest.approx(expected)


def test_layer_vocabulary():
    tracer = Tracer(["block0.qkv", "", "block0.proj"])
    assert tracer.layer_names == LAYERS
    assert tracer.layer_index("block0.proj") == 2
    assert tracer.tag("block0.qkv", "backward") == (1, PHASE["backward"])
    assert tracer.tag("unknown", "unknown") == (0, 0)
    tracer.set_layers(tracer.layer_names)  # idempotent on its own output
    assert tracer.layer_names == LAYERS
    with pytest.raises(ValueError, match="unknown trace level"):
        Tracer(level="ops")


def traced_step(level: str, shift=(0, 0)):
    """One step with a layer scope, an op scope holding a GEMM, a bare GEMM and a wait."""
    tracer = Tracer(LAYERS[1:], level=level, rank=3, clock_offset_ns=shift[0], origin_ns=shift[1])
    tracer.begin_step(4)
    t_start = time.perf_counter_ns()
    with tracer.layer("block0.proj", "backward"):
        with tracer.op("attention"):
            tracer.compute("gemm", 1, 2, 5e6)  # inside an open op scope: FLOPs go to the scope
            tracer.compute("gemm", 1, 2, 1e6)
        t0 = time.perf_counter_ns()
        tracer.compute("gemm", t0, t0 + 50, 7e6)
        assert (tracer.where_layer, tracer.where_phase) == (2, PHASE["backward"])
    tracer.blocked(t0, t0 + 30)
    assert (tracer.where_layer, tracer.where_phase) == (0, 0)
    t_end = time.perf_counter_ns() + 100
    return tracer, tracer.end_step(t_start, t_end, [], GROUPS), (t_start, t_end)


def test_tracer_op_level_events():
    tracer, ev, (t_start, t_end) = traced_step("op")
    assert ev.dtype == EVENT_DTYPE and (ev["rank"] == 3).all() and (ev["step"] == 4).all()
    assert [OPS[o] for o in ev["op"]] == ["step", "attention", "gemm", "layer"]
    assert ev["lane"].tolist() == [LANE_STEP, LANE_HOST, LANE_HOST, LANE_LAYER]
    step, attention, gemm, layer = ev
    assert (step["start_ns"], step["end_ns"]) == (t_start, t_end)
    assert attention["flops"] == 6e6 and gemm["flops"] == 7e6 and gemm["end_ns"] - gemm["start_ns"] == 50
    for e in (attention, gemm, layer):
        assert (e["layer"], e["phase"]) == (2, PHASE["backward"])
        assert t_start <= e["start_ns"] <= e["end_ns"] <= t_end
    assert attention["end_ns"] <= gemm["start_ns"]
    # totals: the op scope's time (its GEMMs are not counted twice) plus the bare GEMM; waits apart
    assert tracer.compute_ns == attention["end_ns"] - attention["start_ns"] + 50
    assert tracer.wait_ns == 30


def test_tracer_layer_and_step_levels_keep_less():
    tracer, ev, (t_start, t_end) = traced_step("layer")
    assert [OPS[o] for o in ev["op"]] == ["step", "layer"]
    step_tracer, ev, _ = traced_step("step")
    assert [OPS[o] for o in ev["op"]] == ["step"] and ev["lane"].tolist() == [LANE_STEP]
    assert step_tracer.compute_ns >= 50 and step_tracer.wait_ns == 30  # the totals are kept at every level
    # and nothing from the collectives either
    out = step_tracer.end_step(0, 10, [comm_record("allgather", "z", 1, 5)], GROUPS)
    assert len(out) == 1


def test_tracer_synchronizes_around_ops_only_at_op_level():
    for level, expected in (("op", 2), ("layer", 0)):
        calls = []
        tracer = Tracer(LAYERS, level=level, synchronize=lambda: calls.append(1))
        with tracer.op("gelu"):
            pass
        assert len(calls) == expected, level


def test_begin_step_resets():
    tracer, _, _ = traced_step("op")
    tracer.begin_step(5)
    assert (tracer.step, tracer.events, tracer.compute_ns, tracer.wait_ns) == (5, [], 0, 0)
    assert [OPS[o] for o in tracer.end_step(0, 1, [], GROUPS)["op"]] == ["step"]


def test_end_step_applies_the_clock_shift():
    tracer = Tracer(LAYERS, level="op", clock_offset_ns=100, origin_ns=10_000)
    tracer.begin_step(0)
    tracer.compute("gemm", 20_000, 21_000, 1.0)
    records = [comm_record("allreduce", "y", 20_500, 22_000, nbytes=4000, wait=300, wait_start=21_700),
               comm_record("allgather", "z", 22_100, 0)]  # never observed complete
    ev = tracer.end_step(19_000, 23_000, records, GROUPS)
    by_op = {OPS[e["op"]]: e for e in ev}
    assert set(by_op) == {"step", "gemm", "allreduce", "allgather", "wait"}
    assert (by_op["step"]["start_ns"], by_op["step"]["end_ns"]) == (8_900, 12_900)
    assert (by_op["gemm"]["start_ns"], by_op["gemm"]["end_ns"]) == (9_900, 10_900)
    coll = by_op["allreduce"]
    assert (coll["start_ns"], coll["end_ns"], coll["issue_ns"], coll["complete_ns"]) == (10_400, 11_900) * 2
    assert coll["wire_bytes"] == 4000 * 2 * 3 // 4 and coll["wait_ns"] == 300 and coll["axis"] == AXIS["y"]
    gather = by_op["allgather"]  # a zero-length span at its (shifted) issue time
    assert (gather["start_ns"], gather["end_ns"], gather["complete_ns"], gather["lane"]) == (
        12_000, 12_000, 12_000, LANE_COMM0)
    wait = by_op["wait"]
    assert (wait["start_ns"], wait["end_ns"], wait["lane"]) == (11_600, 11_900, LANE_HOST)
    assert (wait["issue_ns"], wait["complete_ns"], wait["bytes"], wait["axis"]) == (0, 0, 4000, AXIS["y"])


def test_overlapping_collectives_get_different_comm_lanes():
    tracer = Tracer(LAYERS, level="op", rank=1)
    tracer.begin_step(2)
    records = [  # given out of issue order; the tracer sorts by issue time
        comm_record("reduce_scatter", "z", 150, 400, nbytes=900),   # overlaps A (B ends at 120)
        comm_record("allgather", "z", 100, 300, nbytes=600),        # A
        comm_record("allreduce", "x", 110, 120, nbytes=300),        # B: overlaps A
        comm_record("allgather", "data", 300, 310, nbytes=30),      # A's lane is free again at 300
        comm_record("allreduce", "y", 320, 0, nbytes=90),           # never observed complete: zero length
    ]
    ev = tracer.end_step(0, 1000, records, GROUPS)
    coll = ev[ev["lane"] >= LANE_COMM0]
    assert coll["start_ns"].tolist() == [100, 110, 150, 300, 320]
    assert (coll["lane"] - LANE_COMM0).tolist() == [0, 1, 1, 0, 0]
    assert coll["end_ns"].tolist() == [300, 120, 400, 310, 320]
    assert coll["wire_bytes"].tolist() == [300, 400, 450, 0, 135]  # z: p=2, x: p=3, data: p=1, y: p=4
    assert (coll["rank"] == 1).all() and (coll["step"] == 2).all()
    for lane in np.unique(coll["lane"]):  # disjoint on each lane
        mine = coll[coll["lane"] == lane]
        assert (mine["start_ns"][1:] >= mine["end_ns"][:-1]).all()
    assert not (ev["op"] == OP["wait"]).any()  # no record blocked


def test_collective_rows_match_wire_factor():
    tracer = Tracer(LAYERS)
    tracer.begin_step(0)
    for op in ("allgather", "reduce_scatter", "allreduce"):
        for axis, p in GROUPS.items():
            rec = comm_record(op, axis, 10, 20, nbytes=1_000_003)
            ev = tracer.end_step(0, 100, [rec], GROUPS)
            assert ev["wire_bytes"][1] == int(1_000_003 * wire_factor(op, p)), (op, p)


# ---------------------------------------------------------------------------
# traceread: errors name the file
# ---------------------------------------------------------------------------

def damaged(tmp_path, kind: str) -> str:
    bad = tmp_path / "bad" / "t.h5"
    bad.parent.mkdir()
    if kind == "missing":
        return str(bad)
    if kind == "not-hdf5":
        bad.write_text("hello")
        return str(bad)
    good = valid_trace(tmp_path)
    if kind == "truncated":
        data = open(good, "rb").read()
        bad.write_bytes(data[: len(data) // 2])
    elif kind == "no-schema":
        with h5py.File(bad, "w") as f:
            f["events"] = np.zeros(2, dtype=EVENT_DTYPE)
    elif kind == "newer-schema":
        bad.write_bytes(open(good, "rb").read())
        with h5py.File(bad, "r+") as f:
            f.attrs["schema_version"] = SCHEMA_VERSION + 1
    elif kind == "no-dataset":
        bad.write_bytes(open(good, "rb").read())
        with h5py.File(bad, "r+") as f:
            del f["rank_steps"]
    elif kind == "event-count":
        bad.write_bytes(open(good, "rb").read())
        with h5py.File(bad, "r+") as f:
            f.attrs["events"] = 3
    return str(bad)


@pytest.mark.parametrize("kind, message", [
    ("missing", "no such trace file"),
    ("not-hdf5", "not a readable HDF5 file"),
    ("truncated", "(not a readable HDF5 file|is unreadable|invalid trace)"),
    ("no-schema", "is not a fourd-mpi trace"),
    ("newer-schema", f"uses trace schema v{SCHEMA_VERSION + 1}; this fourd_mpi reads up to v{SCHEMA_VERSION}"),
    ("no-dataset", "no /rank_steps dataset"),
    ("event-count", "header says 3"),
])
def test_load_trace_errors(tmp_path, kind, message):
    path = damaged(tmp_path, kind)
    with pytest.raises(TraceError, match=message) as info:
        load_trace(path)
    assert path in str(info.value)


def test_config_values_starting_with_a_dash_stay_values():
    parser = run_parser()
    tokens = config_tokens({"results-dir": "-out", "seed": -3}, "c.toml")
    args = parser.parse_args(tokens)
    assert args.results_dir == "-out" and args.seed == -3
