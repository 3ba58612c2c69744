"""Clock alignment of the ranks: offsets to rank 0 at the start and at the end of a run, and a
per-rank linear drift model applied to every timestamp of the trace.

Each rank's ``perf_counter_ns`` runs at its own rate and from its own zero. Rank 0 measures the
offset of every other rank twice, with Cristian's algorithm (the ping-pong with the shortest round
trip out of ``rounds``; uncertainty: half that round trip):

- at the start, ``o0`` at the rank's local time ``L0`` (:func:`measure_offsets` in
  :func:`fourd_mpi.trace.events.align_clocks`); the recorder stores every timestamp as
  ``t = L - o0 - origin`` (``origin``: rank 0's clock after a barrier);
- at the end, ``o1`` at ``L1``, before the trace is merged.

Between them the offset is modelled as linear, ``o(L) = o0 + r (L - L0)`` with
``r = (o1 - o0) / (L1 - L0)`` (the drift rate; ppm = 1e6 r; 0 when ``|o1 - o0| <= u0 + u1``,
a change within the measurement noise), so a stored time is corrected by
``t' = t - r (L - L0)`` with ``L = t + o0 + origin`` (:meth:`DriftModel.correct`). The residual
uncertainty of a corrected time is at most ``max(u0, u1)`` (the line through two points each
known to +-u stays within +-max(u) between them); it is stored per rank (``clock_residual_ns``)
and shown by ``fourd-mpi trace show``. Rank 0 is the reference (offset 0, no drift). A trace
recovered from the per-rank files of a run that died has no end alignment: its times keep the
start offsets only (drift NaN).

Communication: point-to-point on the given communicator (tags 71, 72), then a scatter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Tuple

import numpy as np

PING, PONG = 71, 72
#: timestamp columns of the event records that the drift correction moves (0 = absent, left as is)
EVENT_TIME_COLUMNS = ("start_ns", "end_ns", "issue_ns", "complete_ns", "call_ns")


def measure_offsets(comm, rounds: int = 8, clock: Callable[[], int] = time.perf_counter_ns) -> Tuple[int, int, int]:
    """``(offset_ns, uncertainty_ns, at_ns)`` of this rank's ``clock`` to rank 0's (Cristian's algorithm).

    ``offset``: this clock minus rank 0's at the same instant; ``at_ns``: this rank's clock when
    the kept sample was taken. Rank 0 ping-pongs ``rounds`` times with each rank in turn and keeps
    the sample with the shortest round trip. Collective over ``comm``.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    buf = np.zeros(1, dtype=np.int64)
    if rank == 0:
        results = [(0, 0, 0)]
        for peer in range(1, size):
            best = None
            for _ in range(rounds):
                t1 = clock()
                comm.Send(buf, dest=peer, tag=PING)
                comm.Recv(buf, source=peer, tag=PONG)
                t2 = clock()
                rtt = t2 - t1
                if best is None or rtt < best[1]:
                    best = (int(buf[0]) - (t1 + t2) // 2, rtt, int(buf[0]))
            results.append((best[0], best[1] // 2, best[2]))
    else:
        results = None
        for _ in range(rounds):
            comm.Recv(buf, source=0, tag=PING)
            buf[0] = clock()
            comm.Send(buf, dest=0, tag=PONG)
    offset, uncertainty, at = comm.scatter(results, root=0)
    if rank == 0:
        at = clock()  # the reference: offset 0 at any time
    return int(offset), int(uncertainty), int(at)


@dataclass(frozen=True)
class DriftModel:
    """One rank's linear clock model from the start and end alignments (see the module doc).

    offset0/at0, offset1/at1: offsets to rank 0 (ns) and the local times they were measured at;
    origin_ns: the run's origin (rank 0's clock); uncertainty0/1: half the best round trips.
    """

    offset0: int
    at0: int
    offset1: int
    at1: int
    origin_ns: int
    uncertainty0: int = 0
    uncertainty1: int = 0

    @property
    def rate(self) -> float:
        """``r = (o1 - o0) / (L1 - L0)``: ns of offset gained per local ns.

        0 when the offsets differ by no more than their measurement uncertainties (``|o1 - o0| <=
        u0 + u1``: no drift can be told from noise, and correcting by noise would add error) or
        when the two measurements coincide."""
        span = self.at1 - self.at0
        change = self.offset1 - self.offset0
        if span <= 0 or abs(change) <= self.uncertainty0 + self.uncertainty1:
            return 0.0
        return change / span

    @property
    def ppm(self) -> float:
        return 1e6 * self.rate

    @property
    def residual_ns(self) -> int:
        return int(max(self.uncertainty0, self.uncertainty1))

    def correct(self, stored) -> np.ndarray:
        """Corrected times ``t - r (L - L0)`` for stored (start-aligned) times ``t`` (int64 ns)."""
        t = np.asarray(stored, dtype=np.int64)
        local = t + self.offset0 + self.origin_ns
        return t - np.rint(self.rate * (local - self.at0).astype(np.float64)).astype(np.int64)

    def correct_records(self, records: np.ndarray, columns=EVENT_TIME_COLUMNS) -> np.ndarray:
        """A copy of ``records`` with the named time columns corrected (zeros stay zero: absent)."""
        out = records.copy()
        if self.rate == 0.0 or not len(out):
            return out
        for name in columns:
            if name in (out.dtype.names or ()):
                present = out[name] != 0
                out[name][present] = self.correct(out[name][present])
        return out
