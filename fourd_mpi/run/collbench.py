"""``fourd-mpi bench collectives``: OSU / nccl-tests style micro-benchmark and machine calibration.

Run under ``mpiexec``. For every axis communicator of the benchmarked grids (every instance of
an axis runs at once, as in a training step) and for the world: ``Iallgather``,
``Ireduce_scatter_block``, ``Iallreduce`` (each waited at once) and their blocking forms over a
sweep of message sizes (to 64 MiB by default), with warm-up and timed iterations (a barrier
between iterations, not timed) until both a minimum count and a minimum time are reached, the
same count on every rank (:class:`IterationRule`). Message size ``S`` is the nccl-tests "size":
the gathered buffer of an all-gather, the full input of a reduce-scatter, the buffer of an
all-reduce. The report sets the step's own messages beside the table (:func:`step_messages`,
:func:`cover_step_messages`): whether the measured sizes cover them.

- latency = median over iterations on each rank; ``time`` (nccl-tests) is the maximum over
  ranks, and OSU's avg/min/max latency over ranks are reported too;
- out-of-place and in-place (``MPI_IN_PLACE``: all-reduce on the receive buffer, all-gather
  with each rank's block already in place, reduce-scatter-block leaving the result in the
  first block), and after the timed iterations a result check (nccl-tests ``-c``): send
  buffers filled with small integers known per rank and element (exact in float32), the
  wrong elements of the result counted (``#wrong``, summed over ranks; any makes the command
  exit 1);
- ``algbw = S / latency``; ``busbw = algbw * (p-1)/p`` (all-gather, reduce-scatter),
  ``* 2(p-1)/p`` (all-reduce) (nccl-tests, PERFORMANCE.md);
- overlap of the nonblocking forms with a compute phase: NumPy GEMMs of 128 x 128, as many as
  take as long as the pure collective (``t_pure``); ``t_cpu`` the GEMMs alone, ``t_ovrl``
  start + GEMMs + wait, without polling and with ``MPI_Testall`` between GEMMs (as
  ``--progress poll``). OSU: ``max(0, 100 - 100*(t_ovrl - t_cpu)/t_pure)`` averaged over ranks;
  IMB-NBC: ``100*max(0, min(1, (t_pure + t_cpu - t_ovrl)/max(t_pure, t_cpu)))`` with the slowest
  rank's times.

Calibration: the machine profile (:mod:`fourd_mpi.perf.machine`) is fitted to these measurements by the pure
:mod:`fourd_mpi.perf.calibration` (alpha-beta fits per collective and placement level, the fit gate
:data:`~fourd_mpi.perf.calibration.MAX_FIT_RMS`, the profile mapping); this module measures: the latencies
and back-to-back runs, the GEMM rate per dtype of one rank alone (the others sleep) and of all ranks at once,
element-wise bandwidth, the cost of one NumPy call, and the OSU overlap with polling.

Communicators: an axis with the same group size and placement as one already measured (on one
node), or an axis of every rank (the world's group), is measured once and reported under all
its names (``axes``).

Back-to-back runs (inter-node groups, with ``iallreduce``): :data:`RUN_LENGTH` all-reduces issued one after
another, each waited before the next, every group of the axis at once (:func:`_time_run`), seconds per message,
written as ``levels.inter.measured_runs``: the step's data all-reduces run like this at the end of the backward
pass, and over a token-bucket link (``tc tbf``) a message after an idle link passes its burst faster than the
link's rate, while messages back to back get the rate (on the test bed the step's run of 16 data all-reduces took
0.91-1.06 x the sum of these points, 0.75-1.00 x the sum of single-message points).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Dict, List, Optional, Tuple

import numpy as np

from fourd_mpi.core.colltable import collective
from fourd_mpi.core.grid import GridShape, infer_grid_shape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.calibration import KIND_OF, OPS, Row
from fourd_mpi.run.collbench_plan import (  # noqa: F401 (re-exported: the command, tests and probes import them here)
    DEFAULT_TIME_LIMIT_S,
    GUESS_S,
    MAX_ITERATIONS,
    OVERLAP_MAX_BYTES,
    OVERLAP_PHASES,
    PROGRESS_EVERY_S,
    RUN_LENGTH,
    SYNC_COMPUTE_S,
    Budget,
    Item,
    IterationRule,
    cover_step_messages,
    default_grids,
    duration,
    imb_overlap,
    message_sizes,
    osu_overlap,
    overlap_sizes,
    plan_items,
    progress_line,
    step_message_lines,
    step_messages,
)
from fourd_mpi.run.collbench_report import (  # noqa: F401 (re-exported, as above)
    CSV_COLUMNS,
    FORMULAS,
    TABLE_HEAD,
    TABLE_UNITS,
    StreamReport,
    avg_busbw,
    block_key,
    csv_head,
    csv_lines,
    format_result,
    format_tables,
    table_block_head,
    table_head,
    table_row,
    table_tail,
    total_wrong,
)

# ---------------------------------------------------------------------------
# measurement (collective over the world)
# ---------------------------------------------------------------------------

def _buffers(op: str, size: int, p: int):
    elems = size // 4
    if KIND_OF[op] == "allgather":
        return np.ones(elems // p, np.float32), np.empty(elems, np.float32)
    if KIND_OF[op] == "reduce_scatter":
        return np.ones(elems, np.float32), np.empty(elems // p, np.float32)
    return np.ones(elems, np.float32), np.empty(elems, np.float32)


def fill_pattern(kind: str, size: int, p: int, rank: int) -> Tuple[np.ndarray, np.ndarray]:
    """``(input, expected result)`` of the result check, float32, exact: element ``j`` of rank
    ``r``'s input is ``(r + 1) + (j mod 7)``.

    all-reduce: ``p(p+1)/2 + p (j mod 7)``; reduce-scatter-block: block ``rank`` of that;
    all-gather: the concatenation of every rank's input (its block ``i`` from rank ``i``).
    """
    elems = size // 4
    n = elems // p if kind == "allgather" else elems
    j = (np.arange(n, dtype=np.int32) % 7).astype(np.float32)  # small integers: exact in float32
    mine = j + np.float32(rank + 1)
    if kind == "allgather":
        expected = np.concatenate([j + np.float32(r + 1) for r in range(p)])
    else:
        j *= np.float32(p)
        j += np.float32(p * (p + 1) // 2)
        expected = j if kind == "allreduce" else j[rank * (n // p):(rank + 1) * (n // p)].copy()
    return mine, expected


def count_wrong(result: np.ndarray, expected: np.ndarray) -> int:
    """Elements of ``result`` that differ from ``expected`` (both float32, exact)."""
    if result.shape != expected.shape:
        return int(expected.size)
    return int(np.count_nonzero(result != expected))


def _starter(comm, op: str, send, recv, inplace: bool = False):
    """A call of ``op``'s MPI method (the table's nonblocking form for ``i`` names, else the blocking one);
    ``inplace``: ``MPI_IN_PLACE`` as the send buffer, the data in ``recv``."""
    from mpi4py import MPI

    kind = collective(op)
    method = getattr(comm, kind.nonblocking if op.startswith("i") else kind.blocking)
    if inplace:
        return lambda: method(MPI.IN_PLACE, recv)
    return lambda: method(send, recv)


def _inplace_buffers(kind: str, send: np.ndarray, recv: np.ndarray, rank: int, p: int) -> np.ndarray:
    """The receive buffer of an in-place call, holding this rank's input where MPI expects it."""
    if kind == "allgather":  # each rank's block already at its place in the result
        buf = np.empty_like(recv)
        buf[rank * send.size:(rank + 1) * send.size] = send
        return buf
    return send.copy()  # all-reduce: in place; reduce-scatter-block: full input, result in the first block


