"""Ctrl-C (SIGINT to mpiexec, which forwards it to every rank) is recorded as ``interrupted``, not as a failure."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, find_mpiexec, mpi_env


@pytest.mark.mpi
def test_ctrl_c_is_recorded_as_interrupted(tmp_path):
    """Before: the spool said "KeyboardInterrupt: " and the recovered trace was "failed"."""
    cmd = [find_mpiexec(), "-n", "2", sys.executable, "-m", "fourd_mpi", "run", "--gx", "2",
           "--steps", "100000", "--results-dir", str(tmp_path), "--run-id", "c", "--display", "quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(), cwd=REPO)
    spool = tmp_path / "c.ranks"
    try:
        deadline = time.monotonic() + 120
        while not all((spool / f"rank00000{r}.steps").exists() and (spool / f"rank00000{r}.steps").stat().st_size
                      for r in range(2)):  # every rank has finished a step
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "fourd-mpi: interrupted: SIGINT (Ctrl-C) during step " in err
    reports = [json.loads(p.read_text())["error"] for p in spool.glob("*.failed.json")]
    assert reports and all(r.startswith("interrupted: SIGINT (Ctrl-C)") for r in reports), reports
    recovered = subprocess.run([sys.executable, "-m", "fourd_mpi", "trace", "recover", str(spool)],
                               capture_output=True, text=True, env=mpi_env(), cwd=REPO, timeout=120)
    assert recovered.returncode == 0, recovered.stderr
    assert "status interrupted" in recovered.stdout, recovered.stdout
    assert "does not read back" not in recovered.stdout, recovered.stdout
    assert_readable_interrupted(tmp_path / "c.h5")


def assert_readable_interrupted(trace):
    """The recovered trace reads back (before: "status 'interrupted' is not one of complete, partial,
    failed" from ``trace check``, ``show`` and ``analyze``); analysis treats it like a partial trace."""
    for args in (["trace", "check", str(trace)], ["trace", "show", str(trace)], ["analyze", str(trace)]):
        out = subprocess.run([sys.executable, "-m", "fourd_mpi", *args], capture_output=True, text=True,
                             env=mpi_env(), cwd=REPO, timeout=120)
        assert out.returncode == 0, (args, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr and "invalid trace" not in out.stdout + out.stderr, (args, out.stderr)
    show = subprocess.run([sys.executable, "-m", "fourd_mpi", "trace", "show", str(trace)], capture_output=True,
                          text=True, env=mpi_env(), cwd=REPO, timeout=120)
    assert "status interrupted" in show.stdout, show.stdout
