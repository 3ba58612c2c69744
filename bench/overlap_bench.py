"""Overlap benchmark: how much communication does each overlap option hide?

For each configuration (one communication-heavy, one compute-heavy by default),
all in one ``mpiexec`` run, this measures:

* ``compute``: the step with every collective replaced by a local stand-in of
  the right shape (``Run.build(skip_communication=True)``): compute alone.
* ``comm``: the collectives of one blocking step (its records, in program
  order) replayed back to back with no compute: communication alone.
* the step with overlap ``none`` (blocking), each option alone (oag, ors, oar,
  dp, od), and ``all``, each under the ``poll`` and ``none`` progress strategies
  (``--with-thread`` adds ``thread``).

Columns: median step time (max over ranks per step, median over steps);
``vs none`` = blocking step time / this step time (speedup); ``/max`` = step
time / max(compute, comm) (1.0 is perfect overlap; target <= 1.15 with all
overlaps and polling); ``exposed`` = median over steps of this rank's time
blocked in Wait, max over ranks; ``overlap%`` by the OSU formula
``max(0, 100 - 100*(overall - compute)/pure_comm)`` per rank, averaged over
ranks (overall = this rank's step, compute and pure_comm = this rank's compute
alone and communication alone). ``comm share`` = comm / blocking step.

Launch with one BLAS thread per rank (8 ranks share 2 cores here)::

    OMP_NUM_THREADS=1 mpiexec -n 8 python bench/overlap_bench.py [--steps 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpi4py import MPI  # noqa: E402

from fourd_mpi.runtime import Run, resolve  # noqa: E402

#: name -> (preset, grid sizes, model overrides, what it stresses)
CONFIGS = {
    "comm-heavy": ("mlp", dict(data=1, z=2, y=2, x=2), dict(layers=2, hidden=1024, ffn_hidden=4096, seq=16, batch=8),
                   "few tokens, large weights: all-gathers and reduce-scatters dominate"),
    "compute-heavy": ("gpt-small", dict(data=2, z=2, y=1, x=2), dict(layers=2, seq=256, batch=8),
                      "many tokens: GEMMs and attention dominate"),
}
VARIANTS = ["none", "oag", "ors", "oar", "dp", "od", "all"]


def median(values):
    return statistics.median(values) if values else float("nan")


def measure_steps(run: Run, steps: int, warmup: int):
    """(median of max-over-ranks step time, this rank's median local time, this rank's median blocked time)."""
    slow, local, blocked = [], [], []
    for i in range(warmup + steps):
        result = run.trainer.step(i)
        if i >= warmup:
            slow.append(result.seconds)
            local.append(result.local_seconds)
            blocked.append(sum(r.wait_ns for r in run.comm.records) * 1e-9)
    return median(slow), median(local), median(blocked)


def bench_config(world, name: str, args) -> list:
    preset, grid, sizes, _ = CONFIGS[name]
    base = resolve(world.Get_size(), preset, grid, sizes, dtype=args.dtype, backend="numpy",
                   optimizer="sgd", poll_flops=args.poll_flops)
    rows = []

    # compute alone
    run = Run.build(world, base, skip_communication=True)
    compute_slow, compute_local, _ = measure_steps(run, args.steps, args.warmup)
    run.close()

    # communication alone: replay one blocking step's collectives
    run = Run.build(world, replace(base, overlap="none", progress="none"))
    measure_steps(run, 1, args.warmup)
    records = list(run.comm.records)
    comm_local = []
    for _ in range(args.steps):
        world.Barrier()
        comm_local.append(run.comm.replay(records))
    comm_local = median(comm_local)
    comm_slow = world.allreduce(comm_local, op=MPI.MAX)
    run.close()

    progresses = ["poll", "none"] + (["thread"] if args.with_thread else [])
    blocking = None
    for variant in VARIANTS:
        for progress in progresses if variant != "none" else ["none"]:
            options = replace(base, overlap=variant, progress=progress, chunks=args.chunks)
            run = Run.build(world, options)
            step_slow, step_local, blocked = measure_steps(run, args.steps, args.warmup)
            run.close()
            osu = max(0.0, 100.0 - 100.0 * (step_local - compute_local) / comm_local) if comm_local > 0 else 0.0
            osu = world.allreduce(osu, op=MPI.SUM) / world.Get_size()
            blocked = world.allreduce(blocked, op=MPI.MAX)
            if variant == "none":
                blocking = step_slow
            rows.append(dict(config=name, overlap=variant, progress=progress, step=step_slow,
                             speedup=blocking / step_slow, vs_max=step_slow / max(compute_slow, comm_slow),
                             exposed=blocked, osu=osu, compute=compute_slow, comm=comm_slow,
                             comm_share=comm_slow / blocking))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--poll-flops", type=float, default=1e7)
    ap.add_argument("--with-thread", action="store_true", help="also the thread progress strategy")
    ap.add_argument("--json", help="write all rows as JSON (rank 0)")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    root = world.Get_rank() == 0
    if root:
        print(f"# overlap_bench: {world.Get_size()} ranks, MPI {MPI.Get_library_version().splitlines()[0].strip()}, "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {args.dtype}, "
              f"{args.steps} steps after {args.warmup} warm-up, poll every {args.poll_flops:.3g} GEMM FLOPs")
        for name in args.configs.split(","):
            preset, grid, sizes, why = CONFIGS[name]
            print(f"# {name}: {preset} {sizes} on grid data={grid['data']} z={grid['z']} y={grid['y']} "
                  f"x={grid['x']} ({why})")
    all_rows = []
    for name in args.configs.split(","):
        all_rows += bench_config(world, name, args)
    if root:
        header = (f"{'config':<14} {'overlap':<7} {'progress':<8} {'step ms':>8} {'vs none':>7} {'/max':>6} "
                  f"{'exposed ms':>10} {'overlap%':>8} {'compute ms':>10} {'comm ms':>8} {'comm share':>10}")
        print(header)
        print("-" * len(header))
        for r in all_rows:
            print(f"{r['config']:<14} {r['overlap']:<7} {r['progress']:<8} {r['step'] * 1e3:>8.1f} "
                  f"{r['speedup']:>7.2f} {r['vs_max']:>6.2f} {r['exposed'] * 1e3:>10.1f} {r['osu']:>8.1f} "
                  f"{r['compute'] * 1e3:>10.1f} {r['comm'] * 1e3:>8.1f} {r['comm_share'] * 100:>9.0f}%")
        print("step: median over steps of the slowest rank; vs none: blocking step / this step; "
              "/max: step / max(compute alone, comm alone); overlap%: OSU formula, mean over ranks")
        if args.json:
            Path(args.json).write_text(json.dumps(all_rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
