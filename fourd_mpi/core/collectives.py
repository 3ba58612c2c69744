"""Communication primitives on the grid's axis communicators.

Thin and math-free: each method is one nonblocking MPI collective along one
named axis (``Iallgather``, ``Ireduce_scatter_block``, ``Iallreduce``), with a
size-1 fast path (no MPI call, the input is returned as is). Every method
returns a :class:`CommHandle`; ``wait()`` gives the result. Whether the caller
waits at once (a blocking step) or later (an overlapped step) is the engine's
choice; the math does not change.

All methods are collective: every rank of the named axis must call them in the
same order with buffers of the same shape and dtype (MPI matches nonblocking
collectives by issue order per communicator; issuing them in a rank-dependent
order hangs or corrupts results).

Buffers: a fresh receive buffer per operation, and the handle keeps the send
and receive buffers alive until the request completes, so no buffer is reused
while MPI may still touch it. With ``check_buffers=True`` the handle also
copies the send buffer at issue and checks at completion that nobody modified
it in flight.

Staged mode (``backend.staged_for(kind.route_class)``: MPI cannot take device buffers in this
operation class (``nb_gather``: ``Iallgather``; ``nb_reduce``: ``Ireduce_scatter_block``,
``Iallreduce``; :mod:`fourd_mpi.core.gpuaware`), or NumPy's emulation of that): at issue the input is copied into a pooled host buffer
(``d2h``) and the collective runs on host buffers; when the handle is waited
the host result is copied back (``h2d``) and both staging buffers return to the
pool. Only the copies differ from the direct path: the same requests, the same
progress polling, the same waits, so overlap works the same way. Each copy is
recorded on the collective's :class:`CommRecord` and becomes its own trace event.

Stream rules (see :mod:`fourd_mpi.core.backend`): a send buffer is handed to MPI only
after the kernels producing it finished (``mpi_send_buffer`` / ``stage_to_host``
synchronize); a receive buffer is turned into an array that kernels may read only
in :meth:`CommHandle.wait`, after the request completed.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import numpy as np
from mpi4py import MPI

from fourd_mpi.core.backend import ArrayBackend
from fourd_mpi.core.colltable import COLLECTIVES
from fourd_mpi.core.grid import ProcessGrid


@dataclass
class CommRecord:
    """What one collective did (times from ``time.perf_counter_ns``).

    nbytes: the message size (nccl-tests convention: gathered buffer of an
    all-gather, full input of a reduce-scatter, buffer of an all-reduce).
    issue_ns: entry of the ``MPI_I*`` call; call_ns: its return (the in-flight window in
    which compute can overlap starts here); complete_ns: when its completion
    was first observed (by a progress poll, a test or a wait); wait_start_ns and
    wait_ns: when this rank started blocking in ``wait`` for it, and for how long
    (0: it had completed before the wait). layer, phase: trace codes of where it
    was issued (:mod:`fourd_mpi.trace.events`).
    """

    op: str
    axis: str
    nbytes: int
    issue_ns: int
    complete_ns: int = 0
    call_ns: int = 0
    wait_ns: int = 0
    wait_start_ns: int = 0
    layer: int = 0
    phase: int = 0
    #: staged mode: the device-to-host copy before the issue and the host-to-device copy after
    #: completion (:class:`~fourd_mpi.core.backend.CopySpan`; None on the direct path)
    d2h: Any = None
    h2d: Any = None
    #: position of this collective among the step's collectives (issue order), for diagnostics
    seq: int = 0


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
                record = self.record
                if record is not None:
                    # the wait ends when completion was observed (by this wait or by the progress
                    # thread, which may have seen it just before the wait began: then no wait)
                    if record.complete_ns:
                        t1 = min(t1, record.complete_ns)
                        t0 = min(t0, t1)
                    record.wait_start_ns, record.wait_ns = t0, t1 - t0
                    self.owner.tracer.blocked(t0, t1)
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


class BufferModifiedError(RuntimeError):
    """A send buffer changed while its collective was in flight."""


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
        layer, phase = tag if tag is not None else (self.tracer.where_layer, self.tracer.where_phase)
        record = CommRecord(op=op, axis=axis, nbytes=int(nbytes), issue_ns=time.perf_counter_ns(),
                            layer=layer, phase=phase, seq=len(self.records))
        self.records.append(record)
        return record

    def describe(self, record: Optional[CommRecord]) -> str:
        """Where a collective is: op, axis, step, layer and phase, and its sequence number in the step."""
        if record is None:
            return "a collective"
        tr = self.tracer
        layer = tr.layer_names[record.layer] if 0 < record.layer < len(tr.layer_names) else "no layer"
        phase = tr.phase_name(record.phase)
        return (f"{record.op} over {record.axis} ({record.nbytes} bytes), step {tr.step}, layer {layer} ({phase}), "
                f"collective #{record.seq} of the step")

    def watch(self, what):
        """Context of a blocking wait for ``what`` (a :class:`CommRecord` or a text) under the watchdog."""
        if self.watchdog is None:
            return contextlib.nullcontext()
        return self.watchdog.watch(what if isinstance(what, str) else self.describe(what))

    def _staged(self, op: str) -> bool:
        """Does ``op`` (a :data:`~fourd_mpi.core.colltable.COLLECTIVES` name) go through host staging buffers?"""
        return self.backend.staged_for(COLLECTIVES[op].route_class)

    def _buffers(self, op, array, recv_shape, wire):
        """``(send, recv, d2h)``: MPI buffers for ``array`` and a result of ``recv_shape``.

        ``wire``: the dtype MPI sees (the array's own, or a stand-in for a dtype MPI lacks:
        :meth:`_wire_dtypes`). Direct: the backend's arrays (synchronized). Staged: pooled
        host buffers, the input copied in (``d2h``: its :class:`~fourd_mpi.core.backend.CopySpan`).
        """
        backend = self.backend
        if wire != array.dtype:
            array = array.view(wire) if wire.itemsize == array.dtype.itemsize and wire.kind in "ui" \
                else array.astype(wire)
        if self._staged(op):
            send, d2h = backend.stage_to_host(array)
            return send, backend.staging_buffer(recv_shape, wire), d2h
        return backend.mpi_send_buffer(array), backend.mpi_recv_buffer(recv_shape, wire), None

    def _wire_dtypes(self, dtype):
        """``(gather, reduce)`` dtypes MPI sees for arrays of ``dtype``.

        bfloat16 has no MPI datatype: gathers move its bits as uint16, reductions run in float32.
        """
        dtype = np.dtype(dtype)
        if dtype.name == "bfloat16":
            return np.dtype(np.uint16), np.dtype(np.float32)
        return dtype, dtype

    def _issue(self, op: str, axis: str, nbytes: int, comm, send, recv,
               shape, tag=None, d2h=None, dtype=None) -> CommHandle:
        """Start ``op``'s nonblocking MPI call (:data:`~fourd_mpi.core.colltable.COLLECTIVES`) on ``comm``."""
        call = getattr(comm, COLLECTIVES[op].nonblocking)

        def start():
            return call(send, recv)

        record = self._record(op, axis, nbytes, tag)
        record.d2h = d2h
        guard = np.array(send, copy=True) if self.check_buffers and isinstance(send, np.ndarray) else None
        backend = self.backend
        dtype = np.dtype(dtype) if dtype is not None else recv.dtype

        def back(result):  # the MPI dtype back to the array's (bfloat16 stand-ins)
            if result.dtype == dtype:
                return result
            return result.view(dtype) if result.dtype.itemsize == dtype.itemsize and result.dtype.kind in "ui" \
                else result.astype(dtype)

        if self._staged(op):
            def finish(buf):
                # the request has completed (wait): copy the result in, return the send buffer
                out, record.h2d = backend.stage_to_device(buf, shape)
                backend.release_staging(send)
                return back(out)
        else:
            def finish(buf):
                return back(backend.from_mpi_buffer(buf).reshape(shape))
        handle = CommHandle(self, record, recv, buffers=(send, recv), finish=finish)
        handle._guard = (send, guard) if guard is not None else None
        handle.done = handle.waited = False
        self.in_flight.append(handle)
        record.issue_ns = time.perf_counter_ns()
        self.progress.start(handle, start)
        record.call_ns = time.perf_counter_ns()
        self.tracer.mpi_call(record.issue_ns, record.call_ns)
        return handle

    def _retire(self, handle: CommHandle) -> None:
        try:
            self.in_flight.remove(handle)
        except ValueError:
            pass
        if handle._guard is not None:
            send, copy = handle._guard
            handle._guard = None
            if not np.array_equal(send, copy, equal_nan=True):
                rec = handle.record
                raise BufferModifiedError(
                    f"the send buffer of {rec.op} over {rec.axis} ({rec.nbytes} bytes) was modified in flight"
                )

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
            if done.record.complete_ns:
                t1 = min(t1, done.record.complete_ns)
                t0 = min(t0, t1)
            done.record.wait_start_ns, done.record.wait_ns = t0, t1 - t0
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
        wire = self._wire_dtypes(shard.dtype)[0]
        send, recv, d2h = self._buffers("allgather", shard, (p * shard.size,), wire)
        comm = self.grid.axis_comm(axis)
        return self._issue("allgather", axis, recv.nbytes, comm,
                           send, recv, (p * shard.size,), tag, d2h, shard.dtype)

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
        wire = self._wire_dtypes(full.dtype)[1]
        send, recv, d2h = self._buffers("reduce_scatter", full, (full.size // p,), wire)
        comm = self.grid.axis_comm(axis)
        return self._issue("reduce_scatter", axis, send.nbytes, comm,
                           send, recv, (full.size // p,), None, d2h, full.dtype)

    def allreduce(self, axis: str, array, tag=None) -> CommHandle:
        """Element-wise sum of ``array`` (any shape) over ``axis`` (``Iallreduce``); same shape back.

        ``tag``: trace ``(layer, phase)`` codes when issued away from its layer (gradient sync).
        """
        p = self.grid.size(axis)
        if p == 1:
            return completed(array)
        if self.skip_communication:
            return self._skipped("allreduce", axis, array, array.nbytes, tag)
        wire = self._wire_dtypes(array.dtype)[1]
        send, recv, d2h = self._buffers("allreduce", array, array.shape, wire)
        comm = self.grid.axis_comm(axis)
        return self._issue("allreduce", axis, send.nbytes, comm,
                           send, recv, array.shape, tag, d2h, array.dtype)

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
                    getattr(self.grid.axis_comm(axis), COLLECTIVES["allreduce"].blocking)(MPI.IN_PLACE, buf)
                record.complete_ns = time.perf_counter_ns()
                record.wait_start_ns, record.wait_ns = record.issue_ns, record.complete_ns - record.issue_ns
                self.tracer.blocked(record.issue_ns, record.complete_ns)
        return buf.tolist()

    def replay(self, records: List[CommRecord]) -> float:
        """Run the given collectives again, each waited at once, without compute; returns seconds.

        For "communication alone" measurements: pass the records of a step run
        without overlap (their order is the program order, the same on every rank;
        the records of an overlapped step interleave communicators in a
        rank-dependent order and could deadlock here). Collective over the grid.
        """
        ops = {"allgather": lambda a, n: self.allgather(a, self.backend.zeros((n // self.grid.size(a),))),
               "reduce_scatter": lambda a, n: self.reduce_scatter(a, self.backend.zeros((n,))),
               "allreduce": lambda a, n: self.allreduce(a, self.backend.zeros((n,)))}
        itemsize = self.backend.dtype.itemsize
        t0 = time.perf_counter()
        for rec in records:
            ops[rec.op](rec.axis, rec.nbytes // itemsize).wait()
        return time.perf_counter() - t0
