"""Nonblocking collectives on the grid's axis communicators, as waitable handles.

:class:`Collectives` wraps the thin MPI layer (:mod:`fourd_mpi.core.mpicoll`: pick the axis
communicator, call ``Iallgather``, ``Ireduce_scatter_block`` or ``Iallreduce``, return the request)
from outside: the route of the buffers to MPI and back (:mod:`fourd_mpi.core.wire`: wire dtypes,
direct or staged buffers, the buffer guard), the records and the watchdog (:mod:`fourd_mpi.core.commlog`),
and progress (:mod:`fourd_mpi.core.progress`). Math-free: each method is one collective along one
named axis, with a size-1 fast path (no MPI call, the input is returned as is). Every method returns a
:class:`CommHandle`; ``wait()`` gives the result. Whether the caller waits at once (a blocking step) or
later (an overlapped step) is the engine's choice; the math does not change.

All methods are collective: every rank of the named axis must call them in the
same order with buffers of the same shape and dtype (MPI matches nonblocking
collectives by issue order per communicator; issuing them in a rank-dependent
order hangs or corrupts results).

Buffers: a fresh receive buffer per operation, and the handle keeps the send
and receive buffers alive until the request completes, so no buffer is reused
while MPI may still touch it. With ``check_buffers=True`` the handle also
copies the send buffer at issue and checks at completion that nobody modified
it in flight (:class:`~fourd_mpi.core.wire.BufferModifiedError`).

Staged mode (:mod:`fourd_mpi.core.wire`): the input is copied to a pooled host buffer
(``d2h``) at issue and the result back (``h2d``) when the handle is waited; the same
requests, progress polling and waits as the direct path. Each copy is recorded on the
collective's :class:`~fourd_mpi.core.commlog.CommRecord` and becomes its own trace event.

Stream rules (see :mod:`fourd_mpi.core.backend`): a send buffer is handed to MPI only
after the kernels producing it finished (``mpi_send_buffer`` / ``stage_to_host``
synchronize); a receive buffer is turned into an array that kernels may read only
in :meth:`CommHandle.wait`, after the request completed.
"""

from __future__ import annotations

import time
from typing import Any, Callable, List, Optional

import numpy as np

from fourd_mpi.core import commlog, mpicoll
from fourd_mpi.core.backend import ArrayBackend
from fourd_mpi.core.commlog import CommRecord
from fourd_mpi.core.grid import ProcessGrid
from fourd_mpi.core.wire import BufferModifiedError, Route, staged, wire_dtypes

#: what callers import from here (records and the guard's error live in commlog and wire)
__all__ = ["BufferModifiedError", "Collectives", "CommHandle", "CommRecord", "GroupHandle", "completed"]


class CommHandle:
    """A collective that may still be in flight.

    ``test()`` says whether it has completed (and lets MPI progress); ``wait()``
    blocks until it has and returns the result (a backend array). Waiting twice
    returns the same result. A handle stays in its owner's ``in_flight`` list
    until it is waited, so un-waited requests can be detected.
    """

    def __init__(self, owner: Optional["Collectives"], record: Optional[CommRecord], result: Any = None,
                 request=None, buffers=(), finish: Optional[Callable[[Any], Any]] = None):
        self.owner = owner
        self.record = record
        self.request = request
        self._result = result
        self._finish = finish
        self._buffers = buffers  # keeps send/recv buffers alive while MPI may use them
        self._guard = None
        self.done = request is None
        self.waited = request is None

    def observe_complete(self, when_ns: Optional[int] = None) -> None:
        """Record completion (may run on a progress thread: only sets fields)."""
        if self.record is not None and not self.record.complete_ns:
            self.record.complete_ns = when_ns or time.perf_counter_ns()
        self.done = True

    def test(self) -> bool:
        if not self.done:
            progress = self.owner.progress
            t0 = time.perf_counter_ns()
            progress.test(self)
            if progress.calls_mpi_on_test:
                self.owner.tracer.mpi_call(t0, time.perf_counter_ns())
        return self.done

    def wait(self):
        if not self.waited:
            if not self.done:
                t0 = time.perf_counter_ns()
                with self.owner.watch(self.record):
                    self.owner.progress.wait(self)
                t1 = time.perf_counter_ns()
                if self.record is not None:
                    self.owner.tracer.blocked(*commlog.note_wait(self.record, t0, t1))
            self.waited = True
            self.owner._retire(self)
        if self._finish is not None:
            self._result = self._finish(self._result)
            self._finish = None
            self._buffers = ()
        return self._result


def completed(result) -> CommHandle:
    """A handle for a result that needed no communication (size-1 axis)."""
    return CommHandle(None, None, result)


