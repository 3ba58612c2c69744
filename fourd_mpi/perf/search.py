"""``fourd-mpi tune --search``: every scenario ``model predict`` can express, searched with a bound (pure).

``tune --search AXES`` enumerates :class:`~fourd_mpi.perf.scenario.Scenario` s of ``N`` ranks and prices each
through :func:`~fourd_mpi.perf.prediction.predict_scenario` (``model predict``'s model). The axes (run's words, and
``model predict``'s where run has none) and the candidates of each:

- the 4D grid of a stage (always): every ordered ``G_data x G_z x G_y x G_x`` of ``N / (p cp)`` that the model's
  sizes divide (:func:`~fourd_mpi.step.presets.model_problems`);
- ``ginter`` (``p`` pipeline stages): every divisor of ``N / cp`` from 1 to the ``L`` layers (uneven stages as
  run places them, :func:`~fourd_mpi.perf.terms.stage_layers`);
- ``pipeline-schedule`` (``p > 1``): ``1f1b``, ``axonn`` and ``interleaved`` with ``v`` chunks per stage for every
  ``2 <= v <=`` :data:`MAX_CHUNKS` with ``L`` a multiple of ``p v`` (interleaving only where the layers divide)
  and ``m`` a multiple of ``p`` (Megatron-LM's rule, :func:`~fourd_mpi.perf.schedules.check_schedule`);
- ``microbatch-size`` ``b``: the powers of two dividing the batch shard ``B / (G_data G_z)``, ``m = shard / b`` at
  most :data:`MAX_MICROBATCHES` and, with ``p > 1``, at least ``p`` (fewer micro-batches than stages leave every
  stage idle ``(p - 1)/(m + p - 1)``, more than half of the step). With one stage, gradient accumulation
  (``m > 1``) only adds per-micro-batch collectives and smaller GEMMs in the model, so it is a memory relief
  (below), tried only when ``m = 1`` does not fit;
- ``context-parallel`` ``cp``: 1 and the powers of two up to :data:`MAX_CONTEXT_PARALLEL` that divide ``N`` and
  ``s/2`` (Megatron-LM's split into ``2 cp`` chunks) and leave :data:`MIN_CONTEXT_TOKENS` tokens per rank,
  with ``--attention fused`` only (the model's context parallelism runs flash attention on each K/V chunk);
- the memory reliefs ``sequence-parallel`` (``G_y > 1``), ``shard-optimizer data`` (``G_data > 1``) and
  ``recompute`` (``selective``, then ``full``): in the model sequence parallelism costs no time (the same wire
  volume), a sharded optimizer adds a blocking all-gather and recompute adds compute, so they are not searched
  as axes but tried as a ladder, each rung adding the next relief to the previous (sequence parallel, then
  optimizer sharding, then selective, then full recompute; with one stage each rung before gradient
  accumulation): a candidate takes its first rung that fits the memory limit (recompute only when the candidate
  without it does not fit), and is dropped when none does.

An option the user gives (``--ginter 4``, ``--pipeline-schedule 1f1b``, ``--chunks-per-stage``,
``--microbatches`` or ``--microbatch-size``, ``--context-parallel``, ``--sequence-parallel``,
``--shard-optimizer``, ``--recompute``) pins its axis; an axis neither searched nor pinned takes the default
(one stage, ``m = 1``, no context or sequence parallelism, no sharding, recompute ``none``; ``axonn``, run's
schedule, when ``--ginter`` is pinned). The vocabulary is 0 (this suite's models have none: ``tune`` ranks this
suite's runs), every dW block in flight unless ``--dw-window``.

**The bound.** More than :data:`MAX_SCENARIOS` candidates (stage count x grid x micro-batch count x schedule x
context parallelism, each with its ladder counted once) are refused in one line before anything is predicted.
The candidates are ordered by a compute-only lower bound of their first rung (never above the predicted step of
any rung: each rung only adds compute or communication, and with one stage accumulation's ``m`` slots of ``B/m``
sequences compute at least one of ``B``) and walked: once ``keep`` steps are predicted, the walk stops at the first
whose compute-only bound exceeds the ``keep``-th fastest (every later one too); a candidate whose bound with
communication exceeds it is pruned (``X_s = 0`` where the distributed optimizer may be a rung); the others are given
their rung (the memory check, cheap), and one whose rung's bound
(:func:`~fourd_mpi.perf.prediction.scenario_lower_bound`: ``(c - U + X_n)(m + (p-1)/v) + U + X_s``,
``X_s = 0`` with the distributed optimizer) exceeds it is pruned, not predicted. The top
``keep`` are then exactly those of predicting every candidate. Measured: ``tune --ranks 32768 --search all`` (gpt-80b,
batch 2048, perlmutter) in docs/guide/model-and-tuning.md.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from fourd_mpi.core.grid import GridShape, divisors, grid_factorizations
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf import terms
from fourd_mpi.perf.machine import MachineProfile
from fourd_mpi.perf.prediction import ScenarioResult, predict_scenario, scenario_lower_bound, slot_lower_bound
from fourd_mpi.perf.scenario import Scenario
from fourd_mpi.perf.schedules import MAX_MICROBATCHES
from fourd_mpi.perf.step_terms import scenario_memory
from fourd_mpi.step.presets import model_problems
from fourd_mpi.util.units import GIB

#: the axes ``--search`` takes (``all``: every one); the grid of a stage is always searched
AXES = ("ginter", "pipeline-schedule", "microbatch-size", "context-parallel", "sequence-parallel", "shard-optimizer",
        "recompute")
#: axes tried as a memory-relief ladder (module docstring), not enumerated
RELIEFS = ("sequence-parallel", "shard-optimizer", "recompute")
#: the most candidates one search enumerates (each costs a compute-only bound, tens of microseconds; the few that
#: can win are predicted). gpt-80b (42 layers, batch 2,048) at 32,768 ranks with every axis: see the tests
MAX_SCENARIOS = 60_000
#: interleaved schedule: at most this many chunks per stage
MAX_CHUNKS = 8
#: context parallelism: at most this many ranks per sequence
MAX_CONTEXT_PARALLEL = 16
#: context parallelism: at least this many tokens of a sequence per rank (a shorter chunk has too little attention
#: to hide its K/V ring behind: the ring is hidden while a block's attention outlasts its transfer, Liu et al. 2023,
#: Ring Attention, section 3; :func:`fourd_mpi.perf.terms.context_parallel_exposed`)
MIN_CONTEXT_TOKENS = 1024
#: ``--search``'s word for the default search (the grid only, today's ranking)
GRID_ONLY = "grid"


def parse_axes(text: str) -> Tuple[str, ...]:
    """``--search``: ``grid`` (the default: grids only, ``()``), ``all`` (every axis of :data:`AXES`) or a comma
    list of them; one line naming the known ones otherwise."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if items in ([], [GRID_ONLY]):
        return ()
    if items == ["all"]:
        return AXES
    for name in items:
        if name not in AXES + (GRID_ONLY,):
            raise ConfigError(f"--search {name!r}: choose grid, all or a comma list of {', '.join(AXES)}")
    return tuple(a for a in AXES if a in items)


