"""Host overhead per op: how much Python and bookkeeping a step costs, with the math made negligible.

On a model so small that its GEMMs, elementwise work and messages take microseconds
(``gpt-tiny``: h = 64, 16 tokens per sequence), a step's time is the harness and the
MPI calls themselves. This runs ``--steps`` steps (after ``--warmup``) on every grid
given and prints, per grid:

    grid  step (us)  ops/step  us/op

``step``: median over steps of the max over ranks of the step's wall time;
``ops/step``: trace events of one step on rank 0 at trace level ``op`` (every GEMM,
elementwise op, collective, wait and layer span: the units of work the harness
dispatches); ``us/op = step / ops``. It uses only ``Run.build`` and ``trainer.step``,
so the same file measures an older checkout side by side (``PYTHONPATH=<checkout>``)::

    OMP_NUM_THREADS=1 mpiexec -n 8 python -m bench.host_overhead --grids 1x2x2x2,2x1x2x2
"""

from __future__ import annotations

import argparse
import statistics
import sys

from mpi4py import MPI

from fourd_mpi.core.grid import GridShape
from fourd_mpi.run.build import Run
from fourd_mpi.run.options import run_options
from fourd_mpi.step.presets import resolve_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grids", default="1x2x2x2", help="comma list of DxZxYxX (default 1x2x2x2)")
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--overlap", default="none")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    cfg = resolve_model(args.model)
    if world.Get_rank() == 0:
        print(f"# host overhead per op: {args.model}, {world.Get_size()} ranks, overlap {args.overlap}, "
              f"median of {args.steps} steps after {args.warmup}")
        print("# step = max over ranks of the step's wall time; ops = rank 0's trace events per step (level op); "
              "us/op = step / ops")
        print(f"{'grid':<10} {'step (us)':>10} {'ops/step':>9} {'us/op':>7}")
    for text in args.grids.split(","):
        shape = GridShape.parse(text)
        options = run_options(model=cfg, grid=shape, overlap=args.overlap, steps=args.steps + args.warmup,
                             backend="numpy")
        run = Run.build(world, options, trace_level="op")
        times, ops = [], []
        for i in range(args.warmup + args.steps):
            result = run.trainer.step(i)
            if i >= args.warmup:
                times.append(result.seconds)
                ops.append(len(result.events))
        run.close()
        if world.Get_rank() == 0:
            step_us, n = statistics.median(times) * 1e6, statistics.median(ops)
            print(f"{text:<10} {step_us:10.0f} {n:9.0f} {step_us / n:7.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
