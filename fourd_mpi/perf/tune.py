"""``fourd-mpi tune``: rank every grid shape of a rank count by predicted step time.

Every ordered ``(G_data, G_z, G_y, G_x)`` with product N (:func:`fourd_mpi.core.grid.grid_factorizations`)
is checked against the model's divisibility rules (:func:`fourd_mpi.step.presets.model_problems`) and
the memory limit (:mod:`fourd_mpi.perf.memory`), then predicted (:mod:`fourd_mpi.perf.predict`) on a
machine profile (:mod:`fourd_mpi.perf.machine`) and sorted by step time.

Memory admission: a grid fits when :meth:`~fourd_mpi.perf.memory.MemoryEstimate.required` (the counted
bytes plus :data:`~fourd_mpi.perf.memory.ALLOCATOR_MARGIN`, plus
:data:`~fourd_mpi.perf.memory.GPU_RUNTIME_RESERVE_BYTES` on a GPU profile) is at most the limit; the
default limit is the profile's ``device_memory_gib`` (:func:`default_memory_limit`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from fourd_mpi.core.grid import GridShape, divisors, grid_count, grid_factorizations
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.machine import MachineProfile, load_profile
from fourd_mpi.perf.memory import estimate_memory, memory_reserve
from fourd_mpi.perf.predict import Prediction, predict
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import ModelConfig, model_problems
from fourd_mpi.util.units import GIB

#: the most candidate 4D grids (ordered G_data x G_z x G_y x G_x of the rank count) the tuner searches:
#: each is checked and predicted (about a millisecond each), so a search stays within seconds. Every
#: power of two up to the 2^24 ranks the model plans for has fewer (2^24: 2,925); a rank count with
#: many small prime factors has more (720,720: 89,600) and is refused with one line.
MAX_TUNE_GRIDS = 4096
#: the most grids whose divisibility is checked (about a microsecond each) to count the valid ones of a model
MAX_SCANNED_GRIDS = 200_000


def check_search_size(ranks: int, option: str = "--ranks", cfg: Optional[ModelConfig] = None) -> None:
    """Refuse a rank count with more than :data:`MAX_TUNE_GRIDS` candidate grids (one line, with the
    powers of two around it), before anything is predicted. With the model ``cfg`` the candidates are the
    grids that pass its divisibility rules (:func:`model_problems`, checked without predicting, up to
    :data:`MAX_SCANNED_GRIDS` grids): a rank count with no valid grid at all then gets the search's own
    answer, the nearest rank counts that have one."""
    count, which = grid_count(ranks), ""
    if count > MAX_TUNE_GRIDS and cfg is not None and count <= MAX_SCANNED_GRIDS:
        count = sum(1 for grid in grid_factorizations(ranks) if not model_problems(cfg, grid))
        which = f" that the sizes of {cfg.name} divide"
    if count > MAX_TUNE_GRIDS:
        low = 1 << (ranks.bit_length() - 1)
        raise ConfigError(f"{option} {ranks:,} has {count:,} candidate grids{which}, "
                          f"more than the {MAX_TUNE_GRIDS:,} the tuner "
                          f"searches: give a rank count with fewer divisors (e.g. {low:,} or {low * 2:,}), or "
                          f"predict one grid with fourd-mpi model predict --grid")


@dataclass
class Ranking:
    """Predictions sorted by step time, and what was dropped: ``(grid, reason)``."""

    predictions: List[Prediction]
    dropped: List[Tuple[GridShape, str]] = field(default_factory=list)
    considered: int = 0
    reserve: int = 0  # bytes of the runtime reserve counted in a grid's memory need

    def dropped_for(self, kind: str) -> int:
        """How many grids were dropped for ``kind`` (``divisibility`` or ``memory``)."""
        return sum(1 for _, why in self.dropped if why.startswith(kind + ":"))

    def dropped_summary(self) -> str:
        """``"12 of 20 grids dropped: 8 divisibility (hidden size ... not divisible by 8), 4 memory (> 16 GiB)"``."""
        if not self.dropped:
            return f"all {self.considered} grids are valid"
        kinds = Counter(why.split(":", 1)[0] for _, why in self.dropped)
        examples = {}
        for g, why in self.dropped:
            examples.setdefault(why.split(":", 1)[0], f"{g}: {why.split(':', 1)[1].strip()}")
        parts = [f"{n} {kind} (e.g. {examples[kind]})" for kind, n in kinds.items()]
        return f"{len(self.dropped)} of {self.considered} grids dropped: " + "; ".join(parts)


def _nearby_rank_counts(cfg: ModelConfig, ranks: int, limit: int = 6) -> List[int]:
    """Up to ``limit`` rank counts closest to ``ranks`` (the smaller of a tie first) for which some
    grid passes the divisibility rules of :func:`model_problems`.

    Every valid world size is ``(G_data G_z) G_y G_x`` with ``G_data G_z | batch``, ``G_y | ffn``
    and ``G_x | hidden``, so the candidates are the products of one divisor of each (a superset,
    each then checked against the rules); nothing scales with ``ranks`` itself. (Sorting
    ``range(4 * ranks)`` was O(ranks) before the first answer: ``tune --ranks 65536`` hung.)"""
    candidates = sorted({a * b * c for a in divisors(cfg.batch) for b in divisors(cfg.ffn_hidden)
                         for c in divisors(cfg.hidden)}, key=lambda v: (abs(v - ranks), v))
    out = []
    for n in candidates:
        if any(not model_problems(cfg, g) for g in grid_factorizations(n)):
            out.append(n)
            if len(out) >= limit:
                break
    return sorted(out)


def default_memory_limit(profile: MachineProfile) -> Optional[float]:
    """The profile's device memory in bytes (None when it has none: CPU profiles)."""
    gib = profile.device_memory_gib
    return None if gib is None else gib * GIB