def timed_iterations(world, one, rule: IterationRule) -> List[float]:
    """Seconds of each timed call of ``one()`` after ``rule.warmup`` untimed ones, each preceded by
    ``barrier()`` (not timed), until :class:`IterationRule` says stop. ``one = (barrier, body)``.
    Collective over ``world``: every rank of the world calls it at once (each on its instance of
    an axis) and all run the same number of iterations."""
    from mpi4py import MPI

    barrier, body = one
    for _ in range(rule.warmup):
        barrier()
        body()
    times: List[float] = []
    target, t_start = 1, MPI.Wtime()
    while True:
        while len(times) < target:
            barrier()
            t0 = MPI.Wtime()
            body()
            times.append(MPI.Wtime() - t0)
        # outside the timed intervals: the slowest rank's timed sum and wall time
        agreed = np.array([math.fsum(times), MPI.Wtime() - t_start])
        world.Allreduce(MPI.IN_PLACE, agreed, op=MPI.MAX)
        target = rule.next_target(len(times), float(agreed[0]), float(agreed[1]))
        if target == 0:
            return times


def iteration_barrier(comm, world):
    """The barrier before each timed back-to-back run (:func:`_time_run`) on the axis communicator ``comm``: the
    world's, so that every group of the axis starts the run together, as the groups of a training step start
    their data all-reduces together at the end of the backward pass. (Single messages, :func:`_time_op`, keep a
    barrier on ``comm``: the world's puts its exit skew into a small message's time, which the model counts
    apart as ``sync_s``: on the test bed, 4 nodes x 2 ranks, 2-8 KiB all-reduces of groups of 2 and 4 ranks then
    took 4.8-13 x as long as with their own barrier, those of the world, whose barrier is the world's either way,
    0.97-1.22 x.)"""
    return world.Barrier


