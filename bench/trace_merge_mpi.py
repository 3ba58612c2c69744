"""Merge rate of the collective merge of ``fourd-mpi run`` (``merge_run``) by trace-group size.

Each rank appends ``--events`` synthetic events (the real record layout) to its spool, then
``fourd_mpi.trace.merge.merge_run`` writes the trace with each ``--group-sizes`` value: the
world size is one writer (the single-file path), smaller groups write part files in parallel.
Rate = all events / merge wall time (max over ranks); median of ``--repeats``.

    OMP_NUM_THREADS=1 mpiexec -n 8 python -m bench.trace_merge_mpi [--events 100000] [--group-sizes 8,4,2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

from fourd_mpi.trace.events import EVENT_DTYPE, RANK_STEP_DTYPE
from fourd_mpi.trace.merge import merge_run
from fourd_mpi.trace.spool import RankSpool


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=100_000, help="synthetic events per rank")
    p.add_argument("--group-sizes", default=None, help="comma-separated (default: world, world/2, ..., 2)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    sizes = [int(g) for g in args.group_sizes.split(",")] if args.group_sizes else \
        sorted({max(2, size >> k) for k in range(size.bit_length())} | {size}, reverse=True)
    base = world.bcast(tempfile.mkdtemp(prefix="fourd-merge-mpi-") if rank == 0 else None)
    rng = np.random.default_rng(rank)
    n = args.events
    ev = np.zeros(n, dtype=EVENT_DTYPE)
    ev["rank"] = rank
    ev["start_ns"] = np.sort(rng.integers(0, 10**10, n))
    ev["end_ns"] = ev["start_ns"] + rng.integers(1, 10**5, n)
    ev["op"] = rng.integers(0, 13, n)
    ev["bytes"] = rng.integers(0, 1 << 20, n)
    if rank == 0:
        print(f"merge_run: {size} ranks x {n:,} events, gzip; rate = all events / merge wall time (max over ranks), "
              f"median (min-max) of {args.repeats}")
        print(f"{'group size':>10} {'writers':>7} {'M events/s':>22}")
    try:
        for group in sizes:
            rates = []
            for r in range(args.repeats):
                spool_dir = os.path.join(base, f"g{group}-{r}.ranks")
                if rank == 0:
                    os.makedirs(spool_dir)
                world.Barrier()
                spool = RankSpool(spool_dir, rank, {"rank": rank})
                spool.append(ev, np.zeros(1, dtype=RANK_STEP_DTYPE))
                world.Barrier()
                t = time.perf_counter()
                merge_run(world, spool, {"rank": rank}, os.path.join(base, f"g{group}-{r}.h5"), {"run_id": "m"}, [],
                          force=True, group_size=group)
                rates.append(n * size / world.allreduce(time.perf_counter() - t, op=MPI.MAX) / 1e6)
            if rank == 0:
                print(f"{group:>10} {-(-size // group):>7} {statistics.median(rates):>8.2f} "
                      f"({min(rates):.2f}-{max(rates):.2f})", flush=True)
    finally:
        world.Barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
