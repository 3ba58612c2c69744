"""``fourd-mpi sweep plan|render|submit|status|collect``: a scaling study from spec to table.

``render`` writes ``results/<sweep>/<site>/jobs/`` (:func:`default_script_dir`, next to the traces; ``--out``
another directory): one script per run, ``logs/`` for the job
output, and ``manifest.json`` (the resolved spec and, per run, its resources, command,
script, log and trace path; no time stamps, so the same spec renders the same bytes).
``submit`` records job ids in ``jobs.json`` next to the manifest and never submits a run
again whose job is pending, running or finished, or whose trace exists; it claims each run
in ``jobs.json`` under a lock before launching it, so concurrent submits never launch a run
twice (:func:`submit`). ``status`` asks the scheduler and looks at the traces; ``collect`` checks the
traces and runs the analysis (runs table, weak or strong scaling).

All commands run in one process, from the submission directory: paths in scripts and
manifests are relative to it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Dict, List, Optional

from fourd_mpi import __version__
from fourd_mpi.algorithms.registry import DEFAULT_ALGORITHM
from fourd_mpi.errors import ConfigError, Terminated
from fourd_mpi.jobs.jobstate import (  # noqa: F401 (re-exported: callers and tests import them from here)
    CLAIM_STATES,
    JOBS,
    LOCK,
    live_states,
    load_jobs,
    next_steps,
    read_exit_status,
    record_state,
    run_states,
    save_jobs,
    skip_reason,
    spool_of_trace,
    sweep_lock,
    trace_state,
)
from fourd_mpi.jobs.launchers import AFFINITY_SCRIPT
from fourd_mpi.jobs.pack import pack_settings, plan_packs, status_path
from fourd_mpi.jobs.render import (
    job_request,
    job_settings,
    python_for,
    render_affinity_script,
    render_pack_script,
    render_script,
    run_argv,
)
from fourd_mpi.jobs.schedulers import FINAL_STATES, get_scheduler, parse_time, slurm_time
from fourd_mpi.jobs.sites import RETIRED_DIR, SITES_DIR, Site, load_site
from fourd_mpi.jobs.spec import SCHEMA, RunPlan, SweepSpec, spec_from_data
from fourd_mpi.util.files import (
    MARKER,
    claim_directory,
    link_target,
    open_no_follow,
    refuse_link,
    write_marker,
)
from fourd_mpi.util.signals import deferred
from fourd_mpi.util.text import human_bytes
from fourd_mpi.util.yamlspec import schema_violations

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_SCHEMA = "fourd_mpi.sweep"  # file-format id (kept when the module moved)
MANIFEST_VERSION = 1
#: job settings that render and plan take on the command line too
JOB_OVERRIDES = ("account", "partition", "qos", "queue", "time")
#: a script directory whose paths may go into directives (``#SBATCH --output=DIR/logs/...``) unquoted
DIRECTIVE_PATH = r"[A-Za-z0-9_./+-]{1,400}"


def memory_per_rank(run: RunPlan) -> int:
    """Estimated bytes per rank: what memory admission will check when the run starts
    (:func:`fourd_mpi.run.admission.memory_need` of the run's resolved options, with the estimator of
    its algorithm's family: the 4D model, Optimus-CUBE's layouts, or the fullest pipeline stage)."""
    from fourd_mpi.run.admission import memory_need
    from fourd_mpi.run.options import resolve_values

    return memory_need(resolve_values(run.values(), run.ranks)).total


def results_dir_of(spec: SweepSpec, override: Optional[str] = None, site: Optional[str] = None) -> str:
    """Where a sweep's jobs write their traces: ``--results-dir`` as given; else the spec's ``results_dir`` (default
    ``results/SWEEP``) with the site's name below it, ``results/SWEEP/SITE``: the same spec rendered for two
    sites keeps two sets of traces, so the second never finds the first one's traces and skips its runs as
    done (``sweep submit`` skips a run whose trace is complete)."""
    if override:
        return override
    base = spec.results_dir or os.path.join("results", spec.name)
    return os.path.join(base, site) if site else base


#: the directory of a sweep's scripts below its results directory (:func:`default_script_dir`)
SCRIPTS_SUBDIR = "jobs"


def default_script_dir(spec: SweepSpec, site: Site, results_dir: Optional[str] = None) -> str:
    """Where ``sweep render`` writes by default: ``jobs/`` in the sweep's results directory
    (:func:`results_dir_of`: ``results/SWEEP/SITE/jobs``), beside the traces its jobs write. So two sites of one
    spec never share a directory, and in a checkout of fourd_mpi the scripts land under ``results/``, which git
    ignores, not in the source tree."""
    return os.path.join(results_dir_of(spec, results_dir, site.name), SCRIPTS_SUBDIR)


def build_manifest(spec: SweepSpec, site: Site, spec_path: str, script_dir: str, python: Optional[str] = None,
                   results_dir: Optional[str] = None) -> Dict:
    """Every run with its resources and command; raises before anything is written."""
    if site.scheduler != "local" and not re.fullmatch(DIRECTIVE_PATH, script_dir):
        raise ConfigError(f"--out {script_dir!r}: job log paths in it go into scheduler directives, which no shell "
                          f"quotes: use letters, digits and _ . / + - only")
    runs = spec.expand()
    results = results_dir_of(spec, results_dir, site.name)
    py = python_for(spec, site, python)
    entries = []
    for run in runs:
        log = os.path.join(script_dir, "logs", run.run_id + ".out")
        job = job_request(run, spec, site, log)
        memory = memory_per_rank(run)
        argv = run_argv(run, site, job, py, results, script_dir)
        entries.append({
            "index": run.index, "run_id": run.run_id, "ranks": run.ranks, "nodes": job.nodes,
            "ranks_per_node": job.ranks_per_node, "gpus_per_node": site.gpus_per_node, "grid": str(run.grid),
            "model": run.model.as_dict(), "options": dict(run.options), "repeat": run.repeat,
            "memory_per_rank": memory, "time_seconds": job.time_seconds,
            "script": os.path.join(script_dir, run.run_id + ".sh"), "log": log,
            "trace": os.path.join(results, run.run_id + ".h5"),
            "command": shlex.join(argv),
            "_run": run, "_job": job, "_tools": [argv[0], py],
        })
        if site.max_time and job.time_seconds > parse_time(site.max_time):
            raise ConfigError(f"run {run.run_id}: time limit {slurm_time(job.time_seconds)} is more than site "
                              f"{site.name}'s max_time {slurm_time(parse_time(site.max_time))}")
    manifest = {"schema": MANIFEST_SCHEMA, "version": MANIFEST_VERSION, "sweep": spec.name, "study": spec.study,
                "site": site.name, "scheduler": site.scheduler, "spec_path": spec_path, "results_dir": results,
                "script_dir": script_dir, "fourd_mpi_version": __version__, "spec": spec.as_dict(), "runs": entries}
    if site.source and os.path.dirname(os.path.abspath(site.source)) not in (os.path.abspath(SITES_DIR),
                                                                            os.path.abspath(RETIRED_DIR)):
        manifest["site_file"] = site.source  # a user profile: `submit --pack` renders pack scripts with it
    settings = job_settings(spec, site)
    size, mode = pack_settings(settings, site.scheduler)
    if size > 1:
        node_ranks = settings.get("ranks_per_node") or site.ranks_per_node
        manifest["packs"] = pack_entries(plan_packs(spec.name, entries, size, mode, script_dir, node_ranks,
                                                    site.max_time, site.name, queue_for=_queue_chooser(site, settings)),
                                         script_dir)
    return manifest


def _queue_chooser(site: Site, settings: Dict):
    """The queue of a pack's allocation: the job's queue setting, else the site's by node count."""
    return lambda nodes, seconds: site.queue_for(nodes, seconds, settings.get("queue"))


