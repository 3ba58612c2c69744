"""Site profiles: what a cluster needs in a job script (scheduler, launcher, node shape, modules),
and which machine profile of the performance model describes it.

This is the one list of sites: ``sweep --site``, ``tune --site`` and ``model paper --site`` all
take a name from :func:`builtin_sites` or a site FILE.yaml. A site names its machine profile
(:mod:`fourd_mpi.perf.machine`, ``machine_profile:``) when the model has one;
:func:`machine_profile_of` refuses a site without one, listing the sites that have one;
:func:`resolve_profile` is the site -> machine profile resolution that ``tune`` and ``model`` use
(``--profile`` wins; ``--site local`` takes this host's calibrated profile when there is one).

Built-in profiles live in ``fourd_mpi/jobs/sites/<name>.yaml``; ``--site FILE.yaml`` takes a
user profile of the same form for any other cluster. A profile is validated with JSON
Schema, so a typo names its key and line. Values that reach scheduler directives are
restricted to a safe character set (``#SBATCH`` lines are parsed by the scheduler, not by
a shell, so quoting would not protect them); everything else is shell-quoted when rendered.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from fourd_mpi.errors import ConfigError
from fourd_mpi.jobs.launchers import LAUNCHER_CLASSES, get_launcher
from fourd_mpi.jobs.pack import PACK_MODES
from fourd_mpi.jobs.spec import SAFE_VALUE_PATTERN, TIME_PATTERN
from fourd_mpi.perf.machine import MachineProfile, load_profile
from fourd_mpi.util.yamlspec import load_yaml

SITES_DIR = os.path.join(os.path.dirname(__file__), "sites")
#: profiles of retired machines: out of the default list (:func:`builtin_sites`), still selectable by name (each is
#: loaded with a one-line note, :func:`retired_note`), kept for their scheduler and launcher idioms
RETIRED_DIR = os.path.join(SITES_DIR, "retired")
SCHEDULERS = ("local", "slurm", "pbs", "lsf", "sge")
#: the launchers a site may name, one class each (:mod:`fourd_mpi.jobs.launchers`); ``testbed``: the environment's
#: mpiexec (the ``mpich`` wheel's or Open MPI's) on the nodes of a test bed of emulated nodes (``fourd-mpi testbed
#: mpiexec``, :mod:`fourd_mpi.testbed`; the bed is ``$FOURD_TESTBED``, default ``fourd``)
LAUNCHERS = tuple(LAUNCHER_CLASSES)
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
#: the node-local rank a GPU affinity wrapper reads: Slurm's srun, Cray PALS (Polaris's mpiexec)
LOCAL_RANK_VARIABLES = ("SLURM_LOCALID", "PMI_LOCAL_RANK")
#: the variable a wrapper sets: CUDA, ROCm (the ROCm runtime reads ROCR_VISIBLE_DEVICES, as Slurm sets it on Frontier)
VISIBLE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
#: srun options that give each task its own GPU cgroup (all but --gpu-bind=none; --ntasks-per-gpu implies
#: --gpu-bind=single, srun(1)): with HPE Cray MPICH's MPICH_GPU_SUPPORT_ENABLED=1 they break intra-node GPU
#: IPC (docs/sites.md, "GPU binding and CUDA IPC")
TASK_GPU_BINDING = ("--gpus-per-task", "--gpu-bind", "--ntasks-per-gpu")

_safe = {"type": "string", "pattern": SAFE_VALUE_PATTERN,
         "description": "use letters, digits and _.:+@/=,- only (the value goes into scheduler directives)"}
_count = {"type": "integer", "minimum": 0}

SITE_SCHEMA: Dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "scheduler", "launcher", "ranks_per_node"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
                 "description": "a site name uses letters, digits and . _ -"},
        "description": {"type": "string"},
        "documentation": {"type": "array", "items": {"type": "string", "pattern": r"^https://\S+$",
                                                      "description": "a documentation page is an https:// URL"}},
        "retired": {"type": "string", "pattern": r"^[0-9]{4}-[0-9]{2}$",
                    "description": "the month the machine was retired, YYYY-MM"},
        "scheduler": {"enum": list(SCHEDULERS)},
        "launcher": {"enum": list(LAUNCHERS)},
        "launcher_args": {"type": "array", "items": {"type": "string"}},
        "ranks_per_node": {"type": "integer", "minimum": 1},
        "cores_per_node": _count,
        "gpus_per_node": _count,
        "cpus_per_rank": {"type": "integer", "minimum": 1},
        "backend": {"enum": ["auto", "numpy", "cupy"]},
        "gpu_affinity_script": {"type": "boolean"},
        "gpu_map": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0},
                    "description": "the GPU of each node-local rank, closest to its cores first: gpu_map[r % len]"},
        "gpu_local_rank_env": {"enum": list(LOCAL_RANK_VARIABLES)},
        "gpu_visible_env": {"enum": list(VISIBLE_VARIABLES)},
        "parallel_environment": _safe,
        "account_option": {"enum": ["-A", "-P", "-G", "--account"]},
        "requires": {"type": "array", "items": {"enum": ["account", "partition", "qos", "queue", "constraint"]}},
        "directives": {"type": "object", "propertyNames": {"pattern": r"^[a-z][a-z0-9-]*$"},
                       "additionalProperties": _safe},
        "modules": {"type": "array", "items": {"type": "string", "pattern": r"^[A-Za-z0-9_.+/@-]+$",
                                               "description": "a module name uses letters, digits and _.+/@-"}},
        "module_paths": {"type": "array", "items": {"type": "string", "pattern": r"^[A-Za-z0-9_.+/@-]+$",
                                                    "description": "a module path uses letters, digits, _.+/@-"}},
        "env": {"type": "object", "propertyNames": {"pattern": ENV_NAME_PATTERN},
                "additionalProperties": {"type": ["string", "number", "boolean"]}},
        "setup": {"type": "array", "items": {"type": "string"}},
        "python": {"type": "string", "minLength": 1},
        "machine_profile": {"type": "string", "minLength": 1,
                            "description": "a built-in machine profile name or a profile file (the performance model)"},
        "max_time": {"type": "string", "pattern": TIME_PATTERN,
                     "description": "the longest job the site's queue takes, in Slurm's time forms"},
        "queues": {
            "type": "array", "minItems": 1,
            "description": "the queues a job goes to by its node count, in order: the first whose node range and "
                           "time limit take the job (a job's queue or --queue wins)",
            "items": {"type": "object", "additionalProperties": False, "required": ["name", "max_nodes"],
                      "properties": {"name": _safe, "min_nodes": {"type": "integer", "minimum": 1},
                                     "max_nodes": {"type": "integer", "minimum": 1},
                                     "max_time": {"type": "string", "pattern": TIME_PATTERN,
                                                  "description": "a queue's time limit is in Slurm's time forms"}}},
        },
        "defaults": {
            "type": "object", "additionalProperties": False,
            "properties": {"time": {"type": "string", "pattern": TIME_PATTERN,
                                    "description": "a time limit is minutes, M:S, H:M:S, D-H, D-H:M or D-H:M:S "
                                                   "(Slurm's forms)"},
                           "account": _safe, "partition": _safe, "qos": _safe, "queue": _safe,
                           "constraint": _safe, "reservation": _safe,
                           "pack": {"type": "integer", "minimum": 1}, "pack_mode": {"enum": list(PACK_MODES)}},
        },
    },
}


@dataclass(frozen=True)
class Queue:
    """A queue of a site's ``queues:`` (a job of ``min_nodes``..``max_nodes`` nodes, at most ``max_time``)."""

    name: str
    max_nodes: int
    min_nodes: int = 1
    max_time: Optional[str] = None

    def takes(self, nodes: int, seconds: int) -> bool:
        from fourd_mpi.jobs.schedulers import parse_time

        return (self.min_nodes <= nodes <= self.max_nodes
                and (self.max_time is None or seconds <= parse_time(self.max_time)))

    def describe(self) -> str:
        from fourd_mpi.jobs.schedulers import parse_time, slurm_time

        nodes = f"{self.min_nodes}-{self.max_nodes} nodes"
        return f"{self.name} {nodes}" + (f" up to {slurm_time(parse_time(self.max_time))}" if self.max_time else "")


