"""Under mpiexec: a failure inside the step loop still closes the run (``close_run`` in the ``finally`` of
:func:`fourd_mpi.run.session._traced_run`).

``python mpi_session_close_check.py DIR``: every rank runs :func:`fourd_mpi.run.session.traced_run` of gpt-tiny
(data parallel over the world, 4 steps, ``--step-timeout 60``: a watchdog thread runs) into ``DIR`` with run id
``c``, its fault hooks replaced by ones that raise ``RuntimeError`` at the start of step 2 on every rank. Then
each rank checks that the run was closed: :meth:`Run.close` called once, no watchdog thread left, no descriptor
of this process open on a file of the spool ``DIR/c.ranks``; rank 0 checks that every rank recorded the failure
in ``rankNNNNNN.failed.json``. Prints ``close check ok`` when all holds (the test recovers the spool after).
"""

import glob
import json
import os
import sys
import threading

from mpi4py import MPI

from fourd_mpi.run import session
from fourd_mpi.run.build import Run
from fourd_mpi.run.faults import Faults
from fourd_mpi.run.options import resolve

FAILURE = "failure inside the step loop (test)"


class FailAtStep2(Faults):
    """Hooks whose step 2 raises on every rank (a failure every rank meets at the same step)."""

    @staticmethod
    def of(fault, world, spool_dir, results_dir):
        return FailAtStep2()

    def before_step(self, step):
        if step == 2:
            raise RuntimeError(FAILURE)


closed = []
real_close = Run.close


def spy_close(run, failed=False):
    closed.append((run, failed))
    real_close(run, failed)


base = sys.argv[1]
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
options = resolve(size, "gpt-tiny", {"data": size, "z": 1, "y": 1, "x": 1}, {"layers": 1, "seq": 16, "batch": size},
                  steps=4, warmup=1)
session.Faults, Run.close = FailAtStep2, spy_close
try:
    session.traced_run(world, options, session.TraceOptions(results_dir=base, run_id="c"), {}, lambda text: None,
                       display="quiet", peak_tflops=1.0, step_timeout=60.0)
except RuntimeError as exc:
    assert str(exc) == FAILURE, exc
else:
    raise AssertionError("the run did not fail")
spool_dir = os.path.realpath(os.path.join(base, "c.ranks"))
assert len(closed) == 1, f"rank {rank}: Run.close called {len(closed)} times"
assert closed[0][1] is True, f"rank {rank}: the failed run was closed as if it had ended well"
assert not [t for t in threading.enumerate() if t.name == "fourd-mpi-watchdog" and t.is_alive()], "watchdog runs"
open_files = [os.path.realpath(os.path.join("/proc/self/fd", fd)) for fd in os.listdir("/proc/self/fd")
              if os.path.exists(os.path.join("/proc/self/fd", fd))]
assert not [f for f in open_files if f.startswith(spool_dir + os.sep)], (rank, open_files)
world.Barrier()
if rank == 0:
    reports = sorted(glob.glob(os.path.join(spool_dir, "*.failed.json")))
    assert len(reports) == size, reports
    for path in reports:
        with open(path) as fh:
            assert json.load(fh)["error"] == f"RuntimeError: {FAILURE}", path
    print("close check ok", flush=True)