def pack_entries(packs, script_dir: str) -> List[Dict]:
    """Manifest entries of packs (:mod:`fourd_mpi.jobs.pack`); marks each run with its pack and status file."""
    out = []
    for pack in packs:
        for run in pack.runs:
            run["pack"], run["status"] = pack.name, status_path(run["log"])
        out.append({"name": pack.name, "mode": pack.mode, "runs": pack.run_ids, "nodes": pack.job.nodes,
                    "ranks_per_node": pack.job.ranks_per_node, "time_seconds": pack.job.time_seconds,
                    "script": os.path.join(script_dir, pack.name + ".sh"), "log": pack.job.log, "_pack": pack})
    return out


def plan_rows(manifest: Dict) -> List[Dict]:
    return [{"#": r["index"], "run_id": r["run_id"], "ranks": r["ranks"], "nodes": r["nodes"],
             "per_node": r["ranks_per_node"], "grid": r["grid"],
             "algorithm": r["options"].get("algorithm", DEFAULT_ALGORITHM), "model": r["model"]["name"],
             "batch": r["model"]["batch"], "hidden": r["model"]["hidden"], "layers": r["model"]["layers"],
             "options": " ".join(f"{k}={v}" for k, v in r["options"].items()),
             "memory/rank": human_bytes(r["memory_per_rank"])} for r in manifest["runs"]]


