"""Run under mpiexec: OUP's all-gather issued across the step boundary (:mod:`fourd_mpi.step.overlap`).

``python mpi_oup_check.py [STEPS]`` on a grid ``1 x size x 1 x 1`` (every rank on Z, so the weights are
all-gathered), gpt-tiny, float64, SGD, trace level ``op``, overlap ``all``:

1. After each step but the last, exactly one all-gather is in flight: the first layer's, and its result
   (waited here through the fetcher's own handle, then handed back) is the first layer's weight block
   *after* the step's update (a blocking ``Allgather`` of the current shards), and differs from the block
   before the update (so a gather issued before the update would fail this check).
2. Its record is not among the step's records; the next step's records start with it, and the next step's
   trace events hold an ``allgather`` of that layer in phase ``forward``, so every step has the same
   number of all-gathers; its wait, if any, is counted in the next step.
3. The last step (``last=True``) leaves nothing in flight (``check_quiescent``); ``Run.close`` drains a
   gather issued by a step that was not the last (step 0 of a second run).

Prints "oup checks ok" on rank 0 or the failures; exits 1 on failure.
"""

import sys

import numpy as np
from mpi4py import MPI
from mpi_overlap_check import report  # tests/helpers, the script's own directory

from fourd_mpi.run.build import Run
from fourd_mpi.run.options import resolve
from fourd_mpi.trace.events import OP_CODE, PHASES


def gathered_now(run, layer):
    """The layer's weight block from its current shards, blocking (the reference)."""
    z = run.grid.axis_comm("z")
    shard = np.ascontiguousarray(run.backend.to_host(layer.weight.data)).ravel()
    out = np.empty(shard.size * z.Get_size(), dtype=shard.dtype)
    z.Allgather(shard, out)
    return out


def main():
    world = MPI.COMM_WORLD
    size = world.Get_size()
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    options = resolve(size, "gpt-tiny", {"data": 1, "z": size, "y": 1, "x": 1},
                      {"layers": 2, "batch": 2 * size, "hidden": 48, "ffn_hidden": 192, "heads": 3},
                      dtype="float64", backend="numpy", optimizer="sgd", overlap="all", steps=steps)
    failures = []
    run = Run.build(world, options, trace_level="op")
    trainer, comm = run.trainer, run.comm
    first = trainer.weights.layers[0]
    gathers = []
    for i in range(steps):
        before = gathered_now(run, first)
        last = i == steps - 1
        result = trainer.step(i, last=last)
        events = result.events
        gathers.append(int((events["op"] == OP_CODE["allgather"]).sum()))
        if i > 0:
            mine = events[(events["op"] == OP_CODE["allgather"])
                          & (events["layer"] == comm.tracer.layer_index(first.name))
                          & (events["phase"] == PHASES.index("forward"))]
            if len(mine) != 1:
                failures.append(f"step {i}: {len(mine)} forward all-gathers of {first.name} in its events, not 1")
        if last:
            try:
                comm.check_quiescent("after the last step")
            except RuntimeError as exc:
                failures.append(f"last step: {exc}")
            continue
        ahead = trainer.weights.ahead
        if list(ahead) != [first.name] or len(comm.in_flight) > 1:
            failures.append(f"step {i}: in flight {[h.record.op for h in comm.in_flight]}, ahead {list(ahead)}")
            continue
        handle = ahead[first.name]
        if any(r is handle.record for r in comm.records):
            failures.append(f"step {i}: the prefetched gather is among this step's records")
        got = np.asarray(run.backend.to_host(handle.wait())).ravel()
        now = gathered_now(run, first)
        if not np.array_equal(got, now):
            failures.append(f"step {i}: the prefetched block is not the updated weights")
        if np.array_equal(now, before):
            failures.append(f"step {i}: the weights did not change in the update (the check would prove nothing)")
    if len(set(gathers[1:])) > 1 or (steps > 1 and gathers[0] != gathers[1]):
        failures.append(f"all-gathers per step differ: {gathers}")
    run.close()

    # a run whose caller never says which step is the last: close() waits for the gather left in flight
    run = Run.build(world, options)
    run.trainer.step(0)
    if not run.trainer.weights.ahead:
        failures.append("step 0 of the second run issued no all-gather ahead")
    run.close()
    if run.comm.in_flight:
        failures.append(f"close left {len(run.comm.in_flight)} collective(s) in flight")
    return report(world, failures, "oup checks ok")


if __name__ == "__main__":
    sys.exit(main())