@dataclass(frozen=True)
class Site:
    """A validated site profile (see the YAML files in ``fourd_mpi/sites``)."""

    name: str
    scheduler: str
    launcher: str
    ranks_per_node: int
    description: str = ""
    #: the centre's pages that the profile's binding, modules and MPI switches were checked against
    documentation: Tuple[str, ...] = ()
    #: YYYY-MM when the machine was retired (the profile is kept for its idiom; scripts say so)
    retired: Optional[str] = None
    launcher_args: Tuple[str, ...] = ()
    cores_per_node: int = 0
    gpus_per_node: int = 0
    cpus_per_rank: Optional[int] = None
    backend: str = "auto"
    #: render ``gpu_affinity.sh`` (templates/gpu_affinity.sh.j2) and start every rank through it: it exports
    #: ``gpu_visible_env`` = ``gpu_map[local rank % len]`` (no per-task GPU cgroup, so GPU IPC keeps working)
    gpu_affinity_script: bool = False
    #: the GPU of node-local rank r is gpu_map[r % len(gpu_map)]; default 0, 1, ... gpus_per_node - 1
    gpu_map: Tuple[int, ...] = ()
    #: the wrapper's node-local rank; default by launcher (srun: SLURM_LOCALID, polaris-mpiexec: PMI_LOCAL_RANK)
    gpu_local_rank_env: Optional[str] = None
    gpu_visible_env: str = "CUDA_VISIBLE_DEVICES"
    parallel_environment: str = "mpi"
    account_option: Optional[str] = None
    requires: Tuple[str, ...] = ()  # job settings the site's scheduler refuses jobs without
    directives: Tuple[Tuple[str, str], ...] = ()
    modules: Tuple[str, ...] = ()
    module_paths: Tuple[str, ...] = ()
    env: Tuple[Tuple[str, str], ...] = ()
    setup: Tuple[str, ...] = ()
    #: the interpreter jobs run; None: the one the sweep is rendered with (:func:`fourd_mpi.jobs.render.python_for`)
    python: Optional[str] = None
    max_time: Optional[str] = None  # the longest job the queue takes (packs are checked against it)
    #: the queue of a job by its node count (:meth:`queue_for`); empty: the job's queue setting as given
    queues: Tuple[Queue, ...] = ()
    defaults: Dict[str, str] = field(default_factory=dict)
    #: the performance model's machine profile of this site (a built-in name or a file), if any
    machine_profile: Optional[str] = None
    source: str = ""

    @property
    def uses_gpus(self) -> bool:
        return self.gpus_per_node > 0

    @property
    def gpu_order(self) -> Tuple[int, ...]:
        """The GPU of each node-local rank (``gpu_map``, default the identity)."""
        return self.gpu_map or tuple(range(self.gpus_per_node))

    @property
    def local_rank_variable(self) -> str:
        if self.gpu_local_rank_env:
            return self.gpu_local_rank_env
        return get_launcher(self.launcher).local_rank_variable or "SLURM_LOCALID"

    def queue_for(self, nodes: int, seconds: int, named: Optional[str] = None) -> Optional[str]:
        """The queue of a job of ``nodes`` nodes and ``seconds``: ``named`` (the job's queue or ``--queue``) when
        given, checked against :attr:`queues` when it is one of them; else the first of :attr:`queues` that takes
        the job; else None. A :class:`ConfigError` (one line, with the fix) when none takes it."""
        from fourd_mpi.jobs.schedulers import slurm_time

        table = "; ".join(q.describe() for q in self.queues)
        if named:
            queue = next((q for q in self.queues if q.name == named), None)
            if queue is not None and not queue.takes(nodes, seconds):
                raise ConfigError(f"site {self.name}: queue {named} does not take {nodes} node(s) for "
                                  f"{slurm_time(seconds)} ({table}): leave the queue out to have it chosen by node "
                                  f"count, or change --time or the ranks")
            return named
        if not self.queues:
            return None
        for queue in self.queues:
            if queue.takes(nodes, seconds):
                return queue.name
        raise ConfigError(f"site {self.name}: no queue takes {nodes} node(s) for {slurm_time(seconds)} ({table}): "
                          f"give --queue NAME (one of the centre's other queues) or a shorter --time")

    def rank_layout(self, ranks: int, ranks_per_node: Optional[int] = None) -> Tuple[int, int]:
        """``(nodes, ranks per node)`` for ``ranks``; full nodes only, so that nodes x per node = ranks."""
        per_node = ranks_per_node or self.ranks_per_node
        if self.scheduler == "local" and self.launcher != "testbed":  # a test bed's nodes are nodes
            return 1, ranks
        if self.uses_gpus and per_node > self.gpus_per_node:
            raise ConfigError(f"site {self.name}: {per_node} ranks per node but {self.gpus_per_node} GPUs "
                              f"per node (one GPU per rank)")
        if ranks <= per_node:
            return 1, ranks
        if ranks % per_node:
            raise ConfigError(f"site {self.name}: {ranks} ranks do not fill nodes of {per_node} ranks: "
                              f"use a multiple of {per_node} or set job.ranks_per_node")
        return ranks // per_node, per_node


