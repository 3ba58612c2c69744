"""The only calls of MPI collectives, as thin as AxoNN's communication layer.

Each operation picks the named axis' communicator of the grid (:meth:`ProcessGrid.axis_comm`), calls the
nonblocking MPI function of :data:`~fourd_mpi.core.colltable.COLLECTIVES` on a send and a receive buffer,
and returns the MPI request. Nothing else: buffers, dtypes and staging are :mod:`fourd_mpi.core.wire`'s,
records and the watchdog :mod:`fourd_mpi.core.commlog`'s, issue, progress and waits
:class:`fourd_mpi.core.collectives.Collectives`', which wraps these calls.

Ordering rule: every operation is collective over its axis. Every rank of the axis must issue it in
the same order with buffers of the same shape and dtype (MPI matches nonblocking collectives by issue
order per communicator; issuing them in a rank-dependent order hangs or corrupts results).

Stream rules: the send buffer must be ready when it is handed over (the kernels producing it finished)
and the receive buffer must not be read or reused before the request completed; the caller keeps both
alive until then.
"""

from __future__ import annotations

from mpi4py import MPI

from fourd_mpi.core.colltable import COLLECTIVES


def issue(grid, op: str, axis: str, send, recv) -> MPI.Request:
    """Start collective ``op`` (``allgather``, ``reduce_scatter``, ``allreduce``) over ``axis``; its request."""
    return getattr(grid.axis_comm(axis), COLLECTIVES[op].nonblocking)(send, recv)


def allgather(grid, axis: str, send, recv) -> MPI.Request:
    """``Iallgather``: ``recv`` (``p*s`` elements) gets the ``s``-element ``send`` of axis coordinate ``i`` at
    ``[i*s:(i+1)*s]``."""
    return issue(grid, "allgather", axis, send, recv)


def reduce_scatter(grid, axis: str, send, recv) -> MPI.Request:
    """``Ireduce_scatter_block``: ``recv`` (``s`` elements) gets block ``coord(axis)`` of the sum of the
    ``p*s``-element ``send`` over the axis."""
    return issue(grid, "reduce_scatter", axis, send, recv)


def allreduce(grid, axis: str, send, recv) -> MPI.Request:
    """``Iallreduce``: ``recv`` (the shape of ``send``) gets the element-wise sum of ``send`` over the axis."""
    return issue(grid, "allreduce", axis, send, recv)


def allreduce_in_place(grid, axis: str, buf) -> None:
    """Blocking ``Allreduce`` in place: ``buf`` (host) becomes its element-wise sum over the axis."""
    getattr(grid.axis_comm(axis), COLLECTIVES["allreduce"].blocking)(MPI.IN_PLACE, buf)
