"""Run under mpiexec: memory.estimate_memory against the arrays a built run really holds.

For every grid that factors the world and fits the model: sum the bytes of the parameter
shards, gradients and Adam state after one step, and of the tensors the forward pass saves
for backward (deduplicated by their base array), and compare with the estimate. Each grid runs
in float32 (no master copy) and in float16 with ``precision="pure"`` (this suite's step keeps its
Adam state in the run dtype); float16 with the default ``mixed`` precision must add exactly the fp32
master copy and fp32 moments of the same parameters (what a GPU framework keeps).
Usage: mpiexec -n N python tests/helpers/mpi_memory_check.py MODEL [FIELD=VALUE ...] (batch=8 hidden=48 ...)
"""

import sys

import numpy as np
from measured_memory import measure  # tests/helpers (this script's folder)
from mpi4py import MPI

from fourd_mpi.core.grid import grid_factorizations
from fourd_mpi.perf.memory import estimate_memory, saved_activation_elements
from fourd_mpi.run.build import Run
from fourd_mpi.run.options import run_options
from fourd_mpi.step.presets import model_problems, resolve_model


def check(world, cfg, shape, dtype):
    """Measured vs estimated bytes of one built run; the failures as sentences."""
    failures = []
    run = Run.build(world, run_options(model=cfg, grid=shape, optimizer="adam", dtype=dtype))
    run.trainer.step(0)
    measured = {**measure(run), "master": 0}
    e = np.dtype(dtype).itemsize
    est = estimate_memory(cfg, shape, dtype=dtype, optimizer="adam", precision="pure").as_dict()
    est["saved"] = saved_activation_elements(cfg, shape) * e
    for key, value in measured.items():
        if value != est[key]:
            failures.append(f"{shape} {dtype} rank {world.Get_rank()}: {key} measured {value} B, "
                            f"estimated {est[key]} B")
    if dtype == "float16":  # mixed precision: + fp32 master (4 B) and moments (2 x 4 B instead of 2 x 2 B)
        mixed = estimate_memory(cfg, shape, dtype=dtype, optimizer="adam")
        n = measured["weights"] // e
        if (mixed.master, mixed.optimizer, mixed.weights) != (4 * n, 8 * n, measured["weights"]):
            failures.append(f"{shape} mixed precision: master {mixed.master} B, optimizer {mixed.optimizer} B "
                            f"for {n} parameter elements (expected {4 * n}, {8 * n})")
    run.close()
    return failures


def main():
    world = MPI.COMM_WORLD
    model = sys.argv[1]
    overrides = dict(arg.split("=") for arg in sys.argv[2:])
    cfg = resolve_model(model, **{k: int(v) for k, v in overrides.items()})
    failures, checked = [], 0
    for shape in grid_factorizations(world.Get_size()):
        if model_problems(cfg, shape):
            continue
        for dtype in ("float32", "float16"):
            with np.errstate(all="ignore"):  # float16 values of random weights may overflow: only bytes count
                failures += check(world, cfg, shape, dtype)
        checked += 1
    failures = [f for per_rank in world.allgather(failures) for f in per_rank]
    if world.Get_rank() == 0:
        print("\n".join(failures) or f"memory ok for {checked} grids of {world.Get_size()} ranks")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
