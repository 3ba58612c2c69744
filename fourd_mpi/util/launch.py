"""What a launcher (``mpiexec``, ``srun``) tells a process through its environment before MPI starts: its
rank, and whether it has sibling ranks (:func:`launch_rank`). Read by the command line to decide who prints
(``fourd_mpi.cli.args.is_first_rank``) and how a signal that comes before MPI is up is handled
(:mod:`fourd_mpi.util.signals`). Imports nothing but ``os``: the command line reads it before its own imports.
"""

from __future__ import annotations

import os
from typing import Optional

#: environment variables in which launchers (MPICH/Hydra and PMI, Open MPI, PMIx, Slurm) give the rank, each
#: with the variables that give the number of ranks of that launch (none known: the rank alone decides)
RANK_VARIABLES = (("PMI_RANK", ("PMI_SIZE",)), ("OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",)),
                  ("PMIX_RANK", ()), ("SLURM_PROCID", ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")),
                  ("PALS_RANKID", ()))


def launch_rank() -> Optional[int]:
    """This process's rank in a launch that has other ranks, from the first of :data:`RANK_VARIABLES` set; None
    without one. A rank variable whose launch has no other rank (its size variable absent or 1: ``PMI_RANK`` or
    ``SLURM_PROCID`` left in the environment of a job step's shell) is no launch."""
    for name, sizes in RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            if sizes:
                size = next((os.environ[s].strip() for s in sizes if os.environ.get(s, "").strip().isdigit()), "")
                if not size or int(size) <= 1:
                    continue  # no sibling rank
            return int(value)
    return None
