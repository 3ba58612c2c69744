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
                are documented as not CUDA-aware (docs/design.md section 3), so nonblocking
                collectives on device buffers are refused even when it is CUDA-aware
MVAPICH2-GDR    ``MV2_USE_CUDA=1``
others          unknown: staged
==============  ===========================================================================

The verdict (:attr:`GpuAwareness.direct_ok`) decides ``--device-buffers auto``; the whole
report goes into the trace metadata (``gpu_aware_mpi``).

The evidence is then confirmed by a smoke test (:func:`smoke_test`): a small
``Iallreduce`` of a device array whose result is compared with the expected sum.
It runs only where the evidence already allows device buffers (or where the user
forces ``--device-buffers direct``): a library that cannot read a device pointer
may crash the process, and no Python guard catches a segfault. A raised error, a
wrong result or no completion within a timeout counts as failure (staging).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, Optional

import numpy as np

#: query functions, ``int f(void)``, of MPICH and Open MPI (absent ones are skipped)
QUERY_FUNCTIONS = ("MPIX_Query_cuda_support", "MPIX_Query_hip_support", "MPIX_Query_rocm_support",
                   "MPIX_Query_ze_support")
#: environment variables that switch GPU support in some library
GPU_ENV = ("MPICH_GPU_SUPPORT_ENABLED", "MPIR_CVAR_ENABLE_GPU", "MV2_USE_CUDA", "OMPI_MCA_opal_cuda_support",
           "UCX_TLS", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


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
    #: the device-buffer smoke test (:func:`smoke_test`): None when it did not run
    smoke_test: Optional[Dict] = None

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


#: elements of the smoke-test all-reduce, and how long it may take before it counts as failed
SMOKE_ELEMENTS = 1024
SMOKE_TIMEOUT_S = 20.0


def smoke_expected(size: int, n: int = SMOKE_ELEMENTS) -> np.ndarray:
    """What the smoke test's sum must be on ``size`` ranks: rank ``r`` contributes ``arange(n) % 251 + r``
    (small integers: exact in float32, order-independent)."""
    base = (np.arange(n) % 251).astype(np.float64)
    return size * base + size * (size - 1) / 2


def smoke_test(comm, backend, timeout_s: float = SMOKE_TIMEOUT_S) -> Dict:
    """``Iallreduce`` of a small backend (device) array over ``comm``, checked against :func:`smoke_expected`.

    Collective over ``comm``; every rank returns the same verdict
    ``{"ran": True, "ok": bool (all ranks), "elements", "seconds", "detail"}``.
    The test runs on a duplicate of ``comm``: if a rank gives up after ``timeout_s`` the
    pending request and its communicator are abandoned (never freed), so they cannot
    match a later collective. The verdict is agreed on ``comm`` with host buffers.
    """
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    dup = comm.Dup()
    n = SMOKE_ELEMENTS
    ok, detail, abandoned = False, "", False
    t0 = time.perf_counter()
    try:
        host = (np.arange(n) % 251 + rank).astype(np.float32)
        xp = backend.xp
        send = xp.asarray(host)
        recv = xp.zeros(n, dtype=np.float32)
        backend.synchronize()  # MPI reads the device buffer outside any stream (stream rule 1)
        request = dup.Iallreduce(send, recv, op=MPI.SUM)
        deadline = time.perf_counter() + timeout_s
        while not request.Test():
            if time.perf_counter() > deadline:
                abandoned = True
                raise TimeoutError(f"no completion within {timeout_s:g} s")
            time.sleep(1e-4)
        got = np.asarray(backend.to_host(recv), dtype=np.float64)
        expected = smoke_expected(size, n)
        wrong = int(np.count_nonzero(got != expected))
        ok = wrong == 0
        detail = "result correct" if ok else f"{wrong} of {n} elements wrong (first got {got[0]!r}, expected {expected[0]!r})"
    except Exception as exc:  # an MPI error on a device pointer, a timeout, ...
        detail = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    seconds = time.perf_counter() - t0
    if not abandoned:
        dup.Free()
    verdicts = comm.allgather((ok, detail))
    all_ok = all(v[0] for v in verdicts)
    if not all_ok:
        bad = next(r for r, v in enumerate(verdicts) if not v[0])
        detail = f"rank {bad}: {verdicts[bad][1]}"
    return {"ran": True, "ok": all_ok, "elements": n, "seconds": round(seconds, 6), "detail": detail}