def rank_grids(cfg: ModelConfig, ranks: int, profile: MachineProfile, overlap: OverlapConfig = None,
               dtype: str = "float32", progress: str = "poll", optimizer: str = "adam",
               memory_limit_bytes: Optional[float] = None, ranks_per_node: Optional[int] = None,
               recompute: str = "none", attention: str = "unfused", precision: Optional[str] = None,
               shard_optimizer: str = "none", grids: Optional[List[GridShape]] = None,
               dw_window: Optional[int] = None) -> Ranking:
    """Every valid grid of ``ranks`` (or of ``grids``), predicted and sorted (fastest first).

    A grid is dropped when ``required`` memory (module docstring) exceeds ``memory_limit_bytes``
    (None: no limit). Raises :class:`ConfigError` saying what would fit when nothing does.
    """
    if ranks < 1:
        raise ConfigError(f"--ranks must be positive, got {ranks}")
    if cfg.batch is None:
        raise ConfigError(f"preset {cfg.name} needs the global batch: give --batch SEQUENCES")
    if grids is None:
        check_search_size(ranks, cfg=cfg)
    overlap = overlap or OverlapConfig()
    reserve = memory_reserve(profile)
    mem = dict(recompute=recompute, attention=attention, precision=precision, shard_optimizer=shard_optimizer,
               dw_window=dw_window)
    ranking = Ranking([], reserve=reserve)
    fitting: List[Tuple[GridShape, int]] = []
    for grid in (grids if grids is not None else grid_factorizations(ranks)):
        ranking.considered += 1
        problems = model_problems(cfg, grid)
        if problems:
            ranking.dropped.append((grid, f"divisibility: {problems[0]}"))
            continue
        need = estimate_memory(cfg, grid, dtype, optimizer, overlap=overlap, **mem).required(reserve)
        fitting.append((grid, need))
        if memory_limit_bytes is not None and need > memory_limit_bytes:
            ranking.dropped.append((grid, f"memory: needs {need / GIB:.3g} GiB per rank > "
                                          f"{memory_limit_bytes / GIB:.3g} GiB"))
            continue
        ranking.predictions.append(predict(cfg, grid, profile, overlap, dtype, progress, optimizer, ranks_per_node,
                                           **mem))
    if not ranking.predictions:
        shape = (f"{cfg.name} (hidden {cfg.hidden}, heads {cfg.heads}, ffn {cfg.ffn_hidden}, seq {cfg.seq}, "
                 f"batch {cfg.batch})")
        if not fitting:
            near = _nearby_rank_counts(cfg, ranks)
            raise ConfigError(
                f"no grid of {ranks} ranks fits {shape}: every factorization breaks a divisibility rule "
                f"(e.g. {ranking.dropped[0][0]}: {ranking.dropped[0][1].split(':', 1)[1].strip()}); rank counts "
                f"with a valid grid: {', '.join(map(str, near)) or 'none'}")
        best_grid, best_need = min(fitting, key=lambda gn: gn[1])
        more = _ranks_that_fit(cfg, ranks, memory_limit_bytes, dtype, optimizer, overlap, reserve, mem)
        raise ConfigError(
            f"no grid of {ranks} ranks fits {shape} in {memory_limit_bytes / GIB:.3g} GiB per rank: the "
            f"smallest need is {best_need / GIB:.3g} GiB per rank (grid {best_grid}); raise --memory-limit to "
            f"{best_need / GIB:.3g} GiB" + (f", or use {more} ranks (fits)" if more else "")
            + ", or lower the batch")
    ranking.predictions.sort(key=lambda p: (p.step_s, str(p.grid)))
    return ranking