def builtin_sites() -> List[str]:
    """The default list of sites (retired machines are not in it: :func:`retired_sites`)."""
    return sorted(os.path.splitext(f)[0] for f in os.listdir(SITES_DIR) if f.endswith(".yaml"))


def retired_sites() -> List[str]:
    """Built-in profiles of retired machines: selectable by name, not listed among :func:`builtin_sites`."""
    if not os.path.isdir(RETIRED_DIR):
        return []
    return sorted(os.path.splitext(f)[0] for f in os.listdir(RETIRED_DIR) if f.endswith(".yaml"))


def retired_note(site: Site) -> Optional[str]:
    """The one line said when a retired machine's profile is used, or None."""
    if not site.retired:
        return None
    return (f"note: site {site.name} is a retired machine (retired {site.retired}): its profile is kept for its "
            f"scheduler and launcher idiom, not for submission")


def sites_with_profiles() -> List[str]:
    """The built-in sites that name a machine profile (``tune --site`` accepts them)."""
    return [name for name in builtin_sites() if load_site(name).machine_profile]


def machine_profile_of(name_or_path: str) -> str:
    """The machine profile (built-in name or file) of a site; a :class:`ConfigError` listing the
    sites that have one when this one has none."""
    site = load_site(name_or_path)
    if not site.machine_profile:
        raise ConfigError(f"no machine profile for site {site.name!r}: sites with one are "
                          f"{', '.join(sites_with_profiles())}; pass --profile NAME|FILE (a built-in machine profile, "
                          f"or one measured by fourd-mpi bench collectives), or add machine_profile: to the site "
                          f"profile")
    profile = site.machine_profile
    if profile.endswith((".yaml", ".yml", ".json")) and not os.path.isabs(profile) and site.source:
        profile = os.path.join(os.path.dirname(os.path.abspath(site.source)), profile)
    return profile


