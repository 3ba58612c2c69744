"""Clock alignment at start and end with a linear drift model (fourd_mpi.trace.clocks)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import HELPERS, REPO, find_mpiexec, mpi_env

from fourd_mpi.trace.clocks import DriftModel
from fourd_mpi.trace.events import EVENT_DTYPE


def test_drift_model_known_answer():
    """Offset 1000 ns at local 10 us, 2000 ns at local 1010 us: 1e-3 ns per ns. A local time of
    510 us, stored as 510000 - 1000, is really 510000 - 1500."""
    m = DriftModel(offset0=1000, at0=10_000, offset1=2000, at1=1_010_000, origin_ns=0)
    assert m.rate == pytest.approx(1e-3) and m.ppm == pytest.approx(1000.0)
    assert m.correct([509_000]).tolist() == [508_500]
    assert m.correct([10_000 - 1000]).tolist() == [9_000]  # at the start alignment: unchanged


def test_drift_within_noise_is_not_applied():
    m = DriftModel(offset0=1000, at0=0, offset1=1030, at1=10**9, origin_ns=5, uncertainty0=20, uncertainty1=15)
    assert m.rate == 0.0 and m.residual_ns == 20
    assert m.correct([123, 10**9]).tolist() == [123, 10**9]


def test_correct_records_moves_present_times_only():
    m = DriftModel(offset0=0, at0=0, offset1=10_000, at1=10**6, origin_ns=0)  # 1 %
    ev = np.zeros(2, dtype=EVENT_DTYPE)
    ev["start_ns"], ev["end_ns"], ev["issue_ns"], ev["complete_ns"] = [100_000, 0], [200_000, 50], [100_000, 0], 0
    out = m.correct_records(ev)
    assert out["start_ns"].tolist() == [99_000, 0] and out["end_ns"].tolist() == [198_000, 50]
    assert out["complete_ns"].tolist() == [0, 0]  # absent (0) stays absent
    assert ev["start_ns"][0] == 100_000  # the input is not modified


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [3, 4])
def test_skewed_drifting_clocks_are_corrected(nranks):
    proc = subprocess.run([find_mpiexec(), "-n", str(nranks), sys.executable, str(HELPERS / "mpi_clock_check.py"),
                           "2e-3", "1e9"], capture_output=True, text=True, timeout=120, env=mpi_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "clock check ok" in proc.stdout, proc.stdout
