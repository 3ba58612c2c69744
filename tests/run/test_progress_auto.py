"""``--progress auto`` (run's default) in real runs: the strategy it chose is the one the trace's configuration
stores (so the config key is that of the strategy that ran), the header says it with ``(auto)`` and the metadata
says why; the choice follows :func:`~fourd_mpi.core.progress.choose_progress` for this machine's CPUs."""

from __future__ import annotations

import os

import pytest

from fourd_mpi.core.progress import THREAD_CPUS_PER_RANK
from fourd_mpi.trace.read import load_trace

SMALL = ["--model", "gpt-tiny", "--hidden", "48", "--heads", "3", "--seq", "16", "--batch", "6", "--layers", "2",
         "--steps", "2", "--gz", "2", "--trace-level", "step"]


@pytest.mark.mpi
@pytest.mark.parametrize("overlap", ["all", "none"])
def test_the_trace_stores_what_auto_chose(run_mpi, tmp_path, overlap):
    proc = run_mpi(2, ["run", *SMALL, "--overlap", overlap, "--results-dir", tmp_path, "--run-id", "a"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    meta = load_trace(str(tmp_path / "a.h5"), events=False).metadata
    # unpinned ranks on one node run on this process's CPUs: a thread needs two of them per rank
    spare = len(os.sched_getaffinity(0)) / 2 >= THREAD_CPUS_PER_RANK
    expected = "thread" if overlap == "all" and spare and meta["mpi"].get("thread_level") == "multiple" else "poll"
    assert meta["config"]["progress"] == expected
    assert f"progress {expected} (auto)" in proc.stdout
    assert "(--progress auto: " in meta["progress"]
    if overlap == "none":
        assert meta["progress"].endswith("(--progress auto: --overlap none leaves nothing in flight during compute)")


@pytest.mark.mpi
def test_a_named_strategy_is_stored_as_named(run_mpi, tmp_path):
    proc = run_mpi(2, ["run", *SMALL, "--overlap", "all", "--progress", "none", "--results-dir", tmp_path,
                       "--run-id", "n"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    meta = load_trace(str(tmp_path / "n.h5"), events=False).metadata
    assert meta["config"]["progress"] == "none" and "auto" not in meta["progress"]
    assert "progress none, " in proc.stdout
