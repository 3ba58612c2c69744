"""The watchdog: a rank that waits too long in a collective says where, marks the run hung and aborts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, find_mpiexec, mpi_env, mpmd_env

from fourd_mpi.core.watchdog import Watchdog


def test_watchdog_fires_once_with_the_place_and_the_limit():
    """The watchdog's own clock is the test's: what counts as a long wait does not depend on the load."""
    now = [0.0]
    aborted, notes = [], []
    dog = Watchdog(0.2, rank=3, on_hang=notes.append, abort=aborted.append, poll_s=0.02, clock=lambda: now[0])
    with dog.watch("allreduce over x, step 4"):
        now[0] = 0.1  # a short wait
    now[0] = 100.0  # long after it ended, outside any wait: nothing happens
    time.sleep(0.2)  # ten polls (or fewer on a loaded machine: then nothing happens either)
    assert dog.fired is None and not aborted
    with dog.watch("allreduce over x, step 5"):
        now[0] = 100.5  # this wait has lasted 0.5 s > 0.2 s
        deadline = time.monotonic() + 60
        while not aborted and time.monotonic() < deadline:
            time.sleep(0.02)
    dog.close()
    assert aborted == [3]
    assert "rank 3 waited 0.5 s in allreduce over x, step 5" in dog.fired and "--step-timeout 0.2 s" in dog.fired
    assert notes == [f"hung: {dog.fired}"]


def test_a_fire_is_marked_before_the_wait_it_judged_can_end():
    """The watchdog judged a wait too long while the main thread was leaving it; the mark
    (``fired``) came after the ranks had agreed in ``hold_if_fired`` that none fired, and the merge published
    a trace in the 0.5 s before MPI_Abort. Now judging and marking hold the lock the main thread needs to leave
    a wait. Made deterministic: the watchdog's clock read blocks until the main thread is leaving the wait;
    once out of the wait, the mark is there (before: the main thread was out at once, unmarked)."""
    import threading

    reading, go = threading.Event(), threading.Event()
    now = [0.0]
    aborted = []

    def clock():
        if threading.current_thread().name == "fourd-mpi-watchdog" and now[0] > 0:
            reading.set()  # the watchdog is judging the wait below...
            go.wait(30)  # ...and is held here until the main thread tries to leave it
        return now[0]

    dog = Watchdog(0.2, rank=0, abort=aborted.append, poll_s=0.01, clock=clock)
    leaving = threading.Timer(0.3, go.set)  # lets the watchdog go on while the main thread leaves the wait
    with dog.watch("allreduce over x, step 7"):
        now[0] = 5.0  # the wait has lasted 5 s
        assert reading.wait(60), "the watchdog never judged the wait"
        leaving.start()
    assert dog.fired is not None and "waited 5 s in allreduce over x, step 7" in dog.fired
    deadline = time.monotonic() + 60
    while not aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.close()
    assert aborted == [3]


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
    assert all("longer than --step-timeout 3 s" in line and " over " in line and "step " in line
               for line in lines), lines
    reports = {p.name: json.loads(p.read_text())["error"] for p in spool.glob("*.failed.json")}
    # the stopped rank itself may record the launcher's end: Open MPI 4.1.4 resumed it and sent SIGTERM when the
    # job was aborted (1 run in 4 here: its handler ran before the kill), Hydra's proxy kills it (nothing recorded);
    # trace recover then calls the run failed, with every reason (trace/recover.py)
    stopped = reports.pop("rank000001.failed.json", "hung: ")
    assert stopped.startswith(("hung: ", "interrupted: SIGTERM")), stopped
    assert reports and all(text.startswith("hung: ") for text in reports.values()), reports
    assert "Traceback" not in err


def _stale_copy(tmp_path, path: str, old: str, new: str):
    """A copy of the package with one edit and the same ``__version__``: a stale install on some nodes,
    which the same-arguments check (it hashes the options and the version, not the code) cannot see."""
    import shutil

    root = tmp_path / "stale"
    shutil.copytree(REPO / "fourd_mpi", root / "fourd_mpi", ignore=shutil.ignore_patterns("__pycache__"))
    target = root / "fourd_mpi" / path
    text = target.read_text()
    assert text.count(old) == 1, f"{path} changed: update this test's edit"
    target.write_text(text.replace(old, new))
    return root


def _mpmd(parts, cwd, timeout=120):
    """``mpiexec -n N1 env PYTHONPATH=P1 python ARGS : -n N2 ...`` with each part's PYTHONPATH (through ``env``:
    Hydra's ``-env`` and Open MPI's ``-x`` differ); ``parts``: (n, pythonpath, args)."""
    cmd = [find_mpiexec()]
    for i, (n, path, args) in enumerate(parts):
        cmd += ([":"] if i else []) + ["-n", str(n), *mpmd_env("PYTHONPATH", str(path)), sys.executable, "-m",
                                       "fourd_mpi", *args]
    # not from the repository: "python -m" puts the working directory first on sys.path
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=mpi_env(), cwd=cwd)


@pytest.mark.mpi
@pytest.mark.parametrize("command", ["run", "verify", "info"])
def test_a_stale_preset_table_on_some_ranks_fails_at_once(tmp_path, command):
    """The ranks' configuration check on the *resolved* configuration: one rank runs a stale copy of the package whose
    gpt-tiny preset has another depth (same version, same arguments, so the arguments check passes).
    Before, the ranks built different models (a hang or garbage); now every rank prints the same line
    naming the resolved value that differs and which ranks hold it, before the grid is built."""
    stale = _stale_copy(tmp_path, "step/presets.py", 'layers=2, hidden=64, heads=8, seq=16, batch=8)',
                        'layers=3, hidden=64, heads=8, seq=16, batch=8)')
    args = {"run": ["run", "--results-dir", str(tmp_path / "r"), "--display", "quiet", "--steps", "2",
                    "--step-timeout", "60"],
            "verify": ["verify", "--steps", "2", "--step-timeout", "60"], "info": ["info"]}[command] + \
        ["--model", "gpt-tiny", "--gz", "2"]
    proc = _mpmd([(1, REPO, args), (1, stale, args)], tmp_path)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fourd-mpi: error: ")]
    assert len(errors) == 2 and len(set(errors)) == 1, proc.stderr
    assert "different resolved configurations: model.layers is 2 on ranks 0; 3 on ranks 1" in errors[0], errors
    assert "same installation" in errors[0]
    assert "Traceback" not in proc.stderr and "waited" not in proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("command", ["run", "verify"])
def test_ranks_running_different_code_are_diagnosed(tmp_path, command):
    """An MPMD mismatch the configuration check cannot see. One of two ranks runs a stale
    copy of the package (same version, same arguments) whose step starts with a barrier over the world,
    which the others never call. Before (verify had no watchdog) this hung forever; now every
    rank that waits says where and the job ends with the watchdog's status within the timeout."""
    anchor = "    try:\n        if deferred:\n            loss, _ = trainer.forward_backward("  # engine.timed_step
    stale = _stale_copy(tmp_path, "step/engine.py", anchor,
                        "    from mpi4py import MPI\n    MPI.COMM_WORLD.Barrier()\n" + anchor)
    args = {"run": ["run", "--results-dir", str(tmp_path / "r"), "--display", "quiet", "--steps", "3"],
            "verify": ["verify", "--steps", "2"]}[command] + ["--gz", "2", "--step-timeout", "4"]
    proc = _mpmd([(1, REPO, args), (1, stale, args)], tmp_path)
    assert proc.returncode == 3, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fourd-mpi: error: rank ")]
    assert lines, proc.stderr
    assert all("longer than --step-timeout 4 s" in line and " over " in line for line in lines), lines
    assert "different arguments" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.mpi
def test_bench_collectives_has_a_watchdog(tmp_path):
    """A rank of ``bench collectives`` stopped (SIGSTOP) inside its first measurement: before, the
    other rank waited forever; now it names the measurement it waits in and aborts the job."""
    stale = _stale_copy(tmp_path, "run/collbench.py",
                        "             inplace: bool = False) -> Tuple[float, int, int]:\n",
                        "             inplace: bool = False) -> Tuple[float, int, int]:\n"
                        "    import os, signal; os.kill(os.getpid(), signal.SIGSTOP)\n")
    args = ["bench", "collectives", "--max-size", "64", "--iters", "3", "--step-timeout", "3",
            "-o", str(tmp_path / "p.yaml")]
    proc = _mpmd([(1, REPO, args), (1, stale, args)], tmp_path)
    assert proc.returncode == 3, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fourd-mpi: error: rank 0 waited")]
    assert len(lines) == 1 and "iallgather of 8 bytes on world" in lines[0], proc.stderr
    assert not (tmp_path / "p.yaml").exists()
