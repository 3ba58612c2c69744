"""Shared helpers: launch the package under a real ``mpiexec`` from this environment.

The tests mirror the package (``tests/core``, ``tests/step``, ... one folder per subpackage);
``tests/helpers`` holds the scripts they launch under mpiexec and the one-node Slurm.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: MPI helper scripts (launched under mpiexec by the tests) and the local Slurm
HELPERS = Path(__file__).resolve().parent / "helpers"
sys.path.insert(0, str(HELPERS))  # `from localslurm import LocalSlurm`


def find_mpiexec() -> str:
    """The ``mpiexec`` next to this Python (the mpich wheel's), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpiexec found next to the interpreter or on PATH")
    return found


def mpi_env() -> dict:
    env = dict(os.environ)
    # 8 ranks share 2 cores here: one BLAS thread per rank.
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def mpirun(nranks: int, args, timeout: float = 300, script: str = None) -> subprocess.CompletedProcess:
    """Run ``python -m fourd_mpi ARGS`` (or ``python SCRIPT ARGS``) on ``nranks`` ranks."""
    target = [script] if script else ["-m", "fourd_mpi"]
    cmd = [find_mpiexec(), "-n", str(nranks), sys.executable, *target, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=mpi_env(), cwd=REPO)


@pytest.fixture
def run_mpi():
    return mpirun