def public_manifest(manifest: Dict) -> Dict:
    """The manifest without its in-memory objects."""
    public = lambda entries: [{k: v for k, v in e.items() if not k.startswith("_")} for e in entries]  # noqa: E731
    out = {**manifest, "runs": public(manifest["runs"])}
    if "packs" in manifest:
        out["packs"] = public(manifest["packs"])
    return out


def write_sweep(manifest: Dict, spec: SweepSpec, site: Site, out_dir: str, force: bool = False) -> List[str]:
    """Write scripts and manifest into ``out_dir``.

    The rule of :mod:`fourd_mpi.util.files`: ``out_dir`` is new, empty, or one fourd-mpi rendered
    before (its marker, or an older render's manifest); anything else is refused and left alone. Files
    are rendered in a staging directory first; a new ``out_dir`` is that directory renamed, an existing
    one (``force``) receives each file by rename and loses only the files fourd-mpi wrote there before
    and no longer writes (never job ids in ``jobs.json``, ``logs/``, traces or anything else)."""
    previous = claim_directory(out_dir, force, "--out", owned_files=(MANIFEST,))
    if not previous and os.path.isfile(os.path.join(out_dir, MANIFEST)):
        previous = _rendered_names(out_dir)  # rendered before markers existed
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    exists = os.path.isdir(out_dir)
    staging = tempfile.mkdtemp(prefix=".render-", dir=out_dir if exists else parent)
    try:
        os.makedirs(os.path.join(staging, "logs"))
        written = []
        total = len(manifest["runs"])
        for entry in manifest["runs"]:
            text = render_script(entry["_run"], total, spec, site, entry["_job"], entry["command"],
                                 human_bytes(entry["memory_per_rank"]), manifest["spec_path"], entry.get("_tools"))
            name = os.path.basename(entry["script"])
            write_job_file(os.path.join(staging, name), text, executable=True)
            written.append(name)
        for entry in manifest.get("packs", []):
            text = render_pack_script(entry["_pack"], len(manifest["packs"]), spec, site, manifest["spec_path"])
            name = os.path.basename(entry["script"])
            write_job_file(os.path.join(staging, name), text, executable=True)
            written.append(name)
        if site.gpu_affinity_script:
            write_job_file(os.path.join(staging, AFFINITY_SCRIPT), render_affinity_script(site), executable=True)
            written.append(AFFINITY_SCRIPT)
        write_job_file(os.path.join(staging, MANIFEST),
                       json.dumps(public_manifest(manifest), indent=1, sort_keys=False) + "\n")
        if not exists:
            write_marker(staging, written + [MANIFEST])
            os.rename(staging, out_dir)
        else:
            for name in written + [MANIFEST, MARKER]:  # a link there (not fourd-mpi's) is neither followed nor replaced
                refuse_link(os.path.join(out_dir, name), what=f"--out {out_dir}: {name}")
            os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
            for name in written + [MANIFEST]:
                os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
            for name in set(previous) - set(written) - {MANIFEST}:
                path = os.path.join(out_dir, name)
                if os.path.isfile(path) and not os.path.islink(path):
                    os.remove(path)
            write_marker(out_dir, written + [MANIFEST])
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [os.path.join(out_dir, name) for name in written]