def load_site(name_or_path: str) -> Site:
    """A built-in site by name, or a user profile from a ``.yaml`` file."""
    if name_or_path.endswith((".yaml", ".yml")) or os.sep in name_or_path:
        path = name_or_path
    else:
        path = os.path.join(SITES_DIR, name_or_path + ".yaml")
        if not os.path.exists(path) and name_or_path in retired_sites():
            path = os.path.join(RETIRED_DIR, name_or_path + ".yaml")
        if not os.path.exists(path):
            retired = retired_sites()
            raise ConfigError(f"unknown site {name_or_path!r}: choose one of {', '.join(builtin_sites())} "
                              + (f"(retired machines: {', '.join(retired)}) " if retired else "")
                              + "or give a site profile FILE.yaml")
    data = load_yaml(path, "site profile", SITE_SCHEMA).data
    tuples = {k: tuple(data[k]) for k in ("launcher_args", "modules", "module_paths", "setup", "requires",
                                                   "documentation", "gpu_map") if k in data}
    pairs = {k: tuple((str(a), str(b)) for a, b in data[k].items()) for k in ("directives", "env") if k in data}
    rest = {k: v for k, v in data.items() if k not in tuples and k not in pairs and k != "queues"}
    queues = tuple(Queue(**q) for q in data.get("queues", ()))
    site = Site(**rest, **tuples, **pairs, queues=queues, source=path)
    for queue in queues:
        if queue.min_nodes > queue.max_nodes:
            raise ConfigError(f"site {site.name} ({path}): queue {queue.name} has min_nodes {queue.min_nodes} above "
                              f"max_nodes {queue.max_nodes}")
    check_gpu_binding(site)
    return site


