"""MPI launchers: the command line that starts a job's ranks, one class per launcher.

As :mod:`fourd_mpi.jobs.schedulers` has one class per scheduler, this module has one per launcher a site
profile may name (``launcher:``): plain ``mpiexec`` (MPICH's Hydra or Open MPI's, told apart at render time),
Slurm's ``srun``, IBM's ``jsrun`` and LLNL's ``lrun`` (LSF with CSM: Summit, Lassen), Cray PALS's ``mpiexec``
(``polaris-mpiexec``) and ``testbed`` (``fourd-mpi testbed mpiexec`` on a bed of emulated nodes). Each turns a
site and a :class:`~fourd_mpi.jobs.schedulers.JobRequest` (ranks ``n``, nodes ``N``, ranks per node ``R``,
``n = N R``) into the launcher's part of the job's command line; :data:`LAUNCHER_CLASSES` is the registry by
name, in the order the site schema lists them. This module is the floor of :mod:`fourd_mpi.jobs` (sites and
schedulers import it), so ``site`` and ``job`` below are a :class:`~fourd_mpi.jobs.sites.Site` and a
:class:`~fourd_mpi.jobs.schedulers.JobRequest` by duck type, not by import.
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, List, Optional, Type

from fourd_mpi.core.launcher import OPENMPI, beside, flavor, hydra_args_for
from fourd_mpi.errors import ConfigError

#: the per-rank GPU wrapper (``templates/gpu_affinity.sh.j2``) a site with ``gpu_affinity_script: true`` renders
AFFINITY_SCRIPT = "gpu_affinity.sh"


class Launcher:
    """One launcher: its name and the options it takes for a job's ranks, nodes, binding and GPUs."""

    name = "?"
    #: the environment variable holding a rank's node-local index, which the GPU affinity wrapper reads; None: the
    #: launcher does not start that wrapper (a site naming both is refused:
    #: :func:`fourd_mpi.jobs.sites.check_gpu_binding`)
    local_rank_variable: Optional[str] = None
    #: LSF with IBM's Cluster System Management: ``bsub -nnodes`` allocates whole nodes and the launcher places the
    #: ranks (:class:`fourd_mpi.jobs.schedulers.Lsf`); otherwise LSF ranks are slots, a fixed number per host
    whole_nodes = False

    def argv(self, site, job, script_dir: str, python: str) -> List[str]:
        """The launcher part of the command line, before the interpreter (``python``: the interpreter the job
        runs, which ``testbed`` and plain ``mpiexec`` need to find their program)."""
        raise NotImplementedError

    @staticmethod
    def cpus(site) -> List[str]:
        """The site's cores per rank as one option value, or none."""
        return [str(site.cpus_per_rank)] if site.cpus_per_rank else []

    @staticmethod
    def wrapper(site, script_dir: str) -> List[str]:
        """The GPU affinity wrapper, last on the launcher's line (each rank execs it, it execs the interpreter)."""
        return [os.path.join(script_dir, AFFINITY_SCRIPT)] if site.gpu_affinity_script else []


def mpiexec_for(site, python: str) -> str:
    """The ``mpiexec`` of a site whose launcher is plain ``mpiexec``: the one beside an absolute ``python`` (a
    virtual environment with the ``mpich`` wheel, the MPI its mpi4py loads), else ``mpiexec`` from the job's
    PATH (the site's modules)."""
    return beside("mpiexec", python) or "mpiexec"


class MpiExec(Launcher):
    """Plain ``mpiexec -n n`` (MPI-3.1 section 8.8, "Portable MPI Process Startup"), with the site's Hydra options
    as Open MPI spells them where the ``mpiexec`` is Open MPI's (:func:`fourd_mpi.core.launcher.hydra_args_for`)."""

    name = "mpiexec"

    def argv(self, site, job, script_dir, python):
        # the site's Hydra options, as Open MPI spells them where that is the mpiexec: the one beside the interpreter,
        # or the one of that name first on this PATH (the job script runs it by that name, in the environment
        # rendered from)
        mpiexec, args = mpiexec_for(site, python), list(site.launcher_args)
        found = mpiexec if os.path.isabs(mpiexec) else shutil.which(mpiexec)
        if found:
            family = flavor(found)
            args = hydra_args_for(args, family)
            if family == OPENMPI and job.nodes > 1 and not any(a.startswith("--map-by") for a in args):
                # Hydra places ranks as the allocation says; Open MPI's mpirun, with oversubscription allowed,
                # may fill the first node: the job's ranks per node, said explicitly
                args += ["--map-by", f"ppr:{job.ranks_per_node}:node"]
        return [mpiexec, *args, "-n", str(job.ranks)]


