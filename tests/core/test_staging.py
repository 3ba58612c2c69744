"""Host staging of MPI buffers, testable without a GPU (NumPy's emulated staging), and the
choices around it: buffer mode decision, staging pool, dtype/TF32 options, trace events.

Under mpiexec: staged and direct steps are bitwise identical; every staged collective
has a d2h copy before its issue and an h2d copy after its completion with matching
bytes (in memory and in the trace); analysis and export read traces with copy events.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fourd_mpi.core.backend import DTYPES, NumpyBackend, StagingPool, check_dtype_options, make_backend, select_device
from fourd_mpi.errors import BackendError, ConfigError
from fourd_mpi.run.build import FORCE_DIRECT_ENV, check_forced_direct, choose_mpi_buffers


# pure pieces -------------------------------------------------------------------
class Fence:
    def __init__(self):
        self.done = False


def test_pool_reuses_buffers_and_respects_fences():
    allocated = []

    def allocate(n):
        allocated.append(n)
        return np.empty(n, dtype=np.uint8)

    pool = StagingPool(allocate)
    a = pool.acquire((4, 2), np.float64)
    assert a.shape == (4, 2) and a.dtype == np.float64 and pool.allocations == 1 and pool.in_use == 1
    pool.release(a)
    b = pool.acquire((16,), np.float32)  # same byte size, other shape and dtype: the same memory
    assert pool.allocations == 1 and np.shares_memory(a, b)
    fence = Fence()
    pool.release(b, fence=fence)
    c = pool.acquire((64,), np.uint8)  # fenced buffer not reusable until its copy is done
    assert pool.allocations == 2 and not np.shares_memory(b, c)
    fence.done = True
    d = pool.acquire((8,), np.float64)
    assert pool.allocations == 2 and np.shares_memory(b, d)
    pool.release(c)
    pool.release(d)
    assert pool.stats() == {"allocations": 2, "bytes_allocated": 128, "in_use": 0, "free": 2}
    assert allocated == [64, 64]


def test_numpy_emulated_staging_copies():
    b = NumpyBackend(np.float64, staged=True)
    x = np.arange(6.0).reshape(2, 3)
    send, d2h = b.stage_to_host(x)
    assert np.array_equal(send, x) and not np.shares_memory(send, x) and d2h.nbytes == x.nbytes
    assert d2h.start_ns <= d2h.end_ns
    recv = b.staging_buffer((3, 2))
    recv[...] = 7.0
    out, h2d = b.stage_to_device(recv, (3, 2))
    assert np.array_equal(out, np.full((3, 2), 7.0)) and not np.shares_memory(out, recv)
    assert h2d.resolve().end_ns >= h2d.start_ns and h2d.nbytes == out.nbytes
    b.release_staging(send)
    assert b.pool.in_use == 0
    assert "staged (emulated" in b.describe()
    assert make_backend("numpy", np.float32, device_buffers="staged").staged
    assert not make_backend("numpy", np.float32, device_buffers="auto").staged


@pytest.mark.parametrize("local_rank, visible, device", [(0, 1, 0), (3, 1, 0), (3, 4, 3), (5, 4, 1), (7, 2, 1)])
def test_device_is_local_rank_modulo_visible(local_rank, visible, device):
    assert select_device(local_rank, visible) == device


def test_no_visible_device_is_a_clear_error():
    with pytest.raises(BackendError, match="CUDA_VISIBLE_DEVICES"):
        select_device(0, 0)


@pytest.mark.parametrize("dtype, backend, tf32, message", [
    ("bfloat16", "numpy", False, "bfloat16 needs the cupy backend"),
    ("float64", "auto", True, "--tf32 applies to float32 GEMMs only"),
    ("float32", "numpy", True, "--tf32 needs the cupy backend"),
    ("float8", "auto", False, "unknown dtype 'float8'"),
])
def test_dtype_options_rejected(dtype, backend, tf32, message):
    with pytest.raises(ConfigError, match=message):
        check_dtype_options(dtype, backend, tf32)


def test_dtype_options_accepted():
    for dtype in DTYPES:
        check_dtype_options(dtype, "cupy", False)
    check_dtype_options("float32", "cupy", True)
    check_dtype_options("float32", "auto", True)  # decided when the backend is known
    check_dtype_options("float16", "numpy", False)


OK = {"ok": True, "detail": "result correct"}
BAD = {"ok": False, "detail": "rank 1: 3 of 1024 elements wrong"}


@pytest.mark.parametrize("requested, backend, evidence, smoke, mode, words", [
    ("auto", "numpy", False, None, "direct", "host arrays"),
    ("direct", "numpy", False, None, "direct", "host arrays"),
    ("staged", "numpy", False, None, "staged", "emulated"),
    ("staged", "cupy", True, None, "staged", "--device-buffers staged"),
    ("auto", "cupy", False, None, "staged", "auto: MPICH built without CUDA"),
    ("auto", "cupy", True, BAD, "staged", "smoke test failed (rank 1"),
    ("auto", "cupy", True, OK, "direct", "smoke test passed"),
    ("direct", "cupy", False, OK, "direct", "--device-buffers direct (smoke test passed)"),
])
def test_buffer_mode_decision(requested, backend, evidence, smoke, mode, words):
    got = choose_mpi_buffers(requested, backend, evidence, "MPICH built without CUDA", smoke)
    assert got.mode == mode and got.requested == requested and words in got.reason
    assert got.emulated == (backend == "numpy" and mode == "staged")


def test_forced_direct_with_a_failed_smoke_test_is_an_error():
    with pytest.raises(BackendError, match="smoke-test Iallreduce on a device buffer failed"):
        choose_mpi_buffers("direct", "cupy", True, "x", BAD)


OMPI41 = {"p2p": "direct", "blocking": "direct", "nb_gather": "staged", "nb_reduce": "staged"}


def test_forced_direct_where_the_documentation_says_staged_is_refused_before_any_device_pointer():
    # Open MPI 4.1 (ob1): its FAQ lists MPI_Iallgather and MPI_Iallreduce as not CUDA-aware; forced, it segfaulted
    with pytest.raises(BackendError, match=r"^--device-buffers direct, but this MPI's documentation says "
                                           r"nb_gather, nb_reduce do not take device buffers \(Open MPI FAQ\)"):
        check_forced_direct("direct", "cupy", OMPI41, "Open MPI FAQ", {})


@pytest.mark.parametrize("requested, backend, documented, env", [
    ("auto", "cupy", OMPI41, {}),  # auto stages those classes itself
    ("staged", "cupy", OMPI41, {}),
    ("direct", "numpy", OMPI41, {}),  # host arrays: nothing to crash
    ("direct", "cupy", {cls: "direct" for cls in OMPI41}, {}),  # MPICH with CUDA: every class documented direct
    ("direct", "cupy", {}, {}),  # no rule (a simulated or unknown MPI): the smoke test decides
    ("direct", "cupy", OMPI41, {FORCE_DIRECT_ENV: "1"}),  # the user asks for it anyway
])
def test_forced_direct_passes_where_nothing_documented_says_staged(requested, backend, documented, env):
    assert check_forced_direct(requested, backend, documented, "x", env) is None


# under mpiexec -------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [2, 4])
def test_staged_equals_direct_bitwise(run_mpi, nranks):
    proc = run_mpi(nranks, [], script="tests/helpers/mpi_staging_check.py", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "staging checks ok" in proc.stdout


@pytest.mark.mpi
def test_staged_trace_events(run_mpi, tmp_path):
    from fourd_mpi.analysis import export
    from fourd_mpi.analysis import tables as analysis
    from fourd_mpi.trace.invariants import check_invariants
    from fourd_mpi.trace.read import load_trace

    proc = run_mpi(4, ["run", "--gz", "2", "--gx", "2", "--steps", "3", "--device-buffers", "staged",
                       "--overlap", "all", "--poll-flops", "5000", "--results-dir", tmp_path, "--run-id", "staged",
                       "--display", "quiet", "--show-config"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MPI buffers: staged (numpy backend: staging emulated" in proc.stdout
    trace = load_trace(str(tmp_path / "staged.h5"))
    assert check_invariants(trace) == []
    assert trace.metadata["mpi_buffers"]["mode"] == "staged" and trace.metadata["mpi_buffers"]["emulated"]
    assert trace.metadata["config"]["device-buffers"] == "staged" and trace.metadata["config"]["tf32"] is False
    assert trace.metadata["device"]["kind"] == "cpu"
    ev = trace.events
    ops = trace.vocab["ops"]
    code = {name: ops.index(name) for name in ("d2h", "h2d", "allgather", "reduce_scatter", "allreduce")}
    colls = ev[np.isin(ev["op"], [code["allgather"], code["reduce_scatter"], code["allreduce"]])]
    staged = colls[colls["bytes"] > 8]  # the loss all-reduces of host scalars are not staged
    copies = {name: ev[ev["op"] == code[name]] for name in ("d2h", "h2d")}
    assert len(copies["d2h"]) == len(copies["h2d"]) == len(staged) > 0
    grid = {"z": 2, "x": 2}
    axes = trace.vocab["axes"]
    for c in staged:
        same = (lambda e: e[(e["rank"] == c["rank"]) & (e["step"] == c["step"]) & (e["lane"] == c["lane"])
                          & (e["axis"] == c["axis"])])
        d2h = same(copies["d2h"])
        h2d = same(copies["h2d"])
        before = d2h[(d2h["end_ns"] <= c["issue_ns"])]
        after = h2d[(h2d["start_ns"] >= c["complete_ns"])]
        assert len(before) and len(after), c
        p = grid[axes[c["axis"]]]
        op = ops[c["op"]]
        sent = {"allgather": c["bytes"] // p, "reduce_scatter": c["bytes"], "allreduce": c["bytes"]}[op]
        received = {"allgather": c["bytes"], "reduce_scatter": c["bytes"] // p, "allreduce": c["bytes"]}[op]
        assert sent in before["bytes"] and received in after["bytes"]
    # readers: breakdown, communication table (copies as their own rows), Perfetto export
    bd = analysis.breakdown(trace)
    assert abs(bd["share"].sum() - 1.0) < 1e-9
    table = analysis.comm_table(trace)
    rows = table[table["op"].isin(["d2h", "h2d"])]
    assert len(rows) and rows["busbw_gbps"].isna().all() and (rows["algbw_gbps"] > 0).all()
    assert table[table["op"] == "allgather"]["busbw_gbps"].notna().all()
    out = tmp_path / "staged.json"
    export.write_perfetto(trace, str(out))
    names = {str(e.get("name", "")).split(" ")[0] for e in json.loads(out.read_text())["traceEvents"]}
    assert {"d2h", "h2d", "allgather"} <= names


@pytest.mark.mpi
def test_verify_staged_against_the_reference(run_mpi):
    proc = run_mpi(4, ["verify", "--dtype", "float64", "--device-buffers", "staged", "--all-grids",
                       "--overlap", "all", "--poll-flops", "3000"], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " 0 failed" in proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("args, message", [
    (["--dtype", "bfloat16", "--backend", "numpy"], "dtype bfloat16 needs the cupy backend"),
    (["--tf32", "--backend", "numpy"], "--tf32 needs the cupy backend"),
    (["--tf32", "--dtype", "float64"], "--tf32 applies to float32 GEMMs only"),
    (["--device-buffers", "zero-copy"], "--device-buffers: invalid choice: 'zero-copy'"),
])
def test_bad_numerics_options_fail_on_every_rank(run_mpi, args, message):
    proc = run_mpi(2, ["run", *args], timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fourd-mpi: error: ")]
    assert len(errors) == 2 and len(set(errors)) == 1 and message in errors[0], proc.stderr


@pytest.mark.mpi
def test_info_reports_device_detection_and_buffers(run_mpi):
    proc = run_mpi(2, ["info", "--device-buffers", "staged"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "GPU-aware MPI: MPICH" in proc.stdout or "GPU-aware MPI:" in proc.stdout
    assert "MPI buffers: staged (numpy backend: staging emulated" in proc.stdout


def test_help_documents_the_numpy_emulation():
    from fourd_mpi.cli.run import run_parser

    run = run_parser()
    text = " ".join(run.format_help().split())
    assert "emulated staging" in text and "--tf32" in text and "bfloat16" in text


def test_per_class_routes_decision():
    routes = {"p2p": "direct", "blocking": "direct", "nb_gather": "staged", "nb_reduce": "staged"}
    # CuPy auto with Open MPI's verdict: the classes the rules allow go direct, the others stage
    got = choose_mpi_buffers("auto", "cupy", False, "Open MPI ob1", None, routes)
    assert got.mode == "mixed" and got.routes == routes and "direct for p2p, blocking" in got.reason
    # a failed smoke test stages everything; the forced modes override every class
    assert choose_mpi_buffers("auto", "cupy", True, "x", BAD,
                              dict(routes, nb_reduce="direct")).routes["p2p"] == "staged"
    assert set(choose_mpi_buffers("direct", "cupy", False, "x", OK, routes).routes.values()) == {"direct"}
    assert set(choose_mpi_buffers("staged", "cupy", True, "x", None, routes).routes.values()) == {"staged"}
    # the testing hook on NumPy: emulated staging for that class only
    hooked = choose_mpi_buffers("auto", "numpy", False, "x", None, routes, {"nb_gather": "staged"})
    assert hooked.mode == "mixed" and hooked.emulated and hooked.routes["nb_gather"] == "staged"
    assert hooked.routes["nb_reduce"] == "direct" and "FOURD_MPI_TEST_ROUTES" in hooked.reason


def test_backend_routes_per_class():
    b = NumpyBackend(np.float32)
    b.set_routes({"p2p": "direct", "blocking": "direct", "nb_gather": "staged", "nb_reduce": "direct"})
    assert b.staged and b.pool is not None and b.mpi_mode() == "mixed"
    assert b.staged_for("nb_gather") and not b.staged_for("nb_reduce") and not b.staged_for("p2p")
    b.set_staged(False)  # the forced modes set every class
    assert not b.staged_for("nb_gather") and b.mpi_mode() == "direct"


@pytest.mark.mpi
def test_one_class_staged_routes_only_its_collectives(run_mpi, tmp_path, monkeypatch):
    """The test hook stages nb_gather (Iallgather) only: d2h/h2d copies sit next to the all-gathers and next to
    no reduce-scatter or all-reduce."""
    from fourd_mpi.trace.invariants import check_invariants
    from fourd_mpi.trace.read import load_trace

    monkeypatch.setenv("FOURD_MPI_TEST_ROUTES", "nb_gather=staged")
    proc = run_mpi(4, ["run", "--gz", "2", "--gx", "2", "--steps", "2", "--results-dir", tmp_path,
                       "--run-id", "routed", "--display", "quiet", "--show-config"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MPI buffers: mixed" in proc.stdout
    trace = load_trace(str(tmp_path / "routed.h5"))
    assert check_invariants(trace) == []
    buffers = trace.metadata["mpi_buffers"]
    assert buffers["mode"] == "mixed" and buffers["emulated"]
    assert buffers["routes"] == {"p2p": "direct", "blocking": "direct", "nb_gather": "staged", "nb_reduce": "direct"}
    assert set(trace.metadata["gpu_aware_mpi"]["routes"]) == {"p2p", "blocking", "nb_gather", "nb_reduce"}
    ev, ops = trace.events, trace.vocab["ops"]
    code = {name: ops.index(name) for name in ("d2h", "h2d", "allgather", "reduce_scatter", "allreduce")}
    gathers = ev[(ev["op"] == code["allgather"])]
    reductions = ev[np.isin(ev["op"], [code["reduce_scatter"], code["allreduce"]]) & (ev["bytes"] > 8)]
    copies = ev[np.isin(ev["op"], [code["d2h"], code["h2d"]])]
    assert len(gathers) and len(reductions)
    assert len(copies) == 2 * len(gathers)  # one d2h and one h2d per all-gather, none for the reductions
    gather_lanes = {(int(e["rank"]), int(e["step"]), int(e["lane"]), int(e["axis"])) for e in gathers}
    for c in copies:
        assert (int(c["rank"]), int(c["step"]), int(c["lane"]), int(c["axis"])) in gather_lanes
