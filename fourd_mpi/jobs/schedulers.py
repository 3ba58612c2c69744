"""Batch schedulers: directives for a job's resources, submission, and job state.

One class per scheduler (Slurm, PBS Pro, LSF, Grid Engine, and ``local`` for no
scheduler). Each turns a :class:`JobRequest` into directive lines, submits a script
and parses the job id, and maps the scheduler's job state onto one vocabulary:
``PENDING RUNNING COMPLETED FAILED CANCELLED TIMEOUT UNKNOWN`` (``UNKNOWN``: the
scheduler no longer knows the job, e.g. it was purged after finishing).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from fourd_mpi.errors import ConfigError, Terminated
from fourd_mpi.jobs.launchers import LAUNCHER_CLASSES
from fourd_mpi.util import signals

ACTIVE_STATES = ("PENDING", "RUNNING")
#: launchers of LSF clusters with IBM's Cluster System Management (Summit, Lassen): ``bsub -nnodes``
CSM_LAUNCHERS = tuple(name for name, cls in LAUNCHER_CLASSES.items() if cls.whole_nodes)
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")


@dataclass(frozen=True)
class JobRequest:
    """The resources of one job. ``ranks == nodes * ranks_per_node`` always."""

    name: str
    ranks: int
    nodes: int
    ranks_per_node: int
    time_seconds: int
    log: str  # path of the job's combined stdout/stderr, relative to the submission directory
    gpus_per_node: int = 0
    cores_per_node: int = 0
    cpus_per_rank: Optional[int] = None
    account: Optional[str] = None
    partition: Optional[str] = None
    qos: Optional[str] = None
    queue: Optional[str] = None
    constraint: Optional[str] = None
    reservation: Optional[str] = None
    extra: Tuple[Tuple[str, str], ...] = ()  # the site's own directives
    account_option: Optional[str] = None
    parallel_environment: str = "mpi"
    #: the site's launcher: LSF allocates whole nodes for the CSM launchers (jsrun, lrun), slots otherwise
    launcher: str = ""

    def __post_init__(self):
        if self.nodes * self.ranks_per_node != self.ranks:
            raise ConfigError(f"job {self.name}: {self.nodes} nodes x {self.ranks_per_node} ranks per node "
                              f"is not {self.ranks} ranks")


#: Slurm's ``--time`` forms, exactly as ``sbatch(1)`` lists them: ``minutes``, ``minutes:seconds``,
#: ``hours:minutes:seconds``, ``days-hours``, ``days-hours:minutes``, ``days-hours:minutes:seconds``.
#: Like Slurm (``time_str2secs`` in ``src/common/parse_time.c``) no field has an upper bound: ``90``
#: and ``1:30:00`` are the same limit, and so are ``0-36`` and ``1-12``.
SLURM_TIME = re.compile(r"(?P<days>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                        r"|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?")
TIME_FORMS = ("minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes "
              "or days-hours:minutes:seconds")


def parse_time(value) -> int:
    """Seconds of a time limit written as Slurm's ``--time`` (one syntax for every scheduler).

    ``M`` (an int or a string of digits) -> ``60 M``; ``M:S`` -> ``60 M + S``; ``H:M:S`` ->
    ``3600 H + 60 M + S``; ``D-H``, ``D-H:M``, ``D-H:M:S`` -> ``86400 D + 3600 H + 60 M + S``
    (so ``1-12:30`` is 36:30:00 and ``2-0`` is 48:00:00). Fields may exceed 59 or 23, as in Slurm.
    Slurm's ``0``/``-1``/``INFINITE``/``UNLIMITED`` (no limit) are refused: a job script names a
    finite limit. Slurm itself rounds seconds up to whole minutes; the directives of each scheduler
    are written from these seconds (:func:`slurm_time`, :func:`pbs_walltime`, :func:`lsf_run_limit`,
    :func:`sge_time`).
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"time limit {value!r}: use {TIME_FORMS}")
    text = str(value).strip()
    if text.upper() in ("-1", "INFINITE", "UNLIMITED"):
        raise ConfigError(f"time limit {value!r}: no limit is not allowed in a job script; use {TIME_FORMS}")
    match = SLURM_TIME.fullmatch(text)
    if not match:
        raise ConfigError(f"time limit {value!r}: use {TIME_FORMS}")
    g = {k: int(v) for k, v in match.groupdict().items() if v is not None}
    if "days" in g:
        total = ((g["days"] * 24 + g["dh"]) * 60 + g.get("dm", 0)) * 60 + g.get("ds", 0)
    elif "c" in g:  # hours:minutes:seconds
        total = (g["a"] * 60 + g["b"]) * 60 + g["c"]
    else:  # minutes[:seconds]
        total = g["a"] * 60 + g.get("b", 0)
    if total < 1:
        raise ConfigError(f"time limit {value!r} is zero (Slurm would read it as no limit); give a finite limit")
    return total


