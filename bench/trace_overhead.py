"""What tracing costs: op-level vs step-level step time in one run, and the HDF5 merge rate.

1. **Overhead.** One run (one model, one grid, clocks aligned as in ``fourd-mpi
   run``) alternates the trace level between ``step`` and ``op`` in blocks of
   ``--block`` steps, ``--repeats`` times (ABBA order, so drift hits both levels
   alike). Each timed step includes what tracing costs in ``fourd-mpi run``: the
   events of the step become a structured array and are appended to this
   rank's spool file. Step time = max over ranks of that per-rank time; the
   table gives the median and quartiles per level and the ratio op/step.
   The target is op/step <= 1.02.
2. **Merge rate.** Each rank appends ``--merge-events`` synthetic events (the
   real record layout) to its spool, then the collective merge of ``fourd-mpi
   run`` (MPI sends to rank 0, gzip-1 chunked HDF5, temp file + link) writes the
   trace; events per second = all events / merge wall time (median of
   ``--merge-repeats``).

Launch with ``OMP_NUM_THREADS=1``::

    OMP_NUM_THREADS=1 mpiexec -n 8 python -m bench.trace_overhead
    OMP_NUM_THREADS=1 mpiexec -n 8 python -m bench.trace_overhead --model gpt-small --layers 2 --seq 128
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
from mpi4py import MPI

from fourd_mpi.run.build import Run
from fourd_mpi.run.options import resolve
from fourd_mpi.trace.events import EVENT_DTYPE, RANK_STEP_DTYPE
from fourd_mpi.trace.merge import merge_run
from fourd_mpi.trace.spool import RankSpool
from fourd_mpi.util.values import positive_int


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--layers", type=positive_int)
    p.add_argument("--seq", type=positive_int)
    p.add_argument("--hidden", type=positive_int)
    p.add_argument("--batch", type=positive_int)
    p.add_argument("--grid", default="1x2x2x2", help="DxZxYxX (default 1x2x2x2)")
    p.add_argument("--overlap", default="none")
    p.add_argument("--block", type=positive_int, default=1, help="steps per level per repeat (default 1)")
    p.add_argument("--repeats", type=positive_int, default=60, help="blocks per level, ABBA order (default 60)")
    p.add_argument("--warmup", type=positive_int, default=3)
    p.add_argument("--merge-events", type=positive_int, default=100_000, help="synthetic events per rank")
    p.add_argument("--merge-repeats", type=positive_int, default=3)
    p.add_argument("--levels", type=lambda t: tuple(t.split(",")), default=("step", "op"), metavar="A,B",
                   help="the two trace levels compared (default step,op; step,step measures the noise floor)")
    p.add_argument("--dir", default=None, help="where spool and merged files go (default: a temp dir)")
    return p.parse_args(argv)


class BookkeepingClock:
    """Wraps the tracer's ``end_step`` to time it (the events-to-array work of each step)."""

    def __init__(self, tracer):
        self.seconds = 0.0
        self._end_step = tracer.end_step
        tracer.end_step = self

    def __call__(self, *args):
        t0 = time.perf_counter()
        out = self._end_step(*args)
        self.seconds += time.perf_counter() - t0
        return out


def timed_steps(run, spool, level, first_step, count, clock):
    """``count`` steps at ``level``: per step, the max-over-ranks seconds of (step + spool append),
    this rank's events, and this rank's seconds in end-of-step bookkeeping (array + append)."""
    world = run.world  # the whole run (a pipeline splits it into stage grids)
    run.comm.tracer.set_level(level)
    record = np.zeros(1, dtype=RANK_STEP_DTYPE)
    times, events, bookkeeping = [], [], []
    for i in range(first_step, first_step + count):
        clock.seconds = 0.0
        t0 = time.perf_counter()
        result = run.trainer.step(i)
        record[0] = (world.Get_rank(), i, 0, result.start_ns, result.end_ns, result.loss, result.seconds,
                     result.compute_ns, result.wait_ns, len(result.events), result.mpi_ns)
        t1 = time.perf_counter()
        spool.append(result.events, record)
        t2 = time.perf_counter()
        times.append(world.allreduce(t2 - t0, op=MPI.MAX))
        events.append(len(result.events))
        bookkeeping.append(clock.seconds + (t2 - t1))
    return times, events, bookkeeping


