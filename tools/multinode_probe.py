"""A probe (docs/multinode.md): how the step's data all-reduces cost on the test bed, at the level of
single collectives. Run under the bed's launcher on 8 ranks::

    fourd-mpi testbed up --name i29r --nodes 4 --rate 200mbit
    fourd-mpi testbed mpiexec --name i29r -n 8 --ppn 2 -- python tools/multinode_probe.py     # 4 nodes x 2
    fourd-mpi testbed mpiexec --name i29r -n 8 --ppn 4 -- python tools/multinode_probe.py     # 2 nodes x 4
    fourd-mpi testbed down --name i29r

For each data axis of 8 ranks (stride 2: 4 ranks per group, stride 4: 2, the world: 8), ``Iallreduce`` of 128 KiB,
512 KiB and 2 MiB timed four ways, each the per-rank median over iterations, max over ranks (as ``bench
collectives``):

- ``calibration``: bench collectives' protocol of the committed profiles (a barrier on the group's own communicator
  before each timed iteration, every group at once, the iteration rule of ``--iters 5 --min-time 0.1``);
- ``lockstep``: a barrier of the world before each iteration (every group starts together);
- ``alone``: lockstep, only the group of rank 0 communicates;
- ``backtoback``: 5 messages without a barrier between, seconds / 5;

then the step's own data all-reduces (gpt-tiny h=256 seq=64 batch=8, ``GradientSync.finish`` order: fc2, fc1, the
LayerNorm weight and bias, proj, qkv, per block) back to back, each waited before the next: total seconds (median of
4 repeats, max over ranks). The last line is ``JSON {...}`` with every figure.

``python tools/multinode_probe.py --trace TRACE.h5`` (offline): per axis and collective the seconds per step of a
run's trace (sum over its messages of complete - issue on each rank, max over ranks, median over the measured
steps), and the data all-reduces one by one.
"""
import sys

if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "--trace":
    from collections import defaultdict

    import numpy as np

    import fourd_mpi.trace.events as E
    from fourd_mpi.trace.read import load_trace

    tr = load_trace(sys.argv[2])
    ev = tr.events
    warm = {(int(r["rank"]), int(r["step"])) for r in tr.rank_steps if r["warmup"]}
    OPS, AXES = E.OPS, E.AXES
    per = defaultdict(lambda: defaultdict(float))   # (axis, op) -> (rank, step) -> seconds
    seq = defaultdict(list)                            # (rank, step) -> [(issue, bytes, seconds)] data allreduce
    for e in ev:
        op, ax = OPS[e["op"]], AXES[e["axis"]] if e["axis"] < len(AXES) else "?"
        if op not in ("allreduce", "allgather", "reduce_scatter") or (int(e["rank"]), int(e["step"])) in warm:
            continue
        t = (e["complete_ns"] - e["issue_ns"]) / 1e9
        per[(ax, op)][(int(e["rank"]), int(e["step"]))] += t
        if ax == "data" and op == "allreduce":
            seq[(int(e["rank"]), int(e["step"]))].append((int(e["issue_ns"]), int(e["bytes"]), t))
    for key, d in sorted(per.items()):
        by_step = defaultdict(list)
        for (r, s), t in d.items():
            by_step[s].append(t)
        per_step = np.median([max(v) for v in by_step.values()])
        print(f"{key[0]:5} {key[1]:15} per step (max over ranks, median over steps): {per_step:.4f} s")
    if seq:
        by_step = defaultdict(list)
        for (r, s), msgs in seq.items():
            by_step[s].append([t for _, _, t in sorted(msgs)])
        n = min(len(m) for v in by_step.values() for m in v)
        per_msg = np.median([np.max([m[:n] for m in v], axis=0) for v in by_step.values()], axis=0)
        sizes = [b for _, b, _ in sorted(next(iter(seq.values())))][:n]
        print("data all-reduces one by one (bytes: s):", " ".join(f"{b}:{t:.4f}" for b, t in zip(sizes, per_msg)))

    sys.exit(0)


import json

import numpy as np
from mpi4py import MPI

from fourd_mpi.run.collbench import IterationRule, timed_iterations

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
node = MPI.Get_processor_name()
RULE = IterationRule(min_iters=5, min_time=0.1, warmup=3)
ITERS = 5