@dataclass
class SearchResult:
    """What a search predicted (fastest first), and how many candidates it enumerated and left out."""

    results: List[ScenarioResult]
    axes: Tuple[str, ...]
    pinned: Dict[str, object]
    not_searched: List[Tuple[str, str]] = field(default_factory=list)   # (axis, why)
    candidates: int = 0
    pruned: int = 0
    memory_dropped: int = 0
    memory_checked: int = 0
    keep: Optional[int] = None
    dropped_example: str = ""

    @property
    def predicted(self) -> int:
        return len(self.results)

    def summary(self) -> str:
        """One line: the axes, the pins, the candidates and what became of them (the bound named)."""
        axes = ", ".join(("grid",) + self.axes)
        pins = "; pinned: " + ", ".join(f"{k} {v}" for k, v in self.pinned.items()) if self.pinned else ""
        skipped = "".join(f"; {a} not searched: {why}" for a, why in self.not_searched)
        dropped = (f", {self.memory_dropped} dropped by memory (e.g. {self.dropped_example})"
                   if self.memory_dropped else "")
        return (f"searched {self.candidates:,} scenarios (at most {MAX_SCENARIOS:,}) over {axes}{pins}{skipped}: "
                f"{self.predicted} predicted, {self.pruned:,} pruned (lower bound above the slowest of the {self.keep} "
                f"fastest predicted steps){dropped}")


