"""Under mpiexec: after the first steps, a training step allocates no array (the pool serves all).

For each grid and overlap (none, all; send buffers checked): run two steps (the pool
fills), then three more. Without overlap the step's arrays and their lifetimes are the
same every step, so every rank checks that steps 2-4 made no new array. With overlap,
when a lazily issued data all-reduce completes depends on timing, so the number of
arrays alive at once can reach a new peak in a later step (the pool then grows by
one); there every rank checks only that reuse changes no result: the losses equal
those of a run whose every step starts from an empty pool. Prints one line per grid
and overlap: ``GRID OVERLAP allocations A (steps 2-4: G) hits H ok``.
"""

import sys

import numpy as np
from mpi4py import MPI

from fourd_mpi.core.grid import GridShape
from fourd_mpi.run.build import Run
from fourd_mpi.run.options import run_options
from fourd_mpi.step.presets import resolve_model


def losses(world, options, fresh_pool_each_step: bool):
    run = Run.build(world, options)
    out, grown = [], []
    for i in range(options.steps):
        if fresh_pool_each_step:
            run.backend.arrays.clear()
        before = run.backend.arrays.stats()["allocations"]
        out.append(run.trainer.step(i).loss)
        grown.append(run.backend.arrays.stats()["allocations"] - before)
    stats = run.backend.arrays.stats()
    run.close()
    return out, grown, stats


def main():
    world = MPI.COMM_WORLD
    model = resolve_model(sys.argv[1], **{k: int(v) for k, v in (a.split("=") for a in sys.argv[3:])})
    failures = []
    for text in sys.argv[2].split(","):
        for overlap in ("none", "all"):
            shape = GridShape.parse(text)
            options = run_options(model=model, grid=shape, dtype="float64", overlap=overlap,
                                 cache_weights=overlap != "none", check_buffers=True, steps=5, data_batches=2,
                                 backend="numpy")
            pooled, grown, stats = losses(world, options, False)
            fresh, _, _ = losses(world, options, True)
            if overlap == "none" and any(grown[2:]):
                failures.append(f"{shape} {overlap} rank {world.Get_rank()}: steps 2-4 allocated {grown[2:]} arrays")
            if not np.array_equal(pooled, fresh):
                failures.append(f"{shape} {overlap} rank {world.Get_rank()}: losses {pooled} != {fresh} "
                                "without reuse")
            failures = [f for per_rank in world.allgather(failures) for f in per_rank]
            later = world.allreduce(sum(grown[2:]))
            if world.Get_rank() == 0:
                print("\n".join(failures) if failures else
                      f"{shape} {overlap} allocations {stats['allocations']} (steps 2-4: {later}) "
                      f"hits {stats['hits']} ok", flush=True)
            if failures:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
