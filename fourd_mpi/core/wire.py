"""The route of an array to MPI and back: wire dtypes, direct or staged buffers, the finish step, the guard.

No MPI call here (those are :mod:`fourd_mpi.core.mpicoll`'s): this module prepares the buffers a
collective is issued on and turns its receive buffer back into a backend array once it completed.

Wire dtypes (:func:`wire_dtypes`): MPI has no bfloat16, so gathers and messages move its bits as
uint16 and reductions run in float32; other dtypes go as they are.

Direct or staged (``backend.staged_for(kind.route_class)``: MPI cannot take device buffers in this
operation class, ``nb_gather``: ``Iallgather``; ``nb_reduce``: ``Ireduce_scatter_block``, ``Iallreduce``;
:mod:`fourd_mpi.core.gpuaware`; or NumPy's emulation of that). Direct: the backend's own arrays are the
MPI buffers. Staged: at issue the input is copied into a pooled host buffer (``d2h``) and the collective
runs on host buffers; at finish the host result is copied back (``h2d``) and both staging buffers return
to the pool. Only the copies differ: the same requests, polls and waits, so overlap works the same way.

Stream rules (see :mod:`fourd_mpi.core.backend`): a send buffer is handed to MPI only after the kernels
producing it finished (``mpi_send_buffer`` / ``stage_to_host`` synchronize); a receive buffer is turned
into an array that kernels may read only in :meth:`Route.finish`, which the caller runs after the request
completed (:meth:`fourd_mpi.core.collectives.CommHandle.wait`).

Buffer guard (``check_buffers``): :class:`Route` copies a host send buffer at issue and
:meth:`Route.check` says whether anybody modified it while MPI could read it.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from fourd_mpi.core.colltable import COLLECTIVES


class BufferModifiedError(RuntimeError):
    """A send buffer changed while its collective was in flight."""


def wire_dtypes(dtype) -> Tuple[np.dtype, np.dtype]:
    """``(gather, reduce)`` dtypes MPI sees for arrays of ``dtype``.

    bfloat16 has no MPI datatype: gathers move its bits as uint16, reductions run in float32.
    """
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        return np.dtype(np.uint16), np.dtype(np.float32)
    return dtype, dtype


def as_dtype(array, dtype):
    """``array`` in ``dtype``: a view of the same bits for an integer stand-in of the same width (bfloat16 as
    uint16 and back), a converted copy otherwise (bfloat16 to float32 and back), ``array`` itself if equal."""
    dtype = np.dtype(dtype)
    if array.dtype == dtype:
        return array
    same_bits = dtype.itemsize == array.dtype.itemsize and (dtype.kind in "ui" or array.dtype.kind in "ui")
    return array.view(dtype) if same_bits else array.astype(dtype)


def staged(backend, op: str) -> bool:
    """Does ``op`` (a :data:`~fourd_mpi.core.colltable.COLLECTIVES` name) go through host staging buffers?"""
    return backend.staged_for(COLLECTIVES[op].route_class)


class Route:
    """One collective's buffers: ``send`` and ``recv`` for MPI, and the way back to a backend array.

    ``array``: the input; ``recv_shape``: the result's shape; ``wire``: the dtype MPI sees
    (:func:`wire_dtypes`); ``staged``: through host staging buffers (``d2h``: the input's copy, a
    :class:`~fourd_mpi.core.backend.CopySpan`) or direct (the backend's arrays, synchronized).
    ``check``: keep a copy of a host send buffer for :meth:`check`.
    """

    def __init__(self, backend, array, recv_shape, wire, staged: bool, check: bool = False):
        self.backend, self.staged, self.shape, self.dtype = backend, staged, recv_shape, array.dtype
        array = as_dtype(array, wire)
        self.d2h: Any = None
        if staged:
            self.send, self.d2h = backend.stage_to_host(array)
            self.recv = backend.staging_buffer(recv_shape, wire)
        else:
            self.send, self.recv = backend.mpi_send_buffer(array), backend.mpi_recv_buffer(recv_shape, wire)
        self._copy: Optional[np.ndarray] = np.array(self.send, copy=True) \
            if check and isinstance(self.send, np.ndarray) else None

    def finish(self):
        """``(result, h2d)`` once the request completed: the receive buffer as a backend array of the input's
        dtype, and the host-to-device copy (staged; None direct). Staged, the send buffer goes back to the pool."""
        backend = self.backend
        if self.staged:
            out, h2d = backend.stage_to_device(self.recv, self.shape)
            backend.release_staging(self.send)
        else:
            out, h2d = backend.from_mpi_buffer(self.recv).reshape(self.shape), None
        return as_dtype(out, self.dtype), h2d

    def check(self, what: str) -> None:
        """Raise :class:`BufferModifiedError` if the guarded send buffer of ``what`` changed since the issue."""
        copy, self._copy = self._copy, None
        if copy is not None and not np.array_equal(self.send, copy, equal_nan=True):
            raise BufferModifiedError(f"the send buffer of {what} was modified in flight")
