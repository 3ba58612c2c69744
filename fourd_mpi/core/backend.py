"""Array backends: NumPy on CPUs, CuPy on GPUs, behind one small interface.

The step math is written against ``backend.xp`` (the array module). Everything
that differs between host and device is here: dtype handling, device selection,
synchronization, timing (host clocks or CUDA events), and turning an array into
something MPI may read or write.

MPI buffers, two modes (``--device-buffers``), chosen per operation class (``p2p``, ``blocking``,
``nb_gather``, ``nb_reduce``: :data:`fourd_mpi.core.gpuaware.OP_CLASSES`; :meth:`ArrayBackend.set_routes`,
:meth:`ArrayBackend.staged_for`); ``set_staged`` sets every class at once:

``direct``
    MPI gets the backend arrays themselves (device pointers on CuPy: needs a
    CUDA-aware MPI; host arrays on NumPy).
``staged``
    MPI gets host buffers from a reusable pool (:class:`StagingPool`; pinned
    memory on CuPy). Device-to-host copy before the collective, host-to-device
    copy after its request completed. On CuPy the copies run on a separate copy
    stream and are ordered against the compute stream with CUDA events. On NumPy
    the same code path runs with plain host copies ("emulated staging"), so the
    bookkeeping, the trace events and bitwise equality with ``direct`` are
    testable without a GPU.

Stream rules (MPI knows nothing of CUDA streams):

1. Before MPI reads a device buffer, the kernels that produced it must have
   finished: :meth:`CupyBackend.mpi_send_buffer` synchronizes the compute stream
   (direct); :meth:`CupyBackend.stage_to_host` makes the copy stream wait on an
   event recorded after the producing kernels and the host waits for the copy's
   own event before MPI reads the pinned buffer (staged).
2. A kernel may read a receive buffer only after its request completed: the
   collectives layer calls :meth:`from_mpi_buffer` / :meth:`stage_to_device` only
   from ``CommHandle.wait``; the host-to-device copy is enqueued there and the
   compute stream waits on its event, so later kernels see the data without the
   host blocking.
3. A pooled host buffer is reused only after the copy that reads it has finished
   (its CUDA event, the pool's "fence").

The rules are checked without a GPU by ``tests/core/test_stream_order.py``: a simulated CuPy
(``tests/helpers/simcupy.py``, streams and events as vector clocks) runs this backend and the
whole step under mpiexec, and every buffer handed to MPI is checked against it.
"""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from fourd_mpi.core.bufferpool import HostArrayPool
from fourd_mpi.errors import BackendError, ConfigError

#: dtype names; ``bfloat16`` exists only on CuPy (>= 14, with ``ml_dtypes``): NumPy has no bfloat16
DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": None}
BACKENDS = ("auto", "numpy", "cupy")
DEVICE_BUFFER_MODES = ("auto", "direct", "staged")


def bfloat16_dtype():
    """The ``ml_dtypes`` bfloat16 NumPy dtype (raises :class:`BackendError` when it is not installed)."""
    try:
        import ml_dtypes
    except ImportError:
        raise BackendError("dtype bfloat16 needs the ml_dtypes package (pip install ml_dtypes) "
                           "and CuPy >= 14") from None
    return np.dtype(ml_dtypes.bfloat16)


#: bytes per element of each dtype (no array library needed: the performance model uses it offline)
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


def dtype_bytes(name: str) -> int:
    """Bytes per element of dtype ``name`` (raises :class:`ConfigError` for an unknown name)."""
    if name not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPE_BYTES[name]


def parse_dtype(name: str):
    """A dtype name -> NumPy dtype (``bfloat16``: the ``ml_dtypes`` one)."""
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}")
    if name == "bfloat16":
        return bfloat16_dtype()
    return np.dtype(DTYPES[name])


def check_dtype_options(dtype: str, backend: str, tf32: bool) -> None:
    """Pure validation of ``--dtype``/``--backend``/``--tf32`` (runs on every rank before any collective)."""
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if dtype == "bfloat16" and backend == "numpy":
        raise ConfigError("dtype bfloat16 needs the cupy backend: NumPy has no bfloat16 arithmetic "
                          "(use float32 or float16 on the numpy backend)")
    if tf32 and dtype != "float32":
        raise ConfigError(f"--tf32 applies to float32 GEMMs only, but --dtype is {dtype}")
    if tf32 and backend == "numpy":
        raise ConfigError("--tf32 needs the cupy backend (NumPy computes float32 GEMMs in full precision)")


