"""What a CUDA-aware MPI between ranks on one machine needs from the GPU and the OS, probed without MPI's help.

A CUDA-aware MPI moves device buffers between ranks of one node by CUDA IPC (Open MPI's ``smcuda`` BTL,
MPICH's ``MPIDI_GPU`` IPC path): one process exports a device allocation (``cudaIpcGetMemHandle``), the
other maps it (``cudaIpcOpenMemHandle``) and copies device to device. Where IPC is missing it stages
through host memory, which it pins with ``cuMemHostRegister`` (Open MPI's "cuMemHostRegister during init
failed" message). This probe checks each piece on 2 ranks (MPI carries only host bytes: the IPC handle and
the timings) and prints one line per check, flushed, so a crash leaves the lines before it:

- ``host register``: ``cudaHostRegister`` of a page-aligned 128 MiB host array (Open MPI's size);
- ``pinned copy``: device-to-host and host-to-device GB/s of ``--bytes`` through ``cudaHostAlloc`` memory;
- ``ipc open``: rank 1 maps rank 0's allocation and reads a known pattern back (sum compared);
- ``ipc copy``: rank 1 copies ``--bytes`` from the mapped allocation into its own (GB/s, median of 5);
- ``host mpi``: ``MPI_Allreduce`` of ``--bytes`` of float32 host memory (GB/s of payload, median of 5),
  the path every staged collective takes.

    mpiexec -n 2 python bench/gpu_ipc_probe.py --bytes 268435456

GB/s = bytes / seconds / 1e9 (one direction, payload bytes; a copy's time is between device syncs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def say(rank: int, text: str) -> None:
    print(f"ipc-probe rank {rank}: {text}", flush=True)


def timed(fn, sync, repeats: int = 5) -> float:
    """Median seconds of ``fn()`` between device syncs, after one untimed call."""
    fn()
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", type=int, default=256 << 20, help="message bytes of the copies (default 256 MiB)")
    args = p.parse_args(argv)
    import cupy
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    rt = cupy.cuda.runtime
    cupy.cuda.Device(0).use()
    sync = cupy.cuda.Device().synchronize
    n = args.bytes
    say(rank, f"{size} ranks, GPU {rt.getDeviceProperties(0)['name'].decode()}, CUDA runtime "
              f"{rt.runtimeGetVersion()}, {MPI.Get_library_version().splitlines()[0].strip()}")

    # host register (what Open MPI's smcuda does to its shared-memory segment)
    reg = 128 << 20
    raw = np.empty(reg + 4096, dtype=np.uint8)
    off = (-raw.ctypes.data) % 4096
    host = raw[off:off + reg]
    try:
        rt.hostRegister(host.ctypes.data, reg, 0)
        rt.hostUnregister(host.ctypes.data)
        say(rank, "host register: ok (cudaHostRegister of 128 MiB page-aligned malloc memory)")
    except Exception as exc:  # the probe reports what failed and goes on
        say(rank, f"host register: FAILED ({type(exc).__name__}: {exc})")

    # its own cudaMalloc (not a slice of CuPy's pool): the IPC handle names the allocation's base
    base = cupy.cuda.Memory(n)
    dev = cupy.ndarray((n // 4,), dtype=cupy.float32, memptr=cupy.cuda.MemoryPointer(base, 0))
    dev[...] = cupy.arange(n // 4, dtype=cupy.float32)
    pinned = cupy.cuda.alloc_pinned_memory(n)
    hview = np.frombuffer(pinned, dtype=np.float32, count=n // 4)
    d2h = timed(lambda: dev.get(out=hview), sync)
    h2d = timed(lambda: dev.set(hview), sync)
    say(rank, f"pinned copy: device->host {n / d2h / 1e9:.1f} GB/s, host->device {n / h2d / 1e9:.1f} GB/s "
              f"({n} bytes, cudaHostAlloc memory, median of 5)")

    # CUDA IPC between rank 0 and rank 1
    handle, expect = None, float(dev.astype(cupy.float64).sum())  # rank 0's sum is the one rank 1 must read
    if rank == 0:
        try:
            handle = bytes(rt.ipcGetMemHandle(dev.data.ptr))
        except Exception as exc:
            say(rank, f"ipc export: FAILED ({type(exc).__name__}: {exc})")
    handle, expect = comm.bcast((handle, expect), root=0)
    if rank == 1 and handle is not None:
        try:
            ptr = rt.ipcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess)
            mem = cupy.cuda.UnownedMemory(ptr, n, owner=None)
            peer = cupy.ndarray((n // 4,), dtype=cupy.float32, memptr=cupy.cuda.MemoryPointer(mem, 0))
            got = float(peer.astype(cupy.float64).sum())
            say(rank, f"ipc open: ok, read back sum {got:.6e} (expected {expect:.6e}: "
                      f"{'match' if got == expect else 'MISMATCH'})")
            mine = cupy.empty_like(peer)
            t = timed(lambda: cupy.copyto(mine, peer), sync)
            say(rank, f"ipc copy: {n / t / 1e9:.1f} GB/s device-to-device from rank 0's memory "
                      f"({n} bytes, median of 5)")
            del peer, mine
            rt.ipcCloseMemHandle(ptr)
        except Exception as exc:
            say(rank, f"ipc open: FAILED ({type(exc).__name__}: {exc})")
    comm.Barrier()

    # host MPI all-reduce: the path of every staged collective
    a = np.ones(n // 4, dtype=np.float32)
    b = np.empty_like(a)
    out = []
    for _ in range(6):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(a, b, op=MPI.SUM)
        out.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    t = statistics.median(out[1:])
    if rank == 0:
        say(rank, f"host mpi: MPI_Allreduce of {n} bytes float32 host memory, {n / t / 1e9:.2f} GB/s "
                  f"(median of 5, max over ranks, {t:.4f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
