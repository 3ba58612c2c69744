"""``fourd-mpi sweep plan|render|submit|status|collect``: a scaling study from spec to table.

``render`` writes ``jobscripts/<sweep>/``: one script per run, ``logs/`` for the job
output, and ``manifest.json`` (the resolved spec and, per run, its resources, command,
script, log and trace path; no time stamps, so the same spec renders the same bytes).
``submit`` records job ids in ``jobs.json`` next to the manifest and never submits a run
again whose job is pending, running or finished, or whose trace exists. ``status`` asks
the scheduler and looks at the traces; ``collect`` checks the traces and runs the
analysis (runs table, weak or strong scaling).

All commands run in one process, from the submission directory: paths in scripts and
manifests are relative to it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from datetime import datetime, timezone
from typing import Dict, List, Optional, Sequence

from fourd_mpi import __version__
from fourd_mpi.errors import ConfigError, TraceError
from fourd_mpi.jobs.render import (AFFINITY_SCRIPT, job_request, python_for, render_affinity_script, render_script,
                         run_command)
from fourd_mpi.jobs.schedulers import ACTIVE_STATES, get_scheduler
from fourd_mpi.jobs.sites import Site
from fourd_mpi.jobs.spec import RunPlan, SweepSpec

MANIFEST = "manifest.json"
JOBS = "jobs.json"
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
             "per_node": r["ranks_per_node"], "grid": r["grid"], "model": r["model"]["name"],
             "batch": r["model"]["batch"], "hidden": r["model"]["hidden"], "layers": r["model"]["layers"],
             "options": " ".join(f"{k}={v}" for k, v in r["options"].items()),
             "memory/rank": _human_bytes(r["memory_per_rank"])} for r in manifest["runs"]]


def format_rows(rows: Sequence[Dict]) -> str:
    if not rows:
        return "(none)\n"
    keys = list(rows[0])
    cells = [[str(r[k]) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()  # noqa: E731
    return "\n".join([line(keys), line(["-" * w for w in widths]), *map(line, cells)]) + "\n"


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
    """Atomic rewrite: a crash mid-submission must not lose the ids already recorded."""
    path = os.path.join(sweep_dir, JOBS)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(jobs, fh, indent=1)
    os.replace(tmp, path)


def trace_state(path: str) -> str:
    """``complete``/``partial``/``failed`` (the trace's status), ``spooling`` (per-rank files only),
    ``damaged``, or ``missing``. Reads the trace's header only."""
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
    scheduler = get_scheduler(manifest["scheduler"])
    recorded = [jobs[r["run_id"]]["job_id"] for r in manifest["runs"] if r["run_id"] in jobs]
    live = scheduler.states(recorded) if query and recorded and manifest["scheduler"] != "local" else {}
    rows = []
    for run in manifest["runs"]:
        job = jobs.get(run["run_id"])
        state = "-"
        if job:
            state = live.get(job["job_id"], "UNKNOWN")
            if state == "UNKNOWN":  # gone from the scheduler (or local): the last state we saw
                state = job.get("state", "UNKNOWN")
        rows.append({"run_id": run["run_id"], "ranks": run["ranks"], "grid": run["grid"],
                     "job": job["job_id"] if job else "-", "state": state, "trace": trace_state(run["trace"])})
    return rows


def submit(manifest: Dict, sweep_dir: str, resubmit_failed: bool = False, dry_run: bool = False,
           out=sys.stdout) -> int:
    """Submit every run that has no live or finished job and no trace; the number submitted."""
    scheduler = get_scheduler(manifest["scheduler"])
    jobs = load_jobs(sweep_dir)
    submitted = 0
    for row, run in zip(run_states(manifest, jobs), manifest["runs"]):
        run_id, state, trace = row["run_id"], row["state"], row["trace"]
        if trace in ("complete", "partial", "spooling"):
            out.write(f"skip {run_id}: trace {trace}\n")
            continue
        if state in ACTIVE_STATES or (state == "COMPLETED" and not resubmit_failed):
            out.write(f"skip {run_id}: job {row['job']} {state.lower()}\n")
            continue
        if state != "-" and not resubmit_failed:
            out.write(f"skip {run_id}: job {row['job']} {state.lower()} (--resubmit-failed submits it again)\n")
            continue
        if dry_run:
            out.write(f"would submit {run_id}: {' '.join(scheduler.submit_command)} {run['script']}\n")
            continue
        os.makedirs(os.path.dirname(run["log"]) or ".", exist_ok=True)  # schedulers do not create it
        record = {"submitted": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "scheduler": scheduler.name, "workdir": os.getcwd()}
        if scheduler.name == "local":
            out.write(f"run {run_id} ({run['ranks']} ranks) ...\n")
            out.flush()
            rc = scheduler.run(run["script"], run["log"], os.getcwd())
            record.update(job_id=f"local-{run['index']}", state="COMPLETED" if rc == 0 else "FAILED", returncode=rc)
        else:
            record.update(job_id=scheduler.submit(run["script"], os.getcwd()), state="PENDING")
        jobs[run_id] = record
        save_jobs(sweep_dir, jobs)
        submitted += 1
        out.write(f"submitted {run_id}: job {record['job_id']}\n")
    return submitted


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
    for title, frame in sections:
        if fmt == "table":
            out.write(f"== {title} ==\n")
        out.write(analysis.format_table(frame, fmt))
        out.write("\n")
    return 1 if (missing or problems) else 0
