"""The watchdog: a rank that waits too long in a collective says where, marks the run hung and aborts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, find_mpiexec, mpi_env
from fourd_mpi.core.watchdog import Watchdog


def test_watchdog_fires_once_with_the_place_and_the_limit():
    aborted, notes = [], []
    dog = Watchdog(0.2, rank=3, on_hang=notes.append, abort=aborted.append, poll_s=0.02)
    with dog.watch("allreduce over x, step 4"):
        time.sleep(0.05)  # a short wait: nothing happens
    assert dog.fired is None and not aborted
    with dog.watch("allreduce over x, step 5"):
        deadline = time.monotonic() + 30
        while not aborted and time.monotonic() < deadline:
            time.sleep(0.02)
    dog.close()
    assert aborted == [3]
    assert "rank 3 waited" in dog.fired and "allreduce over x, step 5" in dog.fired and "--step-timeout 0.2 s" in dog.fired
    assert notes == [f"hung: {dog.fired}"]


def test_a_disabled_watchdog_has_no_thread():
    dog = Watchdog(0, rank=0, abort=lambda code: pytest.fail("fired"))
    with dog.watch("anything"):
        time.sleep(0.01)
    assert dog._thread is None
    dog.close()


@pytest.mark.mpi
def test_a_stopped_rank_is_diagnosed_and_the_job_ends(tmp_path):
    """SIGSTOP one of 4 ranks mid-run (before: the others busy-polled forever). With --step-timeout 3
    the others print where they wait, mark the spool hung and abort; the job ends well within 60 s."""
    cmd = [find_mpiexec(), "-n", "4", sys.executable, "-m", "fourd_mpi", "run", "--gx", "2", "--gy", "2",
           "--steps", "100000", "--step-timeout", "3", "--results-dir", str(tmp_path), "--run-id", "w",
           "--display", "quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(), cwd=REPO)
    spool = tmp_path / "w.ranks"
    pid = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until rank 1 has finished a step
            steps = spool / "rank000001.steps"
            if steps.exists() and steps.stat().st_size > 0:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        pid = json.loads((spool / "rank000001.json").read_text())["pid"]
        os.kill(pid, signal.SIGSTOP)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode != 0
    lines = [line for line in err.splitlines() if line.startswith("fourd-mpi: error: rank ")]
    assert lines, err
    assert all("longer than --step-timeout 3 s" in line and " over " in line and "step " in line for line in lines)
    hung = [json.loads(p.read_text())["error"] for p in spool.glob("*.failed.json")]
    assert hung and all(text.startswith("hung: ") for text in hung)
    assert "Traceback" not in err
