"""Device-buffer collectives direct vs staged, at the message sizes of one training step.

``fourd-mpi bench collectives`` measures host buffers only (its ``--backend`` picks the GEMM's array
library). This measures the step's own communication path: :class:`fourd_mpi.core.collectives.Collectives`
on the backend's arrays (CuPy: device memory), with MPI given the device pointers (``direct``, a CUDA-aware
MPI) or pinned host copies (``staged``), the two modes alternating round by round in one process so that
both see the same machine state. The sizes are those of the step's collectives
(:func:`fourd_mpi.perf.volumes.step_collectives` for the model and grid given), or ``--sizes``.

    mpiexec -n 2 python bench/gpu_coll.py --backend cupy --dtype bfloat16 --hidden 4096 --heads 32 \\
        --seq 2048 --batch 16 --layers 2 --gx 2 --rounds 3 --json coll.json

A timed operation: barrier, issue (``Iallreduce`` etc.: the staged mode's device-to-host copy included),
wait (its host-to-device copy included), synchronize the device; the time is the maximum over ranks. One
line per round, mode and size is printed (flushed) as it is measured, so a crash of the direct mode (an MPI
that cannot read device pointers) leaves the staged lines of the log. The table at the end gives medians.
``--blocking`` also times the blocking ``MPI_Allreduce`` on the same buffers (Open MPI documents its
blocking collectives as CUDA-aware, its nonblocking ones not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def step_sizes(args):
    """Distinct ``(op, axis, message_bytes)`` of the step's collectives with their counts per step."""
    from fourd_mpi.core.grid import GridShape
    from fourd_mpi.perf.volumes import step_collectives
    from fourd_mpi.step.overlap import OverlapConfig
    from fourd_mpi.step.presets import resolve_model

    cfg = resolve_model(args.model, layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                        batch=args.batch)
    grid = GridShape(args.gdata, args.gz, args.gy, args.gx)
    counts = {}
    for c in step_collectives(cfg, grid, OverlapConfig.parse(args.overlap), args.dtype):
        key = (c.op, c.axis, c.message_bytes)
        counts[key] = counts.get(key, 0) + c.count
    return sorted(counts.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="cupy", choices=("cupy", "numpy"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model", default="gpt-small")
    for name, default in (("layers", 2), ("hidden", 4096), ("heads", 32), ("seq", 2048), ("batch", 16),
                          ("gdata", 1), ("gz", 1), ("gy", 1), ("gx", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--overlap", default="all", help="the step's overlap (od splits forward all-reduces in chunks)")
    p.add_argument("--sizes", default="", help="comma list of message bytes (allreduce over x) instead of the step's")
    p.add_argument("--min-bytes", type=int, default=1024, help="skip the step's messages below this (default 1024)")
    p.add_argument("--modes", default="staged,direct")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=2, help="timed operations per round, mode and size")
    p.add_argument("--blocking", action="store_true", help="also time blocking MPI_Allreduce on the same buffers")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from mpi4py import MPI

    from fourd_mpi.core.backend import make_backend, parse_dtype
    from fourd_mpi.core.collectives import Collectives
    from fourd_mpi.core.grid import GridShape, ProcessGrid
    from fourd_mpi.core.wire import wire_dtypes
    from fourd_mpi.trace.events import Tracer

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    grid = ProcessGrid(world, GridShape(args.gdata, args.gz, args.gy, args.gx))
    dtype = parse_dtype(args.dtype)
    modes = [m for m in args.modes.split(",") if m]
    backend = make_backend(args.backend, dtype, grid.local_rank, device_buffers=modes[0])
    comm = Collectives(grid, backend, tracer=Tracer(level="step"))
    if args.sizes:
        cases = [(("allreduce", "x", int(s)), 1) for s in args.sizes.split(",")]
    else:
        cases = [c for c in step_sizes(args) if c[0][2] >= args.min_bytes]
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    say(f"gpu_coll: {world.Get_size()} ranks, {MPI.Get_library_version().splitlines()[0].strip()}, "
        f"{backend.describe()}")
    say("messages (op axis bytes x count per step): " + ", ".join(f"{o} {a} {b} x{n}" for (o, a, b), n in cases))
    say(f"{'round':>5} {'mode':<8} {'op':<15} {'axis':<4} {'bytes':>12} {'seconds':>10} {'algbw GB/s':>10}")
    xp = backend.xp
    times = {}

    def timed(fn):
        world.Barrier()
        t0 = time.perf_counter()
        fn()
        backend.synchronize()
        return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    def blocking_allreduce(axis, array):
        wire = wire_dtypes(array.dtype)[1]
        a = array.astype(wire)
        mpi = grid.axis_comm(axis)
        if backend.staged:
            send, _ = backend.stage_to_host(a)
            recv = backend.staging_buffer(a.shape, wire)
            mpi.Allreduce(send, recv)
            out, _ = backend.stage_to_device(recv, a.shape)  # recv goes back to the pool there
            backend.release_staging(send)
        else:
            recv = backend.mpi_recv_buffer(a.shape, wire)
            mpi.Allreduce(backend.mpi_send_buffer(a), recv)
            out = backend.from_mpi_buffer(recv)
        return out.astype(array.dtype)

    ops = {"allreduce": lambda axis, a: comm.allreduce(axis, a).wait(),
           "allgather": lambda axis, a: comm.allgather(axis, a).wait(),
           "reduce_scatter": lambda axis, a: comm.reduce_scatter(axis, a).wait()}
    # blocking first: Open MPI's nonblocking collectives may crash on device pointers (then the log keeps the rest)
    variants = ([("allreduce(blk)", "allreduce", blocking_allreduce)] if args.blocking else []) + \
        [(op, op, ops[op]) for op in ops]
    for rnd in range(args.rounds):
        for mode in modes:
            backend.set_staged(mode == "staged")
            for label, kind, fn in variants:
                for (op, axis, nbytes), _count in cases:
                    if op != kind:
                        continue
                    p_axis = grid.size(axis)
                    n = max(nbytes // dtype.itemsize, 1)
                    if op == "allgather":  # message = the gathered buffer: a shard of n/p
                        n = max(n // p_axis, 1)
                    if op == "reduce_scatter":
                        n -= n % p_axis
                    array = xp.ones((n,), dtype=dtype)
                    fn(axis, array)  # warm-up: pool buffers, IPC handles
                    for _ in range(args.iters):
                        dt = timed(lambda: fn(axis, array))
                        times.setdefault((mode, label, axis, nbytes), []).append(dt)
                        say(f"{rnd:>5} {mode:<8} {label:<15} {axis:<4} {nbytes:>12} {dt:>10.5f} "
                            f"{nbytes / dt / 1e9:>10.3f}")
                    del array
    rows = []
    for (mode, label, axis, nbytes), ts in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][3], kv[0][0])):
        med = statistics.median(ts)
        rows.append({"mode": mode, "op": label, "axis": axis, "bytes": nbytes, "median_s": med, "n": len(ts),
                     "min_s": min(ts), "max_s": max(ts), "algbw_GBps": nbytes / med / 1e9})
    say(f"\nmedians ({args.rounds} rounds x {args.iters} per mode, alternating {'/'.join(modes)}):")
    say(f"{'op':<15} {'bytes':>12} " + " ".join(f"{m + ' s':>12} {m + ' GB/s':>12}" for m in modes)
        + ("  direct/staged" if set(modes) >= {"direct", "staged"} else ""))
    keys = sorted({(r["op"], r["axis"], r["bytes"]) for r in rows}, key=lambda k: (k[0], k[2]))
    by = {(r["mode"], r["op"], r["axis"], r["bytes"]): r for r in rows}
    for op, axis, nbytes in keys:
        cells, med = [], {}
        for m in modes:
            r = by.get((m, op, axis, nbytes))
            med[m] = r["median_s"] if r else None
            cells.append(f"{r['median_s']:>12.5f} {r['algbw_GBps']:>12.3f}" if r else f"{'-':>12} {'-':>12}")
        ratio = (f"  {med['direct'] / med['staged']:.3f}" if med.get("direct") and med.get("staged") else "")
        say(f"{op:<15} {nbytes:>12} " + " ".join(cells) + ratio)
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps({"ranks": world.Get_size(), "library": MPI.Get_library_version(),
                                               "backend": backend.describe(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