def cupy_usable() -> bool:
    """True when CuPy imports and sees at least one GPU (CUDA, or HIP for CuPy's ROCm build)."""
    try:
        import cupy
    except Exception:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:
        return False


# timing ---------------------------------------------------------------------
class HostStopwatch:
    """Host clock (``perf_counter_ns``) between :meth:`start` and :meth:`stop`."""

    __slots__ = ("start_ns", "stop_ns")

    def __init__(self):
        self.start_ns = self.stop_ns = 0

    def start(self) -> None:
        self.start_ns = time.perf_counter_ns()

    def stop(self) -> None:
        self.stop_ns = time.perf_counter_ns()

    def done(self) -> bool:
        return True

    def elapsed_ns(self) -> int:
        return self.stop_ns - self.start_ns


class EventStopwatch:
    """Two CUDA events recorded on a stream; :meth:`elapsed_ns` is the GPU time between them.

    Reading the time synchronizes the stop event (host clocks are never read
    around asynchronous kernels).
    """

    __slots__ = ("cupy", "stream", "begin", "end")

    def __init__(self, cupy, stream=None):
        self.cupy = cupy
        self.stream = stream
        self.begin = cupy.cuda.Event()
        self.end = cupy.cuda.Event()

    def start(self) -> None:
        self.begin.record(self.stream)

    def stop(self) -> None:
        self.end.record(self.stream)

    def done(self) -> bool:
        return bool(self.end.done)

    def elapsed_ns(self) -> int:
        self.end.synchronize()
        return int(round(self.cupy.cuda.get_elapsed_time(self.begin, self.end) * 1e6))


class CopySpan:
    """When a staging copy ran (``perf_counter_ns``). ``end_ns`` may be pending on a GPU:
    :meth:`resolve` then reads the copy's CUDA events (after the step synchronized)."""

    __slots__ = ("start_ns", "end_ns", "nbytes", "_watch")

    def __init__(self, start_ns: int, end_ns: Optional[int], nbytes: int, watch=None):
        self.start_ns, self.end_ns, self.nbytes, self._watch = start_ns, end_ns, nbytes, watch

    def resolve(self) -> "CopySpan":
        if self.end_ns is None:
            self.end_ns = self.start_ns + self._watch.elapsed_ns()
            self._watch = None
        return self


