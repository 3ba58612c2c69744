"""Run under mpiexec: optimus3d's memory model against the arrays a built run really holds.

Builds ``--algorithm optimus3d`` on the world (the cube inferred from the world size), takes one
training step, then sums the bytes of the parameter shards, gradients and Adam state and of the
tensors one forward pass saves for backward (deduplicated by base array), and compares them with
:func:`fourd_mpi.perf.optimus3d.estimate_memory` and :func:`~fourd_mpi.perf.optimus3d.saved_activation_elements`.
Usage: mpiexec -n N python tests/helpers/mpi_optimus_check.py MODEL [FIELD=VALUE ...] [recompute=none|selective]
"""

import sys

from measured_memory import measure  # tests/helpers (this script's folder)
from mpi4py import MPI

from fourd_mpi.perf.optimus3d import estimate_memory, saved_activation_elements
from fourd_mpi.run.build import Run
from fourd_mpi.run.options import resolve


def main():
    world = MPI.COMM_WORLD
    overrides = dict(arg.split("=") for arg in sys.argv[2:])
    recompute = overrides.pop("recompute", "none")  # none or selective (full's estimate adds a working set)
    options = resolve(world.Get_size(), sys.argv[1], {"data": None, "z": None, "y": None, "x": None},
                      {k: int(v) for k, v in overrides.items()}, algorithm="optimus3d", dtype="float64",
                      optimizer="adam", recompute=recompute)
    run = Run.build(world, options)
    run.trainer.step(0)
    measured = measure(run, recompute)
    cfg, grid = options.model, options.grid
    est = estimate_memory(cfg, grid, dtype="float64", optimizer="adam", precision="pure").as_dict()
    est["saved"] = saved_activation_elements(cfg, grid, recompute=recompute) * 8
    failures = [f"rank {world.Get_rank()} {grid}: {key} measured {value} B, estimated {est[key]} B"
                for key, value in measured.items() if value != est[key]]
    run.close()
    failures = [f for per_rank in world.allgather(failures) for f in per_rank]
    if world.Get_rank() == 0:
        print("\n".join(failures) or f"optimus3d memory ok on grid {grid}: {measured}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
