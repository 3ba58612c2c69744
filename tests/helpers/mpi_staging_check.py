"""Run under mpiexec: the staged MPI-buffer path, with NumPy's emulated staging.

1. Staged and direct steps give bitwise-identical losses, outputs and gradients
   on every grid given (all overlap options on, poll progress with tiny chunks).
2. Every staged collective record has a d2h copy that ends before its issue and
   an h2d copy that starts at or after its completion; copy bytes match the
   message (d2h: the send buffer, h2d: the receive buffer).
3. The staging pool reuses its buffers (at most two per collective of a step, and
   steps after the first add fewer than half a step's collectives; exact reuse depends on
   how many are in flight at once), and every buffer is back in the pool after a step.
4. The device-buffer smoke test passes on host buffers and reports garbage as a failure.

Arguments: grids as DxZxYxX (default: every grid used by the tests for this size).
Prints "staging checks ok" on rank 0 or the failures; exits 1 on failure.
"""

import sys
from dataclasses import replace

import numpy as np
from mpi4py import MPI

from fourd_mpi.core.backend import NumpyBackend
from fourd_mpi.core.gpuaware import smoke_test
from fourd_mpi.core.grid import GridShape
from fourd_mpi.run.build import Run
from fourd_mpi.run.options import run_options
from fourd_mpi.step.presets import resolve_model

GRIDS = {1: ["1x1x1x1"], 2: ["1x2x1x1", "2x1x1x1", "1x1x1x2"], 4: ["1x2x1x2", "2x2x1x1", "1x1x2x2"],
         8: ["2x2x1x2", "1x2x2x2"]}


def run_steps(world, options, steps=3):
    """Losses, output and gradients of step 0, losses of ``steps`` steps, and the staged records/pool stats."""
    run = Run.build(world, options)
    loss0, y = run.trainer.forward_backward(0)
    grads = [np.array(p.grad, copy=True) for p in run.model.parameters()]
    records = list(run.comm.records)
    losses = []
    pool_after = []
    for i in range(steps):
        # the last step leaves nothing in flight; the others keep the next step's all-gather (overlap oup)
        losses.append(run.trainer.step(i, last=i == steps - 1).loss)
        if run.backend.pool is not None:
            pool_after.append(dict(run.backend.pool.stats()))
    step_records = list(run.comm.records)
    run.close()
    return {"loss0": loss0, "y": np.array(y, copy=True), "grads": grads, "losses": losses,
            "records": records, "step_records": step_records, "pool": pool_after, "buffers": run.mpi_buffers}