def _time_op(comm, world, op: str, size: int, rule: IterationRule,
             inplace: bool = False) -> Tuple[float, int, int]:
    """``(median seconds of one collective on this rank, wrong elements of the result check,
    timed iterations)``; collective over ``world`` (:func:`timed_iterations`).

    A barrier on ``comm`` between iterations, not timed. The check runs once more after the
    timed iterations, on freshly filled buffers (in-place iterations overwrite their input).
    """
    p, rank = comm.Get_size(), comm.Get_rank()
    kind = KIND_OF[op]
    send, recv = _buffers(op, size, p)
    if inplace:
        recv = _inplace_buffers(kind, send, recv, rank, p)
    start = _starter(comm, op, send, recv, inplace)

    def body():
        req = start()
        if req is not None:
            req.Wait()

    times = timed_iterations(world, (comm.Barrier, body), rule)
    del send, recv, start, body  # the check's buffers replace them (64 MiB messages: memory)
    send, expected = fill_pattern(kind, size, p, rank)
    recv = _inplace_buffers(kind, send, np.empty(expected.size * (p if kind == "reduce_scatter" else 1),
                                                 np.float32), rank, p) if inplace else np.empty_like(expected)
    req = _starter(comm, op, send, recv, inplace)()
    if req is not None:
        req.Wait()
    result = recv[:expected.size] if (inplace and kind == "reduce_scatter") else recv
    return float(np.median(times)), count_wrong(result, expected), len(times)


def _gemm_calls(n_calls: int, a, b, poll=None) -> None:
    for _ in range(n_calls):
        a @ b
        if poll is not None:
            poll()


def barrier_median_time(comm, body, iters: int, warmup: int) -> float:
    """Median seconds of ``body()`` over ``iters`` timed runs after ``warmup`` untimed ones, a
    barrier on ``comm`` before each (not timed). Collective over ``comm``."""
    from mpi4py import MPI

    times = []
    for i in range(warmup + iters):
        comm.Barrier()
        t0 = MPI.Wtime()
        body()
        if i >= warmup:
            times.append(MPI.Wtime() - t0)
    return float(np.median(times))


def _measure_overlap(comm, world, op: str, size: int, iters: int, warmup: int) -> Dict[str, float]:
    """t_pure, t_cpu, t_ovrl without and with polling, and the OSU / IMB-NBC overlap %."""
    from mpi4py import MPI

    send, recv = _buffers(op, size, comm.Get_size())
    start = _starter(comm, op, send, recv)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((128, 128)).astype(np.float32)
    b = rng.standard_normal((128, 128)).astype(np.float32)

    def median_time(body):
        return barrier_median_time(comm, body, iters, warmup)

    t_pure = median_time(lambda: start().Wait())
    t_gemm = median_time(lambda: _gemm_calls(4, a, b)) / 4
    # every rank computes the same number of GEMMs (the slowest rank's pure time decides)
    n_calls = max(1, int(round(world.allreduce(t_pure, op=MPI.MAX) / max(t_gemm, 1e-9))))
    n_calls = world.allreduce(n_calls, op=MPI.MAX)
    t_cpu = median_time(lambda: _gemm_calls(n_calls, a, b))
    # once more, with the GEMM time measured inside a phase of that length (contention changes it)
    t_cpu_max = world.allreduce(t_cpu, op=MPI.MAX)
    n_calls = max(1, int(round(n_calls * world.allreduce(t_pure, op=MPI.MAX) / max(t_cpu_max, 1e-9))))
    n_calls = world.allreduce(n_calls, op=MPI.MAX)
    t_cpu = median_time(lambda: _gemm_calls(n_calls, a, b))

    def overlapped(poll: bool):
        def body():
            req = start()
            _gemm_calls(n_calls, a, b, (lambda: req.Test()) if poll else None)
            req.Wait()
        return body

    t_none = median_time(overlapped(False))
    t_poll = median_time(overlapped(True))
    out = {"t_pure": t_pure, "t_cpu": t_cpu, "t_ovrl_none": t_none, "t_ovrl_poll": t_poll, "gemms": n_calls}
    for mode, t in (("none", t_none), ("poll", t_poll)):
        out[f"osu_{mode}"] = world.allreduce(osu_overlap(t, t_cpu, t_pure)) / world.Get_size()
        slow = [world.allreduce(v, op=MPI.MAX) for v in (t, t_cpu, t_pure)]
        out[f"imb_{mode}"] = imb_overlap(*slow)
    return out