def own_barrier(comm, nbytes):
    """The committed profiles' protocol: a barrier on the group's own communicator before each timed iteration."""
    send = np.ones(nbytes // 4, np.float32); recv = np.empty_like(send)
    times = timed_iterations(world, (comm.Barrier, lambda: comm.Iallreduce(send, recv, MPI.SUM).Wait()), RULE)
    return world.allreduce(float(np.median(times)), op=MPI.MAX)

def lock(comm, nbytes, active=True):
    send = np.ones(nbytes // 4, np.float32); recv = np.empty_like(send); ts = []
    for i in range(2 + ITERS):
        world.Barrier(); t0 = MPI.Wtime()
        if active:
            comm.Iallreduce(send, recv, MPI.SUM).Wait()
        if i >= 2:
            ts.append(MPI.Wtime() - t0)
    return world.allreduce(float(np.median(ts)) if active else 0.0, op=MPI.MAX)

def backtoback(comm, nbytes, n=5):
    send = np.ones(nbytes // 4, np.float32); recv = np.empty_like(send)
    comm.Iallreduce(send, recv, MPI.SUM).Wait()
    world.Barrier(); t0 = MPI.Wtime()
    for _ in range(n):
        comm.Iallreduce(send, recv, MPI.SUM).Wait()
    return world.allreduce((MPI.Wtime() - t0) / n, op=MPI.MAX)

def sequence(comm, sizes, reps=4):
    bufs = [(np.ones(s // 4, np.float32), np.empty(s // 4, np.float32)) for s in sizes]
    tot, each = [], []
    for r in range(reps + 1):
        world.Barrier(); t0 = MPI.Wtime(); ts = []
        for s, d in bufs:
            a = MPI.Wtime(); comm.Iallreduce(s, d, MPI.SUM).Wait(); ts.append(MPI.Wtime() - a)
        if r:
            tot.append(MPI.Wtime() - t0); each.append(ts)
    total = world.allreduce(float(np.median(tot)), op=MPI.MAX)
    per = world.allreduce(np.median(np.array(each), axis=0), op=MPI.MAX) if False else \
        np.max(np.array(world.allgather(np.median(np.array(each), axis=0))), axis=0)
    return total, [float(v) for v in per]

def fc(p):  # the step's data sequence on a data axis of p (gpt-tiny h=256 ffn=1024, z*y*x = 8/p split)
    split = 8 // p
    one = [1048576 // split, 1048576 // split, 1024, 1024, 262144 // split, 786432 // split, 1024, 1024]
    return one * 2   # fc2 fc1 ln2(w,b) proj qkv ln1(w,b), 2 blocks

names = world.allgather(node)
out = {"nodes": names}
for stride in (2, 4, 1):
    comm = world.Split(rank % stride, rank) if stride > 1 else world.Dup()
    p = comm.Get_size()
    members = comm.allgather(node)
    g = max(members.count(n) for n in set(members))
    label = f"{p}@{g}"
    if rank == 0:
        print(f"{label}: data axis of {p} (stride {stride}); rank 0's group on {members}", flush=True)
    for nbytes in (131072, 524288, 2097152):
        row = {}
        row["calibration"] = own_barrier(comm, nbytes)
        row["lockstep"] = lock(comm, nbytes)
        row["alone"] = lock(comm, nbytes, active=(rank % stride == 0))
        row["backtoback"] = backtoback(comm, nbytes)
        if rank == 0:
            print(f"  {nbytes:>8} B  " + "  ".join(f"{k} {v*1e3:7.2f} ms" for k, v in row.items()), flush=True)
        out[f"{label}/{nbytes}"] = row
    seq = fc(p)
    total, per = sequence(comm, seq)
    if rank == 0:
        print(f"  step sequence ({len(seq)} msgs, {sum(seq)} B): {total*1e3:.1f} ms; per message (ms): "
              + " ".join(f"{v*1e3:.1f}" for v in per), flush=True)
    out[f"{label}/sequence"] = {"sizes": seq, "total": total, "per_message": per}
    comm.Free()
if rank == 0:
    print("JSON " + json.dumps(out), flush=True)
