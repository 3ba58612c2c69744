"""Array backends: NumPy on CPUs, CuPy on GPUs, behind one small interface.

The step math is written against ``backend.xp`` (the array module). Everything
that differs between host and device is here: dtype handling, device selection,
synchronization, and turning an array into something MPI may read or write.

MPI knows nothing of CUDA streams. Before a device buffer is handed to MPI the
stream that produced it must be synchronized (:meth:`ArrayBackend.mpi_send_buffer`
does that), and a kernel may read a receive buffer only after the request that
fills it has completed (the collectives layer waits before returning it).
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from .errors import BackendError, ConfigError

DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16}
BACKENDS = ("auto", "numpy", "cupy")
DEVICE_BUFFER_MODES = ("auto", "direct", "staged")


def parse_dtype(name: str):
    try:
        return np.dtype(DTYPES[name])
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}") from None


def cupy_usable() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
    except Exception:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:
        return False


class ArrayBackend:
    """Common interface. Attributes: ``name``, ``xp`` (array module), ``dtype``, ``device``."""

    name = "abstract"
    xp = np
    device: Optional[int] = None
    #: True when MPI is given device pointers directly (CUDA-aware MPI).
    device_buffers_direct = False

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)

    # arrays -----------------------------------------------------------------
    def asarray(self, host_array):
        """Host array -> backend array of this backend's dtype."""
        raise NotImplementedError

    def to_host(self, array) -> np.ndarray:
        """Backend array -> NumPy array (blocks until the data is on the host)."""
        raise NotImplementedError

    def zeros(self, shape):
        return self.xp.zeros(shape, dtype=self.dtype)

    def empty(self, shape):
        return self.xp.empty(shape, dtype=self.dtype)

    # execution -------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until all queued device work has finished (no-op on the host)."""

    # MPI buffers -------------------------------------------------------------
    def mpi_send_buffer(self, array):
        """A buffer MPI may read now that holds ``array``'s values."""
        raise NotImplementedError

    def mpi_recv_buffer(self, shape):
        """A fresh buffer MPI may write into; pass it to :meth:`from_mpi_buffer` after completion."""
        raise NotImplementedError

    def from_mpi_buffer(self, buffer):
        """The backend array for a receive buffer whose request has completed."""
        raise NotImplementedError

    def describe(self) -> str:
        return f"{self.name} ({self.dtype.name})"


class NumpyBackend(ArrayBackend):
    name = "numpy"
    xp = np

    def asarray(self, host_array):
        return np.ascontiguousarray(host_array, dtype=self.dtype)

    def to_host(self, array) -> np.ndarray:
        return np.asarray(array)

    def mpi_send_buffer(self, array):
        return np.ascontiguousarray(array)

    def mpi_recv_buffer(self, shape):
        return np.empty(shape, dtype=self.dtype)

    def from_mpi_buffer(self, buffer):
        return buffer

    def describe(self) -> str:
        threads = os.environ.get("OMP_NUM_THREADS", "unset")
        return f"numpy {np.__version__} ({self.dtype.name}, OMP_NUM_THREADS={threads})"


class CupyBackend(ArrayBackend):
    """CuPy on one GPU per rank, chosen by node-local rank.

    ``device_buffers="direct"`` hands device pointers to MPI (needs a CUDA-aware
    MPI); ``"staged"`` copies through pinned host buffers.
    """

    name = "cupy"

    def __init__(self, dtype, local_rank: int = 0, device_buffers: str = "staged"):
        super().__init__(dtype)
        try:
            import cupy
        except Exception as exc:  # pragma: no cover - depends on the machine
            raise BackendError(f"backend 'cupy' requested but CuPy does not import: {exc}") from None
        if not cupy_usable():
            raise BackendError("backend 'cupy' requested but no CUDA device is usable on this rank")
        if device_buffers not in ("direct", "staged"):
            raise ConfigError(f"device buffers must be 'direct' or 'staged', got {device_buffers!r}")
        self.cupy = cupy
        self.xp = cupy
        count = cupy.cuda.runtime.getDeviceCount()
        # CUDA_VISIBLE_DEVICES already renumbers devices from 0; share round-robin
        # when a node runs more ranks than it has visible GPUs.
        self.device = local_rank % count
        cupy.cuda.Device(self.device).use()
        self.device_buffers_direct = device_buffers == "direct"

    def asarray(self, host_array):
        return self.cupy.asarray(np.ascontiguousarray(host_array, dtype=self.dtype))

    def to_host(self, array) -> np.ndarray:
        if isinstance(array, np.ndarray):
            return array
        return self.cupy.asnumpy(array)

    def synchronize(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()

    def mpi_send_buffer(self, array):
        array = self.cupy.ascontiguousarray(array)
        if self.device_buffers_direct:
            # MPI reads device memory outside any stream: the producing kernels must be done.
            self.synchronize()
            return array
        pinned = self._pinned_empty(array.shape, array.dtype)
        array.get(out=pinned)  # synchronous on the current stream
        return pinned

    def mpi_recv_buffer(self, shape):
        if self.device_buffers_direct:
            buf = self.cupy.empty(shape, dtype=self.dtype)
            # The allocation may be pending on the stream; MPI must not race it.
            self.synchronize()
            return buf
        return self._pinned_empty(shape, self.dtype)

    def from_mpi_buffer(self, buffer):
        if isinstance(buffer, np.ndarray):
            return self.cupy.asarray(buffer)
        return buffer

    def _pinned_empty(self, shape, dtype):
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        mem = self.cupy.cuda.alloc_pinned_memory(max(size, 1))
        return np.frombuffer(mem, dtype=dtype, count=int(np.prod(shape))).reshape(shape)

    def describe(self) -> str:
        props = self.cupy.cuda.runtime.getDeviceProperties(self.device)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        mode = "direct" if self.device_buffers_direct else "staged through pinned host memory"
        return f"cupy {self.cupy.__version__} on GPU {self.device} ({name}, {self.dtype.name}), MPI buffers {mode}"


def make_backend(name: str, dtype, local_rank: int = 0, device_buffers: str = "auto") -> ArrayBackend:
    """Create the backend ``name`` (``auto``, ``numpy`` or ``cupy``).

    ``auto`` picks CuPy only when a GPU is usable, NumPy otherwise. For CuPy,
    ``device_buffers="auto"`` means staged until CUDA-aware MPI detection proves
    direct device buffers safe.
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
        return NumpyBackend(dtype)
    mode = "staged" if device_buffers == "auto" else device_buffers
    return CupyBackend(dtype, local_rank=local_rank, device_buffers=mode)
