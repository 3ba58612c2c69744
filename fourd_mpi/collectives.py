"""Communication primitives on the grid's axis communicators.

Thin and math-free: each method is one MPI collective along one named axis, with
a size-1 fast path (no MPI call, the input is returned as is). Every method
returns a :class:`CommHandle`; callers ``wait()`` on it to get the result. This
version issues blocking collectives, so the handle is already complete; the
overlap engine replaces the issue with ``Iallgather`` / ``Ireduce_scatter`` /
``Iallreduce`` and returns pending handles with the same interface, so the layer
math does not change.

All methods are collective: every rank of the named axis must call them, in the
same order, with buffers of the same shape and dtype.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

from .backend import ArrayBackend
from .grid import ProcessGrid


@dataclass
class CommRecord:
    """What one collective did: for traces and for the benchmarks."""

    op: str
    axis: str
    nbytes: int
    issue_ns: int
    complete_ns: int = 0
    wait_ns: int = 0


class CommHandle:
    """Result of a collective that may still be in flight.

    ``wait()`` returns the result (a backend array) once the operation has
    completed; ``test()`` says whether it has. ``record`` describes the operation.
    """

    def __init__(self, record: Optional[CommRecord], result: Any = None,
                 finish: Optional[Callable[[], Any]] = None, request=None):
        self.record = record
        self._result = result
        self._finish = finish
        self._request = request
        self._done = request is None

    def test(self) -> bool:
        if not self._done:
            self._done = bool(self._request.Test())
            if self._done and self.record is not None:
                self.record.complete_ns = time.perf_counter_ns()
        return self._done

    def wait(self):
        if not self._done:
            t0 = time.perf_counter_ns()
            self._request.Wait()
            t1 = time.perf_counter_ns()
            self._done = True
            if self.record is not None:
                self.record.wait_ns += t1 - t0
                self.record.complete_ns = t1
        if self._finish is not None:
            self._result = self._finish()
            self._finish = None
        return self._result


def completed(result) -> CommHandle:
    """A handle for a result that needed no communication (size-1 axis)."""
    return CommHandle(None, result)


@dataclass
class Collectives:
    """Collectives along the named axes of a :class:`ProcessGrid`.

    ``records`` collects a :class:`CommRecord` per non-trivial collective (the
    caller may clear it between steps).
    """

    grid: ProcessGrid
    backend: ArrayBackend
    records: List[CommRecord] = field(default_factory=list)

    def _record(self, op: str, axis: str, nbytes: int) -> CommRecord:
        rec = CommRecord(op=op, axis=axis, nbytes=int(nbytes), issue_ns=time.perf_counter_ns())
        self.records.append(rec)
        return rec

    def _blocking(self, rec: CommRecord, call: Callable[[], None], recv, shape) -> CommHandle:
        call()
        rec.complete_ns = time.perf_counter_ns()
        rec.wait_ns = rec.complete_ns - rec.issue_ns
        result = self.backend.from_mpi_buffer(recv)
        return CommHandle(rec, result.reshape(shape))

    def allgather(self, axis: str, shard) -> CommHandle:
        """All-gather equal flat shards along ``axis``.

        ``shard``: 1-D, ``s`` elements on every rank of the axis. Result: 1-D,
        ``p*s`` elements, shard of axis-coordinate ``i`` at ``[i*s:(i+1)*s]``.
        """
        p = self.grid.size(axis)
        if p == 1:
            return completed(shard)
        send = self.backend.mpi_send_buffer(shard)
        recv = self.backend.mpi_recv_buffer((p * shard.size,))
        rec = self._record("allgather", axis, recv.nbytes)
        comm = self.grid.axis_comm(axis)
        return self._blocking(rec, lambda: comm.Allgather(send, recv), recv, (p * shard.size,))

    def reduce_scatter(self, axis: str, full) -> CommHandle:
        """Sum ``full`` (1-D, ``p*s`` elements) over ``axis`` and keep this rank's block.

        Result: 1-D, ``s`` elements: block ``coord(axis)`` of the sum.
        """
        p = self.grid.size(axis)
        if p == 1:
            return completed(full)
        if full.size % p:
            raise ValueError(f"reduce_scatter over {axis}: {full.size} elements not divisible by {p}")
        send = self.backend.mpi_send_buffer(full)
        recv = self.backend.mpi_recv_buffer((full.size // p,))
        rec = self._record("reduce_scatter", axis, send.nbytes)
        comm = self.grid.axis_comm(axis)
        return self._blocking(rec, lambda: comm.Reduce_scatter_block(send, recv), recv, (full.size // p,))

    def allreduce(self, axis: str, array) -> CommHandle:
        """Element-wise sum of ``array`` (any shape) over ``axis``; result has the same shape."""
        p = self.grid.size(axis)
        if p == 1:
            return completed(array)
        send = self.backend.mpi_send_buffer(array)
        recv = self.backend.mpi_recv_buffer(array.shape)
        rec = self._record("allreduce", axis, send.nbytes)
        comm = self.grid.axis_comm(axis)
        return self._blocking(rec, lambda: comm.Allreduce(send, recv), recv, array.shape)

    def allreduce_scalars(self, values, axes=("data", "z", "y", "x")) -> "list[float]":
        """Sum a few host floats over the given axes (loss bookkeeping, not a hot path)."""
        import numpy as np
        from mpi4py import MPI

        buf = np.asarray(values, dtype=np.float64).copy()
        for axis in axes:
            if self.grid.size(axis) > 1:
                self.grid.axis_comm(axis).Allreduce(MPI.IN_PLACE, buf)
        return buf.tolist()
