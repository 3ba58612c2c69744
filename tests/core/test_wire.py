"""The route of a buffer to MPI and back (core/wire.py) and the records' texts (core/commlog.py), without MPI:
the MPI step itself is stood in for by a copy of the send buffer into the receive buffer (a one-rank
all-reduce), as MPI would write it."""

from __future__ import annotations

import numpy as np
import pytest

from fourd_mpi.core import commlog
from fourd_mpi.core.backend import NumpyBackend
from fourd_mpi.core.wire import BufferModifiedError, Route, as_dtype, staged, wire_dtypes


def test_wire_dtypes_stand_in_only_for_bfloat16():
    assert wire_dtypes(np.float32) == (np.dtype(np.float32), np.dtype(np.float32))
    assert wire_dtypes(np.float16) == (np.dtype(np.float16), np.dtype(np.float16))
    half = np.array([0.5, -1.0], dtype=np.float16)  # a stand-in of the same width is a view, and back
    assert np.shares_memory(as_dtype(half, np.uint16), half)
    assert np.array_equal(as_dtype(as_dtype(half, np.uint16), np.float16), half) and as_dtype(half, np.float16) is half
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert wire_dtypes(bf16) == (np.dtype(np.uint16), np.dtype(np.float32))
    x = np.array([1.5, -2.0, 3.25], dtype=bf16)
    bits = as_dtype(x, np.uint16)
    assert bits.dtype == np.uint16 and np.shares_memory(bits, x)  # the same bits, no copy
    assert np.array_equal(as_dtype(bits, bf16), x)
    assert np.array_equal(as_dtype(as_dtype(x, np.float32), bf16), x)  # float32 and back: exact for these


@pytest.mark.parametrize("mode", [False, True], ids=["direct", "staged"])
def test_route_gives_the_received_buffer_back_in_the_input_shape(mode):
    backend = NumpyBackend(np.float32, staged=mode)
    assert staged(backend, "allreduce") is mode and staged(backend, "allgather") is mode
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    route = Route(backend, array, array.shape, wire_dtypes(array.dtype)[1], staged(backend, "allreduce"))
    assert (route.d2h is not None) is mode and route.send.shape == (2, 3)
    route.recv[...] = route.send  # what MPI writes for a one-rank all-reduce
    out, h2d = route.finish()
    assert (h2d is not None) is mode
    assert out.shape == (2, 3) and out.dtype == np.float32 and np.array_equal(out, array)


def test_guard_reports_a_send_buffer_modified_in_flight():
    backend = NumpyBackend(np.float64)
    array = np.ones(4)
    kept = Route(backend, array, (4,), np.dtype(np.float64), False, check=True)
    kept.check("allreduce over x (32 bytes)")  # unchanged: no error
    changed = Route(backend, array, (4,), np.dtype(np.float64), False, check=True)
    changed.send[1] = 5.0
    with pytest.raises(BufferModifiedError, match=r"^the send buffer of allreduce over x \(32 bytes\) was modified"):
        changed.check("allreduce over x (32 bytes)")
    changed.check("again")  # checked once: the copy is gone
    Route(backend, array, (4,), np.dtype(np.float64), False).check("unguarded")


class _Tracer:
    where_layer, where_phase, step = 2, 1, 7
    layer_names = ["", "block0.fc1", "block0.fc2"]

    @staticmethod
    def phase_name(code):
        return {1: "forward"}.get(code, "?")


def test_records_are_numbered_tagged_and_described():
    records = []
    first = commlog.new_record(records, _Tracer, "allgather", "z", 4096)
    second = commlog.new_record(records, _Tracer, "allreduce", "data", 64, tag=(0, 0))
    assert records == [first, second] and (first.seq, second.seq) == (0, 1)
    assert (first.layer, first.phase, second.layer) == (2, 1, 0)
    assert commlog.describe(_Tracer, first) == ("allgather over z (4096 bytes), step 7, layer block0.fc2 (forward), "
                                                "collective #0 of the step")
    assert "layer no layer" in commlog.describe(_Tracer, second)
    assert commlog.describe(_Tracer, None) == "a collective"
    # a wait ends when completion was observed, if that came first
    second.complete_ns = 150
    assert commlog.note_wait(second, 100, 400) == (100, 150) and second.wait_ns == 50
    assert commlog.note_wait(second, 200, 400) == (150, 150) and second.wait_ns == 0
    with commlog.watch(None, _Tracer, first):
        pass  # no watchdog: nothing watched