def _measure_sync(comm, iters: int, warmup: int) -> float:
    """Extra seconds of an 8-byte ``Iallreduce`` issued right after a compute phase (no barrier before it),
    over the same collective after a barrier: the cost of ranks arriving apart, which on an oversubscribed
    node includes waiting for partners to be scheduled. Median over iterations on each rank."""
    from mpi4py import MPI

    send, recv = np.ones(2, np.float32), np.empty(2, np.float32)
    rng = np.random.default_rng(comm.Get_rank())
    a = rng.standard_normal((96, 96)).astype(np.float32)
    extra = []
    for i in range(warmup + iters):
        comm.Barrier()
        t0 = MPI.Wtime()
        comm.Iallreduce(send, recv).Wait()
        t_pure = MPI.Wtime() - t0
        comm.Barrier()
        t0 = MPI.Wtime()
        for _ in range(8):
            a @ a
        t1 = MPI.Wtime()
        comm.Iallreduce(send, recv).Wait()
        t_after = MPI.Wtime() - t1
        if i >= warmup:
            extra.append(max(0.0, t_after - t_pure))
    return float(np.median(extra))


def _sleep_others(world, measure):
    """Rank 0 runs ``measure()`` while the others sleep (not spin in MPI); returns its result on all."""
    world.Barrier()
    if world.Get_rank() == 0:
        result = measure()
    else:
        result = None
    # the others sleep in slices until rank 0 reports (a nonblocking barrier, tested rarely)
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(0.01 if world.Get_rank() else 0.0)
    return world.bcast(result, root=0)


def _compute_rates(world, dtypes: List[str], n: int, backend_name: str) -> Dict[str, Dict[str, float]]:
    """GEMM TFLOP/s per dtype alone and all at once; element-wise bandwidth and per-call overhead alone."""
    from fourd_mpi.core.backend import make_backend, parse_dtype
    from fourd_mpi.step.kernels import standalone_gemm_tflops

    out: Dict[str, Dict[str, float]] = {"alone": {}, "all": {}}
    for dtype in dtypes:
        backend = make_backend(backend_name, parse_dtype(dtype), 0, "staged" if backend_name == "cupy" else "auto")
        out["alone"][dtype] = _sleep_others(world, lambda: standalone_gemm_tflops(backend, n, n, n, repeats=5,
                                                                                  min_seconds=0.2))
        world.Barrier()
        rate = standalone_gemm_tflops(backend, n, n, n, repeats=5, min_seconds=0.4)
        out["all"][dtype] = world.allreduce(rate) / world.Get_size()

    def elementwise():
        big = np.ones(1 << 20, np.float32)
        big2 = np.ones(1 << 20, np.float32)
        small = np.ones(8, np.float32)
        res = np.empty_like(big)
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            np.add(big, big2, out=res)
            times.append(time.perf_counter() - t0)
        bw = 3 * big.nbytes / min(times)
        calls = []
        for _ in range(20):
            t0 = time.perf_counter()
            for _ in range(100):
                small + small
            calls.append((time.perf_counter() - t0) / 100)
        return bw, min(calls)

    bw, call = _sleep_others(world, elementwise)
    out["mem_bandwidth_gbs"] = {"alone": bw / 1e9}
    out["op_overhead_s"] = {"alone": call}
    world.Barrier()
    return out


