"""Run under mpiexec: request bookkeeping of the nonblocking collectives.

1. A request left un-waited is reported by ``check_quiescent``.
2. A send buffer modified while its collective is in flight is detected (check_buffers).
3. With ``poll`` progress, a collective issued before a chunked GEMM completes
   during chunked GEMMs (seen complete before anyone waits); the record keeps issue,
   completion and wait times in order.
Prints "overlap checks ok" on rank 0 or the failures, exits 1 on failure.
"""

import sys

import numpy as np
from mpi4py import MPI

from fourd_mpi.core.backend import make_backend
from fourd_mpi.core.collectives import BufferModifiedError, Collectives
from fourd_mpi.core.grid import GridShape, ProcessGrid
from fourd_mpi.core.progress import make_progress
from fourd_mpi.step import kernels
from fourd_mpi.trace.events import Tracer


def main():
    world = MPI.COMM_WORLD
    size = world.Get_size()
    grid = ProcessGrid(world, GridShape(1, size, 1, 1))
    backend = make_backend("numpy", np.float64)
    failures = []

    for strategy in ("none", "poll", "thread"):
        comm = Collectives(grid, backend, progress=make_progress(strategy, chunk_flops=2e4), check_buffers=True,
                           tracer=Tracer(level="step"))
        # 1. un-waited request
        handle = comm.allgather("z", np.arange(4.0))
        try:
            comm.check_quiescent("test point")
            failures.append(f"{strategy}: un-waited request not reported")
        except RuntimeError as exc:
            if "allgather/z" not in str(exc):
                failures.append(f"{strategy}: unexpected message {exc}")
        handle.wait()
        comm.check_quiescent()

        # 2. modified send buffer
        buf = np.ones(1000)
        handle = comm.allreduce("z", buf)
        buf[3] = 7.0
        try:
            handle.wait()
            failures.append(f"{strategy}: modified send buffer not detected")
        except BufferModifiedError:
            pass

        # 3. progress during compute
        a = np.random.default_rng(world.Get_rank()).random((2048, 128))
        world.Barrier()  # all ranks issue at about the same time
        handle = comm.allreduce("z", np.full(256, float(world.Get_rank())))
        hook = comm.compute_hook
        if strategy == "poll" and hook is None:
            failures.append("poll: no compute hook while a request is in flight")
        # 32 pieces of 64 rows, a poll between each. One GEMM takes ~10 ms; on an
        # oversubscribed machine a peer may not have issued yet when it ends, so
        # the GEMM is repeated until the request is seen complete (up to ~40 s of
        # compute: a peer descheduled for seconds under load still issues within it;
        # a loop that ends early is fast anyway). Only polls may complete it:
        # nobody waits before the loop ends.
        for _ in range(1 if strategy == "none" else 4000):
            kernels.matmul(a, a[:256].T, progress=hook)
            if handle.done:
                break
        seen_during_compute = handle.done
        result = handle.wait()
        rec = handle.record
        if not np.allclose(result, sum(range(size))):
            failures.append(f"{strategy}: wrong allreduce result")
        if not (rec.issue_ns <= rec.complete_ns and rec.wait_ns >= 0):
            failures.append(f"{strategy}: record times out of order {rec}")
        if strategy == "poll" and not seen_during_compute:
            failures.append("poll: the collective did not complete during the chunked GEMM")
        if strategy == "none" and seen_during_compute:
            failures.append("none: completion observed without any poll")
        comm.check_quiescent()
        comm.progress.close()

    grid.free()
    return report(world, failures, "overlap checks ok")


def report(world, failures, ok: str) -> int:
    """Every rank's failures printed on rank 0 (or ``ok`` when there are none); the exit status (collective)."""
    failures = [f for per_rank in world.allgather(failures) for f in per_rank]
    if world.Get_rank() == 0:
        print("\n".join(sorted(set(failures))) or ok)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
