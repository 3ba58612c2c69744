"""Which ``mpiexec`` this is (MPICH's Hydra or Open MPI's ORTE/PRRTE), and what each needs on one machine
(pure standard library, no MPI: the CI's leftover check and the test bed import it without the dependencies).

The suite launches real ``mpiexec`` processes (the tests, ``fourd-mpi testbed mpiexec``). The two families
differ where it matters here (measured with the ``mpich`` 5.0 wheel and Open MPI 4.1.4, docs/guide/clusters.md):

==================  ===============================================  ===============================================
                    MPICH (Hydra)                                    Open MPI (mpirun/orterun)
==================  ===============================================  ===============================================
as root             runs                                             refuses: ``--allow-run-as-root`` or
                                                                     ``OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1``
more ranks than     runs                                             refuses: ``--oversubscribe`` /
cores                                                                ``OMPI_MCA_rmaps_base_oversubscribe=1``
binding             none unless ``-bind-to``                         ``--bind-to none`` when oversubscribed
MPMD environment    ``-env NAME VALUE`` per executable               ``-x NAME=VALUE`` (portable: ``env NAME=VALUE
                                                                     prog``)
remote start        ``-launcher ssh -launcher-exec SHIM -hosts``     ``--mca plm_rsh_agent SHIM --host n1:4,...``
                    ``-ppn R -iface BRIDGE``                         ``--mca btl_tcp_if_include``/``oob_tcp_if_include``
shared memory       ``/dev/shm/mpich_shm_*`` (left by killed ranks)  session directory under ``/tmp`` (``ompi.*``)
==================  ===============================================  ===============================================
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

#: the families :func:`flavor` tells apart
MPICH, OPENMPI, UNKNOWN = "mpich", "openmpi", "unknown"

#: what Open MPI's mpiexec needs to start ranks on one shared, oversubscribed machine (the tests' and CI's
#: environment; harmless to MPICH): run as root, more ranks than cores, and no core binding then (bound ranks
#: of an oversubscribed node would share cores; the binding tests ask for it on the command line). Open MPI 5
#: (PRRTE) reads the PRTE_ names, 4.1 (ORTE) the OMPI_MCA_ ones. ``opal_warn_on_missing_libcuda=0``: a
#: CUDA-aware build on a machine without a GPU driver warns once per rank otherwise.
OPENMPI_LOCAL_ENV: Dict[str, str] = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "OMPI_MCA_hwloc_base_binding_policy": "none",
    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
    "PRTE_MCA_hwloc_default_binding_policy": "none",
    "OMPI_MCA_opal_warn_on_missing_libcuda": "0",
}


@functools.lru_cache(maxsize=None)
def flavor(mpiexec: str) -> str:
    """:data:`MPICH` (Hydra), :data:`OPENMPI` or :data:`UNKNOWN`, from ``mpiexec --version`` (cached per path).

    Hydra prints ``HYDRA build details``; Open MPI 4 ``mpiexec (OpenRTE) 4.1.4``, Open MPI 5 ``mpiexec (Open
    MPI) 5.0.x``."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    text = (out.stdout + out.stderr).lower()
    if "hydra" in text or "mpich" in text:
        return MPICH
    if "openrte" in text or "open mpi" in text or "open-mpi" in text:
        return OPENMPI
    return UNKNOWN


def local_env(mpiexec: str) -> Dict[str, str]:
    """The environment variables ``mpiexec`` needs on this (shared, oversubscribed) machine: none for MPICH,
    :data:`OPENMPI_LOCAL_ENV` for Open MPI."""
    return dict(OPENMPI_LOCAL_ENV) if flavor(mpiexec) == OPENMPI else {}


def hydra_args_for(args, family: str):
    """Hydra options of a site profile (``launcher_args``) for ``family``'s ``mpiexec``: unchanged for MPICH;
    for Open MPI ``-iface IF`` becomes ``--mca btl_tcp_if_include IF --mca oob_tcp_if_include IF`` (the TCP
    transport and the daemons' wire-up on that interface), ``-bind-to X`` ``--bind-to X``, ``-ppn R``
    ``--map-by ppr:R:node``; anything else is passed as given."""
    args = list(args)
    if family != OPENMPI:
        return args
    out, i = [], 0
    while i < len(args):
        opt, value = args[i], args[i + 1] if i + 1 < len(args) else None
        if opt == "-iface" and value is not None:
            out += ["--mca", "btl_tcp_if_include", value, "--mca", "oob_tcp_if_include", value]
        elif opt in ("-bind-to", "-binding") and value is not None:
            out += ["--bind-to", value]
        elif opt == "-ppn" and value is not None:
            out += ["--map-by", f"ppr:{value}:node"]
        else:
            out.append(opt)
            i += 1
            continue
        i += 2
    return out


# -- the programs of this environment ------------------------------------------------------------------------

#: the words of a launched command that mean this interpreter (:func:`resolve_program`)
PYTHON_NAMES = ("python", "python3")


def interpreter() -> str:
    """This interpreter as an absolute path, symlinks kept: a virtual environment's ``bin/python`` is what makes
    it that environment, whether or not the environment is activated."""
    return os.path.abspath(sys.executable)


def beside(name: str, python: Optional[str] = None) -> Optional[str]:
    """The program ``name`` in the directory of the interpreter ``python`` (default :func:`interpreter`): a
    virtual environment's ``bin/`` holds its ``mpiexec`` (the ``mpich`` wheel's, the MPI its mpi4py loads) and
    its ``fourd-mpi`` console script. None when ``python`` is not an absolute path (a name the job's PATH
    resolves) or no executable file of that name is there."""
    python = python or interpreter()
    if not os.path.isabs(python):
        return None
    path = os.path.join(os.path.dirname(python), name)
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def resolve_program(argv: Sequence[str], python: Optional[str] = None) -> List[str]:
    """A command to launch on every rank, its program resolved in this environment, as ``sweep render`` writes
    the job's command: ``python`` or ``python3`` becomes the interpreter ``python`` (default
    :func:`interpreter`), ``fourd-mpi`` the console script beside it (when it is there). So ``fourd-mpi testbed
    mpiexec -- fourd-mpi run`` runs in the environment of the ``fourd-mpi`` typed, activated or not; the ranks'
    launcher (Hydra's ``execvp``) would otherwise look the name up on PATH. Other programs, and any word with a
    ``/``, are left as given."""
    argv = list(argv)
    if not argv or "/" in argv[0]:
        return argv
    python = python or interpreter()
    if argv[0] in PYTHON_NAMES and os.path.isabs(python):
        return [python, *argv[1:]]
    if argv[0] == "fourd-mpi":
        found = beside("fourd-mpi", python)
        if found:
            return [found, *argv[1:]]
    return argv
