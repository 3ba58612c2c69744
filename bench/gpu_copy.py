"""Standalone host<->device copy bandwidth on one GPU: the reference for the staged path's copies.

What the staged MPI path does for every message (``fourd_mpi/core/backend.py``): a copy between a
device array and a pinned host buffer on a separate non-blocking copy stream. This bench times the
same copy alone, nothing else running: ``GB/s = bytes / (CUDA-event time of one copy)``, best and
median of ``--repeats`` copies after ``--warmup``, for each size of ``--sizes`` and each direction
(``d2h``: device to pinned host, ``h2d``: pinned host to device; ``pageable`` rows: the same copy from
ordinary host memory, what staging without a pinned pool would get).

Compare with the copies inside a step: ``fourd-mpi analyze TRACE --what comm`` (rows ``d2h``/``h2d``,
``algbw_gbps`` = bytes / in-flight time of the copy, median over the measured steps)::

    python bench/gpu_copy.py --sizes 1MiB,16MiB,64MiB,256MiB [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fourd_mpi.util.values import byte_size  # noqa: E402  (the suite's size parser: 4MiB, 1GB, ...)


def time_copy(cupy, nbytes: int, direction: str, pinned: bool, repeats: int, warmup: int):
    """Seconds of each of ``repeats`` copies of ``nbytes`` (CUDA events on a non-blocking stream)."""
    import numpy as np

    stream = cupy.cuda.Stream(non_blocking=True)
    device = cupy.empty(nbytes, dtype=cupy.uint8)
    if pinned:
        mem = cupy.cuda.alloc_pinned_memory(nbytes)
        host = np.frombuffer(mem, dtype=np.uint8, count=nbytes)
    else:
        host = np.empty(nbytes, dtype=np.uint8)
    host[:] = 1
    times = []
    for i in range(warmup + repeats):
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        begin.record(stream)
        if direction == "d2h":
            device.get(stream=stream, out=host)
        else:
            device.set(host, stream=stream)
        end.record(stream)
        end.synchronize()
        if i >= warmup:
            times.append(cupy.cuda.get_elapsed_time(begin, end) * 1e-3)
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=lambda text: [byte_size(t) for t in text.split(",")],
                   default="1MiB,16MiB,64MiB,256MiB", help="comma list of copy sizes (KiB/MiB/GiB, KB/MB/GB)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", metavar="FILE", help="also write every number as JSON")
    args = p.parse_args(argv)
    try:
        import cupy

        if not cupy.cuda.is_available():
            raise ImportError("cupy.cuda.is_available() is False")
    except ImportError as exc:
        print(f"gpu_copy: no usable GPU ({exc})", file=sys.stderr)
        return 2
    rows = []
    print(f"{'bytes':>12} {'direction':<9} {'host memory':<11} {'best GB/s':>10} {'median GB/s':>12}")
    for size in args.sizes:
        for direction in ("d2h", "h2d"):
            for pinned in (True, False):
                times = time_copy(cupy, size, direction, pinned, args.repeats, args.warmup)
                best, median = size / min(times) / 1e9, size / statistics.median(times) / 1e9
                rows.append({"bytes": size, "direction": direction, "pinned": pinned, "best_gbps": best,
                             "median_gbps": median, "seconds": times})
                print(f"{size:>12} {direction:<9} {'pinned' if pinned else 'pageable':<11} {best:>10.2f} "
                      f"{median:>12.2f}")
    print("GB/s = bytes / CUDA-event time of one copy on a non-blocking stream (1 GB = 1e9 bytes)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "rows": rows}, fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