def _rendered_names(out_dir: str) -> List[str]:
    """The files an older render (before :data:`~fourd_mpi.util.files.MARKER`) wrote: its manifest's scripts."""
    try:
        with open(os.path.join(out_dir, MANIFEST)) as fh:
            old = json.load(fh)
        names = [os.path.basename(str(e.get("script", ""))) for e in old.get("runs", []) + old.get("packs", [])]
    except (OSError, ValueError, AttributeError, TypeError):
        return []
    return [n for n in names if n and n.endswith(".sh")] + [AFFINITY_SCRIPT]


def write_job_file(path: str, text: str, executable: bool = False) -> None:
    """A job script (or the manifest) of the sweep: never written through a symbolic link, nor over one."""
    refuse_link(path, what=f"the job script {path}")
    with open_no_follow(path) as fh:
        fh.write(text)
    if executable:
        os.chmod(path, 0o755)


def load_manifest(sweep_dir: str) -> Dict:
    path = os.path.join(sweep_dir, MANIFEST)
    try:
        with open(path) as fh:
            manifest = json.load(fh)
    except OSError as exc:
        if os.path.isdir(sweep_dir):
            raise ConfigError(f"{sweep_dir} is a directory but not a rendered sweep (it holds no {MANIFEST}): give "
                              "the directory 'fourd-mpi sweep render' wrote "
                              "(results/SWEEP/SITE/jobs or its --out)") from None
        from fourd_mpi.util.files import missing_reason

        what = missing_reason(sweep_dir) if not os.path.lexists(sweep_dir) or os.path.islink(sweep_dir) else \
            f"{exc.strerror}"
        raise ConfigError(f"no rendered sweep in {sweep_dir} ({what}): run fourd-mpi sweep render") from None
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    if manifest.get("schema") != MANIFEST_SCHEMA or manifest.get("version") != MANIFEST_VERSION:
        raise ConfigError(f"{path} is not a fourd-mpi sweep manifest of version {MANIFEST_VERSION}")
    return manifest



def set_aside(trace: str) -> Optional[str]:
    """Move what an earlier attempt of a run left (a trace that is not complete, its parts, its per-rank
    files) into ``RESULTS/superseded/RUN_ID-TIME/``, so that the run can run again under its id; returns that
    directory (None: nothing to move)."""
    from fourd_mpi.trace.files import parts_dir_of

    found = [p for p in (trace, parts_dir_of(os.path.abspath(trace)), spool_of_trace(trace)) if os.path.lexists(p)]
    if not found:
        return None
    name = os.path.basename(trace)[:-3] if trace.endswith(".h5") else os.path.basename(trace)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    superseded = os.path.join(os.path.dirname(os.path.abspath(trace)), "superseded")
    if os.path.islink(superseded):  # the attempt's files stay in the results directory, not moved through a link
        raise ConfigError(f"cannot set aside the earlier attempt of {name}: {superseded} is a symbolic link to "
                          f"{link_target(superseded)}, which fourd-mpi did not make; remove it")
    where = os.path.join(superseded, f"{name}-{stamp}-{os.getpid()}")
    os.makedirs(where, exist_ok=True)
    for path in found:
        os.rename(path, os.path.join(where, os.path.basename(path)))
    return where


@dataclass
class SubmitResult:
    """What one ``sweep submit`` did: runs submitted (batch: queued; local: run), and the runs that
    failed at submission or, local, when run (``(run_id, reason)``)."""

    submitted: int = 0
    failed: List = field(default_factory=list)


