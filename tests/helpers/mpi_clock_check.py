"""Under mpiexec: ranks with skewed, drifting fake clocks; the start/end alignment recovers the drift.

Rank r's clock reads ``P (1 + r d) + r s`` (P: the real perf_counter_ns, d = DRIFT, s = SKEW):
its offset to rank 0 grows linearly. Offsets are measured at the start, the middle and the end;
the drift model built from start and end must predict the middle offset within the three
measurements' uncertainties, and its rate must be the true one, ``r d / (1 + r d)`` ns per local
ns, within ``(u0 + u1) / (L1 - L0)``. Rank 0 prints "clock check ok" when every rank passed.
"""

import sys
import time

from mpi4py import MPI

from fourd_mpi.trace.clocks import DriftModel, measure_offsets
from fourd_mpi.trace.events import align_clocks

DRIFT, SKEW = float(sys.argv[1]), int(float(sys.argv[2]))
comm = MPI.COMM_WORLD
rank = comm.Get_rank()


def clock(r=rank):
    return int(time.perf_counter_ns() * (1 + r * DRIFT)) + r * SKEW


offset0, u0, origin, at0 = align_clocks(comm, clock=clock)
time.sleep(0.15)
mid_offset, u_mid, at_mid = measure_offsets(comm, clock=clock)
time.sleep(0.15)
offset1, u1, at1 = measure_offsets(comm, clock=clock)
model = DriftModel(offset0, at0, offset1, at1, origin, u0, u1)
problems = []
true_rate = rank * DRIFT / (1 + rank * DRIFT)
if abs(model.rate - true_rate) > (u0 + u1) / (at1 - at0) + 1e-9:
    problems.append(f"rate {model.rate:.6g}, true {true_rate:.6g}")
stored = at_mid - offset0 - origin  # the recorder's start-aligned time of the middle instant
predicted_offset = at_mid - origin - int(model.correct([stored])[0])
if abs(predicted_offset - mid_offset) > u0 + u1 + u_mid + 2:
    problems.append(f"middle offset {mid_offset} ns, model {predicted_offset} ns (u {u0}, {u1}, {u_mid})")
if rank and abs(offset0 - rank * SKEW) > 0.01 * SKEW + rank * DRIFT * at0:
    problems.append(f"start offset {offset0}, skew {rank * SKEW}")
everyone = comm.gather(problems, root=0)
if rank == 0:
    bad = [f"rank {r}: {p}" for r, ps in enumerate(everyone) for p in ps]
    print("\n".join(bad) if bad else "clock check ok")
