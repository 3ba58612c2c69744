"""The pure parts of ``bench collectives``' sweep (no MPI, tested without it): the message sizes and the step's
own messages (:func:`message_sizes`, :func:`step_messages`, :func:`cover_step_messages`), the overlap formulas
(:func:`osu_overlap`, :func:`imb_overlap`), when the timed iterations stop (:class:`IterationRule`), the
measurements in the order they run (:class:`Item`, :func:`plan_items`), the bound that skips what would not fit
the time limit (:class:`Budget`, times extrapolated from what was measured) and the progress lines
(:func:`progress_line`). :mod:`fourd_mpi.run.collbench` measures with these."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.calibration import Row
from fourd_mpi.util.text import human_bytes
from fourd_mpi.util.units import MIB


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


#: messages of one back-to-back run (:func:`_time_run`): enough that a shaped link's burst, which only the first
#: message after an idle link can use, is a small part of the run (the step's data all-reduces are 8 per block)
RUN_LENGTH = 4


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

    The time is allotted by block: a block is one communicator and collective (its sizes in each placement, then its
    back-to-back runs, synchronization and overlap measurements). When a block starts, it gets the time left (the
    limit less the time elapsed, which includes the compute calibration before the sweep, and :attr:`reserve`, time
    kept for work after it) times its share of the measurements left; what a block leaves unused goes to the blocks
    after it. An item runs when its least predicted time (:meth:`least`: warm-up, ``--min-time`` of timed iterations
    or one iteration, the result check) fits into what is left of its block, and its timed iterations stop after
    ``min(--max-time, max(that less its predicted warm-up and check, --min-time))`` (at least one). So the largest
    sizes of a slow link are left out, not the communicators and collectives measured after them; and the bound
    leaves sizes out rather than measure them below ``--min-time``: with ``--min-time`` m, T seconds hold at most
    ``max(1, T/m)`` rows. A skipped item is listed (:meth:`summary`, :meth:`skipped_line`).

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
