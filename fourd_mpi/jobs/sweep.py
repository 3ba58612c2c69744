"""``fourd-mpi sweep plan|render|submit|status|collect``: a scaling study from spec to table.

``render`` writes ``jobscripts/<sweep>/``: one script per run, ``logs/`` for the job
output, and ``manifest.json`` (the resolved spec and, per run, its resources, command,
script, log and trace path; no time stamps, so the same spec renders the same bytes).
``submit`` records job ids in ``jobs.json`` next to the manifest and never submits a run
again whose job is pending, running or finished, or whose trace exists; it claims each run
in ``jobs.json`` under a lock before launching it, so concurrent submits never launch a run
twice (:func:`submit`). ``status`` asks the scheduler and looks at the traces; ``collect`` checks the traces and runs the
analysis (runs table, weak or strong scaling).

All commands run in one process, from the submission directory: paths in scripts and
manifests are relative to it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Dict, List, Optional

from fourd_mpi import __version__
from fourd_mpi.algorithms.registry import DEFAULT_ALGORITHM
from fourd_mpi.errors import ConfigError, TraceError
from fourd_mpi.jobs.render import (AFFINITY_SCRIPT, job_request, python_for, render_affinity_script, render_script,
                         run_command)
from fourd_mpi.jobs.schedulers import ACTIVE_STATES, get_scheduler
from fourd_mpi.jobs.sites import Site
from fourd_mpi.jobs.spec import RunPlan, SweepSpec
from fourd_mpi.util.text import format_rows  # noqa: F401  (sweep plan/status tables; was defined here)

MANIFEST = "manifest.json"
JOBS = "jobs.json"
#: the lock file of ``submit`` (:func:`sweep_lock`)
LOCK = ".submit.lock"
#: record states that mean "a sweep submit has claimed this run and is launching it"
CLAIM_STATES = ("SUBMITTING", "RUNNING")
MANIFEST_SCHEMA = "fourd_mpi.sweep"  # file-format id (kept when the module moved)
MANIFEST_VERSION = 1
#: job settings that render and plan take on the command line too
JOB_OVERRIDES = ("account", "partition", "qos", "queue", "time")


def _human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return str(count)


def memory_per_rank(run: RunPlan) -> int:
    """Estimated bytes per rank (weights, gradients, optimizer state, activations, buffers)."""
    from fourd_mpi.perf.memory import estimate_memory

    cache = "cache" in str(run.option("overlap", "")).split(",") or bool(run.option("cache-weights", False))
    return estimate_memory(run.model, run.grid, dtype=str(run.option("dtype", "float32")),
                           optimizer=str(run.option("optimizer", "adam")), cache_weights=cache,
                           prefetch_depth=int(run.option("prefetch-depth", 1))).total


def results_dir_of(spec: SweepSpec, override: Optional[str] = None) -> str:
    return override or spec.results_dir or os.path.join("results", spec.name)


def build_manifest(spec: SweepSpec, site: Site, spec_path: str, script_dir: str, python: Optional[str] = None,
                   results_dir: Optional[str] = None) -> Dict:
    """Every run with its resources and command; raises before anything is written."""
    runs = spec.expand()
    results = results_dir_of(spec, results_dir)
    py = python_for(spec, site, python)
    entries = []
    for run in runs:
        log = os.path.join(script_dir, "logs", run.run_id + ".out")
        job = job_request(run, spec, site, log)
        memory = memory_per_rank(run)
        entries.append({
            "index": run.index, "run_id": run.run_id, "ranks": run.ranks, "nodes": job.nodes,
            "ranks_per_node": job.ranks_per_node, "gpus_per_node": site.gpus_per_node, "grid": str(run.grid),
            "model": run.model.as_dict(), "options": dict(run.options), "repeat": run.repeat,
            "memory_per_rank": memory, "time_seconds": job.time_seconds,
            "script": os.path.join(script_dir, run.run_id + ".sh"), "log": log,
            "trace": os.path.join(results, run.run_id + ".h5"),
            "command": run_command(run, site, job, py, results, script_dir),
            "_run": run, "_job": job,
        })
    return {"schema": MANIFEST_SCHEMA, "version": MANIFEST_VERSION, "sweep": spec.name, "study": spec.study,
            "site": site.name, "scheduler": site.scheduler, "spec_path": spec_path, "results_dir": results,
            "script_dir": script_dir, "fourd_mpi_version": __version__, "spec": spec.as_dict(), "runs": entries}


def plan_rows(manifest: Dict) -> List[Dict]:
    return [{"#": r["index"], "run_id": r["run_id"], "ranks": r["ranks"], "nodes": r["nodes"],
             "per_node": r["ranks_per_node"], "grid": r["grid"],
             "algorithm": r["options"].get("algorithm", DEFAULT_ALGORITHM), "model": r["model"]["name"],
             "batch": r["model"]["batch"], "hidden": r["model"]["hidden"], "layers": r["model"]["layers"],
             "options": " ".join(f"{k}={v}" for k, v in r["options"].items()),
             "memory/rank": _human_bytes(r["memory_per_rank"])} for r in manifest["runs"]]


def public_manifest(manifest: Dict) -> Dict:
    """The manifest without its in-memory objects."""
    return {**manifest, "runs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in manifest["runs"]]}


def write_sweep(manifest: Dict, spec: SweepSpec, site: Site, out_dir: str, force: bool = False) -> List[str]:
    """Write scripts and manifest into ``out_dir`` (atomically: a temp dir renamed into place)."""
    if os.path.exists(os.path.join(out_dir, MANIFEST)) and not force:
        raise ConfigError(f"{out_dir} already holds a rendered sweep: give --force to render it again "
                          f"(job ids in {JOBS} and logs/ are kept)")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".render-", dir=parent)
    try:
        os.makedirs(os.path.join(staging, "logs"))
        written = []
        total = len(manifest["runs"])
        for entry in manifest["runs"]:
            text = render_script(entry["_run"], total, spec, site, entry["_job"], entry["command"],
                                 _human_bytes(entry["memory_per_rank"]), manifest["spec_path"])
            name = os.path.basename(entry["script"])
            _write(os.path.join(staging, name), text, executable=True)
            written.append(name)
        if site.gpu_affinity_script:
            _write(os.path.join(staging, AFFINITY_SCRIPT), render_affinity_script(site), executable=True)
            written.append(AFFINITY_SCRIPT)
        _write(os.path.join(staging, MANIFEST), json.dumps(public_manifest(manifest), indent=1, sort_keys=False) + "\n")
        if os.path.isdir(out_dir):  # --force: keep the submission record and the logs
            for keep in (JOBS, "logs"):
                if os.path.exists(os.path.join(out_dir, keep)):
                    if keep == "logs":
                        os.rmdir(os.path.join(staging, "logs"))
                    os.rename(os.path.join(out_dir, keep), os.path.join(staging, keep))
            shutil.rmtree(out_dir)
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [os.path.join(out_dir, name) for name in written]


def _write(path: str, text: str, executable: bool = False) -> None:
    with open(path, "w") as fh:
        fh.write(text)
    if executable:
        os.chmod(path, 0o755)


def load_manifest(sweep_dir: str) -> Dict:
    path = os.path.join(sweep_dir, MANIFEST)
    try:
        with open(path) as fh:
            manifest = json.load(fh)
    except OSError as exc:
        raise ConfigError(f"no rendered sweep in {sweep_dir} ({exc.strerror}): run fourd-mpi sweep render") from None
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    if manifest.get("schema") != MANIFEST_SCHEMA or manifest.get("version") != MANIFEST_VERSION:
        raise ConfigError(f"{path} is not a fourd-mpi sweep manifest of version {MANIFEST_VERSION}")
    return manifest


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
    fd, tmp = tempfile.mkstemp(prefix=f".{JOBS}.", suffix=".tmp", dir=sweep_dir)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(jobs, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


@contextlib.contextmanager
def sweep_lock(sweep_dir: str):
    """An exclusive ``flock`` on ``DIR/.submit.lock`` for one read-decide-write of ``jobs.json``.

    Held for short sections only (never while a job runs or ``sbatch`` waits), so a second
    ``sweep submit`` waits a moment, then sees the first one's claims."""
    path = os.path.join(sweep_dir, LOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(f"cannot lock the sweep directory {sweep_dir} ({path}: {exc.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


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


def record_state(job: Optional[Dict], live: Dict[str, str]) -> str:
    """The state of a run's record: the scheduler's (``live``), else the one recorded; ``-`` when none."""
    if not job:
        return "-"
    if _claimant_gone(job):
        return "FAILED"
    state = live.get(job.get("job_id"), "UNKNOWN") if job.get("job_id") else "UNKNOWN"
    if state == "UNKNOWN":  # gone from the scheduler (or local, or a claim): the last state we saw
        state = job.get("state", "UNKNOWN")
    return state


def trace_state(path: str) -> str:
    """``complete``/``partial``/``failed``/``interrupted`` (the trace's status), ``spooling`` (per-rank
    files only), ``damaged``, or ``missing``. Reads the trace's header only."""
    from fourd_mpi.trace.read import read_status

    if os.path.exists(path):
        try:
            return read_status(path)
        except TraceError:
            return "damaged"
    if os.path.isdir(path[:-3] + ".ranks"):
        return "spooling"
    return "missing"


def run_states(manifest: Dict, jobs: Dict[str, Dict], query: bool = True) -> List[Dict]:
    """Per run: job id, the scheduler's state (asked once per job), and the trace's state."""
    live = _live_states(manifest, jobs) if query else {}
    rows = []
    for run in manifest["runs"]:
        job = jobs.get(run["run_id"])
        rows.append({"run_id": run["run_id"], "ranks": run["ranks"], "grid": run["grid"],
                     "job": (job.get("job_id") or "-") if job else "-", "state": record_state(job, live),
                     "trace": trace_state(run["trace"])})
    return rows


def _live_states(manifest: Dict, jobs: Dict[str, Dict]) -> Dict[str, str]:
    if manifest["scheduler"] == "local":
        return {}
    recorded = [jobs[r["run_id"]]["job_id"] for r in manifest["runs"]
                if jobs.get(r["run_id"], {}).get("job_id")]
    return get_scheduler(manifest["scheduler"]).states(recorded) if recorded else {}


def _skip_reason(row: Dict, job: Optional[Dict], resubmit_failed: bool) -> Optional[str]:
    """Why a run is not submitted (None: submit it)."""
    state, trace = row["state"], row["trace"]
    if trace in ("complete", "partial", "spooling"):
        return f"trace {trace}"
    if state == "SUBMITTING":
        return f"claimed by sweep submit (pid {job.get('pid')} on {job.get('host')}) at {job.get('claimed')}"
    if state in ACTIVE_STATES or (state == "COMPLETED" and not resubmit_failed):
        return f"job {row['job']} {state.lower()}"
    if state != "-" and not resubmit_failed:
        return f"job {row['job']} {state.lower()} (--resubmit-failed submits it again)"
    return None


@dataclass
class SubmitResult:
    """What one ``sweep submit`` did: runs submitted (batch: queued; local: run), and the runs that
    failed at submission or, local, when run (``(run_id, reason)``)."""

    submitted: int = 0
    failed: List = field(default_factory=list)


def submit(manifest: Dict, sweep_dir: str, resubmit_failed: bool = False, dry_run: bool = False,
           out=sys.stdout) -> SubmitResult:
    """Submit every run that has no live or finished job, no claim and no trace.

    Transactional per run: under :func:`sweep_lock`, re-read ``jobs.json``, decide, and record a
    claim (``SUBMITTING``; local: ``RUNNING``) with this process's pid and host; then launch without
    the lock; then record the outcome under the lock. So two concurrent submits never launch a job
    twice, and ``jobs.json`` is never torn or loses an update. A submission that fails (``sbatch``
    exits non-zero) or a local job that exits non-zero is recorded ``FAILED`` with the reason.
    """
    scheduler = get_scheduler(manifest["scheduler"])
    result = SubmitResult()
    live = _live_states(manifest, load_jobs(sweep_dir))
    host, pid = socket.gethostname(), os.getpid()
    for run in manifest["runs"]:
        run_id = run["run_id"]
        with sweep_lock(sweep_dir):
            jobs = load_jobs(sweep_dir)
            job = jobs.get(run_id)
            row = {"job": (job.get("job_id") or "-") if job else "-", "state": record_state(job, live),
                   "trace": trace_state(run["trace"])}
            why = _skip_reason(row, job, resubmit_failed)
            if why is not None or dry_run:
                out.write(f"skip {run_id}: {why}\n" if why is not None else
                          f"would submit {run_id}: {' '.join(scheduler.submit_command)} {run['script']}\n")
                continue
            local = scheduler.name == "local"
            record = {"submitted": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      "scheduler": scheduler.name, "workdir": os.getcwd(), "host": host, "pid": pid,
                      "state": "RUNNING" if local else "SUBMITTING",
                      "job_id": f"local-{run['index']}" if local else None}
            jobs[run_id] = record
            save_jobs(sweep_dir, jobs)  # the claim, before anything is launched
        os.makedirs(os.path.dirname(run["log"]) or ".", exist_ok=True)  # schedulers do not create it
        outcome = {}
        try:
            if local:
                out.write(f"run {run_id} ({run['ranks']} ranks) ...\n")
                out.flush()
                rc = scheduler.run(run["script"], run["log"], os.getcwd())
                outcome = {"state": "COMPLETED" if rc == 0 else "FAILED", "returncode": rc}
                if rc != 0:
                    outcome["error"] = f"the job exited with status {rc}: {_last_line(run['log'])}"
            else:
                outcome = {"job_id": scheduler.submit(run["script"], os.getcwd()), "state": "PENDING"}
        except ConfigError as exc:  # sbatch & co. exited non-zero, or are missing
            outcome = {"state": "FAILED", "error": str(exc)}
        # (Ctrl-C while launching leaves the claim; once this process is gone it reads as FAILED)
        with sweep_lock(sweep_dir):
            jobs = load_jobs(sweep_dir)
            jobs[run_id] = {**jobs.get(run_id, record), **outcome}
            save_jobs(sweep_dir, jobs)
        if outcome["state"] == "FAILED":
            result.failed.append((run_id, outcome["error"]))
            out.write(f"failed {run_id}: {outcome['error']}\n")
        else:
            result.submitted += 1
            out.write(f"submitted {run_id}: job {jobs[run_id]['job_id']}\n")
    return result


def _last_line(log: str) -> str:
    """The last non-empty line of a job's log (where it says why it failed), or where the log is."""
    try:
        with open(log, errors="replace") as fh:
            lines = [line.strip() for line in fh.read()[-4096:].splitlines() if line.strip()]
    except OSError:
        lines = []
    return (lines[-1][:300] + f" (log: {log})") if lines else f"see {log}"


def collect(manifest: Dict, into: Optional[str] = None, out=sys.stdout, fmt: str = "table") -> int:
    """Check every run's trace, copy it into ``into`` when given, analyse. Exit 0 all there, 1 some missing."""
    from fourd_mpi.analysis import tables as analysis

    present, missing = [], []
    for run in manifest["runs"]:
        path = run["trace"]
        if not os.path.exists(path):  # a damaged file is named by analysis.collect below
            missing.append((run["run_id"], trace_state(path)))
            continue
        if into and os.path.abspath(os.path.dirname(path)) != os.path.abspath(into):
            os.makedirs(into, exist_ok=True)
            target = os.path.join(into, os.path.basename(path))
            if not os.path.exists(target):
                shutil.copy2(path, target)
            path = target
        present.append(path)
    for run_id, state in missing:
        sys.stderr.write(f"fourd-mpi: sweep {manifest['sweep']}: no trace of {run_id} ({state})\n")
    if not present:
        raise ConfigError(f"sweep {manifest['sweep']}: no traces yet ({len(missing)} missing)")
    traces, problems = analysis.collect(present)
    analysis.report_skipped(problems)
    if not traces:
        raise ConfigError(f"sweep {manifest['sweep']}: none of its {len(present)} trace file(s) could be read")
    runs = analysis.runs_table(traces)
    sections = [("runs", runs[[c for c in analysis.RUNS_SHOWN if c in runs.columns]])]
    if runs["world_size"].nunique() > 1:
        table = analysis.scaling(runs, manifest["study"])
        sections.append((f"{manifest['study']} scaling", table))
    if runs["algorithm"].nunique() > 1:  # algorithms side by side at each rank count
        sections.append(("compare", analysis.compare(runs)))
    for title, frame in sections:
        if fmt == "table":
            out.write(f"== {title} ==\n")
        out.write(analysis.format_table(frame, fmt))
        out.write("\n")
    return 1 if (missing or problems) else 0