def main(argv=None):
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    from fourd_mpi.core.grid import GridShape

    shape = GridShape.parse(args.grid)
    overrides = {k: getattr(args, k) for k in ("layers", "seq", "hidden", "batch")}
    options = resolve(size, args.model, {"data": shape.data, "z": shape.z, "y": shape.y, "x": shape.x},
                      overrides, overlap=args.overlap)
    run = Run.build(world, options, trace_level="op")
    base = world.bcast(args.dir or tempfile.mkdtemp(prefix="fourd-trace-bench-") if rank == 0 else None)
    spool_dir = os.path.join(base, "overhead.ranks")
    if rank == 0:
        os.makedirs(spool_dir, exist_ok=True)
    world.Barrier()
    spool = RankSpool(spool_dir, rank, {"rank": rank})

    clock = BookkeepingClock(run.comm.tracer)
    timed_steps(run, spool, "op", 0, args.warmup, clock)
    base_level, test_level = args.levels
    samples = {"A": [], "B": []}  # A: base level, B: tested level
    events = {"A": [], "B": []}
    bookkeeping = {"A": [], "B": []}
    paired = []
    step = args.warmup
    for r in range(args.repeats):
        block = {}
        for arm in (("A", "B") if r % 2 == 0 else ("B", "A")):
            t, e, b = timed_steps(run, spool, base_level if arm == "A" else test_level, step, args.block, clock)
            samples[arm] += t
            events[arm] += e
            bookkeeping[arm] += b
            block[arm] = statistics.median(t)
            step += args.block
        paired.append(block["B"] / block["A"])

    # median over steps of this rank's bookkeeping, then the median over ranks
    kept = {arm: world.gather(statistics.median(b), root=0) for arm, b in bookkeeping.items()}
    if rank == 0:
        cfg = run.options.model
        print(f"trace overhead: {cfg.name} ({cfg.layers} layers, hidden {cfg.hidden}, seq {cfg.seq}, batch "
              f"{cfg.batch}), grid {options.grid}, {size} ranks, overlap {args.overlap}, "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
        print(f"{args.repeats} blocks of {args.block} steps per level, alternating ABBA; step time = max over ranks "
              "of (step + events to array + spool append)")
        print(f"{'arm':<4} {'level':<6} {'steps':>5} {'median (ms)':>12} {'q1 (ms)':>9} {'q3 (ms)':>9} "
              f"{'events/step/rank':>17} {'bookkeeping (ms/step/rank)':>27}")
        for arm, level in (("A", base_level), ("B", test_level)):
            t = np.array(samples[arm]) * 1e3
            print(f"{arm:<4} {level:<6} {len(t):>5} {np.median(t):>12.2f} {np.quantile(t, 0.25):>9.2f} "
                  f"{np.quantile(t, 0.75):>9.2f} {statistics.median(events[arm]):>17.0f} "
                  f"{1e3 * statistics.median(kept[arm]):>27.3f}")
        ratio = statistics.median(samples["B"]) / statistics.median(samples["A"])
        boot = np.random.default_rng(0).choice(paired, size=(2000, len(paired)))
        low, high = np.quantile(np.median(boot, axis=1), [0.025, 0.975])
        print(f"{test_level} / {base_level}: ratio of medians {ratio:.4f} ({100 * (ratio - 1):+.2f}%); "
              f"median of per-block ratios {statistics.median(paired):.4f} (95% bootstrap CI {low:.4f}-{high:.4f})")

    # the trace of the run itself goes through the real merge
    t0 = time.perf_counter()
    path = merge_run(world, spool, {"rank": rank}, os.path.join(base, "overhead.h5"), {"run_id": "overhead"},
                     run.comm.tracer.layer_names, force=True)
    merge_s = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    if rank == 0:
        print(f"merge of this run's trace: {os.path.getsize(path) / 1e6:.2f} MB, {merge_s:.3f} s")

    rates, sizes = [], []
    rng = np.random.default_rng(rank)
    synthetic = np.zeros(args.merge_events, dtype=EVENT_DTYPE)
    synthetic["rank"] = rank
    synthetic["start_ns"] = np.sort(rng.integers(0, 10**10, args.merge_events))
    synthetic["end_ns"] = synthetic["start_ns"] + rng.integers(1, 10**5, args.merge_events)
    synthetic["op"] = rng.integers(0, 13, args.merge_events)
    synthetic["bytes"] = rng.integers(0, 1 << 20, args.merge_events)
    for r in range(args.merge_repeats):
        spool_r = os.path.join(base, f"merge{r}.ranks")
        if rank == 0:
            os.makedirs(spool_r)
        world.Barrier()
        s = RankSpool(spool_r, rank, {"rank": rank})
        s.append(synthetic, np.zeros(1, dtype=RANK_STEP_DTYPE))
        world.Barrier()
        t0 = time.perf_counter()
        path = merge_run(world, s, {"rank": rank}, os.path.join(base, f"merge{r}.h5"), {"run_id": "merge"}, [],
                         force=True)
        seconds = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        rates.append(args.merge_events * size / seconds)
        if rank == 0:
            sizes.append(os.path.getsize(path))
            os.remove(path)
    if rank == 0:
        raw = args.merge_events * size * EVENT_DTYPE.itemsize
        print(f"merge rate: {statistics.median(rates):,.0f} events/s (median of {args.merge_repeats}; "
              f"{size} ranks x {args.merge_events:,} events = {raw / 1e6:.1f} MB raw, "
              f"{statistics.median(sizes) / 1e6:.1f} MB in HDF5)")
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    run.close()


if __name__ == "__main__":
    main()
