"""The performance model across algorithms: which predictor serves each algorithm family, the grids each
algorithm may run, and one ranking of every (algorithm, grid) of a rank count (``fourd-mpi tune
--algorithm NAME|all``). Pure: no MPI, no array library.

The model of an algorithm family is its record's model hooks (:data:`fourd_mpi.algorithms.families.FAMILIES`,
:meth:`~fourd_mpi.algorithms.families.Family.hook`): ``predict`` (called with keywords: ``predict(cfg, grid,
profile, overlap=, dtype=, progress=, optimizer=, ranks_per_node=, recompute=, attention=, precision=,
shard_optimizer=, **extra)`` -> :class:`~fourd_mpi.perf.predict.Prediction`, as
:func:`fourd_mpi.perf.predict.predict`); ``candidates(cfg, ranks, algorithm)`` (optional) -> ``[(grid,
extra)]``: the configurations of ``ranks`` ranks worth predicting, ``extra`` the family's own ``predict``
keywords (pipeline stages, micro-batches); without it every 4D factorization of ``ranks`` that the
algorithm allows (:meth:`~fourd_mpi.algorithms.registry.Algorithm.grid_problem`) and the model fits is one,
with no extra; ``run_options(run_options)`` (optional) -> the ``extra`` keywords of a traced run, from its
metadata's ``run_options`` (``model validate``); ``memory`` (optional: a ranking drops what does not fit
before predicting its time) and ``lower_bound`` (optional: a ranking that keeps only its top K skips, without
predicting, what cannot enter it); their signatures are in :mod:`fourd_mpi.algorithms.families`.
:func:`predictor` gives the record of a family the model covers.

A family whose model module is not in the installation (a branch not merged yet) has no predictor: its
algorithms are skipped with a note.

An algorithm of a family without a predictor is named in :attr:`AcrossRanking.skipped`, never an error of
``--algorithm all``. Ranking: by predicted step time (compute + exposed communication, per rank), fastest
first, ties by algorithm name then grid; a configuration is dropped when the model does not divide over
its grid or its predicted memory need (:meth:`~fourd_mpi.perf.memory.MemoryEstimate.required`) exceeds
the limit, as in :func:`fourd_mpi.perf.tune.rank_grids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from fourd_mpi.algorithms.families import FAMILIES, Family
from fourd_mpi.algorithms.registry import ALGORITHMS, Algorithm, model_problems_of
from fourd_mpi.algorithms.registry import get as get_algorithm
from fourd_mpi.core.grid import GridShape, grid_factorizations
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.machine import MachineProfile
from fourd_mpi.perf.memory import memory_reserve
from fourd_mpi.perf.predict import Prediction
from fourd_mpi.perf.schedules import MAX_MICROBATCHES
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import ModelConfig
from fourd_mpi.util.table import render
from fourd_mpi.util.units import GIB


def microbatch_counts(shard: int, limit: int = MAX_MICROBATCHES) -> List[int]:
    """Every micro-batch count ``m`` of a per-replica batch of ``shard`` sequences: ``m`` divides ``shard``
    (micro-batch size ``b = shard/m``, every divisor), ``m <= limit``, ascending. Known answer: 12 ->
    [1, 2, 3, 4, 6, 12]."""
    return [m for m in range(1, min(shard, limit) + 1) if shard % m == 0]


#: the most pipeline configurations (stage count x 4D grid of a stage x micro-batch count) ``tune`` searches:
#: each costs a lower bound (about half a millisecond) and the best are predicted, so a search stays within
#: seconds. gpt-80b's shape (80 layers, batch 2,048) has 5,583 at 1,024 ranks and 9,057 at 4,096; 96 layers
#: and batch 8,192 at 16,384 ranks 16,618; a model divisible by everything at 2^24 ranks over 100,000
#: (refused in one line, before anything is predicted)
MAX_PIPELINE_CONFIGS = 20_000


class SearchTooLarge(ConfigError):
    """A search with more candidates than its bound (refused before anything is predicted)."""


def _divisors(n: int) -> List[int]:
    """The divisors of ``n`` ascending (trial division to the square root: ``n`` <= 2^24 here)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def pipeline_count(cfg: ModelConfig, ranks: int) -> int:
    """How many configurations :func:`pipeline_candidates` considers, without listing them (an upper bound
    of those it returns: the algorithm's own check is not made): per stage count ``s`` (``1 < s <= L``
    dividing the ranks) and product
    ``q = G_data G_z`` dividing ``ranks / s``, the ordered pairs ``(G_data, G_z)`` and ``(G_y, G_x)``
    times the micro-batch counts of the shard ``B // q``."""
    total = 0
    for stages in _divisors(ranks):
        if stages < 2 or stages > cfg.layers:
            continue
        per = ranks // stages
        for q in _divisors(per):
            shard = (cfg.batch or 0) // q
            if shard:
                total += len(_divisors(q)) * len(_divisors(per // q)) * len(microbatch_counts(shard))
    return total


def check_pipeline_search(cfg: ModelConfig, ranks: int, name: str = "pipeline") -> None:
    """Raise :class:`SearchTooLarge` (one line with the ways out) when the pipeline search of ``ranks`` ranks
    has more than :data:`MAX_PIPELINE_CONFIGS` configurations."""
    count = pipeline_count(cfg, ranks)
    if count > MAX_PIPELINE_CONFIGS:
        raise SearchTooLarge(
            f"{name} on {ranks:,} ranks has {count:,} configurations (stage counts dividing the ranks, at most the "
            f"{cfg.layers:,} layers x 4D grids of a stage x micro-batch counts dividing the batch shard), more than "
            f"the {MAX_PIPELINE_CONFIGS:,} tune searches: give fewer ranks, --layers or --batch with fewer divisors, "
            f"or predict one with fourd-mpi model predict --ginter --grid")


def pipeline_candidates(cfg: ModelConfig, ranks: int, algorithm: Algorithm) -> List[Tuple[Any, Dict[str, Any]]]:
    """Pipeline configurations of ``ranks`` ranks: ``s`` stages (every divisor ``1 < s <= layers``; stage ``i``
    holds :func:`~fourd_mpi.perf.terms.stage_layers`' blocks, as ``model predict --algorithm pipeline``), each a
    4D grid of ``ranks / s`` ranks the algorithm allows, with every micro-batch size that divides the
    per-replica batch shard ``B/(G_data G_z)`` (:func:`microbatch_counts`: at most
    :data:`MAX_MICROBATCHES` micro-batches) that the algorithm accepts. More than
    :data:`MAX_PIPELINE_CONFIGS`: :class:`SearchTooLarge`, before any is listed."""
    from dataclasses import replace

    check_pipeline_search(cfg, ranks, algorithm.name)
    out = []
    for stages in (s for s in _divisors(ranks) if 2 <= s <= cfg.layers):
        base = _base_options(cfg, ranks // stages, algorithm)
        for grid in grid_factorizations(ranks // stages):
            shard = (cfg.batch or 0) // (grid.data * grid.z) if grid.data * grid.z else 0
            if not shard:
                continue
            try:  # once per grid: the check's only micro-batch condition (m divides the shard) holds for each m
                algorithm.check(replace(base, grid=grid, ginter=stages, microbatches=1))
            except (ConfigError, TypeError):
                continue
            out += [(grid, {"stages": stages, "microbatches": micro}) for micro in microbatch_counts(shard)]
    return out


def pipeline_stage_memory(cfg: ModelConfig, grid, dtype: str = "float32", optimizer: str = "adam", overlap=None,
                     recompute: str = "none", attention: str = "unfused", precision=None, shard_optimizer: str = "none",
                     stages: int = 1, microbatches: int = 1, schedule: str = "axonn", **_):
    """Stage 0's memory, as :func:`~fourd_mpi.perf.pipeline.predict_pipeline` reports it."""
    from fourd_mpi.perf.pipeline import pipeline_memory

    return pipeline_memory(cfg, grid, stages, microbatches, 0, dtype, optimizer, overlap, recompute, attention,
                           precision, shard_optimizer, schedule)


def pipeline_run_options(run_options: Dict[str, Any]) -> Dict[str, Any]:
    """``--ginter``, ``--microbatches``, ``--pipeline-schedule`` of a traced run as ``predict_pipeline``'s
    keywords (``grid`` in the metadata is then each stage's 4D grid)."""
    return {"stages": int(run_options.get("ginter", 1) or 1),
            "microbatches": int(run_options.get("microbatches", 1) or 1),
            "schedule": str(run_options.get("pipeline_schedule", "axonn"))}


def predictor(family: str) -> Optional[Family]:
    """The record of ``family`` (:data:`~fourd_mpi.algorithms.families.FAMILIES`), or None when the model does
    not cover it (yet): no record, or its model module is not installed. Its ``hook(name)`` gives the
    ``predict``, ``candidates``, ``run_options``, ``memory`` and ``lower_bound`` hooks (None: absent)."""
    entry = FAMILIES.get(family)
    if entry is None or not entry.covered():
        return None
    return entry


def covered(names: Sequence[str]) -> Tuple[List[str], List[Tuple[str, str]]]:
    """``(algorithms the model predicts, [(algorithm, why not)])`` of ``names``."""
    kept, skipped = [], []
    for name in names:
        algorithm = get_algorithm(name)
        if predictor(algorithm.family) is None:
            skipped.append((name, f"the performance model has no predictor for family {algorithm.family!r} yet"))
        else:
            kept.append(name)
    return kept, skipped


def algorithm_names(text: str) -> List[str]:
    """``--algorithm`` of ``tune``: one name, a comma list, or ``all`` (every registered algorithm)."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if items == ["all"]:
        return list(ALGORITHMS)
    for name in items:
        get_algorithm(name)  # one line naming the known ones
    if not items:
        raise ConfigError("--algorithm: give a name, a comma list or all")
    return list(dict.fromkeys(items))


def model_problems(algorithm: Algorithm, cfg: ModelConfig, grid) -> List[str]:
    """What keeps ``cfg`` from running on ``grid`` with ``algorithm``
    (:func:`~fourd_mpi.algorithms.registry.model_problems_of`)."""
    return model_problems_of(algorithm, cfg, grid)


def _base_options(cfg: ModelConfig, ranks: int, algorithm: Algorithm):
    """What the algorithm's pure checks read (no validation of their own)."""
    from fourd_mpi.algorithms.runoptions import GridCheckOptions

    return GridCheckOptions(model=cfg, grid=GridShape(ranks, 1, 1, 1), algorithm=algorithm.name)


def candidates(algorithm: Algorithm, cfg: ModelConfig, ranks: int, dtype: str = "float32"
               ) -> Tuple[List[Tuple[Any, Dict[str, Any]]], List[Tuple[Any, str]]]:
    """``(candidates, dropped)`` of ``algorithm`` on ``ranks`` ranks: ``(grid, extra predict options)``
    the model fits, and ``(grid, "divisibility: ...")`` for those it does not. A grid the algorithm
    cannot run at all (a fixed axis of another size) is neither."""
    entry = predictor(algorithm.family)
    own = entry.hook("candidates") if entry is not None else None
    if callable(own):
        listed = list(own(cfg, ranks, algorithm))
    else:
        base = _base_options(cfg, ranks, algorithm)
        listed = [(g, {}) for g in grid_factorizations(ranks) if algorithm.grid_problem(base, g) is None]
    kept, dropped = [], []
    seen: Dict[Any, List[str]] = {}  # a grid's problems do not depend on the extra options (pipeline: m)
    for grid, extra in listed:
        problems = seen.get(grid)
        if problems is None:
            problems = seen[grid] = model_problems(algorithm, cfg, grid)
        if problems:
            dropped.append((grid, f"divisibility: {problems[0]}"))
        else:
            kept.append((grid, dict(extra)))
    return kept, dropped


@dataclass
class Ranked:
    """One predicted configuration: the algorithm, its grid, extra options and the prediction."""

    algorithm: str
    grid: Any
    options: Dict[str, Any]
    prediction: Prediction
    need_bytes: int
    #: other algorithms whose configuration this is too (``fsdp``'s ``1x8x1x1`` is ``axonn4d``'s)
    same_as: List[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        """The grid, with the extra options (``1x1x2x2 stages=2``)."""
        extra = " ".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.grid}" + (f" {extra}" if extra else "")


@dataclass
class AcrossRanking:
    """Every predicted configuration of the asked algorithms, fastest first, and what was left out."""

    entries: List[Ranked]
    #: every prediction, a configuration named by several algorithms once per name (``entries`` keeps one)
    every: List[Ranked] = field(default_factory=list)
    dropped: List[Tuple[str, Any, str]] = field(default_factory=list)   # (algorithm, grid, reason)
    skipped: List[Tuple[str, str]] = field(default_factory=list)        # (algorithm, reason)
    considered: int = 0
    reserve: int = 0
    #: (algorithm, grid, options, lower bound s) of configurations not predicted: the bound exceeds the
    #: ``keep``-th fastest predicted step of their algorithm, so they cannot be in the top ``keep``
    pruned: List[Tuple[str, Any, Dict[str, Any], float]] = field(default_factory=list)
    keep: Optional[int] = None

    def best_by_algorithm(self) -> Dict[str, Ranked]:
        """The fastest configuration of each algorithm (over :attr:`every`)."""
        best: Dict[str, Ranked] = {}
        for e in self.every:
            best.setdefault(e.algorithm, e)
        return best

    def pruned_summary(self) -> str:
        """One line on the configurations not predicted (empty when none)."""
        if not self.pruned:
            return ""
        names = ", ".join(dict.fromkeys(n for n, _, _, _ in self.pruned))
        return (f"not predicted: {len(self.pruned)} configurations ({names}) whose lower bound of the step (compute "
                f"plus the communication no overlap hides, bubble slots included) exceeds the slowest of the "
                f"{self.keep} fastest predicted steps of their algorithm, so none can be in the top {self.keep} "
                f"or be its algorithm's best (nor was their memory checked)")

    def dropped_summary(self) -> str:
        if not self.dropped:
            return f"all {self.considered} configurations are valid"
        kinds: Dict[str, int] = {}
        example: Dict[str, str] = {}
        for name, grid, why in self.dropped:
            kind = why.split(":", 1)[0]
            kinds[kind] = kinds.get(kind, 0) + 1
            example.setdefault(kind, f"{name} {grid}: {why.split(':', 1)[1].strip()}")
        return (f"{len(self.dropped)} of {self.considered} configurations dropped: "
                + "; ".join(f"{n} {k} (e.g. {example[k]})" for k, n in kinds.items()))


def predict_one(algorithm: Algorithm, cfg: ModelConfig, grid, profile: MachineProfile,
                overlap: Optional[OverlapConfig] = None, dtype: str = "float32", progress: str = "poll",
                optimizer: str = "adam", ranks_per_node: Optional[int] = None, **options) -> Prediction:
    """The prediction of one configuration by the algorithm family's predictor; a :class:`ConfigError`
    when the model has none for it."""
    entry = predictor(algorithm.family)
    if entry is None:
        raise ConfigError(f"the performance model has no predictor for algorithm {algorithm.name} "
                          f"(family {algorithm.family!r}) yet")
    return entry.hook("predict")(cfg, grid, profile, overlap=overlap or OverlapConfig(), dtype=dtype,
                                 progress=progress, optimizer=optimizer, ranks_per_node=ranks_per_node, **options)


def rank_algorithms(names: Sequence[str], cfg: ModelConfig, ranks: int, profile: MachineProfile,
                    overlap: Optional[OverlapConfig] = None, dtype: str = "float32", progress: str = "poll",
                    optimizer: str = "adam", memory_limit_bytes: Optional[float] = None,
                    ranks_per_node: Optional[int] = None, recompute: str = "none", attention: str = "unfused",
                    precision: Optional[str] = None, shard_optimizer: str = "none",
                    keep: Optional[int] = None) -> AcrossRanking:
    """Every configuration of every algorithm in ``names`` on ``ranks`` ranks, predicted and sorted
    (module docstring). Raises :class:`ConfigError` when no configuration of any algorithm remains.

    ``keep``: the caller shows only the top ``keep`` (and each algorithm's best). Then an algorithm whose
    family has a ``lower_bound`` hook predicts its candidates in ascending order of that bound and stops
    when the bound exceeds its ``keep``-th fastest predicted step: the rest cannot be in the top ``keep``
    of the ranking (each of the overall top ``keep`` is among the top ``keep`` of every algorithm naming it),
    nor be an algorithm's best; they are listed in :attr:`AcrossRanking.pruned`, never silently left out.
    Exact: the top ``keep`` and the best per algorithm equal those of the full ranking.

    Long: one search: candidates per algorithm, bound pruning and the merge share state.
    """
    import heapq

    if ranks < 1:
        raise ConfigError(f"--ranks must be positive, got {ranks}")
    if cfg.batch is None:
        raise ConfigError(f"preset {cfg.name} needs the global batch: give --batch SEQUENCES")
    overlap = overlap or OverlapConfig()
    kept, skipped = covered(names)
    out = AcrossRanking([], skipped=skipped, reserve=memory_reserve(profile), keep=keep)
    mem = dict(recompute=recompute, attention=attention, precision=precision, shard_optimizer=shard_optimizer)
    for name in kept:
        algorithm = get_algorithm(name)
        try:
            found, dropped = candidates(algorithm, cfg, ranks, dtype)
        except SearchTooLarge as exc:
            if len(kept) == 1:
                raise
            out.skipped.append((name, str(exc)))  # the others are still ranked; the line says why not this one
            continue
        out.considered += len(found) + len(dropped)
        out.dropped += [(name, g, why) for g, why in dropped]
        if not found and not dropped:
            out.skipped.append((name, f"no grid of {ranks} ranks is a grid of this algorithm"))
        entry = predictor(algorithm.family)
        memory_hook = entry.hook("memory") if memory_limit_bytes is not None else None
        bound_hook = entry.hook("lower_bound") if keep else None
        todo = []

        def too_big(grid, extra) -> bool:
            """Drop (and say so) what does not fit, before predicting its time (cheap)."""
            if memory_hook is None:
                return False
            need = memory_hook(cfg, grid, dtype=dtype, optimizer=optimizer, overlap=overlap, **mem,
                               **extra).required(out.reserve)
            if need > memory_limit_bytes:
                out.dropped.append((name, grid, f"memory: needs {need / GIB:.3g} GiB per rank > "
                                                f"{memory_limit_bytes / GIB:.3g} GiB"))
                return True
            return False

        for grid, extra in found:
            # with a bound, memory is checked when a candidate is reached (pruned ones are not checked)
            if bound_hook is None and too_big(grid, extra):
                continue
            bound = 0.0
            if bound_hook is not None:  # the compute alone first: cheap, and the order of the search
                bound = bound_hook(cfg, grid, profile, overlap=overlap, dtype=dtype, optimizer=optimizer,
                                   ranks_per_node=ranks_per_node, recompute=recompute, attention=attention,
                                   precision=precision, communication=False, **extra)
            todo.append((bound, grid, extra))
        if bound_hook is not None:
            todo.sort(key=lambda t: t[0])
        fastest: List[float] = []  # max-heap (negated) of the algorithm's keep fastest predicted steps
        for i, (bound, grid, extra) in enumerate(todo):
            if bound_hook is not None and len(fastest) >= keep:
                if bound > -fastest[0]:  # sorted: every later one too
                    out.pruned += [(name, g, x, b) for b, g, x in todo[i:]]
                    break
                tight = bound_hook(cfg, grid, profile, overlap=overlap, dtype=dtype, optimizer=optimizer,
                                   ranks_per_node=ranks_per_node, recompute=recompute, attention=attention,
                                   precision=precision, **extra)
                if tight > -fastest[0]:
                    out.pruned.append((name, grid, extra, tight))
                    continue
            if bound_hook is not None and too_big(grid, extra):
                continue
            pred = predict_one(algorithm, cfg, grid, profile, overlap, dtype, progress, optimizer, ranks_per_node,
                               **mem, **extra)
            need = pred.memory.required(out.reserve)
            if memory_limit_bytes is not None and need > memory_limit_bytes:
                out.dropped.append((name, grid, f"memory: needs {need / GIB:.3g} GiB per rank > "
                                                f"{memory_limit_bytes / GIB:.3g} GiB"))
                continue
            out.every.append(Ranked(name, grid, extra, pred, need))
            if keep:
                heapq.heappush(fastest, -pred.step_s)
                if len(fastest) > keep:
                    heapq.heappop(fastest)
    if not out.every:
        why = "; ".join(f"{n} {g}: {w}" for n, g, w in out.dropped[:3]) or "; ".join(f"{n}: {w}" for n, w in skipped)
        raise ConfigError(f"no configuration of {', '.join(names)} on {ranks} ranks fits {cfg.name} "
                          f"(hidden {cfg.hidden}, heads {cfg.heads}, batch {cfg.batch}): {why or 'none listed'}")
    out.every.sort(key=lambda e: (e.prediction.step_s, e.algorithm, str(e.grid), sorted(e.options.items())))
    out.entries = _distinct(out.every)
    return out


def _distinct(entries: List[Ranked]) -> List[Ranked]:
    """One entry per computation: a named baseline's grid is also an ``axonn4d`` grid (same family,
    grid and options: the same step); it is listed once, under the most specific name (the algorithm
    with the most fixed axes), with the others in :attr:`Ranked.same_as`."""
    chosen: Dict[Tuple, Ranked] = {}
    for e in entries:
        key = (get_algorithm(e.algorithm).family, str(e.grid), tuple(sorted(e.options.items())))
        held = chosen.get(key)
        if held is None:
            chosen[key] = e
            continue
        if len(get_algorithm(e.algorithm).fixed) > len(get_algorithm(held.algorithm).fixed):
            e.same_as = held.same_as + [held.algorithm]
            chosen[key] = e
        else:
            held.same_as.append(e.algorithm)
    kept = set(id(e) for e in chosen.values())
    return [e for e in entries if id(e) in kept]


#: per-axis columns, in this order where present (other axes of other families follow)
_AXIS_ORDER = ("x", "y", "z", "data")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _exposed_comm(p: Prediction) -> Dict[str, float]:
    """Exposed communication per axis, pipeline bubbles (op ``bubble``) left out."""
    out: Dict[str, float] = {}
    for (axis, op), t in p.exposed_s.items():
        if op != "bubble":
            out[axis] = out.get(axis, 0.0) + t
    return out


def format_across(ranking: AcrossRanking, k: int) -> str:
    """The top ``k`` configurations as one table with the algorithm column (ms per step and rank;
    ``comm <axis>`` = exposed communication per axis; ``bubble``: pipeline idle time, where predicted)."""
    shown = ranking.entries[:k]
    comm = [_exposed_comm(e.prediction) for e in shown]
    axes = [a for a in _AXIS_ORDER if any(a in c for c in comm)]
    axes += sorted({a for c in comm for a in c} - set(_AXIS_ORDER))
    bubbles = [sum(t for (_, op), t in e.prediction.exposed_s.items() if op == "bubble") for e in shown]
    bubble_col = any(b > 0 for b in bubbles)
    headers = (["rank", "algorithm", "configuration", "step ms", "compute", "exposed"] + [f"comm {a}" for a in axes]
               + (["bubble"] if bubble_col else []) + ["wire MB", "mem GiB", "need GiB"])
    rows = []
    aliases = []
    for i, e in enumerate(shown, 1):
        if e.same_as:
            aliases.append(f"{e.algorithm} {e.label} = {' = '.join(f'{a} {e.label}' for a in e.same_as)}")
        p = e.prediction
        by_axis = comm[i - 1]
        rows.append([i, e.algorithm, e.label, _ms(p.step_s), _ms(p.compute_s), _ms(p.exposed_total_s)]
                    + [_ms(by_axis.get(a, 0.0)) for a in axes] + ([_ms(bubbles[i - 1])] if bubble_col else [])
                    + [f"{sum(p.wire_bytes.values()) / 1e6:.3f}", f"{p.memory.total / GIB:.3g}",
                       f"{e.need_bytes / GIB:.3g}"])
    lines = [render(rows, headers, align=["right", "left", "left"] + ["right"] * (len(headers) - 3))]
    if aliases:
        lines.append("listed once under the most specific name (the same step): " + "; ".join(aliases))
    return "\n".join(lines)


def format_best(ranking: AcrossRanking) -> str:
    """One row per algorithm: its best configuration and how much slower it is than the overall best."""
    best = ranking.best_by_algorithm()
    if not best:
        return ""
    top = ranking.entries[0].prediction.step_s
    from fourd_mpi.algorithms.registry import display_name

    rows = [[name, display_name(name), e.label, f"{_ms(e.prediction.step_s)} ms", f"{e.prediction.step_s / top:.2f}"]
            for name, e in sorted(best.items(), key=lambda kv: kv[1].prediction.step_s)]
    return ("best configuration per algorithm (vs best = predicted step time / the fastest's):\n"
            + render(rows, ["algorithm", "name", "configuration", "step", "vs best"],
                     align=["left", "left", "left", "right", "right"], indent="  "))


def run_predict_options(algorithm: Algorithm, run_options: Dict[str, Any]) -> Dict[str, Any]:
    """Extra ``predict`` keywords of a traced run (the family module's ``run_options``; none for 4D)."""
    entry = predictor(algorithm.family)
    own = entry.hook("run_options") if entry is not None else None
    return dict(own(run_options)) if callable(own) else {}


def sweep_options(ranking: AcrossRanking, k: int) -> Tuple[List[str], List[str]]:
    """``(grids, algorithms)`` of the top ``k``, each once, for ``--emit-sweep``."""
    shown = ranking.entries[:k]
    grids = list(dict.fromkeys(str(e.grid) for e in shown))
    return grids, list(dict.fromkeys(e.algorithm for e in shown))


__all__ = ["AcrossRanking", "Ranked", "algorithm_names", "candidates", "covered", "format_across",
           "format_best", "model_problems", "predict_one", "predictor", "rank_algorithms", "run_predict_options",
           "sweep_options"]