def iteration_rule(args) -> IterationRule:
    """The :class:`IterationRule` of the command line (``--iters``, ``--min-time``, ``--max-time``,
    ``--warmup``; defaults where an option is absent)."""
    d = IterationRule()
    return IterationRule(int(getattr(args, "iters", d.min_iters)), float(getattr(args, "min_time", d.min_time)),
                         float(getattr(args, "max_time", d.max_time)), int(getattr(args, "warmup", d.warmup)))


def _time_run(comm, world, op: str, size: int, rule: IterationRule) -> float:
    """Median seconds per message of :data:`RUN_LENGTH` ``op`` messages issued back to back on ``comm``,
    each waited before the next is issued (as ``GradientSync.finish`` issues the data all-reduces at the
    end of the backward pass), every group of the axis at once (:func:`iteration_barrier` before each
    run); collective over ``world``. Unlike :func:`_time_op`'s single message after a barrier, no message
    but the first follows an idle link: where a token bucket (``tc tbf``) shapes the link, the idle time
    refills it and a single message of up to the burst passes faster than the link's rate; messages back
    to back get the rate."""
    p = comm.Get_size()
    send, recv = _buffers(op, size, p)
    start = _starter(comm, op, send, recv)

    def body():
        for _ in range(RUN_LENGTH):
            req = start()
            if req is not None:
                req.Wait()

    return float(np.median(timed_iterations(world, (iteration_barrier(comm, world), body), rule))) / RUN_LENGTH