# staging buffers ----------------------------------------------------------------
class StagingPool:
    """Reusable host buffers for staged MPI transfers, kept by byte size.

    ``allocate(nbytes)`` returns a 1-D ``uint8`` host array (pinned memory on
    CuPy). :meth:`acquire` returns a free buffer of that size whose fence (the
    event of the last copy that reads it, or None) has completed, or allocates
    one. A step issues the same collectives every time, so after the first step
    nothing is allocated. ``allocations`` and ``bytes_allocated`` count what was.
    """

    def __init__(self, allocate):
        self._allocate = allocate
        self._free: Dict[int, List[Tuple[np.ndarray, object]]] = {}
        self.allocations = 0
        self.bytes_allocated = 0
        self.in_use = 0

    def acquire(self, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        free = self._free.get(nbytes, [])
        raw = None
        for i, (buf, fence) in enumerate(free):
            if fence is None or fence.done:
                raw = free.pop(i)[0]
                break
        if raw is None:
            raw = self._allocate(max(nbytes, 1))[:nbytes]
            self.allocations += 1
            self.bytes_allocated += nbytes
        self.in_use += 1
        return raw.view(dtype).reshape(shape)

    def release(self, buffer: np.ndarray, fence=None) -> None:
        """Give ``buffer`` back; it is handed out again once ``fence`` (a CUDA event or None) is done."""
        self.in_use -= 1
        raw = buffer.reshape(-1).view(np.uint8)
        self._free.setdefault(raw.nbytes, []).append((raw, fence))

    def stats(self) -> Dict[str, int]:
        return {"allocations": self.allocations, "bytes_allocated": self.bytes_allocated, "in_use": self.in_use,
                "free": sum(len(v) for v in self._free.values())}


class ArrayBackend:
    """Common interface. Attributes: ``name``, ``xp`` (array module), ``dtype``, ``device``,
    ``staged`` (MPI gets host staging buffers)."""

    name = "abstract"
    xp = np
    device: Optional[int] = None
    #: True when MPI is given device pointers directly (CUDA-aware MPI).
    device_buffers_direct = False
    #: True when MPI gets host staging buffers (:meth:`stage_to_host` / :meth:`stage_to_device`) for some
    #: operation class (every class when :attr:`routes` is empty)
    staged = False
    #: per operation class ``direct``/``staged`` (:meth:`set_routes`); empty: every class follows :attr:`staged`
    routes: Dict[str, str] = {}
    tf32 = False
    #: the attention kernels the step uses (``unfused``, or a fused mode of :mod:`fourd_mpi.step.fusedattention`,
    #: set by the run's set-up from ``--attention``) and why
    attention = "unfused"
    attention_reason = "default"

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self.pool: Optional[StagingPool] = None

    # arrays -----------------------------------------------------------------
    def asarray(self, host_array):
        """Host (or backend) array -> backend array of this backend's dtype."""
        raise NotImplementedError

    def to_host(self, array) -> np.ndarray:
        """Backend array -> NumPy array (blocks until the data is on the host)."""
        raise NotImplementedError

    def zeros(self, shape, dtype=None):
        return self.xp.zeros(shape, dtype=dtype or self.dtype)

    def empty(self, shape, dtype=None):
        """An uninitialized array for the step (NumPy: from the host array pool; CuPy: CuPy's pool)."""
        return self.xp.empty(shape, dtype=dtype or self.dtype)

    def pool_stats(self) -> Dict[str, int]:
        """What the step's array pool holds (empty where the array module pools by itself)."""
        return {}

    # execution -------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until all queued device work has finished (no-op on the host)."""

    def stopwatch(self):
        """A fresh stopwatch: host clock here, CUDA events on the compute stream on CuPy."""
        return HostStopwatch()

    # MPI buffers -------------------------------------------------------------
    def mpi_mode(self) -> str:
        if self.routes and len(set(self.routes.values())) > 1:
            return "mixed"
        return "staged" if self.staged else "direct"

    def staged_for(self, op_class: str) -> bool:
        """Does MPI get host staging buffers for operations of ``op_class`` (``p2p``, ``nb_gather``, ...)?"""
        if not self.routes:
            return self.staged
        return self.routes.get(op_class, "staged") == "staged"

    def set_routes(self, routes: Dict[str, str]) -> None:
        """Per operation class ``direct`` or ``staged`` (a class not named is staged)."""
        self.set_staged(any(route == "staged" for route in routes.values()))
        self.routes = dict(routes)

    def routes_text(self) -> str:
        """``staged`` / ``direct``, or which classes go which way."""
        if self.mpi_mode() != "mixed":
            return self.mpi_mode()
        by = {route: [cls for cls, r in self.routes.items() if r == route] for route in ("direct", "staged")}
        return "; ".join(f"{route} for {', '.join(classes)}" for route, classes in by.items() if classes)

    def mpi_send_buffer(self, array):
        """A buffer MPI may read now that holds ``array``'s values (direct mode)."""
        raise NotImplementedError

    def mpi_recv_buffer(self, shape, dtype=None):
        """A fresh buffer MPI may write into; pass it to :meth:`from_mpi_buffer` after completion."""
        raise NotImplementedError

    def from_mpi_buffer(self, buffer):
        """The backend array for a receive buffer whose request has completed."""
        raise NotImplementedError

    # staged mode -------------------------------------------------------------
    def stage_to_host(self, array) -> Tuple[np.ndarray, CopySpan]:
        """Copy ``array`` into a pooled host buffer; returns once MPI may read it."""
        raise NotImplementedError

    def staging_buffer(self, shape, dtype=None) -> np.ndarray:
        """A pooled host receive buffer."""
        return self.pool.acquire(shape, dtype or self.dtype)

    def stage_to_device(self, buffer: np.ndarray, shape) -> Tuple[object, CopySpan]:
        """The backend array of a completed receive buffer (the buffer goes back to the pool)."""
        raise NotImplementedError

    def release_staging(self, buffer: np.ndarray) -> None:
        """A send staging buffer whose request completed goes back to the pool."""
        self.pool.release(buffer)

    def describe(self) -> str:
        return f"{self.name} ({self.dtype.name})"


def _host_allocate(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


class NumpyBackend(ArrayBackend):
    """NumPy on the host. ``staged=True`` emulates host staging (for testing the staged
    bookkeeping without a GPU): separate pooled host buffers and explicit copies, no streams."""

    name = "numpy"
    xp = np

    def __init__(self, dtype, staged: bool = False):
        if np.dtype(dtype).name == "bfloat16":
            raise BackendError("dtype bfloat16 needs the cupy backend: NumPy has no bfloat16 arithmetic")
        super().__init__(dtype)
        #: the step's arrays (receive buffers, GEMM outputs, elementwise results), reused step after step
        self.arrays = HostArrayPool()
        self.set_staged(staged)

    def set_staged(self, staged: bool) -> None:
        self.staged = bool(staged)
        self.routes = {}
        if self.staged and self.pool is None:
            self.pool = StagingPool(_host_allocate)

    def empty(self, shape, dtype=None):
        return self.arrays.empty(shape, dtype or self.dtype)

    def zeros(self, shape, dtype=None):
        return self.arrays.zeros(shape, dtype or self.dtype)

    def pool_stats(self) -> Dict[str, int]:
        return self.arrays.stats()

    def asarray(self, host_array):
        return np.ascontiguousarray(host_array, dtype=self.dtype)

    def to_host(self, array) -> np.ndarray:
        return np.asarray(array)

    def mpi_send_buffer(self, array):
        return np.ascontiguousarray(array)

    def mpi_recv_buffer(self, shape, dtype=None):
        return self.arrays.empty(shape, dtype or self.dtype)  # reused once its request and users are done

    def from_mpi_buffer(self, buffer):
        return buffer

    def stage_to_host(self, array):
        t0 = time.perf_counter_ns()
        buf = self.pool.acquire(array.shape, array.dtype)
        np.copyto(buf, array)  # "device-to-host"
        return buf, CopySpan(t0, time.perf_counter_ns(), buf.nbytes)

    def stage_to_device(self, buffer, shape):
        t0 = time.perf_counter_ns()
        out = self.arrays.empty(shape, buffer.dtype)  # not the staging buffer: that one is reused at once
        np.copyto(out, buffer.reshape(shape))  # "host-to-device"
        self.pool.release(buffer)
        return out, CopySpan(t0, time.perf_counter_ns(), out.nbytes)

    def describe(self) -> str:
        threads = os.environ.get("OMP_NUM_THREADS", "unset")
        mode = self.routes_text()
        staging = f", MPI buffers {mode} (emulated: host copies)" if self.staged else ""
        return f"numpy {np.__version__} ({self.dtype.name}, OMP_NUM_THREADS={threads}){staging}"


#: the variables by which launchers restrict a rank's GPUs: CUDA's, and ROCm's (HIP_VISIBLE_DEVICES in
#: HIP, ROCR_VISIBLE_DEVICES below it, which Slurm's --gpu-bind sets on AMD nodes such as Frontier)
VISIBLE_DEVICE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def gpu_platform(is_hip: bool, runtime_version: int) -> str:
    """The GPU runtime CuPy was built for, from ``cupy.cuda.runtime.is_hip`` and ``runtimeGetVersion()``:
    ``"CUDA 12.4"`` (CUDA encodes 1000 * major + 10 * minor) or ``"HIP 7.0"`` (HIP encodes
    10,000,000 * major + 100,000 * minor + patch: ROCm's HIP_VERSION)."""
    if is_hip:
        return f"HIP {runtime_version // 10_000_000}.{runtime_version // 100_000 % 100}"
    return f"CUDA {runtime_version // 1000}.{runtime_version % 1000 // 10}"


def visible_devices(environ) -> str:
    """``NAME=VALUE`` of each device-restricting variable set in ``environ``, comma-separated ("" if none)."""
    return ", ".join(f"{name}={environ[name]}" for name in VISIBLE_DEVICE_VARIABLES if name in environ)


def select_device(local_rank: int, visible: int) -> int:
    """The GPU of a rank: its node-local rank modulo the visible devices.

    CUDA and HIP number the visible devices (``CUDA_VISIBLE_DEVICES``, ``ROCR_VISIBLE_DEVICES``,
    ``HIP_VISIBLE_DEVICES``) from 0, so a launcher that gives each rank one device
    (``--gpus-per-task=1`` with ``--gpu-bind``, a GPU affinity script) makes this 0;
    more ranks than visible devices share them round-robin.
    """
    if visible < 1:
        raise BackendError("no GPU is visible on this rank (check " + ", ".join(VISIBLE_DEVICE_VARIABLES) + ")")
    return local_rank % visible


class CupyBackend(ArrayBackend):
    """CuPy on one GPU per rank, chosen by node-local rank (:func:`select_device`).

    ``device_buffers="direct"`` hands device pointers to MPI (needs a CUDA-aware
    MPI); ``"staged"`` copies through pinned host buffers on a copy stream (see the
    module docstring for the stream rules). ``tf32``: float32 GEMMs on tensor cores
    in TF32 (CuPy's compute type; Ampere and newer).
    """

    name = "cupy"

    def __init__(self, dtype, local_rank: int = 0, device_buffers: str = "staged", tf32: bool = False):
        try:
            import cupy
        except Exception as exc:  # pragma: no cover - depends on the machine
            raise BackendError(f"backend 'cupy' requested but CuPy does not import: {exc}") from None
        if not cupy_usable():
            raise BackendError("backend 'cupy' requested but no CUDA device is usable on this rank")
        if device_buffers not in ("direct", "staged"):
            raise ConfigError(f"device buffers must be 'direct' or 'staged', got {device_buffers!r}")
        super().__init__(dtype)
        self.cupy = cupy
        self.xp = cupy
        if self.dtype.name == "bfloat16":
            try:
                cupy.zeros(1, dtype=self.dtype) @ cupy.zeros((1, 1), dtype=self.dtype)
            except Exception as exc:
                raise BackendError(f"dtype bfloat16: CuPy {cupy.__version__} cannot compute with it "
                                   f"({type(exc).__name__}: {exc}); CuPy >= 14 with ml_dtypes can") from None
        self.device = select_device(local_rank, cupy.cuda.runtime.getDeviceCount())
        cupy.cuda.Device(self.device).use()
        #: the stream of all step kernels (CuPy's current stream, the legacy default stream unless changed)
        self.stream = cupy.cuda.get_current_stream()
        #: staging copies run here, ordered against ``stream`` by events
        self.copy_stream = cupy.cuda.Stream(non_blocking=True)
        self.pool = StagingPool(lambda n: np.frombuffer(cupy.cuda.alloc_pinned_memory(n), dtype=np.uint8, count=n))
        self.set_tf32(tf32)
        self.set_staged(device_buffers == "staged")

    def set_staged(self, staged: bool) -> None:
        self.staged = bool(staged)
        self.routes = {}
        self.device_buffers_direct = not self.staged

    def set_routes(self, routes: Dict[str, str]) -> None:
        super().set_routes(routes)
        self.device_buffers_direct = any(route == "direct" for route in routes.values())

    def set_tf32(self, enabled: bool) -> None:
        """Float32 GEMMs in TF32 on tensor cores (True) or full float32 (False): CuPy's compute type."""
        from cupy._core import _routines_linalg as linalg

        tf32 = getattr(linalg, "COMPUTE_TYPE_TF32", 7)
        default = getattr(linalg, "COMPUTE_TYPE_DEFAULT", 1)
        linalg.set_compute_type(np.float32, tf32 if enabled else default)
        self.tf32 = bool(enabled)

    def asarray(self, host_array):
        if isinstance(host_array, self.cupy.ndarray):
            return self.cupy.ascontiguousarray(host_array, dtype=self.dtype)
        return self.cupy.asarray(np.ascontiguousarray(host_array, dtype=self.dtype))

    def to_host(self, array) -> np.ndarray:
        if isinstance(array, np.ndarray):
            return array
        return self.cupy.asnumpy(array)

    def synchronize(self) -> None:
        self.stream.synchronize()
        self.copy_stream.synchronize()

    def stopwatch(self):
        return EventStopwatch(self.cupy, self.stream)

    # direct -------------------------------------------------------------------
    def mpi_send_buffer(self, array):
        array = self.cupy.ascontiguousarray(array)
        # rule 1: MPI reads device memory outside any stream: the producing kernels must be done
        self.stream.synchronize()
        return array

    def mpi_recv_buffer(self, shape, dtype=None):
        buf = self.cupy.empty(shape, dtype=dtype or self.dtype)
        # CuPy's pool may hand out memory that queued kernels still use (stream order); MPI
        # writes outside the stream, so everything queued before must be done.
        self.stream.synchronize()
        return buf

    def from_mpi_buffer(self, buffer):
        return buffer

    # staged -------------------------------------------------------------------
    def stage_to_host(self, array):
        cupy = self.cupy
        t0 = time.perf_counter_ns()
        array = cupy.ascontiguousarray(array)
        produced = cupy.cuda.Event(disable_timing=True)
        produced.record(self.stream)
        self.copy_stream.wait_event(produced)  # rule 1, without blocking the compute stream
        buf = self.pool.acquire(array.shape, array.dtype)
        watch = EventStopwatch(cupy, self.copy_stream)
        watch.start()
        cupy.cuda.runtime.memcpyAsync(buf.ctypes.data, array.data.ptr, buf.nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToHost, self.copy_stream.ptr)
        watch.stop()
        copy_ns = watch.elapsed_ns()  # the host waits for the copy (not the compute stream's later work)
        t1 = time.perf_counter_ns()
        return buf, CopySpan(max(t0, t1 - copy_ns), t1, buf.nbytes)

    def stage_to_device(self, buffer, shape):
        cupy = self.cupy
        t0 = time.perf_counter_ns()
        out = cupy.empty(shape, dtype=buffer.dtype)
        allocated = cupy.cuda.Event(disable_timing=True)
        allocated.record(self.stream)
        self.copy_stream.wait_event(allocated)  # the memory's previous users on the compute stream are done
        watch = EventStopwatch(cupy, self.copy_stream)
        watch.start()
        cupy.cuda.runtime.memcpyAsync(out.data.ptr, buffer.ctypes.data, buffer.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, self.copy_stream.ptr)
        watch.stop()
        self.stream.wait_event(watch.end)  # rule 2: kernels reading `out` run after the copy
        self.pool.release(buffer, fence=watch.end)  # rule 3
        return out, CopySpan(t0, None, buffer.nbytes, watch)

    def device_name(self) -> str:
        props = self.cupy.cuda.runtime.getDeviceProperties(self.device)
        text = lambda value: value.decode() if isinstance(value, bytes) else str(value)  # noqa: E731
        arch = props.get("gcnArchName")  # HIP only: the GCD's ISA, e.g. gfx90a:sramecc+:xnack-
        return text(props["name"]) + (f" {text(arch).split(':')[0]}" if arch else "")

    def describe(self) -> str:
        mode = self.routes_text()
        mode = "staged through pinned host memory" if mode == "staged" else mode
        tf32 = ", TF32 GEMMs" if self.tf32 else ""
        runtime = self.cupy.cuda.runtime
        shown = "".join(f", {text}" for text in [visible_devices(os.environ)] if text)
        return (f"cupy {self.cupy.__version__} on GPU {self.device} ({self.device_name()}, "
                f"{gpu_platform(bool(getattr(runtime, 'is_hip', False)), runtime.runtimeGetVersion())}{shown}, "
                f"{self.dtype.name}{tf32}), MPI buffers {mode}")


def make_backend(name: str, dtype, local_rank: int = 0, device_buffers: str = "auto",
                 tf32: bool = False) -> ArrayBackend:
    """Create the backend ``name`` (``auto``, ``numpy`` or ``cupy``).

    ``auto`` picks CuPy only when a GPU is usable, NumPy otherwise.
    ``device_buffers``: ``direct`` or ``staged`` (on NumPy: emulated staging);
    ``auto`` means direct on NumPy (host buffers need no staging) and staged on CuPy
    until CUDA-aware MPI detection proves direct device buffers safe
    (:func:`fourd_mpi.run.build.choose_mpi_buffers`).
    """
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
    if device_buffers not in DEVICE_BUFFER_MODES:
        raise ConfigError(
            f"unknown device-buffer mode {device_buffers!r}: choose one of {', '.join(DEVICE_BUFFER_MODES)}"
        )
    dtype = np.dtype(dtype)
    if name == "auto":
        name = "cupy" if cupy_usable() else "numpy"
    if name == "numpy":
        if tf32:
            raise BackendError("--tf32 needs the cupy backend (NumPy computes float32 GEMMs in full precision)")
        return NumpyBackend(dtype, staged=device_buffers == "staged")
    mode = "staged" if device_buffers == "auto" else device_buffers
    return CupyBackend(dtype, local_rank=local_rank, device_buffers=mode, tf32=tf32)
