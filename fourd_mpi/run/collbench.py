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
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

import numpy as np

from fourd_mpi.core.colltable import ALPHA_BETA_FORMULA, BUSBW_FORMULA_SHORT, collective
from fourd_mpi.core.grid import GridShape, infer_grid_shape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.calibration import KIND_OF, OPS, Row
from fourd_mpi.util.text import human_bytes
from fourd_mpi.util.units import MIB

FORMULAS = [
    "latency: median over iterations on each rank, max over ranks; size S = nccl-tests size "
    "(gathered buffer / full input / buffer)",
    f"algbw = S / latency;  {BUSBW_FORMULA_SHORT}",
    "OSU overlap % = max(0, 100 - 100*(t_ovrl - t_cpu)/t_pure), averaged over ranks",
    "IMB-NBC overlap % = 100*max(0, min(1, (t_pure + t_cpu - t_ovrl)/max(t_pure, t_cpu))), slowest rank's times",
    f"fit: {ALPHA_BETA_FORMULA} (least squares on relative error, nonblocking forms)",
]


# ---------------------------------------------------------------------------
# pure helpers (tested without MPI)
# ---------------------------------------------------------------------------

def message_sizes(min_size: int, max_size: int, factor: int, multiple: int) -> List[int]:
    """Sizes from ``min_size`` to ``max_size`` in steps of ``factor``, and ``max_size`` itself when the
    steps miss it (8, 64, ..., 16M, 64M with the defaults), each rounded up to a multiple of
    ``multiple`` bytes (whole elements on every rank of the group)."""
    if min_size > max_size:
        raise ConfigError(f"--min-size {min_size} is larger than --max-size {max_size}")
    if factor < 2:
        raise ConfigError(f"--factor must be at least 2, got {factor}")
    out, s = [], min_size
    while s <= max_size:
        rounded = -(-s // multiple) * multiple
        if rounded not in out:
            out.append(rounded)
        s *= factor
    last = -(-max_size // multiple) * multiple
    if last not in out and last > out[-1]:
        out.append(last)
    return out


#: the overlap is measured at sizes up to this (the sweep's old largest size): its four timed phases at 64 MiB
#: cost tens of seconds each on an oversubscribed node, and the overlap efficiency needs no larger message
OVERLAP_MAX_BYTES = 4 * MIB


def overlap_sizes(sizes: List[int], k: int) -> List[int]:
    """The ``k`` largest of ``sizes`` not above :data:`OVERLAP_MAX_BYTES` (the smallest size when all are above)."""
    fit = [s for s in sizes if s <= OVERLAP_MAX_BYTES] or sizes[:1]
    return fit[-k:] if k > 0 else []


def osu_overlap(t_ovrl: float, t_cpu: float, t_pure: float) -> float:
    """OSU's overlap % of one rank."""
    return max(0.0, 100.0 - 100.0 * (t_ovrl - t_cpu) / t_pure) if t_pure > 0 else float("nan")


def imb_overlap(t_ovrl: float, t_cpu: float, t_pure: float) -> float:
    """IMB-NBC's overlap %."""
    denom = max(t_pure, t_cpu)
    return 100.0 * max(0.0, min(1.0, (t_pure + t_cpu - t_ovrl) / denom)) if denom > 0 else float("nan")


def step_messages(cfg, grids: List[GridShape], dtype: str = "float32") -> List[Dict]:
    """The messages one training step of ``fourd-mpi run --model ...`` (overlap none) issues on each grid,
    per axis and collective (:func:`fourd_mpi.perf.volumes.step_collectives`): ``{"grid", "axis", "p",
    "op", "sizes": the distinct message bytes (nccl-tests size), ascending, "messages": per step}``."""
    from fourd_mpi.perf.volumes import step_collectives

    out: Dict[Tuple[str, str, str], Dict] = {}
    for g in grids:
        for c in step_collectives(replace(cfg, layers=1), g, None, dtype):  # every block's: counted L times
            e = out.setdefault((str(g), c.axis, c.op), {"grid": str(g), "axis": c.axis, "p": c.p, "op": c.op,
                                                        "sizes": set(), "messages": 0})
            e["sizes"].add(int(c.message_bytes))
            e["messages"] += c.count * (1 if c.layer == "loss" else cfg.layers)
    for e in out.values():
        e["sizes"] = sorted(e["sizes"])
    return list(out.values())


def cover_step_messages(messages: List[Dict], rows: List["Row"], world_size: int = 0) -> List[Dict]:
    """Each entry of :func:`step_messages` with ``measured`` (``[smallest, largest]`` bytes measured for its
    grid's axis and collective, either form, or None) and ``covered``: True when no message is larger
    than the largest measured (smaller than the smallest is latency-bound: the model takes the smallest's
    time, :func:`fourd_mpi.perf.machine.interpolate_measured`), False when one is, None when not measured.
    An axis of all ``world_size`` ranks is the world's group: the ``world`` rows count for it."""
    out = []
    for e in messages:
        names = {f"{e['grid']}:{e['axis']}"} | ({"world"} if e["p"] == world_size else set())
        sizes = [r.size for r in rows if r.kind == e["op"] and names & set((r.axes or r.comm).split(","))]
        measured = [min(sizes), max(sizes)] if sizes else None
        out.append(dict(e, measured=measured, covered=None if measured is None else e["sizes"][-1] <= measured[1]))
    return out


def step_message_lines(messages: List[Dict], model: str, dtype: str) -> List[str]:
    """The ``#`` lines of the report: one per grid, axis and collective of the step, and whether the
    measured sizes cover it."""
    if not messages:
        return []
    lines = [f"# the step's own messages (fourd-mpi run --model {model} --dtype {dtype}, overlap none, per rank and "
             f"step; nccl-tests size) per grid, axis and collective, and whether the measured sizes cover them:"]
    for e in messages:
        sizes = e["sizes"]
        what = (human_bytes(sizes[0]) if len(sizes) == 1
                else f"{len(sizes)} sizes {human_bytes(sizes[0])} - {human_bytes(sizes[-1])}")
        label = e["op"].replace("_", "-").replace("allreduce", "all-reduce").replace("allgather", "all-gather")
        if e["covered"] is None:
            state = "not measured (--ops)"
        elif e["covered"]:
            state = f"covered (measured {human_bytes(e['measured'][0])} - {human_bytes(e['measured'][1])})"
        else:
            state = (f"NOT covered: larger than the largest measured, {human_bytes(e['measured'][1])} (--max-size; "
                     f"the model extrapolates the last measured slope)")
        lines.append(f"#   {e['grid']} {e['axis']:<4} p = {e['p']:<3} {label:<14} {what}, {e['messages']} message(s): "
                     f"{state}")
    return lines


def default_grids(world_size: int) -> List[GridShape]:
    """One grid per divisor ``1 < p < world`` with ``G_x = p`` (the data axis takes the rest)."""
    return [GridShape(world_size // p, 1, 1, p) for p in range(2, world_size) if world_size % p == 0]


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


#: the timed iterations of one measurement stop at this count whatever the other rules say
MAX_ITERATIONS = 1 << 20


@dataclass(frozen=True)
class IterationRule:
    """When the timed iterations of one measurement (communicator, op, size, placement) stop.

    In the spirit of OSU (``-x`` warm-up, ``-i`` iterations) and nccl-tests (``-w``, ``-n``), with
    Google Benchmark's minimum time: after ``warmup`` untimed iterations, timed ones run until BOTH
    ``min_iters`` iterations AND ``min_time`` seconds of timed iterations (the slowest rank's sum, as
    the reported latency is the slowest rank's median) are reached. Bounds: ``max_time`` seconds of wall
    time of the timed phase (barriers included, the maximum over ranks; at least one iteration)
    or :data:`MAX_ITERATIONS` iterations, whichever comes first, even below ``min_iters`` or
    ``min_time``: a slow link cannot run forever.

    The decision is collective: the ranks exchange ``(timed, wall)`` (one ``allreduce`` over the
    world, outside the timed intervals) after the first iteration and then at the counts
    :meth:`next_target` predicts, so every rank runs the same number of iterations and the
    collectives stay matched.
    """

    min_iters: int = 20
    min_time: float = 0.2
    max_time: float = 10.0
    warmup: int = 3
    max_iters: int = MAX_ITERATIONS

    def next_target(self, n: int, timed: float, wall: float) -> int:
        """0 to stop after ``n`` iterations, else the iteration count to reach before the next check.

        ``timed``: seconds of the ``n`` timed iterations (maximum over ranks); ``wall``: seconds since
        the first timed iteration began (maximum over ranks). The next count is what the mean
        iteration so far needs to reach ``min_iters`` and ``min_time`` (+10 %), at most 10 x ``n`` (an
        estimate from few iterations) and at most what still fits into ``max_time``."""
        if n >= self.max_iters or wall >= self.max_time:
            return 0
        if n >= self.min_iters and timed >= self.min_time:
            return 0
        want = self.min_iters
        if timed < self.min_time:
            # 10 % more than the mean predicts: iterations vary, and each check costs an allreduce
            want = max(want, n + math.ceil(1.1 * (self.min_time - timed) * n / timed) if timed > 0 else 10 * n)
        target = min(want, 10 * n)
        if wall > 0:  # what fits into the rest of max_time at the mean wall time per iteration so far
            target = min(target, n + max(1, int((self.max_time - wall) * n / wall)))
        return max(n + 1, min(target, self.max_iters))

    def describe(self) -> str:
        return (f"{self.warmup} warm-up iterations, then timed ones until both {self.min_iters} iterations and "
                f"{self.min_time:g} s of timed iterations are reached; bounded by {self.max_time:g} s per "
                f"measurement (at least one iteration) or {self.max_iters:,} iterations")


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


#: messages of one back-to-back run (:func:`_time_run`): enough that a shaped link's burst, which only the first
#: message after an idle link can use, is a small part of the run (the step's data all-reduces are 8 per block)
RUN_LENGTH = 4


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


# ---------------------------------------------------------------------------
# the plan of the sweep, its bound and its progress (pure: tested without MPI)
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Item:
    """One measurement of the sweep, in the order they run. ``what``: ``op`` (one collective, size and
    placement: a row of the report), ``run`` (:func:`_time_run`), ``sync`` (:func:`_measure_sync`) or
    ``overlap`` (:func:`_measure_overlap`); ``comm``: the index of its communicator, ``name`` its axes,
    ``p`` its size; ``index`` of ``count``: the size's place among the communicator's sizes (from 1)."""

    what: str
    comm: int
    name: str
    p: int
    op: str
    size: int = 0
    index: int = 0
    count: int = 0
    inplace: bool = False

    @property
    def size_key(self) -> Tuple:
        """Equal for the placements of one row (what one line of the report shows)."""
        return (self.what, self.comm, self.op, self.size)

    def describe(self) -> str:
        where = f"on {self.name} (p={self.p})"
        at = f"size {self.index} of {self.count} ({human_bytes(self.size)})"
        if self.what == "op":
            return f"{self.op} {where}, {at}, {'in-place' if self.inplace else 'out-of-place'}"
        if self.what == "run":
            return f"{RUN_LENGTH} back-to-back {self.op} {where}, {at}"
        if self.what == "overlap":
            return f"overlap of {self.op} {where} at {human_bytes(self.size)}"
        return f"synchronization cost of {self.op} {where}"

    def as_dict(self) -> Dict:
        out = {"what": self.what, "comm": self.name, "p": self.p, "op": self.op, "size": self.size}
        if self.what == "op":
            out["placement"] = "in-place" if self.inplace else "out-of-place"
        return out


def plan_items(comms: List[Tuple[str, int, str]], sizes: List[List[int]], ops: List[str],
               placements: Tuple[bool, ...], overlap_k: int) -> List[Item]:
    """Every measurement of the sweep in the order :func:`run_bench` makes them. ``comms``: ``(name, p, level)``
    of each communicator, ``sizes`` its message sizes. Per communicator and op, size by size (ascending): the
    size in each placement, then for ``iallreduce`` across nodes its back-to-back run, for a nonblocking op the
    overlap when :func:`overlap_sizes` picks the size, and after the smallest size of ``iallreduce`` the
    synchronization cost; so a bound that runs out leaves out the largest sizes of every kind."""
    items: List[Item] = []
    for c, ((name, p, level), ss) in enumerate(zip(comms, sizes)):
        n = len(ss)
        for op in ops:
            overlapped = set(overlap_sizes(ss, overlap_k)) if op.startswith("i") and overlap_k > 0 else set()
            for i, s in enumerate(ss, 1):
                items += [Item("op", c, name, p, op, s, i, n, inplace) for inplace in placements]
                if op == "iallreduce" and level == "inter":
                    items.append(Item("run", c, name, p, op, s, i, n))
                if op == "iallreduce" and i == 1:
                    items.append(Item("sync", c, name, p, op, 8, 1, 1))
                if s in overlapped:
                    items.append(Item("overlap", c, name, p, op, s, i, n))
    return items


#: the default ``--time-limit``: the whole sweep, the compute calibration before it included
#: (docs/guide/model-and-tuning.md)
DEFAULT_TIME_LIMIT_S = 300.0
#: seconds guessed for a measurement that nothing measured yet predicts (the first of a communicator)
GUESS_S = 0.25
#: compute of one synchronization iteration (eight 96 x 96 GEMMs; a generous guess)
SYNC_COMPUTE_S = 1e-3
#: timed phases of an overlap measurement in units of the pure collective (pure, compute twice, two
#: overlapped ones of up to twice the pure time)
OVERLAP_PHASES = 7


def _extrapolate(points: Dict[int, float], size: int) -> float:
    """Seconds at ``size`` from measured ``{size: seconds}``: the straight line through the two largest
    measured sizes at or below it (slope at least 0), the single one's time, or the smallest size's time below
    every measured size (latency-bound)."""
    below = sorted(s for s in points if s <= size)
    if not below:
        return points[min(points)]
    if len(below) == 1:
        return points[below[0]]
    s0, s1 = below[-2], below[-1]
    slope = max(0.0, (points[s1] - points[s0]) / (s1 - s0))
    return points[s1] + slope * (size - s1)


def _merged(tables) -> Dict[int, float]:
    out: Dict[int, float] = {}
    for table in tables:
        for s, t in table.items():
            out[s] = max(out.get(s, 0.0), t)
    return out


class Budget:
    """The bound on the whole sweep (``--time-limit``) and the estimate of the time it has left.

    Before each item the ranks agree on the elapsed time (the slowest rank's), and :meth:`decide` says whether
    the item runs and the wall-time bound of its timed iterations: the same on every rank, since its inputs
    are agreed (the elapsed time, and latencies that are maxima over ranks), so the collectives stay matched.

    The time is allotted by block: a block is one communicator and collective (its sizes in each placement,
    then its back-to-back runs, synchronization and overlap measurements). When a block starts, it gets the
    time left (the limit less the time elapsed, which includes the compute calibration before the sweep, and
    :attr:`reserve`, time kept for work after it) times its share of the measurements left; what a block leaves unused goes to the blocks after it. An item
    runs when its least predicted time (:meth:`least`: warm-up, ``--min-time`` of timed iterations or one
    iteration, the result check) fits into what is left of its block, and its timed iterations stop after
    ``min(--max-time, max(that less its predicted warm-up and check, --min-time))`` (at least one). So the
    largest sizes of a slow link are left out, not the communicators and collectives measured after them; and
    the bound leaves sizes out rather than measure them below ``--min-time``: with ``--min-time`` m, T seconds
    hold at most ``max(1, T/m)`` rows. A skipped item is listed (:meth:`summary`, :meth:`skipped_line`).

    The time of one call is predicted from what was measured (maxima over ranks): the same size on the same
    communicator by another op, else a straight line through the two largest sizes below it of the same op
    and communicator, of any op on it, of any communicator (:func:`_extrapolate`); nothing measured yet:
    :data:`GUESS_S` for the whole measurement, and it runs. ``limit`` 0: no bound (estimates only)."""

    def __init__(self, limit: float, items: List[Item], rule: "IterationRule", reserve: float = 0.0,
                 overlap_iters: int = 3, sync_iters: int = 5):
        self.limit, self.items, self.rule, self.reserve = float(limit), items, rule, float(reserve)
        self.overlap_iters, self.sync_iters = overlap_iters, sync_iters
        self.lat: Dict[Tuple[int, str], Dict[int, float]] = {}
        self.skipped: List[Item] = []
        self.block = [0] * len(items)  # the block of each item, and each block's length
        self.lengths: List[int] = []
        for i, item in enumerate(items):
            if i == 0 or (item.comm, item.op) != (items[i - 1].comm, items[i - 1].op):
                self.lengths.append(0)
            self.block[i] = len(self.lengths) - 1
            self.lengths[-1] += 1
        self._current: Tuple[int, float] = (-1, 0.0)  # (block, elapsed time at which its allotment ends)

    def record(self, item: Item, seconds: float) -> None:
        """The measured seconds of one call of ``item`` (an ``op`` item; agreed over ranks)."""
        if item.what == "op" and math.isfinite(seconds) and seconds > 0:
            table = self.lat.setdefault((item.comm, item.op), {})
            table[item.size] = max(table.get(item.size, 0.0), seconds)

    def per_call(self, comm: int, op: str, size: int) -> Optional[float]:
        """Predicted seconds of one call of ``op`` of ``size`` bytes on communicator ``comm``, or None."""
        same = [t[size] for (c, _), t in self.lat.items() if c == comm and size in t]
        if same:
            return max(same)
        for tables in ([self.lat[(comm, op)]] if (comm, op) in self.lat else [],
                       [t for (c, _), t in self.lat.items() if c == comm], list(self.lat.values())):
            merged = _merged(tables)
            if merged:
                return _extrapolate(merged, size)
        return None

    def _call(self, item: Item) -> Optional[float]:
        t = self.per_call(item.comm, item.op, item.size)
        return None if t is None else t * (RUN_LENGTH if item.what == "run" else 1)

    def cost(self, item: Item, bound: Optional[float] = None) -> float:
        """Predicted seconds of ``item`` with its timed iterations bounded by ``bound`` (default --max-time)."""
        t = self._call(item)
        rule = self.rule
        if t is None:
            return max(rule.min_time, GUESS_S)
        if item.what == "overlap":
            return OVERLAP_PHASES * (rule.warmup + self.overlap_iters) * t
        if item.what == "sync":
            return 2 * (rule.warmup + self.sync_iters) * (t + SYNC_COMPUTE_S)
        n = max(rule.min_iters, math.ceil(rule.min_time / t) if t > 0 else rule.min_iters)
        bound = rule.max_time if bound is None else min(rule.max_time, max(bound, rule.min_time))
        timed = max(t, min(min(n, rule.max_iters) * t, bound))
        return (rule.warmup + (1 if item.what == "op" else 0)) * t + timed

    def least(self, item: Item) -> Optional[float]:
        """Predicted seconds of ``item`` at its shortest (warm-up, timed iterations of at least ``--min-time``
        or one iteration, the check), or None when nothing predicts it."""
        t = self._call(item)
        if t is None:
            return None
        if item.what in ("op", "run"):
            rule = self.rule
            return (rule.warmup + (1 if item.what == "op" else 0)) * t + max(t, min(rule.min_time, rule.max_time))
        return self.cost(item)

    def room(self, i: int, elapsed: float) -> Optional[float]:
        """Seconds item ``i`` may take: what is left of its block's allotment (and of the whole bound); None
        without a bound. The first item of a block fixes the block's allotment."""
        if self.limit <= 0:
            return None
        left = self.limit - elapsed - self.reserve
        if left <= 0:
            return 0.0
        block = self.block[i]
        if block != self._current[0]:
            self._current = (block, elapsed + left * self.lengths[block] / (len(self.items) - i))
        return max(0.0, min(left, self._current[1] - elapsed))

    def decide(self, i: int, elapsed: float) -> Tuple[bool, float]:
        """``(run item i, the wall-time bound of its timed iterations)``; a skipped item is kept in :attr:`skipped`.
        Called for every item, in order."""
        room = self.room(i, elapsed)
        if room is None:
            return True, self.rule.max_time
        item, rule = self.items[i], self.rule
        least = self.least(item)
        if room <= 0 or (least is not None and least > room):
            self.skipped.append(item)
            return False, 0.0
        t = self._call(item) or 0.0  # the warm-up and the check come on top of the timed iterations
        around = (rule.warmup + 1) * t if item.what in ("op", "run") else 0.0
        return True, min(rule.max_time, max(room - around, rule.min_time))

    def left(self, i: int, elapsed: float) -> float:
        """Estimated seconds from item ``i`` to the end and :attr:`reserve` (at most what the bound leaves); after
        :meth:`decide` of item ``i``."""
        if self.limit <= 0:
            return sum(self.cost(item) for item in self.items[i:]) + self.reserve
        left = max(0.0, self.limit - elapsed - self.reserve)
        share = left / (len(self.items) - i)
        estimate = sum(min(self.cost(item, share * self.lengths[self.block[j]]), share * self.lengths[self.block[j]])
                       for j, item in enumerate(self.items[i:], i)) + self.reserve
        return min(estimate, max(0.0, self.limit - elapsed))

    def describe(self) -> str:
        what = (f"--time-limit {self.limit:g} s for the whole sweep, the compute calibration before it included: each "
                f"communicator and collective gets its share of the time left, and a measurement is skipped when its "
                f"least predicted time exceeds what is left of that share" if self.limit > 0
                else "no bound on the whole sweep (--time-limit 0)")
        return f"{what}; --max-time {self.rule.max_time:g} s per measurement"

    def summary(self, elapsed: float) -> Dict:
        """What the JSON report says of the sweep: the bound, the seconds it took, the measurements planned,
        made and skipped."""
        return {"time_limit_s": self.limit or None, "elapsed_s": elapsed, "planned": len(self.items),
                "measured": len(self.items) - len(self.skipped), "skipped": [s.as_dict() for s in self.skipped]}

    def skipped_line(self) -> Optional[str]:
        """One line naming what ``--time-limit`` left out (by communicator and op, the sizes), or None."""
        if not self.skipped:
            return None
        groups: Dict[Tuple[str, str, str], List[int]] = {}
        for item in self.skipped:
            groups.setdefault((item.what, item.op, item.name), []).append(item.size)
        parts = []
        for (what, op, name), sizes in groups.items():
            span = human_bytes(min(sizes)) + ("" if min(sizes) == max(sizes) else f" - {human_bytes(max(sizes))}")
            label = {"op": op, "run": f"back-to-back {op}", "sync": f"synchronization of {op}",
                     "overlap": f"overlap of {op}"}[what]
            parts.append(f"{label} on {name} {span}" if what != "sync" else f"{label} on {name}")
        shown = "; ".join(parts[:6]) + (f"; and {len(parts) - 6} more" if len(parts) > 6 else "")
        return (f"--time-limit {self.limit:g} s left out {len(self.skipped)} of {len(self.items)} measurements "
                f"(each predicted longer than its share of the time left): {shown}; raise --time-limit, or lower "
                f"--max-size or --max-time")


def duration(seconds: float) -> str:
    """``0.4 s``, ``12 s``, ``3 min 05 s``, ``1 h 02 min``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def progress_line(item: Item, i: int, total: int, elapsed: float, left: float) -> str:
    """The progress line on standard error before measurement ``i`` (from 0) of ``total``."""
    return (f"fourd-mpi bench: [{i + 1}/{total}] {item.describe()}; {duration(elapsed)} elapsed, about "
            f"{duration(left)} left")


#: seconds between two progress lines at most (a new communicator and op, or a long measurement, prints at once)
PROGRESS_EVERY_S = 5.0


class StreamReport:
    """Rank 0's output while the sweep runs, as OSU and nccl-tests print: each size's line on ``out`` as soon
    as it is measured (``table``: :func:`table_head` before the first measurement, :func:`table_block_head`
    for each communicator and op, a :func:`table_row` per size, :func:`table_tail` at the end; ``csv``:
    :func:`csv_head`, then the rows; ``json``: one document at the end), flushed; and a progress line on ``err``
    (:func:`progress_line`) at each new communicator and op, before a measurement predicted to take
    ``every`` seconds or more, and otherwise at most every ``every`` seconds (0: none). What ``out`` receives in
    the end is :func:`format_result`'s text."""

    def __init__(self, fmt: str, out=None, err=None, every: float = PROGRESS_EVERY_S, clock=time.monotonic):
        import sys

        self.fmt, self.out, self.err = fmt, out or sys.stdout, err or sys.stderr
        self.every, self.clock = every, clock
        self._block: Optional[Tuple[str, str]] = None
        self._last: Optional[Tuple[float, Tuple]] = None

    def _write(self, lines: List[str]) -> None:
        if lines:
            self.out.write("\n".join(lines) + "\n")
            self.out.flush()

    def begin(self, head: Dict) -> None:
        self._write(table_head(head) if self.fmt == "table" else csv_head() if self.fmt == "csv" else [])

    def rows(self, rows: List[Row]) -> None:
        """The rows of one size (one per placement measured)."""
        if not rows:
            return
        if self.fmt == "csv":
            self._write(csv_lines(rows))
        elif self.fmt == "table":
            lines = []
            if block_key(rows[0]) != self._block:
                self._block = block_key(rows[0])
                lines += table_block_head(rows[0])
            self._write(lines + [table_row({r.inplace: r for r in rows})])

    def note(self, text: str) -> None:
        """A progress line of its own (what runs before the sweep)."""
        if self.every > 0:
            self.err.write(f"fourd-mpi bench: {text}\n")
            self.err.flush()

    def progress(self, item: Item, i: int, total: int, elapsed: float, left: float, predicted: float = 0.0) -> None:
        if self.every <= 0:
            return
        now, key = self.clock(), (item.comm, item.op, item.what)
        if self._last is None or key != self._last[1] or now - self._last[0] >= self.every or predicted >= self.every:
            self.err.write(progress_line(item, i, total, elapsed, left) + "\n")
            self.err.flush()
            self._last = (now, key)

    def end(self, result: Dict) -> None:
        """What is left to print once everything is measured (and the profile is decided)."""
        if self.fmt == "table":
            self._write(table_tail(result))
        elif self.fmt == "json":
            self._write([format_result(result, "json")])


def run_bench(args, world, watchdog=None, report: Optional["StreamReport"] = None) -> Dict:
    """Measure everything the options ask for, within ``--time-limit`` (:class:`Budget`); returns ``{"rows",
    "overlap", "compute", "grids", ...}`` (same on every rank).

    ``watchdog``: a :class:`~fourd_mpi.core.watchdog.Watchdog` that watches each measurement (one
    communicator, op, size and placement) and aborts the job when a rank waits longer than its limit.
    ``report`` (rank 0's, None on the others): a :class:`StreamReport` that prints each size's row as soon as
    it is measured and a progress line on standard error."""
    import contextlib

    def watch(what: str):
        return watchdog.watching(what) if watchdog is not None else contextlib.nullcontext()

    from mpi4py import MPI

    from fourd_mpi.core.grid import ProcessGrid

    size = world.Get_size()
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
    limit = float(getattr(args, "time_limit", 0) or 0)
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

    comms: List[List] = []  # [name, level, communicator, axes it stands for]
    seen: Dict[Tuple, List] = {}
    made = []
    # the world's nodes from the launcher's assignment (not from the grids: a prime world size has none)
    from fourd_mpi.core.grid import gather_placement

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
    if not args.no_world and size > 1:
        if ("all",) in seen:  # an axis of every rank is the world's group
            seen[("all",)][3].append("world")
        else:
            comms.append(["world", "intra" if num_nodes == 1 else "inter", world, ["world"], local_size])

    rows: List[Row] = []
    runs: List[Row] = []  # back-to-back runs (_time_run): seconds per message
    overlap: List[Dict] = []
    syncs: List[Dict] = []
    placements = (False, True) if getattr(args, "in_place", True) else (False,)
    rule = iteration_rule(args)
    sizes = [message_sizes(args.min_size, args.max_size, args.factor, 4 * comm.Get_size()) for _, _, comm, _, _ in comms]
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
            report.progress(item, i, len(items), elapsed, budget.left(i, elapsed), budget.cost(item, bound) if go else 0)
        name, level, comm, also, per_node = comms[item.comm]
        p, s, op = comm.Get_size(), item.size, item.op
        if go:
            limited = replace(rule, max_time=bound)
            if item.what == "op":
                inplace = item.inplace
                with watch(f"{op} of {s} bytes on {name} ({'in place' if inplace else 'out of place'}, "
                           f"at least {min(rule.min_iters, rule.max_iters)} iterations)"):
                    lat, wrong, iters = _time_op(comm, world, op, s, limited, inplace)
                    stats = (world.allreduce(lat, op=MPI.MAX), world.allreduce(lat) / size,
                             world.allreduce(lat, op=MPI.MIN))
                    wrong = world.allreduce(wrong)
                row = Row(name, level, p, op, s, iters, stats[0], inplace, stats[1], stats[2], stats[0], wrong,
                          ",".join(also), per_node)
                rows.append(row)
                done.append(row)
                budget.record(item, stats[0])
            elif item.what == "run":  # back-to-back runs: the step's data all-reduces (inter-node links only)
                with watch(f"a run of {RUN_LENGTH} back-to-back iallreduce of {s} bytes on {name}"):
                    lat = world.allreduce(_time_run(comm, world, op, s, limited), op=MPI.MAX)
                runs.append(Row(name, level, p, op, s, RUN_LENGTH, lat, False, lat, lat, lat, 0, ",".join(also),
                                per_node))
            elif item.what == "sync":
                with watch(f"the synchronization measurement of iallreduce on {name}"):
                    sync = world.allreduce(_measure_sync(comm, max(5, args.iters), args.warmup), op=MPI.MAX)
                syncs.append({"comm": name, "axes": ",".join(also), "level": level, "p": p, "sync_s": sync})
            else:
                with watch(f"the overlap measurement of {op} of {s} bytes on {name}"):
                    res = _measure_overlap(comm, world, op, s, max(3, args.iters // 4), args.warmup)
                overlap.append(dict(comm=name, axes=",".join(also), level=level, p=p, op=op, size=s, **res))
        if item.what == "op" and (i + 1 == len(items) or items[i + 1].size_key != item.size_key):  # its last placement
            if report is not None and done:
                report.rows(done)
            done = []
    for pg in made:
        pg.free()
    return {"rows": rows, "runs": runs, "overlap": overlap, "syncs": syncs, "compute": compute,
            "grids": [str(g) for g in grids], "bound": budget.describe(),
            "sweep": budget.summary(world.allreduce(MPI.Wtime() - t0, op=MPI.MAX)),
            "skipped_line": budget.skipped_line(),
            "comms": listed, "rule": rule.describe(), "step_model": {"model": model, "dtype": dtype},
            "step_messages": cover_step_messages(messages, rows, size),
            "num_nodes": num_nodes, "ranks_per_node": local_size, "world_size": size}


# ---------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------

#: the column heads of a (communicator, op) block of the text report, two lines (names, units)
TABLE_HEAD = (f"#{'size':>11} {'count':>10} {'type':>6} {'redop':>6} {'root':>5} | {'time':>9} {'algbw':>7} "
              f"{'busbw':>7} {'#wrong':>6} {'iters':>6} | {'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6} "
              f"{'iters':>6} | {'avg':>9} {'min':>9} {'max':>9}")
TABLE_UNITS = (f"#{'(B)':>11} {'(elements)':>10} {'':>6} {'':>6} {'':>5} | {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} "
               f"{'':>6} {'':>6} | {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6} {'':>6} | {'(us)':>9} {'(us)':>9} "
               f"{'(us)':>9}")


def table_head(result: Dict) -> List[str]:
    """The ``#`` lines that open the text report: ranks, nodes, grids, the formulas, the iteration rule, the
    bound on the whole sweep and the communicators (all known before anything is measured)."""
    lines = ["# fourd-mpi bench collectives: " + f"{result['world_size']} ranks, {result['num_nodes']} node(s), "
             f"grids {', '.join(result['grids'])}; type float (float32), redop sum (none for allgather), root -1"]
    lines += [f"# {f}" for f in FORMULAS]
    if result.get("rule"):
        lines.append(f"# iterations: {result['rule']} (column iters)")
    if result.get("bound"):
        lines.append(f"# bound: {result['bound']}")
    for c in result.get("comms", []):
        also = (f" (measured once for all {len(c['axes'])}: same group size and placement)"
                if len(c["axes"]) > 1 else "")
        lines.append(f"# communicator {' = '.join(c['axes'])}: p = {c['p']}, {c['level']}-node{also}")
    return lines


def table_block_head(row: "Row") -> List[str]:
    """The lines that open the block of one communicator and op (``row``: any row of it)."""
    return ["", f"# {row.op} on {row.axes or row.comm} ({row.level}-node, p = {row.p}):   out-of-place   |   "
                "in-place   |   OSU latency over ranks (out-of-place)", TABLE_HEAD, TABLE_UNITS]


def table_row(placed: Dict[bool, "Row"]) -> str:
    """The line of one size: ``placed`` maps in-place (False/True) to its row (a placement not measured: n/a)."""
    oop, ip = placed.get(False), placed.get(True)

    def cells(r):
        if r is None:
            return f"{'n/a':>9} {'':>7} {'':>7} {'':>6} {'':>6}"
        return f"{r.lat_s * 1e6:>9.2f} {r.algbw:>7.3f} {r.busbw:>7.3f} {r.wrong:>6} {r.iters:>6}"

    ref = oop or ip
    return (f" {ref.size:>11} {ref.count:>10} {'float':>6} {ref.redop:>6} {-1:>5} | {cells(oop)} | "
            f"{cells(ip)} | {ref.avg_s * 1e6:>9.2f} {ref.min_s * 1e6:>9.2f} {ref.max_s * 1e6:>9.2f}")


def block_key(row: "Row") -> Tuple[str, str]:
    """The block of the text report a row belongs to: its communicator (every axis it stands for) and op."""
    return (row.axes or row.comm, row.op)


def table_tail(result: Dict) -> List[str]:
    """The lines after the rows: overlap, synchronization, the step's messages, compute, the closing lines."""
    lines: List[str] = []
    if result["overlap"]:
        w = max([13] + [len(o.get("axes") or o["comm"]) for o in result["overlap"]])
        lines += ["", "# overlap with a calibrated compute phase (NumPy 128x128 GEMMs), times in us:",
                  f"#{'comm':<{w}} {'p':>3} {'op':<16} {'size (B)':>10} {'t_pure':>9} {'t_cpu':>9} "
                  f"{'ovrl none':>9} {'OSU%':>6} {'IMB%':>6} {'ovrl poll':>9} {'OSU%':>6} {'IMB%':>6}"]
        for o in result["overlap"]:
            lines.append(f" {o.get('axes') or o['comm']:<{w}} {o['p']:>3} {o['op']:<16} {o['size']:>10} "
                         f"{o['t_pure'] * 1e6:>9.1f} "
                         f"{o['t_cpu'] * 1e6:>9.1f} {o['t_ovrl_none'] * 1e6:>9.1f} {o['osu_none']:>6.1f} "
                         f"{o['imb_none']:>6.1f} {o['t_ovrl_poll'] * 1e6:>9.1f} {o['osu_poll']:>6.1f} "
                         f"{o['imb_poll']:>6.1f}")
    if result.get("syncs"):
        lines += ["", "# synchronization: extra latency of an 8-byte Iallreduce right after compute vs after a barrier:"]
        w = max([14] + [len(y.get("axes") or y["comm"]) for y in result["syncs"]])
        lines += [f"  {y.get('axes') or y['comm']:<{w}} p={y['p']:<3} {y['sync_s'] * 1e6:10.1f} us"
                  for y in result["syncs"]]
    if result.get("step_messages"):
        lines += [""] + step_message_lines(result["step_messages"], **result["step_model"])
    c = result["compute"]
    lines += ["", "# compute (per rank):"]
    for dtype, alone in c["alone"].items():
        lines.append(f"  GEMM {dtype}: {alone * 1e3:.2f} GFLOP/s alone, {c['all'][dtype] * 1e3:.2f} GFLOP/s with all "
                     f"{result['ranks_per_node']} ranks of the node computing (x{alone / c['all'][dtype]:.2f})")
    lines.append(f"  element-wise {c['mem_bandwidth_gbs']['alone']:.2f} GB/s alone; one small NumPy call "
                 f"{c['op_overhead_s']['alone'] * 1e6:.2f} us alone")
    if result.get("skipped_line"):
        lines += ["", f"# left out: {result['skipped_line']}"]
    lines += ["", f"# Out of bounds values : {total_wrong(result)} {'OK' if total_wrong(result) == 0 else 'FAILED'}",
              f"# Avg bus bandwidth    : {avg_busbw(result):.4f} GB/s (mean busbw of all "
              f"{sum(math.isfinite(r.busbw) for r in result['rows'])} rows: "
              f"{' and '.join(sorted({'in-place' if r.inplace else 'out-of-place' for r in result['rows']}, reverse=True)) or 'none'})"]
    return lines


def format_tables(result: Dict) -> str:
    """The text report: nccl-tests-like rows per communicator and op (``#`` header lines with the
    formulas, out-of-place and in-place side by side, ``#wrong``), OSU's avg/min/max latency over
    ranks, the overlap table, compute rates and a closing average bus bandwidth line. Latencies
    in microseconds throughout. :class:`StreamReport` prints the same lines as they are measured:
    :func:`table_head`, then per block :func:`table_block_head` and a :func:`table_row` per size,
    then :func:`table_tail`."""
    lines = table_head(result)
    groups: Dict[Tuple[str, str], Dict[int, Dict[bool, Row]]] = {}
    for r in result["rows"]:
        groups.setdefault(block_key(r), {}).setdefault(r.size, {})[r.inplace] = r
    for by_size in groups.values():
        lines += table_block_head(next(iter(next(iter(by_size.values())).values())))
        lines += [table_row(placed) for _, placed in sorted(by_size.items())]
    return "\n".join(lines + table_tail(result))


def total_wrong(result: Dict) -> int:
    """Wrong result elements of every row (``#wrong``, each already summed over ranks)."""
    return sum(r.wrong for r in result["rows"])


def avg_busbw(result: Dict) -> float:
    """nccl-tests' closing "Avg bus bandwidth": the mean busbw (GB/s) of every row, NaN without rows."""
    busbw = [r.busbw for r in result["rows"] if math.isfinite(r.busbw)]
    return float(np.mean(busbw)) if busbw else float("nan")


def _finite(value):
    """JSON has no NaN or infinity: ``None`` instead (recursively)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


#: columns of ``--format csv`` (rows; one per communicator, op, size and placement)
CSV_COLUMNS = ["comm", "axes", "level", "p", "per_node", "op", "placement", "size", "count", "type", "redop", "root", "iters",
               "time_us", "algbw_gbps", "busbw_gbps", "wrong", "avg_lat_us", "min_lat_us", "max_lat_us"]


def csv_head() -> List[str]:
    """The lines that open ``--format csv``: ``#`` lines with the formulas, then the header row."""
    return [f"# {f}" for f in FORMULAS] + [",".join(CSV_COLUMNS)]


def csv_lines(rows: List["Row"]) -> List[str]:
    """One csv line per row (:data:`CSV_COLUMNS`)."""
    import csv
    import io

    buf = io.StringIO()
    csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n").writerows(r.as_dict() for r in rows)
    return buf.getvalue().splitlines()


def format_result(result: Dict, fmt: str) -> str:
    """``table`` (:func:`format_tables`), ``csv`` (:data:`CSV_COLUMNS`, ``#`` lines with the formulas
    first) or ``json`` (rows, overlap, synchronization, compute, formulas, communicators, ``wrong``,
    ``avg_busbw_gbps``, ``bound`` and ``sweep`` (:meth:`Budget.summary`: what the bound left out) and, when the
    command wrote one, ``profile``; NaN as null; times in us)."""
    if fmt == "table":
        return format_tables(result)
    rows = [r.as_dict() for r in result["rows"]]
    if fmt == "json":
        import json

        overlap = [{(f"{k}_us" if k.startswith("t_") else k): (v * 1e6 if k.startswith("t_") else v)
                    for k, v in o.items()} for o in result["overlap"]]
        syncs = [{(k if k != "sync_s" else "sync_us"): (v * 1e6 if k == "sync_s" else v) for k, v in y.items()}
                 for y in result.get("syncs", [])]
        compute = {k: v for k, v in result["compute"].items() if k != "op_overhead_s"}
        compute["op_overhead_us"] = {k: v * 1e6 for k, v in result["compute"]["op_overhead_s"].items()}
        doc = {"world_size": result["world_size"], "num_nodes": result["num_nodes"], "grids": result["grids"],
               "formulas": FORMULAS, "units": "latencies and times in us, bandwidths in GB/s (1e9 B/s), sizes in B",
               "communicators": result.get("comms", []), "rows": rows, "overlap": overlap, "sync": syncs,
               "compute": compute, "wrong": total_wrong(result), "avg_busbw_gbps": avg_busbw(result),
               "iterations": result.get("rule"), "step_model": result.get("step_model"),
               "step_messages": result.get("step_messages", []), "bound": result.get("bound"),
               "sweep": result.get("sweep")}
        if "profile" in result:
            doc["profile"] = result["profile"]
        return json.dumps(_finite(doc), indent=1, allow_nan=False)
    if fmt == "csv":
        return "\n".join(csv_head() + csv_lines(result["rows"]))
    raise ConfigError(f"--format must be table, csv or json, got {fmt!r}")


def mpi_library() -> str:
    """The MPI library that measured (the first line of ``MPI_Get_library_version``): the profile's
    ``calibration.mpi`` (:func:`fourd_mpi.perf.calibration.build_profile`)."""
    from mpi4py import MPI

    return MPI.Get_library_version().splitlines()[0].strip()