def check_records(records, failures, where):
    staged = [r for r in records if r.d2h is not None or r.h2d is not None]
    for r in staged:
        if r.d2h is None or r.h2d is None:
            failures.append(f"{where}: {r.op}/{r.axis} has only one of its copies")
            continue
        if not r.d2h.start_ns <= r.d2h.end_ns <= r.issue_ns:
            failures.append(f"{where}: {r.op}/{r.axis} d2h [{r.d2h.start_ns}, {r.d2h.end_ns}] not before issue "
                            f"{r.issue_ns}")
        if not (r.complete_ns and r.complete_ns <= r.h2d.start_ns <= r.h2d.end_ns):
            failures.append(f"{where}: {r.op}/{r.axis} h2d [{r.h2d.start_ns}, {r.h2d.end_ns}] not after "
                            f"completion {r.complete_ns}")
        p_bytes = {"allgather": (r.nbytes // _group(r), r.nbytes), "reduce_scatter": (r.nbytes, None),
                   "allreduce": (r.nbytes, r.nbytes)}[r.op]
        if r.d2h.nbytes != p_bytes[0] or (p_bytes[1] is not None and r.h2d.nbytes != p_bytes[1]):
            failures.append(f"{where}: {r.op}/{r.axis} copies {r.d2h.nbytes}/{r.h2d.nbytes} bytes for a "
                            f"{r.nbytes}-byte message")
    return len(staged)


_GROUPS = {}


def _group(record):
    return _GROUPS[record.axis]


def main():
    world = MPI.COMM_WORLD
    size = world.Get_size()
    grids = sys.argv[1:] or GRIDS.get(size, [f"1x{size}x1x1"])
    failures = []
    model = resolve_model("gpt-tiny")
    for text in grids:
        shape = GridShape.parse(text)
        _GROUPS.update({"data": shape.data, "z": shape.z, "y": shape.y, "x": shape.x})
        base = run_options(model=model, grid=shape, dtype="float64", backend="numpy", overlap="all",
                          cache_weights=False, poll_flops=2000.0, chunks=2, check_buffers=True)
        direct = run_steps(world, replace(base, device_buffers="direct"))
        staged = run_steps(world, replace(base, device_buffers="staged"))
        where = f"grid {text} rank {world.Get_rank()}"
        if direct["buffers"].mode != "direct" or staged["buffers"].mode != "staged" or not staged["buffers"].emulated:
            failures.append(f"{where}: modes {direct['buffers']} / {staged['buffers']}")
        # 1. bitwise identical
        if direct["loss0"] != staged["loss0"] or direct["losses"] != staged["losses"]:
            failures.append(f"{where}: losses differ {direct['losses']} vs {staged['losses']}")
        if not np.array_equal(direct["y"], staged["y"]):
            failures.append(f"{where}: outputs differ")
        for i, (a, b) in enumerate(zip(direct["grads"], staged["grads"])):
            if not np.array_equal(a, b):
                failures.append(f"{where}: gradient {i} differs")
        # 2. copies around every staged collective, none on the direct path
        if any(r.d2h is not None or r.h2d is not None for r in direct["records"] + direct["step_records"]):
            failures.append(f"{where}: the direct path recorded staging copies")
        n_staged = check_records(staged["records"] + staged["step_records"], failures, where)
        expected = sum(1 for r in staged["records"] + staged["step_records"] if not _scalar(r))
        if n_staged != expected:
            failures.append(f"{where}: {n_staged} staged records of {expected} nonblocking collectives")
        # 3. the pool reuses buffers: its size is bounded by the buffers in flight at once (which
        # varies a little with timing under overlap), not by the number of calls; nothing left in use
        pool = staged["pool"]
        per_step = sum(1 for r in staged["step_records"] if not _scalar(r))
        if shape.size > 1:
            if not pool or pool[-1]["allocations"] > 2 * per_step or \
                    pool[-1]["allocations"] - pool[0]["allocations"] >= per_step // 2:
                failures.append(f"{where}: staging pool allocates per call ({per_step} collectives a step): {pool}")
            if pool and pool[-1]["in_use"] != 0:
                failures.append(f"{where}: {pool[-1]['in_use']} staging buffers still in use after a step")
    # 4. smoke test on host buffers, and a backend that returns garbage
    verdict = smoke_test(world, NumpyBackend(np.float32))
    if not (verdict["ran"] and verdict["ok"]):
        failures.append(f"smoke test on host buffers failed: {verdict}")

    class Garbage(NumpyBackend):
        def to_host(self, array):
            return np.asarray(array) + (1.0 if world.Get_rank() == size - 1 else 0.0)

    verdict = smoke_test(world, Garbage(np.float32))
    if verdict["ok"] or f"rank {size - 1}" not in verdict["detail"] or "wrong" not in verdict["detail"]:
        failures.append(f"smoke test did not report a wrong result: {verdict}")

    everyone = world.gather(failures, root=0)
    if world.Get_rank() == 0:
        flat = [f for part in everyone for f in part]
        if flat:
            print("\n".join(flat))
            sys.exit(1)
        print(f"staging checks ok ({', '.join(grids)})")


def _scalar(record):
    """The blocking loss all-reduces of host scalars are never staged."""
    return record.nbytes <= 8 and record.op == "allreduce" and record.wait_ns == record.complete_ns - record.issue_ns


if __name__ == "__main__":
    main()
