"""Point-to-point messages between pipeline stages (``Isend``/``Irecv`` on the ``inter`` communicator).

Thin and math-free, like :mod:`fourd_mpi.core.mpicoll`: :meth:`PointToPoint.isend` and
:meth:`PointToPoint.irecv` each issue one nonblocking MPI call and return a :class:`P2PHandle`;
the pipeline schedule (:mod:`fourd_mpi.algorithms.pipeline_schedule`) decides where they are
waited. The ``inter`` communicator joins the ranks with equal 4D coordinates in every stage
(its rank is the stage index), so a message goes to the rank of the same 4D coordinates in the
neighbouring stage. Tags name the micro-batch and the direction (:func:`tag`).

Each message is a :class:`~fourd_mpi.core.commlog.CommRecord` (op ``send``/``recv``, axis
``inter``) in the step's records, so it becomes a trace event on a comm lane like a collective:
``bytes`` is the message, ``wire_bytes`` the bytes the rank sends (the message for a send, 0 for
a receive). Time blocked for a receive is a pipeline **bubble** (:meth:`Tracer.bubble`: the stage
has nothing to do until another stage's message arrives), not exposed communication; time
blocked for a send to complete is exposed communication (a ``wait`` event on axis ``inter``).

Buffers (operation class ``p2p`` of :mod:`fourd_mpi.core.gpuaware`: ``backend.staged_for("p2p")``):
direct mode hands the backend's arrays to MPI (after the producing kernels finished);
staged mode copies through pooled host buffers (``d2h`` before a send, ``h2d`` after a receive),
as the collectives do. The handle keeps its buffers alive until the request completed.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from fourd_mpi.core import commlog
from fourd_mpi.core.collectives import Collectives
from fourd_mpi.core.commlog import CommRecord
from fourd_mpi.core.wire import as_dtype, wire_dtypes

FORWARD, BACKWARD = 0, 1


def tag(microbatch: int, direction: int) -> int:
    """The message tag of ``microbatch`` (activations: ``FORWARD``; their gradients: ``BACKWARD``)."""
    return 2 * microbatch + direction


class P2PHandle:
    """One ``Isend`` or ``Irecv`` in flight. ``result()`` of a completed receive: the backend array."""

    def __init__(self, request, record: CommRecord, buffer, shape=None, dtype=None, staged: bool = False):
        self.request, self.record, self.buffer = request, record, buffer
        self.shape, self.dtype, self.staged = shape, dtype, staged
        self.done = False

    def observe(self, when_ns: Optional[int] = None) -> None:
        if not self.done:
            self.done = True
            if not self.record.complete_ns:
                self.record.complete_ns = when_ns or time.perf_counter_ns()


class PointToPoint:
    """Nonblocking messages to and from the neighbouring stages on ``inter`` (a communicator whose rank
    is the stage). ``comm``: the stage's :class:`Collectives` (backend, tracer, records, watchdog)."""

    def __init__(self, inter, comm: Collectives):
        self.inter = inter
        self.comm = comm
        self.sends: List[P2PHandle] = []

    def _record(self, op: str, nbytes: int) -> CommRecord:
        return commlog.new_record(self.comm.records, self.comm.tracer, op, "inter", nbytes)

    def isend(self, array, stage: int, message_tag: int) -> P2PHandle:
        """Send ``array`` to ``stage`` (``Isend``); waited by :meth:`complete_sends`."""
        backend = self.comm.backend
        array = as_dtype(array, wire_dtypes(array.dtype)[0])
        record = self._record("send", array.nbytes)
        staged = backend.staged_for("p2p")
        if staged:
            buffer, record.d2h = backend.stage_to_host(array)
        else:
            buffer = backend.mpi_send_buffer(array)
        record.issue_ns = time.perf_counter_ns()
        request = self.inter.Isend(buffer, dest=stage, tag=message_tag)
        record.call_ns = time.perf_counter_ns()
        self.comm.tracer.mpi_call(record.issue_ns, record.call_ns)
        handle = P2PHandle(request, record, buffer, staged=staged)
        self.sends.append(handle)
        return handle

    def irecv(self, shape, stage: int, message_tag: int) -> P2PHandle:
        """Post a receive of a ``shape`` array of the backend's dtype from ``stage`` (``Irecv``)."""
        backend = self.comm.backend
        dtype = np.dtype(backend.dtype)
        wire = wire_dtypes(dtype)[0]
        nbytes = int(np.prod(shape)) * wire.itemsize
        record = self._record("recv", nbytes)
        staged = backend.staged_for("p2p")
        buffer = backend.staging_buffer(shape, wire) if staged else backend.mpi_recv_buffer(shape, wire)
        record.issue_ns = time.perf_counter_ns()
        request = self.inter.Irecv(buffer, source=stage, tag=message_tag)
        record.call_ns = time.perf_counter_ns()
        self.comm.tracer.mpi_call(record.issue_ns, record.call_ns)
        return P2PHandle(request, record, buffer, shape, dtype, staged)

    def result(self, handle: P2PHandle):
        """The received array of a completed receive (staged: copied to the device)."""
        backend = self.comm.backend
        if handle.staged:
            out, handle.record.h2d = backend.stage_to_device(handle.buffer, handle.shape)
        else:
            out = backend.from_mpi_buffer(handle.buffer).reshape(handle.shape)
        handle.buffer = None
        return as_dtype(out, handle.dtype)

    def wait_first(self, handles: Sequence[P2PHandle], group=None, what: str = "a pipeline message") -> int:
        """Block until one of ``handles`` (receives) completes; returns its position. The blocked time is a
        bubble. ``group`` (a communicator of ranks that must agree, e.g. the stage's 4D grid): its rank 0
        picks the first message to arrive (``Waitany``) and broadcasts the choice; the others wait for the
        same message (theirs come from their own partners), so every rank of the group handles the
        messages in the same order and their collectives match."""
        t0 = time.perf_counter_ns()
        with self.comm.watch(f"{what} (MPI_Waitany over the inter axis)"):
            if group is None or group.Get_size() == 1:
                index = MPI.Request.Waitany([h.request for h in handles])
            else:
                index = MPI.Request.Waitany([h.request for h in handles]) if group.Get_rank() == 0 else None
                index = group.bcast(index, root=0)
                handles[index].request.Wait()
        t1 = time.perf_counter_ns()
        handles[index].observe(t1)
        self.comm.tracer.bubble(t0, t1, handles[index].record.nbytes)
        return index

    def wait(self, handle: P2PHandle, what: str = "a pipeline message"):
        """Block for one receive (a bubble if it has not arrived); returns the array."""
        if not handle.done:
            if handle.request.Test():
                handle.observe()
            else:
                t0 = time.perf_counter_ns()
                with self.comm.watch(f"{what} (MPI_Wait on the inter axis)"):
                    handle.request.Wait()
                t1 = time.perf_counter_ns()
                handle.observe(t1)
                self.comm.tracer.bubble(t0, t1, handle.record.nbytes)
        return self.result(handle)

    def retire_sends(self) -> None:
        """Drop the sends that have completed (a ``Test`` each), releasing their buffers."""
        if not self.sends:
            return
        t0 = time.perf_counter_ns()
        done = [h.request.Test() for h in self.sends]
        self.comm.tracer.mpi_call(t0, time.perf_counter_ns())
        keep = []
        for handle, finished in zip(self.sends, done):
            if finished:
                self._finish_send(handle)
            else:
                keep.append(handle)
        self.sends = keep

    def complete_sends(self) -> None:
        """Wait for every send still in flight (exposed communication over ``inter``)."""
        for handle in self.sends:
            if handle.request.Test():
                self._finish_send(handle)
                continue
            t0 = time.perf_counter_ns()
            with self.comm.watch(f"a pipeline send of {handle.record.nbytes} bytes (MPI_Wait on the inter axis)"):
                handle.request.Wait()
            t1 = time.perf_counter_ns()
            handle.record.wait_start_ns, handle.record.wait_ns = t0, t1 - t0
            self.comm.tracer.blocked(t0, t1)
            self._finish_send(handle, t1)
        self.sends = []

    def _finish_send(self, handle: P2PHandle, when_ns: Optional[int] = None) -> None:
        handle.observe(when_ns)
        if handle.staged:
            self.comm.backend.release_staging(handle.buffer)
        handle.buffer = None
