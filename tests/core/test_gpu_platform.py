"""The GPU runtime and visible devices that ``info`` and the run header report.

CuPy's ROCm build answers ``cupy.cuda.runtime.is_hip`` and a HIP_VERSION from ``runtimeGetVersion()``;
the CUDA build a CUDA version. These are the numbers the runtimes themselves return (no GPU here: the
CuPy path is exercised on a GPU machine by tests/core/test_gpu.py; see docs/sites.md for what was not run on ROCm).
"""

import pytest

from fourd_mpi.core.backend import VISIBLE_DEVICE_VARIABLES, gpu_platform, select_device, visible_devices
from fourd_mpi.core.gpuaware import GPU_ENV
from fourd_mpi.errors import BackendError


@pytest.mark.parametrize("is_hip, version, text", [
    (False, 12040, "CUDA 12.4"), (False, 13000, "CUDA 13.0"), (False, 11080, "CUDA 11.8"),
    (True, 70_051_831, "HIP 7.0"),   # ROCm 7.0.2's HIP_VERSION 7.0.51831
    (True, 60_032_830, "HIP 6.0"), (True, 60_342_131, "HIP 6.3"),
])
def test_gpu_platform_names_the_runtime_and_its_version(is_hip, version, text):
    assert gpu_platform(is_hip, version) == text


def test_visible_devices_lists_cuda_and_rocm_variables_in_a_fixed_order():
    env = {"ROCR_VISIBLE_DEVICES": "3", "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert visible_devices(env) == "CUDA_VISIBLE_DEVICES=0,1, ROCR_VISIBLE_DEVICES=3"
    assert visible_devices({"PATH": "/bin"}) == ""
    assert set(VISIBLE_DEVICE_VARIABLES) <= set(GPU_ENV)  # recorded with the GPU-aware MPI evidence


def test_no_visible_gpu_names_the_rocm_variables_too():
    with pytest.raises(BackendError, match="ROCR_VISIBLE_DEVICES"):
        select_device(0, 0)