def _ranks_that_fit(cfg, ranks, limit, dtype, optimizer, overlap, reserve=0, mem=None) -> Optional[int]:
    """The smallest multiple of ``ranks`` (up to 64x) with a grid that fits the memory limit."""
    n = ranks * 2
    while n <= ranks * 64:
        for g in grid_factorizations(n):
            if not model_problems(cfg, g) and estimate_memory(cfg, g, dtype, optimizer, overlap=overlap,
                                                              **(mem or {})).required(reserve) <= limit:
                return n
        n *= 2
    return None


def top_grids(cfg: ModelConfig, ranks: int, k: int, profile=None, overlap: str = "none", dtype: str = "float32",
              memory_limit_bytes=None, algorithm: str = "axonn4d") -> List[GridShape]:
    """The ``k`` grids of ``ranks`` with the smallest predicted step time (for ``grids: auto:K``).

    ``profile``: a :class:`MachineProfile`, a built-in name or a file (None: ``laptop``);
    ``overlap``: as ``--overlap`` (``none``, ``all``, ``oag,ors``...); ``algorithm``: the grids of this
    algorithm only (:mod:`fourd_mpi.perf.algorithms`). Raises :class:`ConfigError` with what would fit
    when nothing fits.
    """
    if k < 1:
        raise ConfigError(f"k must be positive, got {k}")
    check_search_size(ranks, "grids: auto for", cfg=cfg if cfg.batch is not None else None)
    if not isinstance(profile, MachineProfile):
        profile = load_profile(profile)
    if algorithm != "axonn4d":
        from fourd_mpi.perf.algorithms import rank_algorithms

        ranking = rank_algorithms([algorithm], cfg, ranks, profile, OverlapConfig.parse(overlap), dtype,
                                  memory_limit_bytes=memory_limit_bytes)
        if ranking.skipped:
            raise ConfigError(f"grids: auto for algorithm {algorithm}: {ranking.skipped[0][1]}")
        return [e.grid for e in ranking.every[:k]]
    ranking = rank_grids(cfg, ranks, profile, OverlapConfig.parse(overlap), dtype,
                         memory_limit_bytes=memory_limit_bytes)
    return [p.grid for p in ranking.predictions[:k]]