def submit(manifest: Dict, sweep_dir: str, resubmit_failed: bool = False, dry_run: bool = False,
           out=sys.stdout, pack: Optional[int] = None, pack_mode: str = "sequential") -> SubmitResult:
    """Submit every run that has no live or finished job, no claim and no trace.

    Transactional per run: under :func:`sweep_lock`, re-read ``jobs.json``, decide, and record a
    claim (``SUBMITTING``; local: ``RUNNING``) with this process's pid and host; then launch without
    the lock; then record the outcome under the lock. So two concurrent submits never launch a job
    twice, and ``jobs.json`` is never torn or loses an update. A submission that fails (``sbatch``
    exits non-zero) or a local job that exits non-zero is recorded ``FAILED`` with the reason.

    A packed sweep (:mod:`fourd_mpi.jobs.pack`) is submitted one pack at a time: the runs of a pack
    that need submitting are claimed together and launched as one job (the pack script's arguments,
    or ``--array=`` for an array, select them when not all do; PBS and LSF cannot pass arguments to
    a job script, so there the remaining runs are submitted as their own jobs). Each run's record
    holds the pack job's id (``ID_K`` for array task K) and its exit-status file, and is tracked alone.

    ``pack`` (``submit --pack N``) packs at submission: the runs that need submitting now, rendered or
    not in packs, go into new packs of ``pack`` runs (``DIR/pack-TIME-K.sh``), e.g. to retry the
    failed runs of a large sweep as a few jobs.
    """
    scheduler = get_scheduler(manifest["scheduler"])
    result = SubmitResult()
    live = live_states(manifest, load_jobs(sweep_dir))
    host, pid = socket.gethostname(), os.getpid()
    local = scheduler.name == "local"
    units = _units(manifest)
    if pack and pack > 1:
        units = _packed_at_submission(manifest, sweep_dir, live, resubmit_failed, pack, pack_mode, dry_run)
    for pack_entry, runs in units:
        claimed: Dict[str, Optional[Dict]] = {}  # run id -> its record before this submit claimed it
        started: set = set()  # run ids whose launch began
        try:
            with deferred(), sweep_lock(sweep_dir):  # a signal comes after the claims are saved, or before any
                jobs = load_jobs(sweep_dir)
                chosen = []
                for run in runs:
                    job = jobs.get(run["run_id"])
                    why = skip_reason(_submit_row(run, job, live), job, resubmit_failed)
                    if why is not None:
                        out.write(f"skip {run['run_id']}: {why}\n")
                    else:
                        chosen.append(run)
                if not chosen:
                    continue
                launches = plan_launches(scheduler, pack_entry, runs, chosen)
                if dry_run:
                    _say_would_submit(scheduler, launches, out)
                    continue
                records, before = _claim(scheduler, launches, jobs, host, pid)
                if resubmit_failed:  # an earlier attempt's partial trace or per-rank files would refuse the run
                    _set_aside_earlier_attempts(launches, out)
                save_jobs(sweep_dir, jobs)  # the claims, before anything is launched
                claimed = before
            for launch in launches:
                started.update(r["run_id"] for r in launch.runs)
                outcomes = _launch(scheduler, launch, out)
                with deferred():  # the outcome recorded and reported whole
                    with sweep_lock(sweep_dir):
                        jobs = load_jobs(sweep_dir)
                        for run_id, outcome in outcomes.items():
                            jobs[run_id] = {**jobs.get(run_id, records[run_id]), **outcome}
                        save_jobs(sweep_dir, jobs)
                    for run_id in outcomes:
                        claimed.pop(run_id, None)
                    where = f" ({launch.name})" if launch.packed else ""
                    for run_id, outcome in outcomes.items():
                        if outcome["state"] == "FAILED":
                            result.failed.append((run_id, outcome["error"]))
                            out.write(f"failed {run_id}{where}: {outcome['error']}\n")
                        else:
                            result.submitted += 1
                            out.write(f"submitted {run_id}: job {jobs[run_id]['job_id']}{where}\n")
        except (KeyboardInterrupt, Terminated) as exc:
            _record_interruption(sweep_dir, claimed, started, local, getattr(exc, "outcomes", {}), out)
            raise
    return result


def _packed_at_submission(manifest: Dict, sweep_dir: str, live, resubmit_failed: bool, pack: int, pack_mode: str,
                          dry_run: bool) -> List:
    """``submit --pack N``: the ``(pack entry, runs)`` units of a submit that packs now: the runs that need
    submitting go into new packs of ``pack`` runs (written unless ``dry_run``); every other run is a unit of its
    own with no pack (its skip is reported by the caller)."""
    jobs = load_jobs(sweep_dir)
    pending = [run for run in manifest["runs"]
               if skip_reason(_submit_row(run, jobs.get(run["run_id"]), live), jobs.get(run["run_id"]),
                               resubmit_failed) is None]
    ids = {run["run_id"] for run in pending}
    skipped = [(None, [run]) for run in manifest["runs"] if run["run_id"] not in ids]  # reported below
    return skipped + ([(entry, entry["_runs"]) for entry in submission_packs(manifest, pending, pack, pack_mode,
                                                                               write=not dry_run)]
                      if pending else [])