class GroupHandle:
    """Several handles waited together; ``combine`` turns their results into one."""

    def __init__(self, handles: List[CommHandle], combine: Callable[[list], Any]):
        self.handles = handles
        self.combine = combine
        self._result = None

    def test(self) -> bool:
        return all([h.test() for h in self.handles])

    def wait(self):
        if self.handles:
            self._result = self.combine([h.wait() for h in self.handles])
            self.handles = []
        return self._result


class Collectives:
    """Nonblocking collectives along the named axes of a :class:`ProcessGrid`.

    Attributes: ``records`` (a :class:`CommRecord` per non-trivial collective;
    the engine clears it each step), ``in_flight`` (handles not yet observed
    complete), ``progress`` (a :mod:`fourd_mpi.core.progress` engine or None),
    ``tracer`` (the rank's event recorder, a :class:`fourd_mpi.trace.events.Tracer`: given by whoever
    builds the collectives, since ``core`` sits below ``trace`` and never imports it; layers and
    kernels reach it as ``comm.tracer``).
    """

    def __init__(self, grid: ProcessGrid, backend: ArrayBackend, progress=None, check_buffers: bool = False,
                 skip_communication: bool = False, *, tracer):
        from fourd_mpi.core.progress import make_progress

        self.skip_communication = skip_communication
        self.grid = grid
        self.backend = backend
        self.progress = progress if progress is not None else make_progress("none")
        self.check_buffers = check_buffers
        #: where records are tagged (layer, phase) and blocked time is counted
        self.tracer = tracer
        self.records: List[CommRecord] = []
        self.in_flight: List[CommHandle] = []
        #: called after each progress poll (the gradient sync issues ready data all-reduces)
        self.on_poll: List[Callable[[], None]] = []
        #: :class:`~fourd_mpi.core.watchdog.Watchdog` of blocking waits, or None
        self.watchdog = None

    # bookkeeping -------------------------------------------------------------
    def _record(self, op: str, axis: str, nbytes: int, tag=None) -> CommRecord:
        return commlog.new_record(self.records, self.tracer, op, axis, nbytes, tag)

    def describe(self, record: Optional[CommRecord]) -> str:
        """Where a collective is: op, axis, step, layer and phase, and its sequence number in the step."""
        return commlog.describe(self.tracer, record)

    def watch(self, what):
        """Context of a blocking wait for ``what`` (a :class:`CommRecord` or a text) under the watchdog."""
        return commlog.watch(self.watchdog, self.tracer, what)

    def _route(self, op: str, array, recv_shape, wire) -> Route:
        """The MPI buffers of ``op`` (a :data:`~fourd_mpi.core.colltable.COLLECTIVES` name) for ``array``."""
        return Route(self.backend, array, recv_shape, wire, staged(self.backend, op), self.check_buffers)

    def _issue(self, op: str, axis: str, nbytes: int, route: Route, tag=None) -> CommHandle:
        """Start ``op`` (its operation of :mod:`fourd_mpi.core.mpicoll`) on ``route``'s buffers over ``axis``."""
        call = getattr(mpicoll, op)
        record = self._record(op, axis, nbytes, tag)
        record.d2h = route.d2h

        def finish(_recv):  # the request has completed (wait): the result as a backend array
            out, record.h2d = route.finish()
            return out

        handle = CommHandle(self, record, route.recv, buffers=(route.send, route.recv), finish=finish)
        handle._guard = route
        handle.done = handle.waited = False
        self.in_flight.append(handle)
        record.issue_ns = time.perf_counter_ns()
        self.progress.start(handle, lambda: call(self.grid, axis, route.send, route.recv))
        record.call_ns = time.perf_counter_ns()
        self.tracer.mpi_call(record.issue_ns, record.call_ns)
        return handle

    def _retire(self, handle: CommHandle) -> None:
        try:
            self.in_flight.remove(handle)
        except ValueError:
            pass
        if handle._guard is not None:
            route, handle._guard = handle._guard, None
            rec = handle.record
            route.check(f"{rec.op} over {rec.axis} ({rec.nbytes} bytes)")

    def poll(self, record: bool = True) -> None:
        """Let MPI progress the collectives in flight (called between compute chunks).

        ``record``: count the poll as host MPI time (False while the host only waits for a GPU
        kernel that computes meanwhile: the poll takes nothing from compute).
        """
        if self.in_flight:
            progress = self.progress
            if record and progress.calls_mpi_on_poll:
                t0 = time.perf_counter_ns()
                progress.poll(self.in_flight)
                self.tracer.mpi_call(t0, time.perf_counter_ns())
            else:
                progress.poll(self.in_flight)
            for callback in self.on_poll:
                callback()

    def wait_any(self, handles) -> None:
        """Block until one more request of ``handles`` (:class:`CommHandle` or :class:`GroupHandle`) has completed
        (``MPI_Waitany`` over their pending requests; the progress thread's flags under ``thread``). The time
        blocked is the completed one's wait (its record's ``wait_ns``, and blocked time in the trace), as if
        it alone had been waited. Returns at once when one has completed already."""
        pending = []
        for h in handles:
            left = [leaf for leaf in getattr(h, "handles", [h]) if not leaf.done]  # a group: its pending parts
            if not left:
                return
            pending += left
        t0 = time.perf_counter_ns()
        with self.watch(f"any of {len(pending)} collectives, the first {self.describe(pending[0].record)}"):
            done = pending[self.progress.wait_any(pending)]
        t1 = time.perf_counter_ns()
        if done.record is not None:
            t0, t1 = commlog.note_wait(done.record, t0, t1)
        self.tracer.blocked(t0, t1)

    @property
    def compute_hook(self):
        """What GEMMs call between chunks, or None when the strategy needs no chunking."""
        return self.progress.compute_hook(self)

    def check_quiescent(self, where: str = "end of step", expected=()) -> None:
        """Raise if any request but those in ``expected`` (handles left in flight on purpose: the next step's
        prefetched all-gather) is still in flight (every request must be waited)."""
        left = [h for h in self.in_flight if not any(h is e for e in expected)]
        if left:
            pending = ", ".join(f"{h.record.op}/{h.record.axis}" for h in left)
            raise RuntimeError(f"{len(left)} collective(s) still in flight at {where}: {pending}")

    # operations -------------------------------------------------------------
    def _skipped(self, op: str, axis: str, result, nbytes: int, tag=None) -> CommHandle:
        """Benchmark mode ``skip_communication``: a result of the right shape, no MPI call.

        The values are wrong (only this rank's contribution); only the compute time is meaningful.
        """
        record = self._record(op, axis, nbytes, tag)
        record.complete_ns = record.call_ns = time.perf_counter_ns()
        return completed(result)

    def allgather(self, axis: str, shard, tag=None) -> CommHandle:
        """All-gather equal flat shards along ``axis`` (``Iallgather``).

        ``shard``: 1-D, ``s`` elements on every rank of the axis. Result: 1-D,
        ``p*s`` elements, the shard of axis coordinate ``i`` at ``[i*s:(i+1)*s]``.
        """
        p = self.grid.size(axis)
        if p == 1:
            return completed(shard)
        if self.skip_communication:
            xp = self.backend.xp
            return self._skipped("allgather", axis, xp.tile(shard, p), p * shard.nbytes, tag)
        route = self._route("allgather", shard, (p * shard.size,), wire_dtypes(shard.dtype)[0])
        return self._issue("allgather", axis, route.recv.nbytes, route, tag)

    def reduce_scatter(self, axis: str, full) -> CommHandle:
        """Sum ``full`` (1-D, ``p*s`` elements) over ``axis``; keep this rank's block (``Ireduce_scatter_block``).

        Result: 1-D, ``s`` elements: block ``coord(axis)`` of the sum.
        """
        p = self.grid.size(axis)
        if p == 1:
            return completed(full)
        if full.size % p:
            raise ValueError(f"reduce_scatter over {axis}: {full.size} elements not divisible by {p}")
        if self.skip_communication:
            return self._skipped("reduce_scatter", axis, full[: full.size // p].copy(), full.nbytes)
        route = self._route("reduce_scatter", full, (full.size // p,), wire_dtypes(full.dtype)[1])
        return self._issue("reduce_scatter", axis, route.send.nbytes, route)

    def allreduce(self, axis: str, array, tag=None) -> CommHandle:
        """Element-wise sum of ``array`` (any shape) over ``axis`` (``Iallreduce``); same shape back.

        ``tag``: trace ``(layer, phase)`` codes when issued away from its layer (gradient sync).
        """
        p = self.grid.size(axis)
        if p == 1:
            return completed(array)
        if self.skip_communication:
            return self._skipped("allreduce", axis, array, array.nbytes, tag)
        route = self._route("allreduce", array, array.shape, wire_dtypes(array.dtype)[1])
        return self._issue("allreduce", axis, route.send.nbytes, route, tag)

    def allreduce_scalars(self, values, axes=("data", "z", "y", "x")) -> "list[float]":
        """Sum a few host floats over the given axes, blocking (loss bookkeeping, not a hot path).

        Recorded like a nonblocking collective waited at once.
        """
        buf = np.asarray(values, dtype=np.float64).copy()
        for axis in axes:
            if self.grid.size(axis) > 1:
                record = self._record("allreduce", axis, buf.nbytes)
                record.call_ns = record.issue_ns  # blocking: the whole call is the wait, nothing overlaps
                with self.watch(record):
                    mpicoll.allreduce_in_place(self.grid, axis, buf)
                record.complete_ns = time.perf_counter_ns()
                record.wait_start_ns, record.wait_ns = record.issue_ns, record.complete_ns - record.issue_ns
                self.tracer.blocked(record.issue_ns, record.complete_ns)
        return buf.tolist()