def why_best(ranking: Ranking) -> str:
    """A sentence on why the first grid wins against the runner-up (and the slowest)."""
    preds = ranking.predictions
    best = preds[0]
    if len(preds) == 1:
        return f"{best.grid} is the only valid grid."
    second, worst = preds[1], preds[-1]

    def contrast(other: Prediction) -> str:
        diffs = {}
        mine, theirs = best.exposed_by_axis(), other.exposed_by_axis()
        for axis in set(mine) | set(theirs):
            diffs[f"{axis}-axis communication"] = theirs.get(axis, 0.0) - mine.get(axis, 0.0)
        diffs["compute"] = other.compute_s - best.compute_s
        what, gain = max(diffs.items(), key=lambda kv: kv[1])
        if gain <= 0:
            return f"{other.grid} is within the model's noise of it"
        ops = sorted({op for (axis, op) in other.exposed_s
                      if f"{axis}-axis" in what and other.exposed_s[(axis, op)] > 0})
        detail = f" ({', '.join(ops)})" if ops else ""
        return (f"it saves {gain * 1e3:.3g} ms of {what}{detail} per step against {other.grid} "
                f"({other.step_s * 1e3:.3g} ms)")

    return (f"{best.grid} wins ({best.step_s * 1e3:.3g} ms predicted): {contrast(second)}; "
            f"against the slowest valid grid, {contrast(worst)}.")


# ---------------------------------------------------------------------------
# presentation (for fourd-mpi tune; the machine profile of a site: fourd_mpi.jobs.sites.resolve_profile)
# ---------------------------------------------------------------------------

def _fmt_ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def format_ranking(ranking: Ranking, k: int) -> str:
    from fourd_mpi.util.table import render

    preds = ranking.predictions[:k]
    axes = ("x", "y", "z", "data")
    headers = (["rank", "grid DxZxYxX", "step ms", "compute", "exposed"] + [f"comm {a}" for a in axes]
               + ["wire MB", "mem GiB", "need GiB", "placement (x,y,z,data)"])
    rows = []
    for i, p in enumerate(preds, 1):
        by_axis = p.exposed_by_axis()
        wire = sum(p.wire_bytes.values()) / 1e6
        rows.append([i, p.grid, _fmt_ms(p.step_s), _fmt_ms(p.compute_s), _fmt_ms(p.exposed_total_s)]
                    + [_fmt_ms(by_axis.get(a, 0.0)) for a in axes]
                    + [f"{wire:.3f}", f"{p.memory.total / GIB:.3g}", f"{p.memory.required(ranking.reserve) / GIB:.3g}",
                       ",".join(p.placement[a] for a in axes)])
    return render(rows, headers, align=["right"] * (len(headers) - 1) + ["left"])


def sweep_spec(cfg: ModelConfig, ranks: int, grids: List[GridShape], overlap: str) -> Dict:
    """The sweep-spec mapping (:mod:`fourd_mpi.jobs.spec` format) measuring ``grids``."""
    from fourd_mpi.step.presets import PRESETS, preset_of

    model: Dict = {"preset": preset_of(cfg), "batch": cfg.batch}
    base = PRESETS.get(preset_of(cfg))
    for f in ("layers", "hidden", "heads", "ffn_hidden", "seq"):
        if base is None or getattr(base, f) != getattr(cfg, f):
            model[f] = getattr(cfg, f)
    safe = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in f"tune-{preset_of(cfg)}-{ranks}")
    return {"name": safe, "description": f"the top {len(grids)} grids of fourd-mpi tune",
            "study": "strong", "ranks": [ranks], "grids": {ranks: [str(g) for g in grids]},
            "model": model, "options": {"steps": 10, "warmup": 2, "trace_level": "op"},
            "matrix": {"overlap": [overlap]}}


