"""Job packing: several runs of a sweep in one scheduler allocation.

A study of hundreds of runs would otherwise put hundreds of jobs in the queue. ``--pack N``
(``job.pack`` in the spec, ``defaults.pack`` in a site profile) groups the runs, in sweep
order, into packs of at most ``N`` consecutive runs; each pack is one job script
(``pack-000.sh``, ...). The runs keep their own scripts, which the pack script calls, so
each run still has its own log (``logs/RUN.out``) and its own exit status
(``logs/RUN.status``, ``"EXIT_STATUS JOB_ID"``, written to a temp file and renamed when
the run ends). ``sweep status`` and ``collect`` keep tracking every run.

Three modes (``--pack-mode``, ``job.pack_mode``):

``sequential`` (every scheduler)
    the runs one after another in one allocation sized for the largest run:
    ``nodes = max_i nodes_i``, ``ranks per node = max_i ranks_per_node_i``, and a time
    limit of ``sum_i time_i``, checked against the site's ``max_time``. A failed run does
    not stop the others; the job exits 1 when any run failed.
``concurrent`` (Slurm)
    every run at once as a background ``srun`` step (``SLURM_EXACT=1``: a step gets only the
    CPUs it asks for, so steps do not block each other; Slurm 22.05 semantics), then
    ``wait``. Time limit ``max_i time_i``; nodes: each multi-node run gets its own nodes,
    single-node runs share nodes (first-fit decreasing of their ranks into nodes of ``R``
    slots, ``R`` the site's ranks per node), and the job asks for ``nodes x R`` tasks.
``array`` (Slurm)
    one ``#SBATCH --array=0-K`` script; array task ``k`` runs the pack's run ``k``
    (``SLURM_ARRAY_TASK_ID``). Only runs of one shape (nodes, ranks per node, time limit)
    share an array; other packs are refused with the runs that differ.

Every value that reaches a pack script is quoted by :mod:`fourd_mpi.jobs.render`'s ``sh``
filter (values) or ``comment`` filter (comment lines), as in the per-run scripts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence

from fourd_mpi.errors import ConfigError
from fourd_mpi.jobs.schedulers import JobRequest, parse_time, slurm_time

PACK_MODES = ("sequential", "concurrent", "array")
#: schedulers that take each mode (sequential only needs a launcher that works inside an allocation)
MODE_SCHEDULERS = {"sequential": ("slurm", "pbs", "lsf", "sge", "local"), "concurrent": ("slurm",),
                   "array": ("slurm",)}


@dataclass(frozen=True)
class PackPlan:
    """One pack: its name, mode, the manifest entries of its runs, and its allocation."""

    name: str
    mode: str
    runs: tuple  # manifest run entries (dicts with "_job": JobRequest)
    job: JobRequest  # the allocation; for array: one array task's

    @property
    def run_ids(self) -> List[str]:
        return [r["run_id"] for r in self.runs]


def pack_settings(settings: Dict, scheduler: str) -> tuple:
    """``(size, mode)`` from the job settings (spec ``job:`` over site ``defaults:``); size 1: no packing."""
    size = int(settings.get("pack") or 1)
    mode = settings.get("pack_mode") or "sequential"
    if mode not in PACK_MODES:
        raise ConfigError(f"pack mode {mode!r}: choose one of {', '.join(PACK_MODES)}")
    if size > 1 and scheduler not in MODE_SCHEDULERS[mode]:
        raise ConfigError(f"--pack-mode {mode} needs Slurm (srun steps or a job array); scheduler {scheduler} "
                          f"supports --pack-mode sequential only")
    return size, mode


def status_path(log: str) -> str:
    """The exit-status file of a run whose log is ``log`` (``logs/RUN.out`` -> ``logs/RUN.status``)."""
    return os.path.splitext(log)[0] + ".status"


def _first_fit_nodes(sizes: Sequence[int], capacity: int) -> int:
    """Nodes of ``capacity`` slots that hold items of ``sizes`` (first-fit decreasing)."""
    free: List[int] = []
    for size in sorted(sizes, reverse=True):
        for i, room in enumerate(free):
            if room >= size:
                free[i] -= size
                break
        else:
            free.append(capacity - size)
    return len(free)


def _shape(job: JobRequest) -> tuple:
    return job.nodes, job.ranks_per_node, job.time_seconds


def plan_packs(sweep: str, entries: Sequence[Dict], size: int, mode: str, script_dir: str, node_ranks: int,
               max_time: Optional[str] = None, site_name: str = "?", prefix: str = "pack-",
               queue_for: Optional[Callable[[int, int], Optional[str]]] = None) -> List[PackPlan]:
    """Group manifest run entries into packs of at most ``size`` consecutive runs and size each allocation.
    ``queue_for(nodes, seconds)``: the queue of an allocation (a site's queues by node count,
    :meth:`fourd_mpi.jobs.sites.Site.queue_for`); None: the first run's.

    ``node_ranks`` is how many ranks a node takes (the site's or the spec's ranks per node): concurrent
    packs fit single-node runs into nodes of that many slots. Raises :class:`ConfigError` when a pack's time
    limit exceeds ``max_time`` (the site's longest job) or when an array pack mixes run shapes."""
    limit = parse_time(max_time) if max_time else None
    packs = []
    for start in range(0, len(entries), size):
        runs = tuple(entries[start:start + size])
        name = f"{prefix}{start // size:03d}"
        log = os.path.join(script_dir, "logs", name + ("-%a.out" if mode == "array" else ".out"))
        jobs = [r["_job"] for r in runs]
        first = jobs[0]
        if mode == "array":
            odd = [r["run_id"] for r, j in zip(runs, jobs) if _shape(j) != _shape(first)]
            if odd:
                raise ConfigError(
                    f"--pack-mode array: {name} mixes run shapes ({runs[0]['run_id']}: {first.nodes} node(s) x "
                    f"{first.ranks_per_node} ranks, {slurm_time(first.time_seconds)}; different: {', '.join(odd)}); "
                    f"an array's tasks share one shape: use --pack-mode sequential or concurrent, or a pack size "
                    f"that groups equal runs")
            job = replace(first, name=f"{sweep}-{name}", log=log)
        else:
            per_node = max(j.ranks_per_node for j in jobs)
            if mode == "sequential":
                nodes, seconds = max(j.nodes for j in jobs), sum(j.time_seconds for j in jobs)
            else:
                per_node = max(per_node, node_ranks)
                whole = sum(j.nodes for j in jobs if j.nodes > 1)
                nodes = whole + _first_fit_nodes([j.ranks for j in jobs if j.nodes == 1], per_node)
                seconds = max(j.time_seconds for j in jobs)
            job = replace(first, name=f"{sweep}-{name}", ranks=nodes * per_node,
                          nodes=nodes, ranks_per_node=per_node, time_seconds=seconds, log=log)
        if queue_for is not None:
            job = replace(job, queue=queue_for(job.nodes, job.time_seconds))
        if limit is not None and job.time_seconds > limit:
            raise ConfigError(
                f"{name} ({mode}, {len(runs)} runs) needs a time limit of {slurm_time(job.time_seconds)}, more than "
                f"site {site_name}'s max_time {slurm_time(limit)}: use a smaller --pack, a shorter --time"
                + (" or --pack-mode concurrent" if mode == "sequential" else ""))
        packs.append(PackPlan(name=name, mode=mode, runs=runs, job=job))
    return packs
