"""Shared helpers: launch the package under a real ``mpiexec`` from this environment.

The tests mirror the package (``tests/core``, ``tests/step``, ... one folder per subpackage);
``tests/helpers`` holds the scripts they launch under mpiexec and the one-node Slurm.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: MPI helper scripts (launched under mpiexec by the tests) and the local Slurm
HELPERS = Path(__file__).resolve().parent / "helpers"
sys.path.insert(0, str(HELPERS))  # `from localslurm import LocalSlurm`


def layout_listing() -> list:
    """The paths the tree of docs/layout.md (the one description of the package's layout) lists, relative to the
    repository and in the page's order: ``fourd_mpi``, ``fourd_mpi/errors.py``, ``fourd_mpi/util``, ... (a folder
    by its path, no trailing slash). An entry's folder is its indentation (two spaces a level)."""
    page = (REPO / "docs" / "layout.md").read_text()
    tree = re.findall(r"^```text\n(.*?)^```$", page, re.M | re.S)[0]
    stack, listed = [], []
    for line in tree.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        name = line.split()[0]
        stack = stack[:depth]
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
            listed.append("/".join(stack))
        else:
            listed.append("/".join(stack + [name]))
    return listed


def mounted_tmpfs(where, options: str):
    """Mount a tmpfs with ``options`` (e.g. ``size=4m``, ``ro,size=1m``) on ``where`` and yield it, unmounted
    afterwards; skips with the reason where mounting is not allowed (root / CAP_SYS_ADMIN). For fixtures."""
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {proc.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def find_mpiexec() -> str:
    """The ``mpiexec`` next to this Python (the mpich wheel's), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpiexec found next to the interpreter or on PATH")
    return found


def mpi_flavor() -> str:
    """``"mpich"`` (Hydra) or ``"openmpi"`` (or ``"unknown"``): the family of :func:`find_mpiexec`'s ``mpiexec``
    (``mpiexec --version``, cached). Tests whose expectations differ by launcher (exit statuses, signal forwarding,
    binding options) branch on it; none skips for it."""
    from fourd_mpi.core.launcher import flavor

    return flavor(find_mpiexec())


def launcher_env() -> dict:
    """What the ``mpiexec`` in use needs here (root, oversubscribed 2 cores): nothing for MPICH; for Open MPI
    :data:`fourd_mpi.core.launcher.OPENMPI_LOCAL_ENV` (run as root, oversubscribe, no binding). Also put in
    ``os.environ`` at the start of the session (:func:`pytest_configure`), so every command line a test builds
    itself (``[find_mpiexec(), "-n", ...]``, ``fourd-mpi testbed mpiexec``, a Slurm job) gets it too."""
    from fourd_mpi.core.launcher import local_env

    return local_env(find_mpiexec())


def bind_to_core() -> list:
    """``mpiexec`` options that bind each rank to a core, also with more ranks than cores: Hydra's ``-bind-to
    core``; Open MPI's ``--bind-to core:overload-allowed`` (without the qualifier it refuses to bind more ranks
    than cores)."""
    return ["--bind-to", "core:overload-allowed"] if mpi_flavor() == "openmpi" else ["-bind-to", "core"]


def mpmd_env(name: str, value: str) -> list:
    """A per-executable environment variable in an MPMD launch, portable across launchers (Hydra's ``-env NAME
    VALUE``, Open MPI's ``-x NAME=VALUE`` differ): the program is started through ``env NAME=VALUE``."""
    return ["env", f"{name}={value}"]


#: Open MPI's own messages on stderr: help blocks between lines of dashes ("mpirun detected that one or more
#: processes exited with non-zero status", "MPI_ABORT was invoked on rank ..."), and ORTE's one-line notes
#: ("[host:pid] 1 more process has sent help message ...", "Set MCA parameter ... to see all help")
_LAUNCHER_RULE = re.compile(r"^-{20,}\s*$")
_LAUNCHER_NOTE = re.compile(r"^\[[^\]\s]+:\d+\] |^Set MCA parameter ")


def rank_stderr(text: str) -> str:
    """``text`` (a job's stderr) without the launcher's own messages, i.e. what the ranks wrote: Hydra adds
    nothing for a non-zero exit, Open MPI a help block (:data:`_LAUNCHER_RULE`) and notes."""
    out, inside = [], False
    for line in text.splitlines(keepends=True):
        if _LAUNCHER_RULE.match(line):
            inside = not inside
            continue
        if not inside and not _LAUNCHER_NOTE.match(line):
            out.append(line)
    return "".join(out)


def caught_signals(pid: int) -> int:
    """The signals ``pid`` catches (``SigCgt`` of /proc/PID/status; 0 once it is gone): tests wait for a child's
    handlers to be in place before they signal it, not for a delay."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next(int(line.split()[1], 16) for line in fh if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return 0


def mpi_env() -> dict:
    env = dict(os.environ)
    env.update(launcher_env())
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


#: MPI shared-memory segments: MPICH's (``/dev/shm/mpich_shm_*``), Open MPI 4's vader BTL
#: (``vader_segment.*``) and Open MPI 5's sm BTL (``sm_segment.*``): a rank killed by a test (``kill -9``,
#: ``MPI_Abort``) leaves its segment behind, and enough of them make MPICH's shared-memory bootstrap
#: fail ("Out of memory") or hang in ``MPI_Init`` for every later job on the machine (and fill /dev/shm)
from fourd_mpi.testbed.bed import SHM_DIR, SHM_PREFIX  # noqa: E402


def _mapped_anywhere() -> set:
    """Every file under :data:`SHM_DIR` some process maps or holds open (``/proc/*/maps``, ``/proc/*/fd``)."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as fh:
                held.update(line.split(None, 5)[-1].strip() for line in fh if SHM_DIR in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(SHM_DIR):
                    held.add(target)
        except OSError:  # the process ended, or is not ours to read
            continue
    return {path.removesuffix(" (deleted)") for path in held}


def pytest_configure(config):
    """The launcher's environment (:func:`launcher_env`) for every subprocess of the session."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists() or shutil.which("mpiexec"):
        os.environ.update(launcher_env())


def pytest_sessionstart(session):
    session.config._shm_start = __import__("time").time()


def pytest_sessionfinish(session, exitstatus):
    """Remove the MPI segments this session's killed ranks left behind: created since the session
    started and no longer mapped or open by any process (a concurrent job's live segments are kept)."""
    start = getattr(session.config, "_shm_start", None)
    if start is None or not os.path.isdir(SHM_DIR):
        return
    try:
        candidates = [os.path.join(SHM_DIR, n) for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)]
        candidates = [p for p in candidates if os.stat(p).st_mtime >= start - 1]
    except OSError:
        return
    if not candidates:
        return
    for attempt in range(2):  # ranks of a job aborted by the last test may still be exiting: look again once
        held = _mapped_anywhere()
        for path in candidates:
            if path not in held:
                try:
                    os.remove(path)
                except OSError:
                    pass
        candidates = [path for path in candidates if os.path.exists(path)]
        if not candidates or attempt:
            return
        __import__("time").sleep(2)
