"""The CUDA stream rules of :class:`fourd_mpi.core.backend.CupyBackend`, checked without a GPU.

``tests/helpers/simcupy_run.py`` runs the real CuPy backend, step, algorithms and collectives on a
simulated CuPy (``tests/helpers/simcupy.py``: NumPy memory, a vector-clock model of streams and
events) under a real ``mpiexec``, with communicators that check every buffer handed to MPI. Each
run must pass ``verify``'s numerical check with zero ordering violations; and removing one
synchronization from the backend must be reported, naming the rule.
"""

from __future__ import annotations

import re

import pytest
from conftest import mpirun

SCRIPT = "tests/helpers/simcupy_run.py"
COMMON = ["--backend", "cupy", "--model", "gpt-tiny", "--steps", "2"]

#: (algorithm, ranks, extra options): every algorithm, every grid of the world, an odd world among them
CASES = [
    ("axonn4d", 4, ["--all-grids"]),
    ("axonn4d", 3, ["--all-grids", "--batch", "6"]),
    ("megatron1d", 2, ["--all-grids"]),
    ("fsdp", 2, ["--all-grids"]),
    ("dp", 3, ["--all-grids", "--batch", "6"]),
    ("optimus3d", 8, ["--all-grids"]),  # a cube of tensor ranks: q = 2
    ("pipeline", 4, ["--all-grids", "--ginter", "2", "--microbatches", "2"]),
]


def _summary(proc, ranks):
    """``{rank: (violations, MPI calls checked)}`` from every rank's last line (ranks' output may interleave)."""
    found = re.findall(r"streamcheck rank (\d+): (\d+) violations, (\d+) MPI calls checked", proc.stdout)
    summary = {int(r): (int(v), int(c)) for r, v, c in found}
    assert sorted(summary) == list(range(ranks)), proc.stdout + proc.stderr
    return summary


@pytest.mark.parametrize("buffers", ["direct", "staged"])
@pytest.mark.parametrize("algorithm,ranks,extra", CASES, ids=[f"{a}-{n}" for a, n, _ in CASES])
def test_stream_rules_hold(algorithm, ranks, extra, buffers):
    args = ["verify", "--algorithm", algorithm, "--device-buffers", buffers, *COMMON, *extra,
            "--overlap", "none", "--overlap", "all"]
    proc = mpirun(ranks, args, timeout=240, script=SCRIPT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert " 0 failed" in proc.stdout and " passed" in proc.stdout, out[-4000:]
    summary = _summary(proc, ranks)
    assert all(violations == 0 for violations, _ in summary.values()), out[-4000:]
    assert max(checked for _, checked in summary.values()) > 0, out[-4000:]  # the checked communicators saw MPI


#: (SIMCUPY_BREAK, buffers, options, the rule that must be reported). For the collectives ``mpi_send_buffer``
#: and ``mpi_recv_buffer`` are called back to back, so either synchronization covers the other's buffer: the
#: pipeline's Isend / Irecv (one buffer per call) shows each one's removal alone.
BREAKS = [
    ("send-sync", "direct", ["--algorithm", "pipeline", "--ginter", "2", "--grid", "1x1x1x1"],
     "rule 1: MPI reads a device buffer before the kernels producing it finished"),
    ("recv-sync", "direct", ["--algorithm", "pipeline", "--ginter", "2", "--grid", "1x1x1x1"],
     "MPI writes memory that a queued copy or kernel may still read"),
    ("h2d-wait", "staged", ["--algorithm", "axonn4d", "--grid", "1x1x1x2"],
     "compute stream (current) is not ordered after the write by stream 1 (memcpyAsync(H2D)"),
    ("fence", "staged", ["--algorithm", "pipeline", "--ginter", "2", "--microbatches", "2", "--grid", "1x1x1x1"],
     "MPI writes memory that a queued copy or kernel may still read"),
]


@pytest.mark.parametrize("broken,buffers,extra,rule", BREAKS, ids=[b[0] for b in BREAKS])
def test_missing_synchronization_is_reported(monkeypatch, broken, buffers, extra, rule):
    monkeypatch.setenv("SIMCUPY_BREAK", broken)
    proc = mpirun(2, ["verify", "--device-buffers", buffers, *COMMON, *extra], timeout=120, script=SCRIPT)
    out = proc.stdout + proc.stderr
    assert proc.returncode in (3, 4), out[-4000:]
    assert rule in proc.stdout, out[-4000:]


#: Open MPI 4.1's routes (core/gpuaware.py ROUTE_RULES, ob1): point-to-point and blocking calls direct, the
#: nonblocking collectives staged; one step mixes both paths on the same streams
MIXED = "nb_gather=staged,nb_reduce=staged"


@pytest.mark.parametrize("algorithm,ranks,extra", [c for c in CASES if c[0] in ("pipeline", "axonn4d") and c[1] == 4],
                         ids=["axonn4d-4", "pipeline-4"])
def test_stream_rules_hold_with_mixed_routes(monkeypatch, algorithm, ranks, extra):
    monkeypatch.setenv("FOURD_MPI_TEST_ROUTES", MIXED)
    args = ["verify", "--algorithm", algorithm, "--device-buffers", "direct", *COMMON, *extra,
            "--overlap", "none", "--overlap", "all"]
    proc = mpirun(ranks, args, timeout=240, script=SCRIPT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert " 0 failed" in proc.stdout, out[-4000:]
    assert all(violations == 0 for violations, _ in _summary(proc, ranks).values()), out[-4000:]