def _say_would_submit(scheduler, launches, out) -> None:
    """``submit --dry-run``: one ``would submit`` line per launch, with the command it would run."""
    for launch in launches:
        what = launch.name if launch.packed else launch.runs[0]["run_id"]
        argv = [*scheduler.submit_command, *launch.options, launch.script, *launch.args]
        runs_text = f" ({', '.join(r['run_id'] for r in launch.runs)})" if launch.packed else ""
        out.write(f"would submit {what}{runs_text}: {' '.join(argv)}\n")


def _claim(scheduler, launches, jobs: Dict, host: str, pid: int):
    """The claims of every run of ``launches``, written into ``jobs`` (the caller holds the lock and saves them):
    ``(records, before)``, the new record and the record before this submit, by run id. A claim is
    ``SUBMITTING`` (local: ``RUNNING``, with its job id) with this process's host and pid; a packed run's
    record names its pack and exit-status file, and a previous attempt's exit status is removed."""
    local = scheduler.name == "local"
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    records, before = {}, {}
    for launch in launches:
        for run in launch.runs:
            record = {"submitted": stamp, "scheduler": scheduler.name, "workdir": os.getcwd(),
                      "host": host, "pid": pid, "state": "RUNNING" if local else "SUBMITTING",
                      "job_id": (f"local-{launch.name}" if launch.packed else f"local-{run['index']}")
                      if local else None}
            if launch.packed:
                record.update(pack=launch.name, status_file=run["status"])
                with contextlib.suppress(FileNotFoundError):
                    os.remove(run["status"])  # a previous attempt's exit status
            before[run["run_id"]] = jobs.get(run["run_id"])
            jobs[run["run_id"]] = records[run["run_id"]] = record
    return records, before


def _set_aside_earlier_attempts(launches, out) -> None:
    """``submit --resubmit-failed``: move what an earlier attempt of each run left (no complete trace) aside,
    with a line each; one that cannot be moved: :class:`~fourd_mpi.errors.ConfigError`."""
    for launch in launches:
        for run in launch.runs:
            try:
                moved = set_aside(run["trace"])
            except OSError as exc:
                raise ConfigError(f"cannot set aside what an earlier attempt of {run['run_id']} "
                                  f"left next to {run['trace']}: {exc.strerror or exc}") from None
            if moved:
                out.write(f"moved the earlier attempt of {run['run_id']} (no complete trace) to {moved}\n")


def _record_interruption(sweep_dir: str, claimed: Dict[str, Optional[Dict]], started: set, local: bool,
                         outcomes: Dict[str, Dict], out) -> None:
    """``sweep submit`` interrupted (SIGINT, SIGTERM, SIGHUP) while it held ``claimed`` runs (run id -> the record
    before the claim): the runs of a stopped local job get their ``outcomes`` (``CANCELLED`` with the reason,
    or what they ended with); the claims of runs never launched are given back (their earlier record, or none);
    a batch job whose submission was cut short keeps its claim (it may be queued: once this process is gone the
    claim reads ``FAILED``, see :func:`record_state`). Further signals are held back meanwhile."""
    from fourd_mpi.util import signals

    if not claimed:
        return
    signals.hold()
    try:
        with sweep_lock(sweep_dir):
            jobs = load_jobs(sweep_dir)
            for run_id, previous in claimed.items():
                mine = jobs.get(run_id) or {}
                if mine.get("pid") != os.getpid() or mine.get("host") != socket.gethostname():
                    continue  # not this process's claim any more
                if run_id in outcomes:
                    jobs[run_id] = {**mine, **outcomes[run_id]}
                    out.write(f"{outcomes[run_id]['state'].lower()} {run_id}: {outcomes[run_id].get('error', '')}\n")
                elif run_id not in started or local:
                    if previous is None:
                        jobs.pop(run_id, None)
                    else:
                        jobs[run_id] = previous
            save_jobs(sweep_dir, jobs)
        out.flush()
    except (ConfigError, OSError):  # the records cannot be written: the claims read FAILED once this process ends
        pass
    finally:
        signals.release(raise_pending=False)