def _checked_options(args, size: int):
    """The options of ``bench collectives`` checked on every rank before any collective: ``(ops, dtypes, grids,
    model, dtype, messages)``; the grids from ``--grid``, the ``--gx``... flags or :func:`default_grids`, and the
    step's own messages on them (:func:`step_messages`; a bad ``--model`` fails here). A wrong option:
    :class:`~fourd_mpi.errors.ConfigError` with the reason."""
    ops = [o.strip().lower() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise ConfigError(f"--ops: unknown {', '.join(bad)} (choose from {', '.join(OPS)})")
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be zero or positive, got {args.warmup}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    from fourd_mpi.core.backend import DTYPES

    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise ConfigError(f"--dtypes: unknown {', '.join(bad) or '(none)'} (choose from {', '.join(DTYPES)})")
    flags = {"data": args.gdata, "z": args.gz, "y": args.gy, "x": args.gx}
    if args.grid:
        grids = [GridShape.parse(g) for g in args.grid]
        wrong = [str(g) for g in grids if g.size != size]
        if wrong:
            raise ConfigError(f"--grid {', '.join(wrong)}: product is not the world size {size}")
    elif any(v is not None for v in flags.values()):
        grids = [infer_grid_shape(size, **flags)]
    else:
        grids = default_grids(size)
    # the step's own messages on these grids (a bad --model fails here, on every rank, before any collective)
    from fourd_mpi.step.presets import resolve_model

    model = getattr(args, "model", None) or "gpt-tiny"
    dtype = getattr(args, "dtype", None) or "float32"
    cfg = resolve_model(model, **{k: getattr(args, k, None) for k in ("layers", "hidden", "heads", "ffn_hidden",
                                                                       "seq", "batch")})
    # a prime world has no benchmarked grid: the run's default grid then (its data axis is the world)
    messages = step_messages(cfg, grids or [infer_grid_shape(size)], dtype)
    # every rank checks the same sizes before any collective
    for g in grids:
        for axis in ("x", "y", "z", "data"):
            if g[axis] > 1:
                message_sizes(args.min_size, args.max_size, args.factor, 4 * g[axis])
    message_sizes(args.min_size, args.max_size, args.factor, 4 * size)
    return ops, dtypes, grids, model, dtype, messages


def _bench_comms(world, grids: List[GridShape], with_world: bool):
    """The communicators to measure: ``(comms, made, num_nodes, ranks_per_node)``; ``comms`` lists ``[name,
    level, communicator, axes it stands for, ranks of one group per node]``, one per distinct group size and
    placement over the axes of ``grids`` (an axis of every rank is the world's group), then the world when
    ``with_world`` and it is not there yet; ``made``: the process grids built (the caller frees them).
    Collective over ``world``."""
    from fourd_mpi.core.grid import ProcessGrid, gather_placement

    size = world.Get_size()
    comms: List[List] = []  # [name, level, communicator, axes it stands for, per_node]
    seen: Dict[Tuple, List] = {}
    made = []
    # the world's nodes from the launcher's assignment (not from the grids: a prime world size has none)
    whole = gather_placement(world, {"data": 1, "z": 1, "y": 1, "x": size})
    num_nodes, local_size = whole.num_nodes, max(whole.ranks_per_node)
    for g in grids:
        pg = ProcessGrid(world, g)
        made.append(pg)
        num_nodes, local_size = pg.num_nodes, max(pg.ranks_per_node)
        for axis in ("x", "y", "z", "data"):
            p = g[axis]
            if p == 1:
                continue
            level = "intra" if pg.intra_node[axis] else "inter"
            # ranks of one group on a node: the group's size over the most nodes any group spans
            per_node = -(-p // max(pg.placement.spans.get(axis) or [1]))
            # the same group size and placement (on one node; across nodes the same ranks per node), or
            # an axis of every rank (the world's group): measured once, reported for every axis it stands for
            key = ("all",) if p == size else (p, level, per_node)
            if key in seen:
                seen[key][3].append(f"{g}:{axis}")
                continue
            seen[key] = [f"{g}:{axis}", level, pg.axis_comm(axis), [f"{g}:{axis}"], per_node]
            comms.append(seen[key])
    if with_world and size > 1:
        if ("all",) in seen:  # an axis of every rank is the world's group
            seen[("all",)][3].append("world")
        else:
            comms.append(["world", "intra" if num_nodes == 1 else "inter", world, ["world"], local_size])
    return comms, made, num_nodes, local_size


def _measure_item(item: Item, entry: List, world, rule: IterationRule, args, watch, out: Dict[str, List]):
    """Measure one :class:`Item` of the plan on its communicator ``entry`` (of :func:`_bench_comms`) under
    ``rule`` (its ``max_time`` already bounded) and append the result to its list of ``out`` (``rows``,
    ``runs``, ``syncs`` or ``overlap``); returns the row of an ``op`` item (None for the others). Collective
    over ``world``; ``watch(what)`` is the watchdog's context for the measurement."""
    from mpi4py import MPI

    name, level, comm, also, per_node = entry
    size = world.Get_size()
    p, s, op = comm.Get_size(), item.size, item.op
    if item.what == "op":
        inplace = item.inplace
        with watch(f"{op} of {s} bytes on {name} ({'in place' if inplace else 'out of place'}, "
                   f"at least {min(rule.min_iters, rule.max_iters)} iterations)"):
            lat, wrong, iters = _time_op(comm, world, op, s, rule, inplace)
            stats = (world.allreduce(lat, op=MPI.MAX), world.allreduce(lat) / size,
                     world.allreduce(lat, op=MPI.MIN))
            wrong = world.allreduce(wrong)
        row = Row(name, level, p, op, s, iters, stats[0], inplace, stats[1], stats[2], stats[0], wrong,
                  ",".join(also), per_node)
        out["rows"].append(row)
        return row
    if item.what == "run":  # back-to-back runs: the step's data all-reduces (inter-node links only)
        with watch(f"a run of {RUN_LENGTH} back-to-back iallreduce of {s} bytes on {name}"):
            lat = world.allreduce(_time_run(comm, world, op, s, rule), op=MPI.MAX)
        out["runs"].append(Row(name, level, p, op, s, RUN_LENGTH, lat, False, lat, lat, lat, 0, ",".join(also),
                               per_node))
    elif item.what == "sync":
        with watch(f"the synchronization measurement of iallreduce on {name}"):
            sync = world.allreduce(_measure_sync(comm, max(5, args.iters), args.warmup), op=MPI.MAX)
        out["syncs"].append({"comm": name, "axes": ",".join(also), "level": level, "p": p, "sync_s": sync})
    else:
        with watch(f"the overlap measurement of {op} of {s} bytes on {name}"):
            res = _measure_overlap(comm, world, op, s, max(3, args.iters // 4), args.warmup)
        out["overlap"].append(dict(comm=name, axes=",".join(also), level=level, p=p, op=op, size=s, **res))
    return None


def run_bench(args, world, watchdog=None, report: Optional["StreamReport"] = None) -> Dict:
    """Measure everything the options ask for, within ``--time-limit`` (:class:`Budget`); returns ``{"rows",
    "overlap", "compute", "grids", ...}`` (same on every rank).

    ``watchdog``: a :class:`~fourd_mpi.core.watchdog.Watchdog` that watches each measurement (one
    communicator, op, size and placement) and aborts the job when a rank waits longer than its limit.
    ``report`` (rank 0's, None on the others): a :class:`StreamReport` that prints each size's row as soon as
    it is measured and a progress line on standard error.

    Phases: the options checked (:func:`_checked_options`), the communicators built (:func:`_bench_comms`),
    the compute calibration, then each item of the plan within the bound (:func:`_measure_item`)."""
    import contextlib

    def watch(what: str):
        return watchdog.watching(what) if watchdog is not None else contextlib.nullcontext()

    from mpi4py import MPI

    size = world.Get_size()
    ops, dtypes, grids, model, dtype, messages = _checked_options(args, size)
    limit = float(getattr(args, "time_limit", 0) or 0)
    comms, made, num_nodes, local_size = _bench_comms(world, grids, not args.no_world)

    out: Dict[str, List] = {"rows": [], "runs": [], "overlap": [], "syncs": []}  # runs: seconds per message
    placements = (False, True) if getattr(args, "in_place", True) else (False,)
    rule = iteration_rule(args)
    sizes = [message_sizes(args.min_size, args.max_size, args.factor, 4 * comm.Get_size())
             for _, _, comm, _, _ in comms]
    items = plan_items([(",".join(also), comm.Get_size(), level) for _, level, comm, also, _ in comms], sizes, ops,
                       placements, args.overlap_sizes)
    budget = Budget(limit, items, rule, overlap_iters=max(3, args.iters // 4), sync_iters=max(5, args.iters))
    listed = [{"comm": name, "axes": also, "level": level, "p": comm.Get_size(), "per_node": per_node}
              for name, level, comm, also, per_node in comms]
    head = {"world_size": size, "num_nodes": num_nodes, "grids": [str(g) for g in grids], "rule": rule.describe(),
            "bound": budget.describe(), "comms": listed}
    if report is not None:
        report.begin(head)
    world.Barrier()
    t0 = MPI.Wtime()
    # first: its time is then known, and the bound covers it (the sweep gets what it leaves)
    if report is not None:
        report.note(f"compute calibration first: GEMM rates of {', '.join(dtypes)} (n = {args.gemm_size}) alone and "
                    f"with all ranks, element-wise bandwidth")
    with watch("the compute calibration (GEMM and elementwise rates)"):
        compute = _compute_rates(world, dtypes, args.gemm_size, args.backend)
    done: List[Row] = []  # the rows of the size being measured (its placements)
    for i, item in enumerate(items):
        elapsed = world.allreduce(MPI.Wtime() - t0, op=MPI.MAX)  # the same on every rank: so is the decision
        go, bound = budget.decide(i, elapsed)
        if report is not None:
            report.progress(item, i, len(items), elapsed, budget.left(i, elapsed),
                            budget.cost(item, bound) if go else 0)
        if go:
            row = _measure_item(item, comms[item.comm], world, replace(rule, max_time=bound), args, watch, out)
            if row is not None:
                done.append(row)
                budget.record(item, row.lat_s)
        if item.what == "op" and (i + 1 == len(items) or items[i + 1].size_key != item.size_key):  # its last placement
            if report is not None and done:
                report.rows(done)
            done = []
    for pg in made:
        pg.free()
    return {**out, "compute": compute,
            "grids": [str(g) for g in grids], "bound": budget.describe(),
            "sweep": budget.summary(world.allreduce(MPI.Wtime() - t0, op=MPI.MAX)),
            "skipped_line": budget.skipped_line(),
            "comms": listed, "rule": rule.describe(), "step_model": {"model": model, "dtype": dtype},
            "step_messages": cover_step_messages(messages, out["rows"], size),
            "num_nodes": num_nodes, "ranks_per_node": local_size, "world_size": size}


def mpi_library() -> str:
    """The MPI library that measured (the first line of ``MPI_Get_library_version``): the profile's
    ``calibration.mpi`` (:func:`fourd_mpi.perf.calibration.build_profile`)."""
    from mpi4py import MPI

    return MPI.Get_library_version().splitlines()[0].strip()
