"""The state of a sweep's runs (no MPI): ``jobs.json`` beside the manifest (:func:`load_jobs`,
:func:`save_jobs`, written whole under :func:`sweep_lock`), what a run's record, its scheduler job and its trace
say (:func:`record_state`, :func:`trace_state`, :func:`run_states`), and why ``submit`` skips a run
(:func:`skip_reason`). :mod:`fourd_mpi.jobs.sweep` builds on these and imports them."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shlex
import socket
import tempfile
from typing import Dict, List, Optional

from fourd_mpi.errors import ConfigError, TraceError
from fourd_mpi.jobs.schedulers import ACTIVE_STATES, FINAL_STATES, get_scheduler
from fourd_mpi.util.files import NO_LOCK_ERRNOS, refuse_link

log = logging.getLogger(__name__)

JOBS = "jobs.json"
#: the lock file of ``submit`` (:func:`sweep_lock`)
LOCK = ".submit.lock"
#: record states that mean "a sweep submit has claimed this run and is launching it"
CLAIM_STATES = ("SUBMITTING", "RUNNING")


def load_jobs(sweep_dir: str) -> Dict[str, Dict]:
    path = os.path.join(sweep_dir, JOBS)
    if not os.path.exists(path):
        return {}
    with open(path) as fh:
        try:
            return json.load(fh)
        except ValueError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None


def save_jobs(sweep_dir: str, jobs: Dict[str, Dict]) -> None:
    """Atomic rewrite (a private temp file, fsync, rename): a crash or a second writer never leaves
    a torn file. Call it under :func:`sweep_lock`, after :func:`load_jobs`, so no update is lost."""
    path = os.path.join(sweep_dir, JOBS)
    refuse_link(path, what=path)  # the sweep's own file: a link there is not (and would be replaced)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{JOBS}.", suffix=".tmp", dir=sweep_dir)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(jobs, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.remove(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):  # a full disk, EIO: one line, jobs.json as it was
            from fourd_mpi.trace.files import io_error_text

            raise ConfigError(f"cannot write {path}: {io_error_text(exc)}") from None
        raise


@contextlib.contextmanager
def sweep_lock(sweep_dir: str):
    """An exclusive ``flock`` on ``DIR/.submit.lock`` for one read-decide-write of ``jobs.json``.

    Held for short sections only (never while a job runs or ``sbatch`` waits), so a second
    ``sweep submit`` waits a moment, then sees the first one's claims.

    On a file system without file locks (``flock`` fails with ENOLCK, EOPNOTSUPP or ENOSYS: NFS
    mounted ``nolock``, some FUSE and Lustre mounts) it goes on unlocked, after one ``note:`` line per
    directory: refusing would make a sweep on such a file system (often the home directory on a
    cluster) impossible to submit at all, while the lock only guards against a second ``sweep submit``
    of the same directory at the same moment, which the user can avoid; claims are still recorded
    before anything is launched, so a later submit still skips them. Any other error: one line."""
    path = os.path.join(sweep_dir, LOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(f"cannot lock the sweep directory {sweep_dir} ({path}: {exc.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno not in NO_LOCK_ERRNOS:
                raise ConfigError(f"cannot lock the sweep directory {sweep_dir} ({path}: {exc.strerror})") from None
            if os.path.abspath(sweep_dir) not in _UNLOCKED_NOTED:
                _UNLOCKED_NOTED.add(os.path.abspath(sweep_dir))
                log.info(f"note: {sweep_dir} is on a file system without file locks ({path}: {exc.strerror}); this "
                         "submit goes on, not protected against a concurrent 'sweep submit' of the same directory: run "
                         "one at a time")
        yield
    finally:
        os.close(fd)  # releases the lock


#: sweep directories whose missing locks were noted (one note per directory and process)
_UNLOCKED_NOTED: set = set()


def _claimant_gone(job: Dict) -> bool:
    """A claim (``SUBMITTING``, or a local ``RUNNING``) whose ``sweep submit`` process ended without
    recording the outcome (Ctrl-C, a crash). Only a claimant on this host can be checked."""
    if job.get("state") not in CLAIM_STATES or job.get("host") != socket.gethostname() or not job.get("pid"):
        return False
    try:
        os.kill(int(job["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):
        return False
    return False


def read_exit_status(path: Optional[str]) -> Optional[int]:
    """The exit status a pack script recorded for one run (``logs/RUN.status``: ``"STATUS JOB_ID"``),
    or None when the run has not ended (or the file is unreadable)."""
    if not path:
        return None
    try:
        with open(path) as fh:
            return int(fh.read(200).split()[0])
    except (OSError, ValueError, IndexError):
        return None


def record_state(job: Optional[Dict], live: Dict[str, str]) -> str:
    """The state of a run's record: the scheduler's (``live``), else the one recorded; ``-`` when none.

    A run inside a pack (its record has a ``status_file``) is ``COMPLETED`` or ``FAILED`` by the exit
    status its pack script recorded; before that, the pack job's state; a pack job that ended without
    recording this run's status failed it (or was cancelled or timed out)."""
    if not job:
        return "-"
    if _claimant_gone(job):
        return "FAILED"
    packed = bool(job.get("status_file"))
    if packed:
        status = read_exit_status(job["status_file"])
        if status is not None:
            return "COMPLETED" if status == 0 else "FAILED"
    state = live.get(job.get("job_id"), "UNKNOWN") if job.get("job_id") else "UNKNOWN"
    if state == "UNKNOWN":  # gone from the scheduler (or local, or a claim): the last state we saw
        state = job.get("state", "UNKNOWN")
    if packed and state in FINAL_STATES:
        return state if state in ("CANCELLED", "TIMEOUT") else "FAILED"
    return state