def _submit_row(run: Dict, job: Optional[Dict], live: Dict[str, str]) -> Dict:
    row = {"job": (job.get("job_id") or "-") if job else "-", "state": record_state(job, live),
           "trace": trace_state(run["trace"])}
    if row["trace"] == "complete" and row["state"] in FINAL_STATES:
        row["state"] = "COMPLETED"
    return row


def submission_packs(manifest: Dict, runs: List[Dict], size: int, mode: str, write: bool = True) -> List[Dict]:
    """Pack entries for ``runs`` (entries of ``manifest``), packed now; writes their scripts into the sweep's
    directory unless ``write`` is false. The spec and site are those the sweep was rendered with."""
    violations = schema_violations(manifest.get("spec"), SCHEMA)
    if violations:
        raise ConfigError(f"{manifest['script_dir']}/{MANIFEST}: its spec is not valid ({violations[0][1]}); "
                          f"render the sweep again")
    spec = spec_from_data(manifest["spec"], manifest["spec_path"])
    site = load_site(manifest.get("site_file") or manifest["site"])
    size, mode = pack_settings({"pack": size, "pack_mode": mode}, site.scheduler)
    script_dir = manifest["script_dir"]
    rebuilt = build_manifest(spec, site, manifest["spec_path"], script_dir, results_dir=manifest["results_dir"])
    by_id = {r["run_id"]: r for r in rebuilt["runs"]}
    if sorted(by_id) != sorted(r["run_id"] for r in manifest["runs"]):
        raise ConfigError(f"{script_dir}: the runs of the spec differ from the rendered ones; render the sweep again")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    settings = job_settings(spec, site)
    plans = plan_packs(spec.name, [by_id[r["run_id"]] for r in runs], size, mode, script_dir,
                       settings.get("ranks_per_node") or site.ranks_per_node, site.max_time, site.name,
                       prefix=f"pack-{stamp}-", queue_for=_queue_chooser(site, settings))
    entries = pack_entries(plans, script_dir)
    for entry in entries:
        entry["_runs"] = list(entry["_pack"].runs)
        if write:
            write_job_file(entry["script"],
                           render_pack_script(entry["_pack"], len(entries), spec, site, manifest["spec_path"]),
                           executable=True)
    return entries


def _units(manifest: Dict) -> List:
    """``(pack entry or None, runs)`` in submission order: each run alone, or the packs."""
    if not manifest.get("packs"):
        return [(None, [run]) for run in manifest["runs"]]
    by_id = {r["run_id"]: r for r in manifest["runs"]}
    return [(pack, [by_id[i] for i in pack["runs"]]) for pack in manifest["packs"]]


@dataclass
class Launch:
    """One job to launch: its script (a run's or a pack's), log, script arguments, submit options, runs."""

    name: str
    script: str
    log: str
    runs: List[Dict]
    packed: bool
    mode: str = ""
    args: List[str] = field(default_factory=list)
    options: List[str] = field(default_factory=list)


def plan_launches(scheduler, pack: Optional[Dict], runs: List[Dict], chosen: List[Dict]) -> List[Launch]:
    """The submissions that start the ``chosen`` runs of ``runs``: the run's own script without a ``pack``; the whole
    pack when every run of it is chosen; else the pack's script on the chosen positions (an array's indices, or its
    arguments), or each chosen run alone where the ``scheduler`` passes no arguments to a script (PBS, LSF)."""
    if pack is None:
        return [Launch(chosen[0]["run_id"], chosen[0]["script"], chosen[0]["log"], chosen, packed=False)]
    launch = Launch(pack["name"], pack["script"], pack["log"], chosen, packed=True, mode=pack["mode"])
    if len(chosen) == len(runs):
        return [launch]
    positions = [str(runs.index(run)) for run in chosen]
    if pack["mode"] == "array":
        launch.options = [f"--array={','.join(positions)}"]
    elif scheduler.name in ("pbs", "lsf"):  # qsub/bsub pass no arguments to a job script
        return [Launch(r["run_id"], r["script"], r["log"], [r], packed=False) for r in chosen]
    else:
        launch.args = positions
    return [launch]


