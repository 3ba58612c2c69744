"""Array backends without a GPU: selection, dtypes, MPI buffer bookkeeping."""

import numpy as np
import pytest

from fourd_mpi.core.backend import NumpyBackend, cupy_usable, make_backend, parse_dtype
from fourd_mpi.errors import BackendError, ConfigError


def test_auto_picks_numpy_without_a_gpu():
    backend = make_backend("auto", np.float32)
    assert backend.name == ("cupy" if cupy_usable() else "numpy")


def test_numpy_backend_round_trip_and_buffers():
    b = NumpyBackend(np.float64)
    a = b.asarray(np.arange(6, dtype=np.int64).reshape(2, 3))
    assert a.dtype == np.float64 and a.flags.c_contiguous
    send = b.mpi_send_buffer(a.T)  # non-contiguous input is made contiguous for MPI
    assert send.flags.c_contiguous and np.array_equal(send, a.T)
    recv = b.mpi_recv_buffer((3, 2))
    assert recv.shape == (3, 2) and recv.dtype == np.float64
    assert b.from_mpi_buffer(recv) is recv
    assert np.array_equal(b.to_host(a), a)
    assert "float64" in b.describe()


def test_bad_names_are_config_errors():
    with pytest.raises(ConfigError, match="unknown backend 'tpu'"):
        make_backend("tpu", np.float32)
    with pytest.raises(ConfigError, match="unknown dtype 'float8'"):
        parse_dtype("float8")
    with pytest.raises(ConfigError, match="device-buffer mode"):
        make_backend("numpy", np.float32, device_buffers="zero-copy")


@pytest.mark.skipif(cupy_usable(), reason="a GPU is usable here")
def test_cupy_without_gpu_is_a_clear_error():
    with pytest.raises(BackendError, match="cupy"):
        make_backend("cupy", np.float32)


@pytest.mark.skipif(not cupy_usable(), reason="no usable GPU (cupy.cuda.is_available() is False)")
@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_cupy_buffers(mode):
    import cupy

    b = make_backend("cupy", np.float32, device_buffers=mode)
    x = b.asarray(np.arange(4))
    send = b.mpi_send_buffer(x)
    assert isinstance(send, cupy.ndarray if mode == "direct" else np.ndarray)
    recv = b.mpi_recv_buffer((4,))
    recv[...] = send if mode == "staged" else recv
    assert isinstance(b.from_mpi_buffer(recv), cupy.ndarray)
