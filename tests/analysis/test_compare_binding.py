"""Each rank's CPU binding recorded by real runs (``mpiexec -bind-to core`` and no binding, 2 and 3 ranks), the run
header's binding line, and ``compare``'s note on unpinned runs (none for pinned runs or old traces without the key).

The expectations come from the machine, not from the code under test: an unbound rank inherits this process's
affinity (so two of them share every CPU: not pinned); ``-bind-to core`` gives each rank one core, pinned when
there are at least as many cores as ranks (on 2 cores, 3 ranks: two share a core, not pinned)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, bind_to_core, find_mpiexec, mpi_env

from fourd_mpi.core.binding import cpu_ranges
from fourd_mpi.trace.read import load_trace

pytestmark = pytest.mark.mpi
pytest.importorskip("scipy")

BASELINES = REPO / "results" / "baselines"
HAS_AFFINITY = hasattr(os, "sched_getaffinity")


def allowed_cores() -> int:
    """Distinct cores among the CPUs this process may run on (a core's hardware threads counted once)."""
    cores = set()
    for cpu in os.sched_getaffinity(0):
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        cores.add(path.read_text().strip() if path.exists() else str(cpu))
    return len(cores)


def fourd_run(ranks: int, bind: bool, results: Path):
    """One short traced run; ``(stdout, trace path)``."""
    cmd = [find_mpiexec(), "-n", str(ranks), *(bind_to_core() if bind else []), sys.executable, "-m", "fourd_mpi",
           "run", "--gdata", str(ranks), "--model", "gpt-tiny", "--batch", "6", "--steps", "4", "--warmup", "1",
           "--results-dir", str(results), "--show-config"]
    before = set(results.glob("*.h5")) if results.exists() else set()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=mpi_env(), cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    (trace,) = set(results.glob("*.h5")) - before
    return done.stdout, trace


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not HAS_AFFINITY:
        pytest.skip("no os.sched_getaffinity here: nothing is recorded")
    base = tmp_path_factory.mktemp("binding")
    out = {}
    for ranks in (2, 3):
        out[ranks, "bound"] = fourd_run(ranks, True, base / f"np{ranks}")
        out[ranks, "free"] = fourd_run(ranks, False, base / f"np{ranks}")
    out[2, "bound2"] = fourd_run(2, True, base / "np2")
    return out


def compare(*args):
    done = subprocess.run([sys.executable, "-m", "fourd_mpi", "compare", *map(str, args)], capture_output=True,
                          text=True, timeout=300, env=mpi_env(), cwd=REPO)
    assert done.returncode in (0, 1), done.stderr
    return done


@pytest.mark.parametrize("ranks", [2, 3])
def test_unbound_ranks_record_their_real_affinity_and_are_not_pinned(runs, ranks):
    stdout, path = runs[ranks, "free"]
    binding = load_trace(str(path)).metadata["binding"]
    mine = cpu_ranges(os.sched_getaffinity(0))  # an unbound rank inherits the launcher's affinity
    assert binding["cpus"] == [mine] * ranks and binding["num_cpus"] == [len(os.sched_getaffinity(0))] * ranks
    assert binding["pinned"] is False and binding["shared_ranks"] == ranks
    assert binding["node_cpus"] == [os.cpu_count()]
    assert "(not pinned)" in stdout and "note: ranks not pinned" in stdout and "mpiexec -bind-to core" in stdout


@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_bound_to_cores_record_one_core_each(runs, ranks):
    stdout, path = runs[ranks, "bound"]
    binding = load_trace(str(path)).metadata["binding"]
    expect = ranks <= allowed_cores()  # else two ranks share a core
    assert binding["pinned"] is expect, binding
    assert all(n < os.cpu_count() for n in binding["num_cpus"]) or os.cpu_count() == 1
    assert (binding["shared_ranks"] == 0) is expect
    line = next(t for t in stdout.splitlines() if "binding (CPU affinity of each rank)" in t)
    assert line.endswith("(pinned)" if expect else "(not pinned)")
    assert ("note: ranks not pinned" in stdout) is not expect


def test_compare_notes_the_unpinned_side_only(runs):
    free, bound, bound2 = runs[2, "free"][1], runs[2, "bound"][1], runs[2, "bound2"][1]
    if not load_trace(str(bound)).metadata["binding"]["pinned"]:
        pytest.skip("fewer than 2 cores here: -bind-to core cannot pin 2 ranks")
    done = compare(free, "--baseline", bound)
    note = [t for t in done.stdout.splitlines() if t.startswith("note: ranks not pinned")]
    assert note == [note[0]] and "1 of 1 new run(s) and 0 of 1 baseline run(s)" in note[0]
    assert "mpiexec -bind-to core" in note[0] and "srun --cpu-bind=cores" in note[0]
    assert "Open MPI: mpiexec --bind-to core" in note[0]
    back = json.loads(compare(bound, "--baseline", free, "--format", "json").stdout)
    assert "0 of 1 new run(s) and 1 of 1 baseline run(s)" in back["binding_note"]
    assert back["comparisons"][0]["new"]["pinned"] == [True] and back["comparisons"][0]["baseline"]["pinned"] == [False]
    pinned = compare(bound2, "--baseline", bound)
    assert "not pinned" not in pinned.stdout
    assert json.loads(compare(bound2, "--baseline", bound, "--format", "json").stdout)["binding_note"] is None


def test_the_note_does_not_change_the_verdict(runs):
    free, bound = runs[2, "free"][1], runs[2, "bound"][1]
    with_note = json.loads(compare(free, "--baseline", bound, "--format", "json").stdout)
    from fourd_mpi.analysis.compare import Settings, compare_runs
    from fourd_mpi.trace.indexing import entry_of_trace
    from fourd_mpi.trace.summary import step_stats

    def side(path):
        trace = load_trace(str(path))
        entry = entry_of_trace(trace, str(path.parent))
        entry["pinned"] = None  # as an old trace: no note
        return [(entry, step_stats(trace).per_step_s, str(path))]

    (plain,) = compare_runs(side(free), side(bound), Settings())
    assert with_note["comparisons"][0]["verdict"] == plain.verdict
    assert with_note["comparisons"][0]["ratio"] == pytest.approx(plain.ratio)


def test_old_traces_without_the_key_load_and_compare_without_a_note():
    base, slow = BASELINES / "baseline-gpt-tiny-np2.h5", BASELINES / "slower-gpt-tiny-np2.h5"
    assert "binding" not in load_trace(str(base)).metadata
    done = compare(slow, "--baseline", base, "--unit", "step")
    assert "not pinned" not in done.stdout and done.returncode == 1  # the committed regression (one run a side)
    data = json.loads(compare(slow, "--baseline", base, "--format", "json").stdout)
    assert data["binding_note"] is None and data["comparisons"][0]["new"]["pinned"] == [None]