def _powers_of_two_dividing(n: int, limit: int) -> List[int]:
    out, d = [], 1
    while d <= limit and n % d == 0:
        out.append(d)
        d *= 2
    return out


def _pinned(given: Dict[str, object]) -> Dict[str, object]:
    """The axes the user fixed (``given``: option word -> value, only those given)."""
    return {k: v for k, v in given.items() if v is not None and v is not False}


def _context_choices(base: Scenario, ranks: int, axes: Sequence[str], pinned: Dict[str, object],
                     not_searched: List[Tuple[str, str]]) -> List[int]:
    if "context-parallel" in pinned:
        return [base.context_parallel]
    if "context-parallel" not in axes:
        return [1]
    if base.attention != "fused":
        not_searched.append(("context-parallel", "needs --attention fused"))
        return [1]
    seq = base.model.seq
    return [c for c in _powers_of_two_dividing(ranks, MAX_CONTEXT_PARALLEL)
            if c == 1 or ((seq // 2) % c == 0 and seq // c >= MIN_CONTEXT_TOKENS)]


def _stage_choices(base: Scenario, world: int, axes: Sequence[str], pinned: Dict[str, object]) -> List[int]:
    if "ginter" in pinned:
        return [base.stages] if world % base.stages == 0 else []
    if "ginter" not in axes:
        return [1]
    return [p for p in divisors(world) if p <= base.model.layers]


def _schedule_choices(base: Scenario, stages: int, m: int, axes: Sequence[str],
                      pinned: Dict[str, object]) -> List[Tuple[str, int]]:
    """``(schedule, v)`` of ``p`` stages and ``m`` micro-batches (module docstring)."""
    if stages == 1:
        return [(base.schedule, 1)]
    if "pipeline-schedule" in pinned:
        names = [base.schedule]
    elif "pipeline-schedule" in axes:
        names = ["1f1b", "axonn", "interleaved"]
    else:
        return [(base.schedule, base.chunks)]
    out = []
    for name in names:
        if name != "interleaved":
            out.append((name, 1))
        elif m % stages == 0:
            chunks = [base.chunks] if "chunks-per-stage" in pinned else range(2, MAX_CHUNKS + 1)
            out += [(name, v) for v in chunks if base.model.layers % (stages * v) == 0]
    return out


def _microbatch_choices(base: Scenario, shard: int, stages: int, axes: Sequence[str],
                        pinned: Dict[str, object]) -> List[int]:
    """Micro-batch counts ``m`` of a batch shard (one stage: only ``m = 1`` here, the rest is a relief)."""
    if "microbatch-size" in pinned:
        b = pinned["microbatch-size"]
        return [shard // b] if shard % b == 0 else []
    if "microbatches" in pinned:
        m = pinned["microbatches"]
        return [m] if shard % m == 0 else []
    if "microbatch-size" not in axes or stages == 1:
        return [1]
    return [shard // b for b in _powers_of_two_dividing(shard, shard) if stages <= shard // b <= MAX_MICROBATCHES]


def _relief_ladder(sc: Scenario, axes: Sequence[str], pinned: Dict[str, object]) -> Iterator[Scenario]:
    """The rungs of ``sc`` (module docstring), cheapest first: each adds the next relief that applies."""
    rungs = [sc]
    if "sequence-parallel" in axes and "sequence-parallel" not in pinned and sc.grid.y > 1:
        rungs.append(replace(rungs[-1], sequence_parallel=True))
    if "shard-optimizer" in axes and "shard-optimizer" not in pinned and sc.grid.data > 1:
        rungs.append(replace(rungs[-1], shard_optimizer="data"))
    if "recompute" in axes and "recompute" not in pinned:
        rungs += [replace(rungs[-1], recompute=r) for r in ("selective", "full")]
    accumulate = (sc.stages == 1 and "microbatch-size" in axes and "microbatch-size" not in pinned
                  and "microbatches" not in pinned)
    shard = sc.model.batch // (sc.grid.data * sc.grid.z)
    counts = [m for m in _powers_of_two_dividing(shard, MAX_MICROBATCHES)] if accumulate else [sc.microbatches]
    for rung in rungs:
        for m in counts:
            yield replace(rung, microbatches=m, microbatch_size=shard // m)


def _cp_model_and_grid(base: Scenario, cp: int, grid: GridShape, views: Optional[Dict[int, object]] = None):
    """The model and grid every term but attention sees under ``cp``
    (:func:`~fourd_mpi.perf.terms.context_parallel_view`); ``views``: a memo of the model per ``cp``."""
    if cp == 1:
        return base.model, grid
    model = views.get(cp) if views is not None else None
    if model is None:
        view = terms.context_parallel_view(base.model.seq, base.model.batch, grid.data, cp)
        model = replace(base.model, seq=view["seq"], batch=view["batch"])
        if views is not None:
            views[cp] = model
    return model, GridShape(grid.data * cp, grid.z, grid.y, grid.x)


#: one candidate before it is a :class:`Scenario` (cheap to list and sort): ``(cp, p, grid, m, schedule, v)``
Candidate = Tuple[int, int, GridShape, int, str, int]


def candidates(base: Scenario, ranks: int, axes: Sequence[str], pinned: Dict[str, object],
               not_searched: Optional[List[Tuple[str, str]]] = None) -> List[Candidate]:
    """Every candidate of ``ranks`` ranks (module docstring), at the first rung of its ladder. More than
    :data:`MAX_SCENARIOS`: a one-line :class:`ConfigError` as soon as the count passes it."""
    not_searched = [] if not_searched is None else not_searched
    out: List[Candidate] = []
    views: Dict[int, object] = {}
    cfg = base.model
    for cp in _context_choices(base, ranks, axes, pinned, not_searched):
        if ranks % cp:
            continue
        for p in _stage_choices(base, ranks // cp, axes, pinned):
            for grid in grid_factorizations(ranks // (cp * p)):
                shards = grid.data * grid.z
                if cfg.batch % shards or model_problems(*_cp_model_and_grid(base, cp, grid, views)):
                    continue
                shard = cfg.batch // shards
                for m in _microbatch_choices(base, shard, p, axes, pinned):
                    out += [(cp, p, grid, m, schedule, v)
                            for schedule, v in _schedule_choices(base, p, m, axes, pinned)]
                if len(out) > MAX_SCENARIOS:
                    raise ConfigError(
                        f"tune --search on {ranks:,} ranks has more than {MAX_SCENARIOS:,} scenarios (stage counts x "
                        f"grids x micro-batch counts x schedules x context parallelism): pin an axis (--ginter, "
                        f"--pipeline-schedule, --microbatches, --context-parallel) or search fewer axes")
    return out


def scenario_of(base: Scenario, c: Candidate) -> Scenario:
    """The scenario of a candidate (``b`` and ``m`` set; algorithm ``pipeline`` with more than one stage)."""
    cp, p, grid, m, schedule, v = c
    shard = base.model.batch // (grid.data * grid.z)
    return replace(base, grid=grid, stages=p, context_parallel=cp, microbatches=m, microbatch_size=shard // m,
                   schedule=schedule, chunks=v, algorithm="pipeline" if p > 1 else base.algorithm)


class _Bounds:
    """Lower bounds of candidates at their first rung (:func:`~fourd_mpi.perf.prediction.slot_lower_bound`),
    the slot's model built once per ``(cp, p, m)``: what :func:`~fourd_mpi.perf.prediction.scenario_lower_bound`
    computes, without building a scenario per candidate."""

    def __init__(self, base: Scenario, ranks: int, profile: MachineProfile):
        self.base, self.profile = base, profile
        self.rpn = base.ranks_per_node or min(profile.ranks_per_node, ranks)
        self.overlap = base.overlap_config
        self.store = terms.storage_dtype(base.dtype)
        self.gemm = base.dtype if base.dtype != self.store else None
        self.micro: Dict[Tuple[int, int, int], object] = {}
        self.views: Dict[int, object] = {}
        self.memo: Dict[tuple, float] = {}  # 1f1b and axonn share a bound

    def __call__(self, c: Candidate, communication: bool = False, sync: bool = True) -> float:
        cp, p, grid, m, schedule, v = c
        slots = (p - 1) / (v if schedule == "interleaved" else 1)
        key = (cp, p, grid, m, slots, communication, sync)
        found = self.memo.get(key)
        if found is not None:
            return found
        base = self.base
        cfg, view_grid = _cp_model_and_grid(base, cp, grid, self.views)
        micro = self.micro.get((cp, p, m))
        if micro is None:
            layers = max(terms.stage_layers(base.model.layers, p, base.first_stage_layers, base.last_stage_layers))
            micro = self.micro[(cp, p, m)] = replace(cfg, layers=layers, batch=cfg.batch // m)
        found = self.memo[key] = slot_lower_bound(
            micro, view_grid, self.profile, self.overlap, self.store, self.rpn, base.optimizer, base.recompute,
            base.attention, base.precision, p, m, slots, communication, sync, self.gemm, cp)
        return found


def search(base: Scenario, ranks: int, profile: MachineProfile, axes: Sequence[str],
           given: Dict[str, object], keep: int = 5) -> SearchResult:
    """The fastest ``keep`` scenarios of ``ranks`` ranks (module docstring: exact under the bound), with the
    counts. ``base``: every choice not searched (tune's options); ``given``: the options the user gave (they pin
    their axes). Raises :class:`ConfigError` when no candidate divides or fits."""
    pinned = _pinned(given)
    result = SearchResult([], tuple(axes), pinned, keep=keep)
    found = candidates(base, ranks, axes, pinned, result.not_searched)
    result.candidates = len(found)
    if not found:
        raise ConfigError(f"tune --search: no scenario of {ranks:,} ranks divides {base.model.name} (hidden "
                          f"{base.model.hidden}, heads {base.model.heads}, batch {base.model.batch}) with the pinned "
                          f"options {pinned or 'none'}")
    relief_sync = "shard-optimizer" in axes and "shard-optimizer" not in pinned
    bound = _Bounds(base, ranks, profile)
    todo = sorted(((bound(c), i) for i, c in enumerate(found)))
    limit = base.memory_limit_gib * GIB if base.memory_limit_gib is not None else None
    fastest: List[float] = []  # max-heap (negated) of the keep fastest predicted steps
    for n, (cheap, i) in enumerate(todo):
        c = found[i]
        if len(fastest) >= keep:
            if cheap > -fastest[0]:  # sorted: every later one too
                result.pruned += len(todo) - n
                break
            sync = base.shard_optimizer != "data" and not (relief_sync and c[2].data > 1)
            if bound(c, communication=True, sync=sync) > -fastest[0]:  # valid for every rung (module docstring)
                result.pruned += 1
                continue
        sc = scenario_of(base, c)
        chosen, need = None, None
        for rung in _relief_ladder(sc, axes, pinned):
            try:
                result.memory_checked += 1
                need = scenario_memory(rung, profile)["required"]
            except ConfigError:  # a rung the model refuses (e.g. a schedule's micro-batch rule)
                continue
            if limit is None or need <= limit:
                chosen = rung
                break
        if chosen is None:
            result.memory_dropped += 1
            if not result.dropped_example:
                result.dropped_example = f"{label(sc)}: " + ("no rung the model accepts" if need is None else
                                                              f"needs {need / GIB:.3g} GiB per rank at its last "
                                                              f"rung > {limit / GIB:.3g} GiB")
            continue
        # the rung's own bound (its recompute, its accumulation; X_s = 0 with the distributed optimizer)
        if len(fastest) >= keep and scenario_lower_bound(chosen, profile, sync=chosen.shard_optimizer != "data") \
                > -fastest[0]:
            result.pruned += 1
            continue
        r = predict_scenario(chosen, profile)
        result.results.append(r)
        heapq.heappush(fastest, -r.step_s)
        if len(fastest) > keep:
            heapq.heappop(fastest)
    if not result.results:
        raise ConfigError(f"tune --search: no scenario of {ranks:,} ranks fits {base.model.name} in "
                          f"{base.memory_limit_gib:g} GiB per rank even with every memory relief searched "
                          f"(e.g. {result.dropped_example}); raise --memory-limit or search more axes "
                          f"(--search all)")
    result.results.sort(key=lambda r: (r.step_s, label(r.scenario)))
    return result


def options_of(sc: Scenario) -> Dict[str, object]:
    """The searched choices of a scenario in run's and ``model predict``'s words (``tune --format json``)."""
    return {"ginter": sc.stages, "pipeline-schedule": sc.schedule if sc.stages > 1 else None,
            "chunks-per-stage": sc.chunks if sc.schedule == "interleaved" else None,
            "microbatch-size": sc.microbatch_size, "microbatches": sc.microbatches,
            "context-parallel": sc.context_parallel, "sequence-parallel": sc.sequence_parallel,
            "shard-optimizer": sc.shard_optimizer, "recompute": sc.recompute}


def label(sc: Scenario) -> str:
    """``16x1x8x1 p=4 1f1b b=1x32 cp=2 sp opt=data recompute=full`` (what differs from the defaults)."""
    parts = [str(sc.grid)]
    if sc.stages > 1:
        parts.append(f"p={sc.stages} {sc.schedule}" + (f" v={sc.chunks}" if sc.schedule == "interleaved" else ""))
    parts.append(f"b={sc.microbatch_size}x{sc.microbatches}")
    if sc.context_parallel > 1:
        parts.append(f"cp={sc.context_parallel}")
    if sc.sequence_parallel:
        parts.append("sp")
    if sc.shard_optimizer != "none":
        parts.append(f"opt={sc.shard_optimizer}")
    if sc.recompute != "none":
        parts.append(f"recompute={sc.recompute}")
    return " ".join(parts)


def format_search(result: SearchResult, k: int) -> str:
    """The top ``k`` as a table: ms per step and rank (``comm``: exposed communication per axis; ``bubble``: the
    pipeline's idle slots), memory need per GPU of the larger of the first and last stage."""
    from fourd_mpi.util.table import render

    shown = result.results[:k]
    axes = [a for a in ("x", "y", "z", "data", "pipeline", "context") if any(r.exposed_s.get(a, 0) for r in shown)]
    headers = (["rank", "scenario", "step ms", "compute", "exposed"] + [f"comm {a}" for a in axes]
               + ["bubble", "mem GiB", "need GiB"])
    rows = []
    for i, r in enumerate(shown, 1):
        rows.append([i, label(r.scenario), f"{r.step_s * 1e3:.3f}", f"{r.compute_s * 1e3:.3f}",
                     f"{sum(r.exposed_s.values()) * 1e3:.3f}"]
                    + [f"{r.exposed_s.get(a, 0.0) * 1e3:.3f}" for a in axes]
                    + [f"{r.bubble_s * 1e3:.3f}", f"{r.memory['total'] / GIB:.3g}",
                       f"{r.memory['required'] / GIB:.3g}"])
    return render(rows, headers, align=["right", "left"] + ["right"] * (len(headers) - 2))
