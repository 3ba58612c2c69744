"""Run ``fourd-mpi`` with the simulated CuPy and checked communicators (stream-order checker).

    mpiexec -n 4 python tests/helpers/simcupy_run.py verify --backend cupy --device-buffers staged ...

Installs :mod:`simcupy` as ``cupy`` (and the submodules the backend imports), wraps
``MPI.COMM_WORLD`` in :class:`CheckedIntracomm` (the communicators derived from it stay checked
through :func:`fourd_mpi.core.mpiutil.derived`), declares the simulated MPI CUDA-aware (so
``--device-buffers direct`` runs), then runs the real ``fourd_mpi.cli.main``. Every nonblocking
MPI call on a device or pinned buffer is checked (:meth:`simcupy.Simulator.mpi_issue`). At the
end each rank prints ``streamcheck rank N: K violations, M MPI calls checked, ...``; any
violation makes the exit status 3 (or 4 when the command itself failed too).

``SIMCUPY_BREAK`` removes one synchronization from :class:`~fourd_mpi.core.backend.CupyBackend`
to show that the checker catches it: ``send-sync`` (the stream synchronization of
``mpi_send_buffer``, direct mode), ``h2d-wait`` (the compute stream's wait on the H2D copy's
event in ``stage_to_device``, staged mode), ``recv-sync`` (``mpi_recv_buffer``'s synchronization),
``fence`` (the staging pool ignores the fence events: pinned buffers reused while a copy reads them).
"""

from __future__ import annotations

import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import simcupy  # noqa: E402
from simcupy import SIM  # noqa: E402


def install_cupy() -> None:
    """``simcupy`` as ``cupy`` and the submodules :class:`CupyBackend` imports."""
    sys.modules["cupy"] = simcupy
    core = types.ModuleType("cupy._core")
    linalg = types.ModuleType("cupy._core._routines_linalg")
    linalg.COMPUTE_TYPE_TF32, linalg.COMPUTE_TYPE_DEFAULT = 7, 1
    linalg.set_compute_type = lambda dtype, compute_type: None
    core._routines_linalg = linalg
    sys.modules["cupy._core"], sys.modules["cupy._core._routines_linalg"] = core, linalg
    simcupy._core = core


def _checked(base):
    from mpi4py import MPI

    class Checked(base):
        """A communicator whose nonblocking calls check their buffers against the stream model."""

        def adopt_derived(self, child):
            return (CheckedCartcomm if isinstance(child, MPI.Cartcomm) else CheckedIntracomm)(child)

        def _call(self, name, sends, recvs, *args, **kwargs):
            op = f"MPI {name} (comm size {self.Get_size()})"
            found = SIM.mpi_issue(op, [b for b in sends if b is not MPI.IN_PLACE],
                                  [b for b in recvs if b is not None])
            request = getattr(super(), name)(*args, **kwargs)
            SIM.mpi_started(found, request, op)
            return request

        def Iallgather(self, sendbuf, recvbuf):
            return self._call("Iallgather", [sendbuf], [recvbuf], sendbuf, recvbuf)

        def Ireduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
            return self._call("Ireduce_scatter_block", [sendbuf], [recvbuf], sendbuf, recvbuf, op)

        def Iallreduce(self, sendbuf, recvbuf, op=MPI.SUM):
            return self._call("Iallreduce", [sendbuf], [recvbuf], sendbuf, recvbuf, op)

        def Isend(self, buf, dest, tag=0):
            return self._call("Isend", [buf], [], buf, dest, tag)

        def Irecv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
            return self._call("Irecv", [], [buf], buf, source, tag)

    Checked.__name__ = Checked.__qualname__ = "Checked" + base.__name__
    return Checked


def break_backend(what: str) -> None:
    """Remove one synchronization from CupyBackend (``SIMCUPY_BREAK``; see the module doc)."""
    from fourd_mpi.core import backend

    if what == "send-sync":
        def mpi_send_buffer(self, array):
            return self.cupy.ascontiguousarray(array)  # no self.stream.synchronize()
        backend.CupyBackend.mpi_send_buffer = mpi_send_buffer
    elif what == "recv-sync":
        def mpi_recv_buffer(self, shape, dtype=None):
            return self.cupy.empty(shape, dtype=dtype or self.dtype)  # no self.stream.synchronize()
        backend.CupyBackend.mpi_recv_buffer = mpi_recv_buffer
    elif what == "h2d-wait":
        # CupyBackend.stage_to_device without the compute stream's wait on the copy's end event
        def stage_to_device(self, buffer, shape):
            cupy = self.cupy
            out = cupy.empty(shape, dtype=buffer.dtype)
            allocated = cupy.cuda.Event(disable_timing=True)
            allocated.record(self.stream)
            self.copy_stream.wait_event(allocated)
            watch = backend.EventStopwatch(cupy, self.copy_stream)
            watch.start()
            cupy.cuda.runtime.memcpyAsync(out.data.ptr, buffer.ctypes.data, buffer.nbytes,
                                          cupy.cuda.runtime.memcpyHostToDevice, self.copy_stream.ptr)
            watch.stop()
            # dropped: self.stream.wait_event(watch.end)
            self.pool.release(buffer, fence=watch.end)
            return out, backend.CopySpan(0, None, buffer.nbytes, watch)
        backend.CupyBackend.stage_to_device = stage_to_device
    elif what == "fence":
        release = backend.StagingPool.release
        backend.StagingPool.release = lambda self, buffer, fence=None: release(self, buffer, None)
    elif what:
        raise SystemExit(f"SIMCUPY_BREAK={what!r}: choose send-sync, recv-sync, h2d-wait or fence")


def main() -> int:
    install_cupy()
    from mpi4py import MPI

    global CheckedIntracomm, CheckedCartcomm
    CheckedIntracomm, CheckedCartcomm = _checked(MPI.Intracomm), _checked(MPI.Cartcomm)
    world = MPI.COMM_WORLD
    MPI.COMM_WORLD = CheckedIntracomm(world)  # the CLI reads it at call time

    from fourd_mpi.core.gpuaware import GpuAwareness
    from fourd_mpi.run import build

    def detect():  # the simulated MPI takes device buffers
        return GpuAwareness(library="simulated", version="simcupy", libmpi=None, cuda_aware=True, direct_ok=True,
                            reason="simulated CUDA-aware MPI (tests/helpers/simcupy_run.py)")
    build.detect_gpu_awareness = detect
    break_backend(os.environ.get("SIMCUPY_BREAK", ""))

    from fourd_mpi.cli.main import main as cli_main

    status = cli_main(sys.argv[1:])
    rank = world.Get_rank()
    violations = SIM.report()
    print(f"streamcheck rank {rank}: {len(violations)} violations, {SIM.checked_mpi_calls} MPI calls checked, "
          f"{SIM.kernels} kernels and copies", flush=True)
    for line in violations[:10]:
        print(f"streamcheck rank {rank}: {line}", flush=True)
    if violations:
        return 4 if status else 3
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
