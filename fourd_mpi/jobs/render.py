"""Job scripts: one per run of a sweep, for a site, rendered from a Jinja2 template.

Every value that reaches the shell goes through :func:`shlex.quote` (the ``sh`` filter,
or :func:`shlex.join` for the launch line); values that go into scheduler directives
were restricted to a safe character set when the spec and the site were validated.
Paths in scripts are relative to the submission directory, so a rendered sweep is the
same on every checkout (the examples in ``jobscripts/`` are compared byte for byte).
"""

from __future__ import annotations

import os
import shlex
from typing import Dict, List, Optional

from fourd_mpi import __version__
from fourd_mpi.core.launcher import interpreter
from fourd_mpi.errors import ConfigError
from fourd_mpi.jobs.launchers import get_launcher
from fourd_mpi.jobs.schedulers import JobRequest, get_scheduler, parse_time
from fourd_mpi.jobs.sites import Site
from fourd_mpi.jobs.spec import RunPlan, SweepSpec

TEMPLATES = os.path.join(os.path.dirname(__file__), "templates")


def _environment():
    import jinja2  # only when rendering: the CLI parser imports this module's package on every rank

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    env.filters["sh"] = lambda value: shlex.quote(str(value))
    env.filters["comment"] = comment_text
    return env


def comment_text(value) -> str:
    """``value`` safe inside a ``#`` comment line: characters that are not printable (a newline
    would end the comment and start a command) are written as their escapes (``\\n``)."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in str(value))


def job_settings(spec: SweepSpec, site: Site) -> Dict:
    """Scheduler settings: the spec's ``job:`` over the site's ``defaults:``."""
    return {**site.defaults, **spec.job}


def job_request(run: RunPlan, spec: SweepSpec, site: Site, log: str) -> JobRequest:
    settings = job_settings(spec, site)
    for key in site.requires:
        if not settings.get(key):
            raise ConfigError(f"site {site.name} needs job.{key} for every job: give it in the spec's job: section "
                              f"or --{key} on the command line")
    nodes, per_node = site.rank_layout(run.ranks, settings.get("ranks_per_node"))
    seconds = parse_time(settings.get("time", "00:30:00"))
    return JobRequest(
        name=run.run_id, ranks=run.ranks, nodes=nodes, ranks_per_node=per_node, time_seconds=seconds, log=log,
        gpus_per_node=site.gpus_per_node, cores_per_node=site.cores_per_node, cpus_per_rank=site.cpus_per_rank,
        account=settings.get("account"), partition=settings.get("partition"), qos=settings.get("qos"),
        queue=site.queue_for(nodes, seconds, settings.get("queue")), constraint=settings.get("constraint"),
        reservation=settings.get("reservation"), extra=site.directives, account_option=site.account_option,
        parallel_environment=site.parallel_environment, launcher=site.launcher)


def run_command(run: RunPlan, site: Site, job: JobRequest, python: str, results_dir: str, script_dir: str) -> str:
    """The job's command line, shell-quoted token by token."""
    return shlex.join(run_argv(run, site, job, python, results_dir, script_dir))


def run_argv(run: RunPlan, site: Site, job: JobRequest, python: str, results_dir: str, script_dir: str) -> List[str]:
    """The job's command line as a list: launcher (:mod:`fourd_mpi.jobs.launchers`), interpreter,
    ``-m fourd_mpi run ...``."""
    argv = run.run_argv(results_dir)
    if site.backend != "auto" and run.option("backend") is None:
        argv[1:1] = ["--backend", site.backend]
    launcher = get_launcher(site.launcher).argv(site, job, script_dir, python)
    return [*launcher, python, "-m", "fourd_mpi", *argv]


def render_script(run: RunPlan, total: int, spec: SweepSpec, site: Site, job: JobRequest, command: str,
                  memory: str, spec_path: str, tools: Optional[List[str]] = None) -> str:
    """One run's job script. ``tools``: the programs the command starts (launcher, interpreter), checked at the
    start of the job after the modules and setup lines, so that a missing one is one line naming it."""
    scheduler = get_scheduler(site.scheduler)
    setup = list(site.setup) + list(spec.job.get("setup", []))
    return _environment().get_template("job.sh.j2").render(
        directives=scheduler.directives(job), sweep=spec.name, run=run, total=total, site=site, job=job,
        memory=memory, version=__version__, spec_path=spec_path, workdir_variable=scheduler.workdir_variable,
        setup=setup, command=command, tools=list(dict.fromkeys(tools or [])))


def render_pack_script(pack, packs: int, spec: SweepSpec, site: Site, spec_path: str) -> str:
    """The job script of a :class:`fourd_mpi.jobs.pack.PackPlan` (``templates/pack.sh.j2``)."""
    scheduler = get_scheduler(site.scheduler)
    directives = scheduler.directives(pack.job)
    if pack.mode == "array":
        directives.append(f"{scheduler.prefix} --array=0-{len(pack.runs) - 1}")
    return _environment().get_template("pack.sh.j2").render(
        directives=directives, sweep=spec.name, pack=pack, packs=packs, site=site, job=pack.job,
        version=__version__, spec_path=spec_path, workdir_variable=scheduler.workdir_variable,
        job_id_variable=scheduler.job_id_variable)


def render_affinity_script(site: Site) -> str:
    """The per-rank GPU wrapper of a site (``gpu_affinity_script: true``): local rank r gets GPU
    ``gpu_order[r % len]`` in ``gpu_visible_env``; no per-task cgroup, so every rank can still open the other GPUs'
    memory (CUDA/ROCm IPC) for intra-node GPU-aware MPI."""
    return _environment().get_template("gpu_affinity.sh.j2").render(
        site=site, gpu_order=list(site.gpu_order), local_rank=site.local_rank_variable, visible=site.gpu_visible_env)


def python_for(spec: SweepSpec, site: Site, override: Optional[str]) -> str:
    """The interpreter the jobs run: ``--python``, else the spec's ``job.python``, else the site's ``python:``,
    else the interpreter rendering the sweep (``sys.executable`` as an absolute path, symlinks kept: a virtual
    environment's ``bin/python`` is what makes it that environment). So a sweep rendered from a virtual
    environment runs in it whether or not it is activated where the job runs (docs/placement.md section 3)."""
    return override or spec.job.get("python") or site.python or interpreter()
