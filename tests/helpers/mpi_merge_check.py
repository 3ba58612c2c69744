"""Under mpiexec: the hierarchical merge gives the same trace, event for event, as the single-file merge.

``python mpi_merge_check.py DIR GROUP_SIZE [STEPS]``: every rank runs STEPS real traced training
steps of gpt-tiny (data parallel over the whole world, level ``op``) and appends each step to two
spools, A and B, so both hold the same events. Spool A is merged with one group (the single-file
layout of schema 4, ``merge_run(group_size=world)``), spool B with groups of GROUP_SIZE ranks
(part files bound by a virtual ``/events``); both with a clock correction that moves every time
by ``17 * rank`` ns, as the drift model does. Rank 0 loads both with ``load_trace`` and compares
every dataset, then copies B (file + parts directory) elsewhere, removes the original and reads
the copy. Prints ``merge check ok parts=P`` when all holds.
"""

import os
import shutil
import sys

import numpy as np
from mpi4py import MPI

from fourd_mpi.run.build import Run
from fourd_mpi.run.options import resolve
from fourd_mpi.trace.clocks import EVENT_TIME_COLUMNS
from fourd_mpi.trace.events import RANK_STEP_DTYPE
from fourd_mpi.trace.files import parts_dir_of
from fourd_mpi.trace.invariants import check_invariants
from fourd_mpi.trace.merge import merge_run
from fourd_mpi.trace.read import load_trace
from fourd_mpi.trace.spool import RankSpool

base, group_size = sys.argv[1], int(sys.argv[2])
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 2
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
options = resolve(size, "gpt-tiny", {"data": size, "z": 1, "y": 1, "x": 1}, {"layers": 1, "seq": 16, "batch": size},
                  steps=steps, warmup=1)
run = Run.build(world, options, trace_level="op")
spools = {}
for name in ("A", "B"):
    if rank == 0:
        os.makedirs(os.path.join(base, f"{name}.ranks"))
    world.Barrier()
    spools[name] = RankSpool(os.path.join(base, f"{name}.ranks"), rank, {"rank": rank, "hostname": f"h{rank}"})
record = np.zeros(1, dtype=RANK_STEP_DTYPE)
for i in range(steps):
    result = run.trainer.step(i)
    record[0] = (rank, i, i < 1, result.start_ns, result.end_ns, result.loss, result.seconds, result.compute_ns,
                 result.wait_ns, len(result.events), result.mpi_ns)
    events = result.events
    if rank == size - 1 and i == steps - 1:  # the last rank's last step in reverse order: the merge must sort
        events = events[::-1]
    for spool in spools.values():
        spool.append(events, record)


def correct(records):
    """Every time column moved by ``17 * rank`` ns (zeros stay zero: absent), as DriftModel does."""
    out = records.copy()
    for column in EVENT_TIME_COLUMNS:
        if column in out.dtype.names:
            out[column][out[column] != 0] += 17 * rank
    return out


meta = {"run_id": "merge-check", "world_size": size}
layers = run.comm.tracer.layer_names
path_a = merge_run(world, spools["A"], {"rank": rank}, os.path.join(base, "A.h5"), meta, layers, False,
                   correct=correct, group_size=size)
path_b = merge_run(world, spools["B"], {"rank": rank}, os.path.join(base, "B.h5"), meta, layers, False,
                   correct=correct, group_size=group_size)
run.close()
if rank == 0:
    a, b = load_trace(path_a), load_trace(path_b)
    problems = []
    want_parts = -(-size // group_size) if group_size < size else 0
    if a.attrs["parts"] != 0 or b.attrs["parts"] != want_parts:
        problems.append(f"parts {a.attrs['parts']} and {b.attrs['parts']}, expected 0 and {want_parts}")
    for name in ("events", "ranks", "rank_steps", "steps"):
        if getattr(a, name).tobytes() != getattr(b, name).tobytes():  # bytes: NaN drift columns compare equal
            problems.append(f"/{name} differs")
    if a.metadata.keys() != b.metadata.keys() or a.vocab != b.vocab:
        problems.append("metadata or vocabulary differ")
    if not (np.diff(a.events["rank"].astype(np.int64)) >= 0).all():
        problems.append("events not in rank order")
    if check_invariants(b):
        problems.append(f"invariants: {check_invariants(b)[:2]}")
    moved = os.path.join(base, "moved")
    os.makedirs(moved)
    shutil.copy(path_b, moved)
    if want_parts:
        shutil.copytree(parts_dir_of(path_b), parts_dir_of(os.path.join(moved, "B.h5")))
        shutil.rmtree(parts_dir_of(path_b))
    os.remove(path_b)
    os.chdir("/")
    if load_trace(os.path.join(moved, "B.h5")).events.tobytes() != a.events.tobytes():
        problems.append("the moved copy reads differently")
    import h5py

    with h5py.File(os.path.join(moved, "B.h5"), "r") as f:  # plain h5py through the virtual dataset
        if f["events"][()].tobytes() != a.events.tobytes():
            problems.append("plain h5py reads the virtual /events differently")
    print("merge check " + ("ok" if not problems else "FAILED: " + "; ".join(problems))
          + f" parts={b.attrs['parts']} events={len(a.events)}", flush=True)
