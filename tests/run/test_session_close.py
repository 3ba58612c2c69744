"""``fourd_mpi.run.session``: whatever ends a run, ``close_run`` closes it (``finally``), and what the steps
before the failure wrote stays recoverable."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import HELPERS, REPO, mpi_env


@pytest.mark.mpi
def test_a_failure_inside_the_step_loop_still_closes_the_run(tmp_path, run_mpi):
    """Every rank raises at the start of step 2 (a fault hook): each rank's run is closed (``Run.close`` once,
    the watchdog stopped, the spool files closed; helpers/mpi_session_close_check.py), each recorded the
    failure, and ``trace recover`` turns the spool into a ``failed`` trace of steps 0-1 that reads back."""
    proc = run_mpi(2, [tmp_path], script=str(HELPERS / "mpi_session_close_check.py"), timeout=240)
    assert proc.returncode == 0 and "close check ok" in proc.stdout, (proc.stdout, proc.stderr)
    recover = subprocess.run([sys.executable, "-m", "fourd_mpi", "trace", "recover", str(tmp_path / "c.ranks")],
                             capture_output=True, text=True, env=mpi_env(), cwd=REPO, timeout=120)
    assert recover.returncode == 0, recover.stderr
    assert "status failed, steps 0-1 completed by every rank (2)" in recover.stdout, recover.stdout
    check = subprocess.run([sys.executable, "-m", "fourd_mpi", "trace", "check", str(tmp_path / "c.h5")],
                           capture_output=True, text=True, env=mpi_env(), cwd=REPO, timeout=120)
    assert check.returncode == 0, (check.stdout, check.stderr)
