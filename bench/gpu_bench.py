"""GPU benchmark of the CuPy path: GEMM rate in the step vs alone vs the device's peak, and
direct vs staged MPI buffers.

Needs a usable GPU (CuPy, ``cupy.cuda.is_available()``); without one it prints one line
and exits with status 2. Launch under mpiexec; ranks share the node's GPUs round-robin
(node-local rank modulo the visible devices)::

    OMP_NUM_THREADS=1 mpiexec -n 4 python bench/gpu_bench.py
    OMP_NUM_THREADS=1 mpiexec -n 4 python bench/gpu_bench.py --hidden 4096 --seq 2048 --batch 4 --json gpu.json

Measured, all GEMMs timed with CUDA events on the compute stream (never host clocks
around asynchronous kernels):

1. **GEMM rate inside a single-rank step** (rank 0 alone, grid 1x1x1x1, the other
   ranks sleep in a barrier): ``--warmup`` untimed steps, then ``--steps`` steps with
   the run's :class:`~fourd_mpi.step.kernels.ComputeCounter` on; rate = layer-GEMM FLOPs /
   event-measured GEMM seconds, for float32, float32 with TF32, and the other
   ``--dtypes``.
2. **The same GEMM shapes alone** (:func:`~fourd_mpi.step.kernels.standalone_gemm_tflops`,
   best of 5), FLOP-weighted over the step's shapes: ``in-step / alone`` is the
   efficiency of the step's GEMMs.
3. **The device's peak** from the suite's one table ``fourd_mpi/perf/peaks.py`` (dense, no sparsity; NVIDIA data
   sheets) by device name and dtype: float32 without TF32 is the CUDA-core FP32 peak,
   with TF32 the TF32 tensor-core peak; float16/bfloat16 the FP16/BF16 tensor-core peak;
   float64 the FP64 tensor-core peak. Unknown devices print "n/a".
4. **Direct vs staged MPI buffers**: median step time of the world-size run (grid
   inferred, all overlap options) with ``--device-buffers staged`` and, where the MPI
   takes device buffers (detection plus the smoke test), ``direct``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fourd_mpi.perf import peaks  # noqa: E402  (the one table of data-sheet peaks)


def peak_for(device_name: str, dtype: str, tf32: bool):
    """``(TFLOP/s, device label)`` from the suite's one peak table (:mod:`fourd_mpi.perf.peaks`), or
    ``(None, None)`` for an unknown device."""
    dev = peaks.match_device(device_name)
    value = None if dev is None else peaks.peak_tflops(dev, dtype, tf32)
    return (value, dev.title) if value is not None else (None, None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    p.add_argument("--dtypes", default="float32,tf32,float16",
                   help="comma list of float64, float32, tf32 (= float32 --tf32), float16, bfloat16")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", metavar="FILE", help="also write every number as JSON (rank 0)")
    return p


def fail(message: str) -> None:
    sys.stderr.write(f"gpu_bench: {message}\n")
    sys.exit(2)


def numerics(name: str):
    return ("float32", True) if name == "tf32" else (name, False)


def gemm_in_step(options, warmup: int, steps: int) -> Dict:
    """Single-rank step on COMM_SELF: in-step GEMM rate (CUDA events), standalone rate of the same shapes."""
    from mpi4py import MPI

    from fourd_mpi.core.grid import GridShape
    from fourd_mpi.run.build import Run
    from fourd_mpi.run.options import overlap_of
    from fourd_mpi.step.kernels import standalone_gemm_tflops

    run = Run.build(MPI.COMM_SELF, replace(options, grid=GridShape(1, 1, 1, 1), overlap=overlap_of({})),
                    count_flops=True)
    for i in range(warmup):
        run.trainer.step(i)
    run.counter.reset()
    times = [run.trainer.step(warmup + i).local_seconds for i in range(steps)]
    seconds, flops = run.counter.seconds.get("gemm", 0.0), run.counter.flops.get("gemm", 0.0)
    shapes = dict(run.counter.shapes)
    alone_weighted, weight = 0.0, 0.0
    per_shape = []
    for (m, n, k, _, _), count in sorted(shapes.items()):
        rate = standalone_gemm_tflops(run.backend, m, n, k)
        shape_flops = 2.0 * m * n * k * count
        alone_weighted += shape_flops / rate  # FLOP-weighted harmonic mean: time of the step's GEMMs alone
        weight += shape_flops
        per_shape.append({"m": m, "n": n, "k": k, "calls": count, "alone_tflops": rate})
    device = run.backend.device_name()
    run.close()
    return {"step_median_s": statistics.median(times), "gemm_tflops": flops / seconds / 1e12 if seconds else 0.0,
            "gemm_share": seconds / sum(times) if times else 0.0,
            "alone_tflops": weight / alone_weighted if alone_weighted else 0.0, "shapes": per_shape,
            "device": device}


def step_time(world, options, warmup: int, steps: int) -> Dict:
    from fourd_mpi.run.build import Run

    run = Run.build(world, options)
    for i in range(warmup):
        run.trainer.step(i)
    times = [run.trainer.step(warmup + i).seconds for i in range(steps)]
    mode = run.mpi_buffers.mode
    reason = run.mpi_buffers.reason
    run.close()
    return {"mode": mode, "reason": reason, "median_s": statistics.median(times), "min_s": min(times)}


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from fourd_mpi.core.backend import cupy_usable

    if not cupy_usable():
        fail("no usable GPU (CuPy is not installed, or cupy.cuda.is_available() is False); "
             "this benchmark measures the CuPy path only")
    from mpi4py import MPI

    from fourd_mpi.core.grid import infer_grid_shape
    from fourd_mpi.core.mpiutil import idle_barrier
    from fourd_mpi.errors import BackendError, ConfigError
    from fourd_mpi.run.options import run_options
    from fourd_mpi.step.presets import resolve_model, validate_model

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    try:
        model = resolve_model(args.model, layers=args.layers, hidden=args.hidden, heads=args.heads,
                              seq=args.seq, batch=args.batch)
        shape = infer_grid_shape(world.Get_size())
        validate_model(model, shape)
    except ConfigError as exc:
        fail(str(exc))
    names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    rows = []
    for name in names:
        dtype, tf32 = numerics(name)
        options = run_options(model=model, grid=shape, dtype=dtype, backend="cupy", tf32=tf32,
                             steps=args.steps, warmup=args.warmup)
        result = None
        if rank == 0:
            try:
                result = gemm_in_step(options, args.warmup, args.steps)
            except (BackendError, ConfigError) as exc:
                result = {"error": str(exc)}
        idle_barrier(world)
        if rank == 0:
            if "error" not in result:
                peak, label = peak_for(result["device"], dtype, tf32)
                result.update(peak_tflops=peak, peak_device=label)
            rows.append(dict(result, dtype=name))
    buffers = []
    if world.Get_size() > 1:
        base = run_options(model=model, grid=shape, dtype="float32", backend="cupy", overlap="all",
                          steps=args.steps, warmup=args.warmup)
        from fourd_mpi.core.gpuaware import detect

        verdicts = world.allgather((detect().direct_ok, detect().reason))
        for mode in ("staged", "direct"):
            if mode == "direct" and not all(ok for ok, _ in verdicts):
                # never hand a device pointer to an MPI that says it cannot read one: it may crash
                why = next(r for ok, r in verdicts if not ok)
                buffers.append({"mode": mode, "reason": f"not run: {why}", "median_s": None, "min_s": None})
                continue
            try:
                buffers.append(step_time(world, replace(base, device_buffers=mode), args.warmup, args.steps))
            except BackendError as exc:  # the smoke test failed: direct refused
                buffers.append({"mode": mode, "reason": str(exc), "median_s": None, "min_s": None})
    if rank == 0:
        report(rows, buffers, model, shape, world.Get_size(), args)
    return 0


def report(rows, buffers, model, shape, size, args) -> None:
    from mpi4py import MPI

    device = next((r["device"] for r in rows if "device" in r), "?")
    print(f"gpu_bench: {device}; {MPI.Get_library_version().splitlines()[0].strip()}; "
          f"model {model.name} (layers {model.layers}, hidden {model.hidden}, seq {model.seq}, batch {model.batch})")
    print("GEMMs of a single-rank step (CUDA events), FLOP-weighted over the step's shapes:")
    print(f"{'dtype':<9} {'step (s)':>9} {'GEMM %':>7} {'in step':>9} {'alone':>9} {'peak':>9} "
          f"{'step/alone':>10} {'step/peak':>9}   (TFLOP/s)")
    for r in rows:
        if "error" in r:
            print(f"{r['dtype']:<9} error: {r['error']}")
            continue
        peak = r["peak_tflops"]
        print(f"{r['dtype']:<9} {r['step_median_s']:>9.4f} {100 * r['gemm_share']:>6.1f}% {r['gemm_tflops']:>9.1f} "
              f"{r['alone_tflops']:>9.1f} {peak if peak else 'n/a':>9} "
              f"{r['gemm_tflops'] / r['alone_tflops'] if r['alone_tflops'] else float('nan'):>10.2f} "
              + (f"{r['gemm_tflops'] / peak:>9.2f}" if peak else f"{'n/a':>9}"))
    if rows and rows[0].get("peak_device"):
        print(f"peak: {rows[0]['peak_device']} data sheet, dense (no sparsity)")
    if buffers:
        print(f"MPI buffers, {size} ranks on grid {shape}, float32, overlap all (median step time over "
              f"{args.steps} steps):")
        for b in buffers:
            t = f"{b['median_s']:.4f} s" if b["median_s"] is not None else "not run"
            print(f"  {b['mode']:<7} {t:>10}  ({b['reason']})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": device, "gemm": rows, "buffers": buffers, "model": model.as_dict(),
                       "grid": str(shape), "world_size": size}, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
