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

A quick look: ``--configs comm-heavy --steps 2 --warmup 1 --probe-mib 1 --overlaps none,all``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpi4py import MPI  # noqa: E402

from fourd_mpi.run.build import Run
from fourd_mpi.run.options import overlap_of, resolve  # noqa: E402

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


def replay(comm, records) -> float:
    """Run the given collectives again on ``comm`` (a :class:`~fourd_mpi.core.collectives.Collectives`), each
    waited at once, without compute; returns seconds.

    For "communication alone": pass the records of a step run without overlap (their order is the
    program order, the same on every rank; the records of an overlapped step interleave communicators in a
    rank-dependent order and could deadlock here). Collective over the grid.
    """
    zeros, size = comm.backend.zeros, comm.grid.size
    ops = {"allgather": lambda a, n: comm.allgather(a, zeros((n // size(a),))),
           "reduce_scatter": lambda a, n: comm.reduce_scatter(a, zeros((n,))),
           "allreduce": lambda a, n: comm.allreduce(a, zeros((n,)))}
    itemsize = comm.backend.dtype.itemsize
    t0 = time.perf_counter()
    for rec in records:
        ops[rec.op](rec.axis, rec.nbytes // itemsize).wait()
    return time.perf_counter() - t0


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
    run = Run.build(world, replace(base, overlap=overlap_of({}), progress="none"))
    measure_steps(run, 1, args.warmup)
    records = list(run.comm.records)
    comm_local = []
    for _ in range(args.steps):
        world.Barrier()
        comm_local.append(replay(run.comm, records))
    comm_local = median(comm_local)
    comm_slow = world.allreduce(comm_local, op=MPI.MAX)
    run.close()

    progresses = ["poll", "none"] + (["thread"] if args.with_thread else [])
    blocking = None
    for variant in ["none"] + [v for v in args.overlaps.split(",") if v and v != "none"]:
        for progress in progresses if variant != "none" else ["none"]:
            options = replace(base, overlap=overlap_of({"overlap": variant, "chunks": args.chunks}), progress=progress)
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


def progress_probe(world, sizes_mib, repeats: int, poll_flops: float):
    """OSU-style check of MPI progress alone: one ``Iallreduce`` over the world
    against a calibrated GEMM phase of about the same length, with and without polls.

    Per size: pure comm (Iallreduce + Wait), pure compute, then issue -> compute ->
    Wait under ``none`` and ``poll``. Returns rows with the wait time after the
    compute and the overlap % by OSU (mean over ranks) and IMB-NBC (slowest rank).
    """
    import numpy as np

    from fourd_mpi.core.backend import NumpyBackend
    from fourd_mpi.core.collectives import Collectives
    from fourd_mpi.core.grid import GridShape, ProcessGrid
    from fourd_mpi.core.progress import make_progress
    from fourd_mpi.step import kernels
    from fourd_mpi.trace.events import Tracer

    grid = ProcessGrid(world, GridShape(world.Get_size(), 1, 1, 1))
    backend = NumpyBackend(np.float32)
    a = np.random.default_rng(world.Get_rank()).random((512, 512), dtype=np.float32)
    rows = []

    def timed(fn):
        out = []
        for _ in range(repeats):
            world.Barrier()
            t0 = time.perf_counter()
            extra = fn()
            out.append((time.perf_counter() - t0, extra))
        out.sort(key=lambda x: x[0])
        return out[len(out) // 2]

    for mib in sizes_mib:
        buf = np.ones(int(mib * 2**20) // 4, dtype=np.float32)
        comm = Collectives(grid, backend, progress=make_progress("none"), tracer=Tracer(level="step"))
        t_pure, _ = timed(lambda: comm.allreduce("data", buf).wait())
        reps = 4

        def compute(hook):
            for _ in range(reps):
                kernels.matmul(a, a, progress=hook)
                if hook is not None:
                    hook()

        # calibrate as OSU does: the compute phase lasts about as long as the pure collective
        t_probe, _ = timed(lambda: compute(None))
        reps = max(1, int(round(reps * world.allreduce(t_pure, op=MPI.MAX) / world.allreduce(t_probe, op=MPI.MAX))))
        t_cpu, _ = timed(lambda: compute(None))
        for strategy in ("none", "poll"):
            comm = Collectives(grid, backend, progress=make_progress(strategy, poll_flops), tracer=Tracer(level="step"))

            def overlapped():
                handle = comm.allreduce("data", buf)
                compute(comm.compute_hook)
                t0 = time.perf_counter()
                handle.wait()
                return time.perf_counter() - t0

            t_ovrl, t_wait = timed(overlapped)
            osu = max(0.0, 100.0 - 100.0 * (t_ovrl - t_cpu) / t_pure)
            imb_local = 100.0 * max(0.0, min(1.0, (t_pure + t_cpu - t_ovrl) / max(t_pure, t_cpu)))
            rows.append(dict(mib=mib, progress=strategy, pure=world.allreduce(t_pure, op=MPI.MAX),
                             cpu=world.allreduce(t_cpu, op=MPI.MAX), total=world.allreduce(t_ovrl, op=MPI.MAX),
                             wait=world.allreduce(t_wait, op=MPI.MAX),
                             osu=world.allreduce(osu, op=MPI.SUM) / world.Get_size(),
                             imb=world.allreduce(imb_local, op=MPI.MIN)))
    grid.free()
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
    ap.add_argument("--probe-mib", default="1,4,16,64",
                    help="message sizes (MiB) of the progress probe; empty to skip it")
    ap.add_argument("--overlaps", default=",".join(VARIANTS),
                    help=f"comma list of the overlap options measured, of {', '.join(VARIANTS)} (default all; none, "
                         f"the blocking step every ratio is against, is always measured)")
    ap.add_argument("--json", help="write all rows as JSON (rank 0)")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    root = world.Get_rank() == 0
    configs = [c for c in args.configs.split(",") if c]
    bad = [v for v in args.overlaps.split(",") if v and v not in VARIANTS]
    if bad:  # same check on every rank, before any collective
        print(f"overlap_bench.py: error: unknown overlap option(s) {', '.join(bad)}: choose from {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:  # same check on every rank, before any collective
        print(f"overlap_bench.py: error: unknown config(s) {', '.join(unknown)}: choose from {', '.join(CONFIGS)}",
              file=sys.stderr)
        return 2
    if root:
        print(f"# overlap_bench: {world.Get_size()} ranks, MPI {MPI.Get_library_version().splitlines()[0].strip()}, "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {args.dtype}, "
              f"{args.steps} steps after {args.warmup} warm-up, poll every {args.poll_flops:.3g} GEMM FLOPs")
        for name in configs:
            preset, grid, sizes, why = CONFIGS[name]
            print(f"# {name}: {preset} {sizes} on grid data={grid['data']} z={grid['z']} y={grid['y']} "
                  f"x={grid['x']} ({why})")
    probe = []
    if args.probe_mib:
        probe = progress_probe(world, [float(x) for x in args.probe_mib.split(",")], args.steps, args.poll_flops)
    if root and probe:
        print("progress probe: Iallreduce over all ranks, then a GEMM phase calibrated to the pure "
              "collective's time, then Wait (median of repeats; times are the slowest rank's)")
        print(f"{'MiB':>6} {'progress':<8} {'pure ms':>8} {'compute ms':>10} {'total ms':>9} {'wait ms':>8} "
              f"{'OSU %':>6} {'IMB-NBC %':>9}")
        for r in probe:
            print(f"{r['mib']:>6g} {r['progress']:<8} {r['pure'] * 1e3:>8.2f} {r['cpu'] * 1e3:>10.2f} "
                  f"{r['total'] * 1e3:>9.2f} {r['wait'] * 1e3:>8.2f} {r['osu']:>6.1f} {r['imb']:>9.1f}")
        print("OSU %: max(0, 100 - 100*(total - compute)/pure), mean over ranks; "
              "IMB-NBC %: 100*clip((pure + compute - total)/max(pure, compute)), slowest rank\n")
    all_rows = []
    for name in configs:
        all_rows += bench_config(world, name, args)
    if root and all_rows:
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
            Path(args.json).write_text(json.dumps({"probe": probe, "steps": all_rows}, indent=1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # one failing rank must not leave the others in a collective
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
