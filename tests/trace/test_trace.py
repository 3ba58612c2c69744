"""Traces of real multi-rank runs: invariants, byte volumes, crash recovery, bad input."""

from __future__ import annotations

import glob
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, mpi_env

from fourd_mpi.trace.events import SCHEMA_VERSION
from fourd_mpi.trace.invariants import check_invariants
from fourd_mpi.trace.read import load_trace

pytestmark = pytest.mark.mpi

FC_LAYERS = (("qkv", 3, 1, False), ("proj", 1, 1, True), ("fc1", None, 1, False), ("fc2", 1, None, True))


def traced(run_mpi, nranks, results, *args, timeout=240):
    proc = run_mpi(nranks, ["run", "--results-dir", results, "--display", "lines", "--peak-tflops", "1", *args],
                   timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    traces = [line.split("trace: ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("trace: /")]
    assert len(traces) == 1, proc.stdout
    return traces[0], proc


def expected_wire_bytes(meta, cache=False):
    """Per-rank bytes sent per step by each FC layer's collectives (docs/design.md section 2, ring algorithms)."""
    opts = meta["run_options"]
    model, g = opts["model"], opts["grid"]
    itemsize = np.dtype(opts["dtype"]).itemsize
    h, f = model["hidden"], model["ffn_hidden"]
    m = model["batch"] * model["seq"] / (g["data"] * g["z"])
    out = {}
    for block in range(model["layers"]):
        for name, n_mult, k_mult, transposed in FC_LAYERS:
            n = h * n_mult if n_mult else f
            k = h * k_mult if k_mult else f
            layer = f"block{block}.{name}"
            in_axis, out_axis = ("y", "x") if transposed else ("x", "y")
            g_in, g_out, gz, gd = g[in_axis], g[out_axis], g["z"], g["data"]
            block_elems = n * k / (g["x"] * g["y"])
            if gz > 1:
                out[(layer, "allgather", "z")] = (gz - 1) / gz * block_elems * (1 if cache else 2)
                out[(layer, "reduce_scatter", "z")] = (gz - 1) / gz * block_elems
            if g_in > 1:
                out[(layer, "allreduce", in_axis)] = 2 * (g_in - 1) / g_in * m * n / g_out
            if g_out > 1:
                out[(layer, "allreduce", out_axis)] = 2 * (g_out - 1) / g_out * m * k / g_in
            if gd > 1:
                out[(layer, "allreduce", "data")] = 2 * (gd - 1) / gd * block_elems / gz
    return {key: value * itemsize for key, value in out.items()}


def check_volumes(trace, cache=False):
    expected = expected_wire_bytes(trace.metadata, cache)
    ev = trace.events
    fc = {trace.code("layer", layer) for layer, _, _ in expected}
    colls = ev[np.isin(ev["layer"], list(fc)) & (ev["lane"] >= 3)]
    names = {(trace.vocab["layers"][r["layer"]], trace.vocab["ops"][r["op"]], trace.vocab["axes"][r["axis"]])
             for r in colls}
    assert names == set(expected), sorted(names ^ set(expected))
    for rank in range(trace.world_size):
        for step in trace.steps["step"]:
            mine = colls[(colls["rank"] == rank) & (colls["step"] == step)]
            for (layer, op, axis), want in expected.items():
                rows = mine[(mine["layer"] == trace.code("layer", layer)) & (mine["op"] == trace.code("op", op))
                            & (mine["axis"] == trace.code("axis", axis))]
                got = int(rows["wire_bytes"].sum())
                # each message rounds its (p-1)/p share down to whole bytes
                assert abs(got - want) <= len(rows), (rank, step, layer, op, axis, got, want)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return str(tmp_path_factory.mktemp("results"))


@pytest.fixture(scope="module")
def trace_8(results):
    from conftest import mpirun

    path, proc = traced(mpirun, 8, results, "--gx", "2", "--gy", "2", "--gz", "2", "--steps", "4",
                        "--label", "inv")
    return load_trace(path), proc


def test_trace_of_an_8_rank_run_holds_its_invariants(trace_8):
    trace, proc = trace_8
    assert trace.status == "complete" and trace.schema_version == SCHEMA_VERSION
    assert trace.world_size == 8 and sorted(trace.ranks["rank"]) == list(range(8))
    assert check_invariants(trace) == []
    assert list(trace.steps["step"]) == [0, 1, 2, 3] and list(trace.steps["warmup"]) == [1, 0, 0, 0]
    # the losses of the trace are the ones printed
    printed = [float(line.split()[1]) for line in proc.stdout.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert np.allclose(printed, trace.steps["loss"][:2], rtol=1e-7)
    # per-step wall time >= each rank's blocking (host-lane) time, and it is the max over ranks
    for row in trace.steps:
        mine = trace.rank_steps[trace.rank_steps["step"] == row["step"]]
        assert row["seconds"] == pytest.approx(((mine["end_ns"] - mine["start_ns"]).max()) * 1e-9)
        assert (mine["compute_ns"] + mine["wait_ns"] <= mine["end_ns"] - mine["start_ns"]).all()


def test_byte_counts_match_the_algorithm(trace_8):
    check_volumes(trace_8[0])


def test_metadata_is_complete(trace_8):
    meta = trace_8[0].metadata
    assert meta["gpu_aware_mpi"]["library"] and meta["gpu_aware_mpi"]["reason"]
    for key in ("config", "grid", "world_size", "mpi", "device_buffers_direct", "environment", "packages",
                "start_time", "end_time", "run_id", "summary", "layers"):
        assert key in meta, key
    assert meta["grid"] == "1x2x2x2" and meta["world_size"] == 8
    assert "MPICH" in meta["mpi"]["library_version"] or "Open MPI" in meta["mpi"]["library_version"]
    assert meta["config"]["gx"] == 2 and meta["config"]["trace-level"] == "op"
    assert meta["environment"]["OMP_NUM_THREADS"] == "1"
    assert meta["packages"]["h5py"] and meta["packages"]["mpi4py"]
    assert "-inv-" in meta["run_id"]
    ranks = trace_8[0].ranks
    assert all(r["hostname"] for r in ranks)
    # one host: perf_counter is one clock, so the estimated offsets are within their uncertainty (+10 us)
    assert (np.abs(ranks["clock_offset_ns"]) <= ranks["clock_uncertainty_ns"] + 10_000).all()


def test_data_is_prepared_before_the_steps(trace_8):
    """Synthetic data is made before the first step: no step holds a `data` op; its time is reported apart."""
    trace = trace_8[0]
    meta = trace.metadata
    assert "data" not in {trace.vocab["ops"][code] for code in np.unique(trace.events["op"])}
    assert meta["data"]["batches"] == 4 and meta["data"]["prep_seconds_max"] > 0
    # gpt-tiny on 1x2x2x2: m = 8*16/2 tokens x h/x = 32 columns, input + target, float32, 4 batches
    assert meta["data"]["bytes_per_rank"] == 4 * 2 * (8 * 16 // 2) * (64 // 2) * 4
    assert meta["summary"]["data_prep_s"] == meta["data"]["prep_seconds_max"]
    assert meta["summary"]["data_batches"] == 4
    assert meta["array_pool"]["allocations"] > 0 and meta["array_pool"]["hits"] > meta["array_pool"]["allocations"]
    assert "prepared before the first step" in trace_8[1].stdout


def test_pandas_view(trace_8):
    df = trace_8[0].events_frame()
    assert set(df["op"].unique()) >= {"step", "layer", "gemm", "allgather", "reduce_scatter", "allreduce", "wait"}
    gemm = df[df["op"] == "gemm"]
    assert (gemm["flops"] > 0).all() and (gemm["layer"].str.startswith("block")).all()
    assert set(df["lane"].unique()) >= {"step", "layer", "host", "comm0"}


@pytest.mark.parametrize("nranks, args, cache", [
    (8, ["--gdata", "2", "--gz", "2", "--gx", "2", "--overlap", "all"], False),
    (6, ["--gz", "3", "--gy", "2", "--hidden", "48", "--heads", "6", "--ffn-hidden", "192", "--seq", "8",
         "--batch", "6", "--cache-weights", "--dtype", "float64"], True),
], ids=["8-ranks-data2-overlap-all", "6-ranks-z3-cached"])
def test_volumes_and_invariants_on_other_grids(run_mpi, tmp_path, nranks, args, cache):
    path, _ = traced(run_mpi, nranks, str(tmp_path), "--steps", "2", *args)
    trace = load_trace(path)
    assert check_invariants(trace) == []
    check_volumes(trace, cache)


def test_step_level_keeps_only_steps(run_mpi, tmp_path):
    path, _ = traced(run_mpi, 4, str(tmp_path), "--gx", "2", "--gy", "2", "--steps", "3", "--trace-level", "step")
    trace = load_trace(path)
    assert set(trace.decode("op", trace.events["op"])) == {"step"}
    assert len(trace.events) == 12
    # the totals behind the summary are kept at every level
    assert (trace.rank_steps["compute_ns"] > 0).all()


@pytest.mark.parametrize("mode, status", [("kill", "partial"), ("raise", "failed")])
def test_a_rank_dying_mid_run_leaves_a_recoverable_trace(run_mpi, tmp_path, mode, status):
    proc = run_mpi(8, ["run", "--gx", "2", "--gy", "2", "--gz", "2", "--steps", "6", "--results-dir", tmp_path,
                       "--run-id", "crash", "--display", "lines", "--peak-tflops", "1",
                       "--inject-fault", f"5:3:{mode}"], timeout=120)
    assert proc.returncode != 0
    assert not os.path.exists(tmp_path / "crash.h5")
    spool = tmp_path / "crash.ranks"
    assert spool.is_dir()
    rec = subprocess.run([sys.executable, "-m", "fourd_mpi", "trace", "recover", str(spool)], capture_output=True,
                         text=True, timeout=60, env=mpi_env(), cwd=REPO)
    assert rec.returncode == 0, rec.stdout + rec.stderr
    assert f"status {status}" in rec.stdout
    trace = load_trace(str(tmp_path / "crash.h5"))
    assert trace.status == status
    assert list(trace.steps["step"]) == [0, 1, 2]
    assert sorted(trace.ranks["rank"]) == list(range(8))
    assert check_invariants(trace) == []
    check_volumes(trace)
    assert trace.metadata["summary"]["steps"] == 2  # steps 1 and 2 (step 0 is warm-up)
    if mode == "raise":
        assert "injected fault" in trace.metadata["failures"][0]["error"]
        assert trace.metadata["failures"][0]["rank"] == 5
    # recovering again does not overwrite the recovered trace
    again = subprocess.run([sys.executable, "-m", "fourd_mpi", "trace", "recover", str(spool)], capture_output=True,
                           text=True, timeout=60, env=mpi_env(), cwd=REPO)
    assert again.returncode == 2 and "already exists" in again.stderr


def _one_line_errors(proc, nranks):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fourd-mpi: error: ")]
    assert len(errors) == nranks and len(set(errors)) == 1, proc.stderr
    return errors[0]


def test_unwritable_results_directory(run_mpi, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = run_mpi(8, ["run", "--gx", "2", "--results-dir", blocker / "results", "--steps", "1", "--warmup", "0"],
                   timeout=60)
    assert "cannot create the results directory" in _one_line_errors(proc, 8)
    assert proc.stdout.strip() == ""
    assert blocker.read_text() == "not a directory"


def test_an_existing_run_id_is_never_overwritten(run_mpi, tmp_path):
    args = ["--gx", "2", "--gy", "2", "--steps", "1", "--warmup", "0", "--run-id", "fixed"]
    first, _ = traced(run_mpi, 4, str(tmp_path), *args)
    digest = hashlib.sha256(open(first, "rb").read()).hexdigest()
    proc = run_mpi(4, ["run", "--results-dir", tmp_path, *args], timeout=60)
    assert "already exists" in _one_line_errors(proc, 4)
    assert hashlib.sha256(open(first, "rb").read()).hexdigest() == digest
    assert sorted(os.listdir(tmp_path)) == ["fixed.h5", "index.jsonl"]  # the first run's index line
    second, _ = traced(run_mpi, 4, str(tmp_path), *args, "--force", "--steps", "2")
    assert second == first and len(load_trace(second).steps) == 2


def test_concurrent_jobs_share_a_results_directory(tmp_path):
    from conftest import find_mpiexec

    cmd = [find_mpiexec(), "-n", "2", sys.executable, "-m", "fourd_mpi", "run", "--gx", "2", "--steps", "2",
           "--results-dir", str(tmp_path), "--label", "same", "--display", "quiet", "--peak-tflops", "1"]
    jobs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(), cwd=REPO)
            for _ in range(3)]
    for job in jobs:
        out, err = job.communicate(timeout=180)
        assert job.returncode == 0, out + err
    files = sorted(glob.glob(str(tmp_path / "*.h5")))
    assert len(files) == 3 and len({load_trace(f).metadata["run_id"] for f in files}) == 3
    assert not glob.glob(str(tmp_path / "*.ranks")) and not glob.glob(str(tmp_path / ".*"))


@pytest.mark.parametrize("damage", ["truncated", "no-superblock", "not-a-trace", "missing"])
def test_damaged_trace_files_give_a_clear_error(trace_8, tmp_path, damage):
    good = trace_8[0].path
    bad = tmp_path / "bad.h5"
    if damage == "truncated":
        data = open(good, "rb").read()
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "no-superblock":
        data = bytearray(open(good, "rb").read())
        data[:512] = bytes(512)
        bad.write_bytes(bytes(data))
    elif damage == "not-a-trace":
        import h5py

        with h5py.File(bad, "w") as f:
            f["x"] = np.arange(3)
    for cmd in (["show"], ["check"]):
        proc = subprocess.run([sys.executable, "-m", "fourd_mpi", "trace", *cmd, str(bad)], capture_output=True,
                              text=True, timeout=60, env=mpi_env(), cwd=REPO)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr and proc.stderr.startswith("fourd-mpi: error: "), proc.stderr
        assert str(bad) in proc.stderr
    assert open(good, "rb").read(8) == b"\x89HDF\r\n\x1a\n"  # the original is untouched


def test_config_file_and_command_line(run_mpi, tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('model = "gpt-tiny"\nsteps = 5\ntrace_level = "layer"\n[grid]\ngx = 2\ngy = 2\n')
    path, proc = traced(run_mpi, 4, str(tmp_path), "--config", cfg, "--steps", "2", "--show-config")
    trace = load_trace(path)
    assert len(trace.steps) == 2  # the command line wins
    assert trace.metadata["grid"] == "1x1x2x2" and trace.metadata["level"] == "layer"
    assert trace.metadata["config"]["steps"] == 2 and trace.metadata["config"]["gx"] == 2
    assert 'trace-level = "layer"' in proc.stdout
    # the printed (resolved) configuration is itself a valid config file
    printed = proc.stdout.split("resolved configuration (reusable as --config FILE.toml):\n", 1)[1]
    lines = [line.strip() for line in printed.splitlines()]
    toml_text = "\n".join(lines[: next(i for i, line in enumerate(lines) if line.startswith("fourd-mpi "))])
    again = tmp_path / "again.toml"
    again.write_text(toml_text.replace(f'results-dir = "{tmp_path}"', f'results-dir = "{tmp_path / "b"}"'))
    path2, _ = traced(run_mpi, 4, str(tmp_path / "b"), "--config", again)
    assert np.array_equal(load_trace(path2).steps["loss"], trace.steps["loss"])


@pytest.mark.parametrize("content, suffix, message", [
    ("gx: 2\nbogus: 1\n", ".yaml", "unknown option 'bogus'"),
    ("gx = [2\n", ".toml", "is malformed"),
    ("gx: 0\n", ".yaml", "--gx: expected a positive integer, got 0"),
    ("steps = 2\n", ".ini", "unknown format .ini"),
])
def test_bad_config_files(run_mpi, tmp_path, content, suffix, message):
    cfg = tmp_path / f"c{suffix}"
    cfg.write_text(content)
    proc = run_mpi(4, ["run", "--config", cfg, "--results-dir", tmp_path], timeout=60)
    assert message in _one_line_errors(proc, 4)


def test_progress_bar(run_mpi, tmp_path):
    proc = run_mpi(2, ["run", "--gx", "2", "--steps", "3", "--results-dir", tmp_path, "--display", "bar",
                       "--peak-tflops", "1"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "training" in proc.stderr and "loss" in proc.stderr and "3/3" in proc.stderr
    assert "step time: median" in proc.stdout


def test_summary_lines(trace_8):
    out = trace_8[1].stdout
    for text in ("step time: median", "compute", "exposed communication", "GFLOP/s", "MFU: ", "HFU: ",
                 "% of measured GEMM: ", "tokens/s",
                 "trace: "):
        assert text in out, text
    summary = trace_8[0].metadata["summary"]
    assert summary["steps"] == 3 and summary["peak_tflops"] == 1.0
    assert 0 < summary["compute_share"] < 1 and 0 <= summary["wait_share"] < 1


def test_trace_show_and_check(trace_8):
    for cmd, text in (("show", "status complete"), ("check", ": ok")):
        proc = subprocess.run([sys.executable, "-m", "fourd_mpi", "trace", cmd, trace_8[0].path], capture_output=True,
                              text=True, timeout=60, env=mpi_env(), cwd=REPO)
        assert proc.returncode == 0 and text in proc.stdout, proc.stdout + proc.stderr