def task_gpu_binding(site: Site) -> List[str]:
    """The launcher options of ``site`` that bind GPUs per task (a cgroup per task); ``--gpu-bind=none`` is none."""
    found = []
    for arg in site.launcher_args:
        name, _, value = arg.partition("=")
        if name in TASK_GPU_BINDING and not (name == "--gpu-bind" and value == "none"):
            found.append(arg)
    return found


def check_gpu_binding(site: Site) -> None:
    """Refuse what cannot work: a ``gpu_map`` that is not one GPU per rank of the node's GPUs, and per-task GPU
    binding with Cray MPICH's GPU-aware mode unless its GPU IPC is switched off (``MPICH_GPU_IPC_ENABLED=0``)."""
    where = f"site {site.name} ({site.source})"
    if site.gpu_map and sorted(site.gpu_map) != list(range(site.gpus_per_node)):
        raise ConfigError(f"{where}: gpu_map {list(site.gpu_map)} must list each of the node's {site.gpus_per_node} "
                          f"GPUs (0..{site.gpus_per_node - 1}) once, the GPU closest to local rank r at position r")
    if (site.gpu_map or site.gpu_local_rank_env) and not site.gpu_affinity_script:
        raise ConfigError(f"{where}: gpu_map and gpu_local_rank_env need gpu_affinity_script: true (the wrapper "
                          f"that applies them)")
    if site.gpu_affinity_script and not get_launcher(site.launcher).local_rank_variable:
        wrapping = " and ".join(name for name, cls in LAUNCHER_CLASSES.items() if cls.local_rank_variable)
        raise ConfigError(f"{where}: gpu_affinity_script works with the {wrapping} launchers, not {site.launcher}")
    env = dict(site.env)
    bound = task_gpu_binding(site)
    if bound and env.get("MPICH_GPU_SUPPORT_ENABLED") == "1" and env.get("MPICH_GPU_IPC_ENABLED") != "0":
        raise ConfigError(f"{where}: {' '.join(bound)} puts each task's GPU in its own cgroup, which breaks Cray "
                          f"MPICH's intra-node GPU IPC under MPICH_GPU_SUPPORT_ENABLED=1 (cuIpcOpenMemHandle "
                          f"errors): request the node's GPUs (directives: gpus-per-node) and set "
                          f"gpu_affinity_script: true with gpu_map (see perlmutter.yaml), or set "
                          f"MPICH_GPU_IPC_ENABLED=0 in env (slower intra-node GPU messages)")


# ---------------------------------------------------------------------------
# site -> machine profile (tune, model, bench/algorithms.py)
# ---------------------------------------------------------------------------

def profile_for_site(site: Optional[str], profile: Optional[str] = None,
                     fallback: Optional[str] = None) -> MachineProfile:
    """``--profile`` wins; else the machine profile that ``--site`` names (the one site list,
    :func:`machine_profile_of`: perlmutter, frontier; local -> laptop); no
    site: laptop."""
    if profile:
        return load_profile(profile, fallback)
    if site is None:
        return load_profile("laptop", fallback)
    return load_profile(machine_profile_of(site), fallback)


def resolve_profile(site: Optional[str], profile: Optional[str], fallback: Optional[str] = None) -> MachineProfile:
    """``--profile`` wins; ``--site local`` takes the calibrated profile of this host when there is one."""
    if not profile and site == "local":
        import socket

        calibrated = os.path.join("results", "profiles", f"{socket.gethostname()}.yaml")
        if os.path.exists(calibrated):
            return load_profile(calibrated, fallback)
    return profile_for_site(site, profile, fallback)
