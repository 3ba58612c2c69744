"""Can this MPI library take GPU buffers in the nonblocking collectives the step uses?

Detection never hands MPI a device pointer (a library that cannot read one may crash
the process): it reads the library's identity (``MPI_Get_library_version``), calls the
library's own query functions where it has them (found with ``ctypes`` in the loaded
``libmpi``), and reads the environment variables that switch GPU support on:

==============  ===========================================================================
library         evidence
==============  ===========================================================================
Cray MPICH      ``MPICH_GPU_SUPPORT_ENABLED=1`` (and the GTL library linked, which we cannot
                see); without it device buffers crash or corrupt
MPICH           ``MPIX_Query_cuda_support()`` (``MPIX_GPU_query_support``; 0 when built
                without CUDA or with ``MPIR_CVAR_ENABLE_GPU=0``)
Open MPI        ``MPIX_Query_cuda_support()``; but its ``MPI_Iallgather`` / ``MPI_Iallreduce``
                are documented as not CUDA-aware (DESIGN.md section 3), so nonblocking
                collectives on device buffers are refused even when it is CUDA-aware
MVAPICH2-GDR    ``MV2_USE_CUDA=1``
others          unknown: staged
==============  ===========================================================================

The verdict (:attr:`GpuAwareness.direct_ok`) decides ``--device-buffers auto``; the whole
report goes into the trace metadata (``gpu_aware_mpi``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, Optional

#: query functions, ``int f(void)``, of MPICH and Open MPI (absent ones are skipped)
QUERY_FUNCTIONS = ("MPIX_Query_cuda_support", "MPIX_Query_hip_support", "MPIX_Query_rocm_support",
                   "MPIX_Query_ze_support")
#: environment variables that switch GPU support in some library
GPU_ENV = ("MPICH_GPU_SUPPORT_ENABLED", "MPIR_CVAR_ENABLE_GPU", "MV2_USE_CUDA", "OMPI_MCA_opal_cuda_support",
           "UCX_TLS", "CUDA_VISIBLE_DEVICES")


@dataclass
class GpuAwareness:
    """What we know about device buffers and this MPI (one rank's view)."""

    library: str
    version: str
    libmpi: Optional[str]
    queries: Dict[str, bool] = field(default_factory=dict)
    env: Dict[str, str] = field(default_factory=dict)
    #: True: CUDA device buffers are accepted; False: they are not; None: unknown
    cuda_aware: Optional[bool] = None
    #: nonblocking collectives (Iallgather, Ireduce_scatter_block, Iallreduce) on device buffers are safe
    direct_ok: bool = False
    reason: str = ""

    def as_dict(self) -> Dict:
        return asdict(self)


def library_family(version_text: str) -> str:
    """``MPI_Get_library_version`` text -> "Cray MPICH", "MPICH", "Open MPI", "MVAPICH", "Intel MPI" or "unknown"."""
    text = version_text.lower()
    if "cray" in text and "mpich" in text:
        return "Cray MPICH"
    if "mvapich" in text:
        return "MVAPICH"
    if "intel(r) mpi" in text or "intel mpi" in text:
        return "Intel MPI"
    if "open mpi" in text:
        return "Open MPI"
    if "mpich" in text:
        return "MPICH"
    return "unknown"


def loaded_libmpi() -> Optional[str]:
    """Path of the ``libmpi`` this process has loaded (``/proc/self/maps``), else the linker's guess."""
    try:
        with open("/proc/self/maps") as fh:
            paths = sorted({line.split()[-1] for line in fh
                            if "/libmpi" in line and ".so" in line and "libmpi_" not in line})
    except OSError:
        paths = []
    if paths:
        return paths[0]
    return ctypes.util.find_library("mpi")


def run_queries(libmpi: Optional[str]) -> Dict[str, bool]:
    """Call every :data:`QUERY_FUNCTIONS` the library exports (MPI must be initialized)."""
    if not libmpi:
        return {}
    try:
        lib = ctypes.CDLL(libmpi)
    except OSError:
        return {}
    results = {}
    for name in QUERY_FUNCTIONS:
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        fn.argtypes, fn.restype = [], ctypes.c_int
        results[name] = bool(fn())
    return results


def decide(library: str, queries: Dict[str, bool], env: Dict[str, str]):
    """``(cuda_aware, direct_ok, reason)`` from the evidence (pure: the tests feed it cases)."""
    cuda = queries.get("MPIX_Query_cuda_support")
    if library == "Cray MPICH":
        if env.get("MPICH_GPU_SUPPORT_ENABLED") == "1":
            return True, True, "Cray MPICH with MPICH_GPU_SUPPORT_ENABLED=1"
        return False, False, "Cray MPICH without MPICH_GPU_SUPPORT_ENABLED=1 (set it, and load the GTL library)"
    if library == "Open MPI":
        if cuda:
            return True, False, ("Open MPI is CUDA-aware, but documents MPI_Iallgather/MPI_Iallreduce on device "
                                 "buffers as unsupported: staging through host memory")
        if cuda is None:
            return None, False, "Open MPI without the CUDA extension (no MPIX_Query_cuda_support)"
        return False, False, "Open MPI reports no CUDA support (MPIX_Query_cuda_support() = 0)"
    if library == "MVAPICH":
        if env.get("MV2_USE_CUDA") == "1":
            return True, True, "MVAPICH with MV2_USE_CUDA=1"
        return None, False, "MVAPICH without MV2_USE_CUDA=1"
    if library == "MPICH" and cuda is not None:
        if cuda:
            return True, True, "MPICH reports CUDA support (MPIX_Query_cuda_support() = 1)"
        disabled = env.get("MPIR_CVAR_ENABLE_GPU") == "0"
        return False, False, ("MPICH GPU support disabled by MPIR_CVAR_ENABLE_GPU=0" if disabled
                              else "MPICH built without CUDA (MPIX_Query_cuda_support() = 0)")
    return None, False, f"no way to ask {library} about device buffers: staging through host memory"


def detect() -> GpuAwareness:
    """This rank's view (local, no communication, no device pointer). MPI must be initialized."""
    from mpi4py import MPI

    version = MPI.Get_library_version().strip()
    library = library_family(version)
    libmpi = loaded_libmpi()
    queries = run_queries(libmpi)
    env = {k: os.environ[k] for k in GPU_ENV if k in os.environ}
    cuda, direct, reason = decide(library, queries, env)
    return GpuAwareness(library=library, version=version.splitlines()[0].strip() if version else "",
                        libmpi=libmpi, queries=queries, env=env, cuda_aware=cuda, direct_ok=direct, reason=reason)