def _launch(scheduler, launch: Launch, out) -> Dict[str, Dict]:
    """Launch one job; the outcome of each of its runs (the fields to merge into its record)."""
    for path in {launch.log, *(r["log"] for r in launch.runs)}:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # schedulers do not create it
    ids = [r["run_id"] for r in launch.runs]
    try:
        if scheduler.name != "local":
            job_id = scheduler.submit(launch.script, os.getcwd(), launch.args, launch.options)
            if launch.mode == "array":
                order = [int(o) for o in launch.options[0].split("=")[1].split(",")] if launch.options \
                    else range(len(ids))
                return {i: {"job_id": f"{job_id}_{k}", "state": "PENDING"} for i, k in zip(ids, order)}
            return {i: {"job_id": job_id, "state": "PENDING"} for i in ids}
        out.write(f"run {launch.name} " + (f"({len(ids)} runs) ...\n" if launch.packed
                                           else f"({launch.runs[0]['ranks']} ranks) ...\n"))
        out.flush()
        rc = scheduler.run(launch.script, launch.log, os.getcwd(), launch.args)
    except ConfigError as exc:  # sbatch & co. exited non-zero, or are missing
        return {i: {"state": "FAILED", "error": str(exc)} for i in ids}
    except (KeyboardInterrupt, Terminated) as exc:  # a local job was stopped (Local.run): what its runs ended with
        if getattr(exc, "job_status", None) is not None:
            exc.outcomes = _stopped(launch, exc.job_status, getattr(exc, "signum", signal.SIGINT))
        raise
    if not launch.packed:
        outcome = {"state": "COMPLETED" if rc == 0 else "FAILED", "returncode": rc}
        if rc != 0:
            outcome["error"] = f"the job exited with status {rc}: {_last_line(launch.log)}"
        return {ids[0]: outcome}
    outcomes = {}
    for run in launch.runs:
        status = read_exit_status(run["status"])
        if status is None:
            outcomes[run["run_id"]] = {"state": "FAILED", "error": f"{launch.name} exited with status {rc} before "
                                                                   f"the run ended: {_last_line(launch.log)}"}
        elif status:
            outcomes[run["run_id"]] = {"state": "FAILED", "returncode": status,
                                       "error": f"the run exited with status {status}: {_last_line(run['log'])}"}
        else:
            outcomes[run["run_id"]] = {"state": "COMPLETED", "returncode": 0}
    return outcomes


def _stopped(launch: Launch, status: int, signum: int) -> Dict[str, Dict]:
    """The outcome of each run of a local job that ``sweep submit`` stopped when it got ``signum`` (the job's exit
    ``status``): ``CANCELLED`` with the reason; in a pack, a run that ended before keeps its own outcome and a run
    that never started has none (its claim is given back)."""
    name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    why = (f"interrupted: sweep submit got {name} while the job ran and stopped it (exit status {status}); "
           "'fourd-mpi sweep status' says what its run left")
    if not launch.packed:
        return {launch.runs[0]["run_id"]: {"state": "CANCELLED", "returncode": status, "error": why}}
    outcomes = {}
    for run in launch.runs:
        ended = read_exit_status(run["status"])
        if ended == 0:
            outcomes[run["run_id"]] = {"state": "COMPLETED", "returncode": 0}
        elif ended is not None:
            outcomes[run["run_id"]] = {"state": "CANCELLED", "returncode": ended, "error": why}
    return outcomes


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
            refuse_link(target, what=f"--into {into}: {os.path.basename(path)}")  # copy2 would write through it
            if not os.path.exists(target):
                shutil.copy2(path, target)
            path = target
        present.append(path)
    for run_id, state in missing:
        log.warning("sweep %s: no trace of %s (%s)", manifest["sweep"], run_id, state)
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