class Srun(Launcher):
    """Slurm's ``srun -N N -n n --ntasks-per-node=R [-c cores]`` (srun(1)); ``-c`` from the site unless its
    ``launcher_args`` give one."""

    name = "srun"
    local_rank_variable = "SLURM_LOCALID"

    def argv(self, site, job, script_dir, python):
        args, cpus = list(site.launcher_args), self.cpus(site)
        extra = [] if any(a.startswith(("-c", "--cpus-per-task")) for a in args) or not cpus else ["-c", *cpus]
        return ["srun", *args, "-N", str(job.nodes), "-n", str(job.ranks), f"--ntasks-per-node={job.ranks_per_node}",
                *extra, *self.wrapper(site, script_dir)]


class JsRun(Launcher):
    """IBM's ``jsrun`` (Spectrum LSF CSM): one resource set per rank (``-a 1``), its cores (``-c``, bound
    ``-b packed:c``), one GPU (``-g 1``), ``R`` sets per host (``-r``); ``--smpiargs=-gpu`` turns on Spectrum MPI's
    CUDA-aware mode (OLCF Summit user guide, "Job Launcher (jsrun)")."""

    name = "jsrun"
    whole_nodes = True

    def argv(self, site, job, script_dir, python):
        gpus = ["-g", "1"] if site.uses_gpus else []
        per_rank = (self.cpus(site) or ["1"])[0]  # each rank bound to its resource set's cores (-b packed:C)
        return ["jsrun", *site.launcher_args, "-n", str(job.ranks), "-a", "1", "-c", per_rank, *gpus,
                "-b", f"packed:{per_rank}", "-r", str(job.ranks_per_node),
                *(["--smpiargs=-gpu"] if site.uses_gpus else [])]


class LRun(Launcher):
    """LLNL's ``lrun -N N -T R`` (a jsrun wrapper, LLNL Lassen documentation), ``--smpiargs=-gpu`` as jsrun."""

    name = "lrun"
    whole_nodes = True

    def argv(self, site, job, script_dir, python):
        return ["lrun", *site.launcher_args, "-N", str(job.nodes), "-T", str(job.ranks_per_node),
                *(["--smpiargs=-gpu"] if site.uses_gpus else [])]


class PalsMpiExec(Launcher):
    """Cray PALS's ``mpiexec -n n --ppn R --depth c --cpu-bind depth`` (ALCF Polaris, "Running Jobs"): ``c`` cores
    per rank, each rank bound to its own."""

    name = "polaris-mpiexec"
    local_rank_variable = "PMI_LOCAL_RANK"

    def argv(self, site, job, script_dir, python):
        depth = self.cpus(site) or ["1"]
        return ["mpiexec", *site.launcher_args, "-n", str(job.ranks), "--ppn", str(job.ranks_per_node),
                "--depth", *depth, "--cpu-bind", "depth", *self.wrapper(site, script_dir)]


class Testbed(Launcher):
    """``fourd-mpi testbed mpiexec -n n --ppn R --``: consecutive ranks on one emulated node, as a scheduler places
    them (:mod:`fourd_mpi.testbed`)."""

    name = "testbed"

    def argv(self, site, job, script_dir, python):
        return [python, "-m", "fourd_mpi", "testbed", "mpiexec", *site.launcher_args, "-n", str(job.ranks),
                "--ppn", str(job.ranks_per_node), "--"]


LAUNCHER_CLASSES: Dict[str, Type[Launcher]] = {
    cls.name: cls for cls in (MpiExec, Srun, JsRun, LRun, PalsMpiExec, Testbed)}


def get_launcher(name: str) -> Launcher:
    """The launcher of that name; a :class:`ConfigError` listing the names otherwise."""
    try:
        return LAUNCHER_CLASSES[name]()
    except KeyError:
        raise ConfigError(f"unknown launcher {name!r}: choose one of {', '.join(LAUNCHER_CLASSES)}") from None