def trace_state(path: str) -> str:
    """``complete``/``partial``/``failed``/``interrupted`` (the trace's status), ``running`` (per-rank files
    that a live run holds), ``recoverable`` (per-rank files of a run that ended without its trace: ``fourd-mpi
    trace recover`` merges them), ``damaged``, or ``missing``. Reads the trace's header only."""
    from fourd_mpi.trace.read import read_status

    if os.path.exists(path):
        try:
            return read_status(path)
        except TraceError:
            return "damaged"
    spool = spool_of_trace(path)
    if os.path.isdir(spool):
        return "running" if _spool_live(spool) else "recoverable"
    return "missing"


def spool_of_trace(path: str) -> str:
    return path[:-3] + ".ranks" if path.endswith(".h5") else path + ".ranks"


def _spool_live(spool: str) -> bool:
    """Whether a process still holds a rank's spool files (their lock: :func:`~fourd_mpi.trace.spool.live_ranks`)."""
    from fourd_mpi.trace.spool import live_ranks

    try:
        with open(os.path.join(spool, "run.json")) as fh:
            world = int(json.load(fh).get("world_size") or 0)
    except (OSError, ValueError, TypeError, AttributeError):  # not written yet, or damaged: the rank files say
        world = len([n for n in os.listdir(spool) if n.endswith(".events")]) if os.path.isdir(spool) else 0
    try:
        return bool(live_ranks(spool, max(world, 1)))
    except (OSError, ValueError):
        return False


def next_steps(manifest: Dict, rows: List[Dict], sweep_dir: str) -> List[str]:
    """What to run for the runs without a complete trace and without a live job (``sweep status``)."""
    traces = {run["run_id"]: run["trace"] for run in manifest["runs"]}
    lines = []
    # the commands as a shell reads them: every path quoted (a sweep directory may hold spaces, quotes, `...`)
    resubmit = shlex.join(["fourd-mpi", "sweep", "submit", "--resubmit-failed", sweep_dir])
    for row in rows:
        trace, state = row["trace"], row["state"]
        spool = spool_of_trace(traces[row["run_id"]])
        if trace == "recoverable":
            lines.append(f"{row['run_id']}: its job ended without a trace; its per-rank files are in {spool!r}: "
                         f"run {shlex.join(['fourd-mpi', 'trace', 'recover', spool])} for a trace of its steps so "
                         f"far, or {resubmit} to run it again")
        elif trace != "complete" and trace != "running" and state not in ACTIVE_STATES + ("SUBMITTING", "-"):
            lines.append(f"{row['run_id']}: job {state.lower()}, trace {trace}: run {resubmit} to run it again")
    return lines


def run_states(manifest: Dict, jobs: Dict[str, Dict], query: bool = True) -> List[Dict]:
    """Per run: job id, the scheduler's state (asked once per job), and the trace's state."""
    live = live_states(manifest, jobs) if query else {}
    rows = []
    for run in manifest["runs"]:
        job = jobs.get(run["run_id"])
        row = {"run_id": run["run_id"], "ranks": run["ranks"], "grid": run["grid"]}
        if "packs" in manifest or any("pack" in j for j in jobs.values()):
            row["pack"] = (job or {}).get("pack") or run.get("pack", "-")
        row.update({"job": (job.get("job_id") or "-") if job else "-", "state": record_state(job, live),
                    "trace": trace_state(run["trace"])})
        if row["trace"] == "complete" and row["state"] in FINAL_STATES:  # the trace is the truth (a job record
            row["state"] = "COMPLETED"  # left FAILED by an interrupted submit, or a launcher killed after the merge)
        rows.append(row)
    return rows


def live_states(manifest: Dict, jobs: Dict[str, Dict]) -> Dict[str, str]:
    if manifest["scheduler"] == "local":
        return {}
    recorded = [jobs[r["run_id"]]["job_id"] for r in manifest["runs"]
                if jobs.get(r["run_id"], {}).get("job_id")]
    return get_scheduler(manifest["scheduler"]).states(recorded) if recorded else {}


def skip_reason(row: Dict, job: Optional[Dict], resubmit_failed: bool) -> Optional[str]:
    """Why a run is not submitted (None: submit it). ``--resubmit-failed`` submits exactly the runs without a
    complete trace and without a live job or run."""
    state, trace = row["state"], row["trace"]
    if trace == "complete":
        return "trace complete"
    if trace == "running":
        return "trace running (a live run holds its per-rank files)"
    if state == "SUBMITTING":
        return f"claimed by sweep submit (pid {job.get('pid')} on {job.get('host')}) at {job.get('claimed')}"
    if state in ACTIVE_STATES:
        return f"job {row['job']} {state.lower()}"
    if resubmit_failed:
        return None
    if trace != "missing":
        return f"trace {trace} (--resubmit-failed submits it again)"
    if state != "-":
        return f"job {row['job']} {state.lower()} (--resubmit-failed submits it again)"
    return None