def hms(seconds: int) -> str:
    """``HH:MM:SS`` (hours may exceed 24)."""
    return f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def slurm_time(seconds: int) -> str:
    """Slurm ``--time``: ``HH:MM:SS`` below a day, ``D-HH:MM:SS`` from one day (sbatch(1))."""
    days, rest = divmod(seconds, 86400)
    return (f"{days}-" if days else "") + hms(rest)


def pbs_walltime(seconds: int) -> str:
    """PBS Pro ``-l walltime``: a duration ``[[hours:]minutes:]seconds``; written ``HH:MM:SS``, hours
    unbounded (pbs_resources(7B))."""
    return hms(seconds)


def lsf_run_limit(seconds: int) -> str:
    """LSF ``bsub -W [hour:]minute``: whole minutes only, so the limit is rounded UP to the next minute
    (never shorter than asked); written ``H:MM``."""
    minutes = -(-seconds // 60)
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def sge_time(seconds: int) -> str:
    """Grid Engine ``-l h_rt``: a time_specifier ``hours:minutes:seconds`` (or plain seconds), written
    ``HH:MM:SS``, hours unbounded (sge_types(1))."""
    return hms(seconds)


def _run(argv: Sequence[str], cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, cwd=cwd, timeout=120)
    except FileNotFoundError:
        raise ConfigError(f"{argv[0]} not found: is this a login node of the scheduler?") from None
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{' '.join(argv)} did not answer within 120 s") from None


class Scheduler:
    name = "?"
    prefix = "#"
    submit_command: Tuple[str, ...] = ()
    #: the environment variable holding the submission directory, where the job must cd first
    workdir_variable: Optional[str] = None
    #: the environment variable holding the job's id inside the job (pack scripts record it)
    job_id_variable: Optional[str] = None

    def directives(self, job: JobRequest) -> List[str]:
        raise NotImplementedError

    def submit(self, script: str, cwd: str, args: Sequence[str] = (), options: Sequence[str] = ()) -> str:
        """Submit ``script`` from ``cwd`` (submit ``options`` before it, script ``args`` after); the job id."""
        done = _run([*self.submit_command, *options, script, *args], cwd=cwd)
        if done.returncode != 0:
            raise ConfigError(f"{self.submit_command[0]} {script} failed: {' '.join(done.stderr.split())}")
        return self.parse_job_id(done.stdout)

    def parse_job_id(self, stdout: str) -> str:
        return stdout.strip().split()[0]

    def states(self, job_ids: Sequence[str]) -> Dict[str, str]:
        return {job_id: self.state(job_id) for job_id in job_ids}

    def state(self, job_id: str) -> str:
        raise NotImplementedError

    def _lines(self, pairs) -> List[str]:
        return [f"{self.prefix} {text}" for text in pairs]


class Slurm(Scheduler):
    name = "slurm"
    job_id_variable = "SLURM_JOB_ID"
    prefix = "#SBATCH"
    submit_command = ("sbatch", "--parsable")
    _states = {"PENDING": "PENDING", "CONFIGURING": "PENDING", "REQUEUED": "PENDING", "RESV_DEL_HOLD": "PENDING",
               "SUSPENDED": "PENDING", "RUNNING": "RUNNING", "COMPLETING": "RUNNING", "STAGE_OUT": "RUNNING",
               "COMPLETED": "COMPLETED", "FAILED": "FAILED", "NODE_FAIL": "FAILED", "OUT_OF_MEMORY": "FAILED",
               "BOOT_FAIL": "FAILED", "DEADLINE": "TIMEOUT", "TIMEOUT": "TIMEOUT", "CANCELLED": "CANCELLED",
               "PREEMPTED": "CANCELLED"}

    def directives(self, job: JobRequest) -> List[str]:
        options = {"job-name": job.name, "nodes": job.nodes, "ntasks": job.ranks,
                   "ntasks-per-node": job.ranks_per_node}
        if job.cpus_per_rank:
            options["cpus-per-task"] = job.cpus_per_rank
        options["time"] = slurm_time(job.time_seconds)
        options["output"] = job.log
        for key in ("account", "partition", "qos", "constraint", "reservation"):
            if getattr(job, key):
                options[key] = getattr(job, key)
        for key, value in job.extra:
            options.setdefault(key, value)
        return self._lines(f"--{k}={v}" for k, v in options.items())

    def parse_job_id(self, stdout: str) -> str:
        return stdout.strip().split(";")[0]  # --parsable: "id" or "id;cluster"

    def state(self, job_id: str) -> str:
        done = _run(["scontrol", "show", "job", "-o", job_id])
        match = re.search(r"\bJobState=(\S+)", done.stdout)
        if done.returncode != 0 or not match:
            return "UNKNOWN"  # purged after MinJobAge
        return self._states.get(match.group(1), "UNKNOWN")


class Pbs(Scheduler):
    name = "pbs"
    job_id_variable = "PBS_JOBID"
    prefix = "#PBS"
    submit_command = ("qsub",)
    workdir_variable = "PBS_O_WORKDIR"
    _states = {"Q": "PENDING", "H": "PENDING", "W": "PENDING", "T": "PENDING", "S": "PENDING",
               "R": "RUNNING", "E": "RUNNING", "B": "RUNNING", "X": "COMPLETED", "F": "COMPLETED"}

    def directives(self, job: JobRequest) -> List[str]:
        extra = dict(job.extra)
        chunk = f"select={job.nodes}"
        if "system" in extra:  # ALCF: the system name selects the node type
            chunk += f":system={extra.pop('system')}"
        else:
            chunk += f":mpiprocs={job.ranks_per_node}"
            chunk += f":ncpus={job.cores_per_node}" if job.cores_per_node else ""
            chunk += f":ngpus={job.gpus_per_node}" if job.gpus_per_node else ""
        lines = [f"-N {job.name}", f"-l {chunk}"]
        lines += [f"-l {k}={v}" for k, v in extra.items()]
        lines.append(f"-l walltime={pbs_walltime(job.time_seconds)}")
        if job.queue or job.partition:
            lines.append(f"-q {job.queue or job.partition}")
        if job.account:
            lines.append(f"-A {job.account}")
        lines += ["-j oe", f"-o {job.log}"]
        return self._lines(lines)

    def state(self, job_id: str) -> str:
        done = _run(["qstat", "-x", "-f", "-F", "json", job_id])
        try:
            info = next(iter(json.loads(done.stdout)["Jobs"].values()))
        except (ValueError, KeyError, StopIteration):
            return "UNKNOWN"
        state = self._states.get(info.get("job_state", ""), "UNKNOWN")
        if state == "COMPLETED" and int(info.get("Exit_status", 0)) != 0:
            return "FAILED"
        return state


class Lsf(Scheduler):
    name = "lsf"
    job_id_variable = "LSB_JOBID"
    prefix = "#BSUB"
    submit_command = ("bsub",)
    _states = {"PEND": "PENDING", "PSUSP": "PENDING", "WAIT": "PENDING", "RUN": "RUNNING", "USUSP": "RUNNING",
               "SSUSP": "RUNNING", "DONE": "COMPLETED", "EXIT": "FAILED", "ZOMBI": "FAILED"}

    def directives(self, job: JobRequest) -> List[str]:
        if job.launcher in CSM_LAUNCHERS:  # LSF with CSM (Summit, Lassen): whole nodes; jsrun places the ranks
            lines = [f"-J {job.name}", f"-nnodes {job.nodes}"]
        else:  # a plain LSF cluster: ranks are slots, a fixed number per host
            lines = [f"-J {job.name}", f"-n {job.ranks}", f'-R "span[ptile={job.ranks_per_node}]"']
        lines.append(f"-W {lsf_run_limit(job.time_seconds)}")
        if job.account:
            lines.append(f"{job.account_option or '-P'} {job.account}")
        if job.queue or job.partition:
            lines.append(f"-q {job.queue or job.partition}")
        lines.append(f"-o {job.log}")
        return self._lines(lines)

    def submit(self, script: str, cwd: str, args: Sequence[str] = (), options: Sequence[str] = ()) -> str:
        if args or options:
            raise ConfigError("bsub < SCRIPT passes no arguments to a job script")
        # bsub reads the #BSUB lines only from standard input
        with open(os.path.join(cwd, script)) as fh:
            try:
                done = subprocess.run(["bsub"], stdin=fh, capture_output=True, text=True, cwd=cwd, timeout=120)
            except FileNotFoundError:
                raise ConfigError("bsub not found: is this a login node of the scheduler?") from None
        match = re.search(r"Job <(\d+)>", done.stdout)
        if done.returncode != 0 or not match:
            raise ConfigError(f"bsub < {script} failed: {' '.join((done.stderr or done.stdout).split())}")
        return match.group(1)

    def state(self, job_id: str) -> str:
        done = _run(["bjobs", "-noheader", "-o", "stat", job_id])
        words = done.stdout.split()
        return self._states.get(words[0], "UNKNOWN") if done.returncode == 0 and words else "UNKNOWN"


class GridEngine(Scheduler):
    name = "sge"
    job_id_variable = "JOB_ID"
    prefix = "#$"
    submit_command = ("qsub", "-terse")

    def directives(self, job: JobRequest) -> List[str]:
        lines = [f"-N {job.name}", "-S /bin/bash", "-cwd", f"-pe {job.parallel_environment} {job.ranks}",
                 f"-l h_rt={sge_time(job.time_seconds)}"]
        if job.queue or job.partition:
            lines.append(f"-q {job.queue or job.partition}")
        if job.account:
            lines.append(f"-A {job.account}")
        lines += ["-j y", f"-o {job.log}"]
        return self._lines(lines)

    def parse_job_id(self, stdout: str) -> str:
        return stdout.strip().split(".")[0]  # array jobs print id.range

    def state(self, job_id: str) -> str:
        done = _run(["qstat", "-u", "*"])
        for line in done.stdout.splitlines():
            words = line.split()
            if words and words[0] == job_id and len(words) > 4:
                code = words[4]
                if "E" in code:
                    return "FAILED"
                return "RUNNING" if ("r" in code or "t" in code) else "PENDING"
        return "UNKNOWN"  # left the queue: finished; qacct (if accounting is on) has the exit status


class Local(Scheduler):
    """No scheduler: ``submit`` runs the script here and now, one after another."""

    name = "local"
    submit_command = ("bash",)

    def directives(self, job: JobRequest) -> List[str]:
        return []

    def run(self, script: str, log: str, cwd: str, args: Sequence[str] = ()) -> int:
        """Run ``script`` here and now (its output into ``log``); its exit status.

        The job runs in a process group of its own. SIGINT, SIGTERM or SIGHUP to this process while it runs
        (:class:`KeyboardInterrupt`, :class:`~fourd_mpi.errors.Terminated`) is passed on to the job's group (as
        a terminal's Ctrl-C or a scheduler's ``scancel`` would reach it), which then has :data:`STOP_GRACE_S`
        seconds to end (the run records the interruption) before it is killed; the exception then goes on,
        with the job's exit status as its ``job_status``. No job outlives an interrupted ``sweep submit``."""
        from fourd_mpi.util.files import open_no_follow, refuse_link

        path = os.path.join(cwd, log)
        for where in (os.path.dirname(path), path):  # the sweep's logs: never written through a link
            refuse_link(where, what=f"the job log {path}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open_no_follow(path) as out:
            job = None
            try:
                with signals.deferred():  # started and known, or not started: never a job this process lost track of
                    job = subprocess.Popen(["bash", script, *args], stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                           start_new_session=True)
                return job.wait()
            except (KeyboardInterrupt, Terminated) as exc:
                if job is not None:
                    exc.job_status = stop_job(job, getattr(exc, "signum", signal.SIGINT))
                raise

    def state(self, job_id: str) -> str:
        return "UNKNOWN"  # local runs record their final state at submission


#: seconds an interrupted local job has to end after the signal was passed on to it, before it is killed
STOP_GRACE_S = 60.0


def stop_job(job: subprocess.Popen, signum: int) -> int:
    """Pass ``signum`` on to the process group of ``job`` (started with ``start_new_session``), wait until every
    process of the group has ended (at most :data:`STOP_GRACE_S` seconds, then SIGKILL), and return the job's exit
    status. Further signals meanwhile are held back and dropped: the job is already being stopped."""
    signals.hold()
    try:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signum)
        deadline, killed = time.monotonic() + STOP_GRACE_S, False
        while True:
            job.poll()  # reaps the script: the group then holds the processes it left running, if any
            if not _group_running(job.pid):
                break
            if time.monotonic() > deadline:
                if killed:  # what SIGKILL did not end (a process stuck in the kernel): not waited for
                    break
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(job.pid, signal.SIGKILL)
                deadline, killed = time.monotonic() + 10, True
            time.sleep(0.02)
        return job.wait()
    finally:
        signals.release(raise_pending=False)


def _group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (a zombie, waiting for whoever reaps it, does not)."""
    if not os.path.isdir("/proc/self"):  # no procfs: whether the group exists at all
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


SCHEDULER_CLASSES = {cls.name: cls for cls in (Slurm, Pbs, Lsf, GridEngine, Local)}


def get_scheduler(name: str) -> Scheduler:
    try:
        return SCHEDULER_CLASSES[name]()
    except KeyError:
        raise ConfigError(f"unknown scheduler {name!r}: choose one of {', '.join(SCHEDULER_CLASSES)}") from None
