"""The pipeline's arithmetic, pure (no MPI, no arrays): rank order, stages, micro-batches, checks.

Used on every rank before any collective (:func:`fourd_mpi.run.options.resolve` calls
:func:`stage_world` and :func:`check` through the registry), by the implementation
(:mod:`fourd_mpi.algorithms.pipeline`) and by the performance model (:mod:`fourd_mpi.perf.pipeline`).

**Rank order** (outermost first): ``data, inter, z, y, x``, as AxoNN (the inter-layer axis
between data and the intra-layer axes). With ``T = G_z G_y G_x`` ranks per 4D tensor group and
``P = G_inter`` stages, world rank ``r`` is in data replica ``d = r // (P T)``, stage
``s = (r // T) mod P`` and holds tensor rank ``t = r mod T``. A stage's 4D grid (its ranks with
the same ``s``, ordered by ``(d, t)``) is ``G_data x G_z x G_y x G_x``. Why this order: the tensor
axes communicate in every layer and stay innermost (on one node first, as without pipelining);
the pipeline's point-to-point messages (one activation per micro-batch and stage boundary) come
next, so that stage neighbours (world ranks ``T`` apart) share a node whenever ``P T`` ranks fit on
one, and only the data all-reduce (once per step) is left to cross nodes first. Putting ``inter``
outermost would send every micro-batch's activations across nodes as soon as one stage fills a node.

**Stages**: stage ``s`` holds the contiguous blocks ``[s L // P + min(s, L mod P) ...)``, i.e. the
first ``L mod P`` stages one block more than the others (balanced to one block); stage 0 takes the
input, the last stage computes the loss.
"""

from __future__ import annotations

from typing import Dict, Mapping, Tuple

from fourd_mpi.errors import ConfigError

#: ``--pipeline-schedule`` values
SCHEDULES = ("axonn", "1f1b")
#: the 5D grid's axes, in the order the trace metadata spells it (``inter x data x z x y x x``)
GRID5D_AXES = ("inter", "data", "z", "y", "x")
#: rank order of the 5D grid, outermost first
RANK_ORDER = ("data", "inter", "z", "y", "x")


def stage_world(algorithm, world_size: int, values: Mapping) -> int:
    """Ranks of one stage's 4D grid: ``world_size / G_inter``. Pure; a :class:`ConfigError` when
    ``G_inter`` does not divide the world."""
    stages = values.get("ginter") or 1
    if stages < 1:
        raise ConfigError(f"--ginter must be a positive integer, got {stages}")
    if world_size % stages:
        raise ConfigError(f"--ginter {stages} does not divide the world size {world_size}: the {stages} pipeline "
                          f"stages need the same number of ranks each (give a divisor of {world_size})")
    return world_size // stages


def local_sequences(options) -> int:
    """Sequences of the batch shard of one rank: ``B / (G_data G_z)``."""
    return options.model.batch // (options.grid.data * options.grid.z)


def check(algorithm, options) -> None:
    """Cross-checks of resolved options (:class:`~fourd_mpi.algorithms.runoptions.RunOptions`). Pure."""
    stages, layers = options.ginter, options.model.layers
    if stages > layers:
        raise ConfigError(f"--ginter {stages}: more pipeline stages than blocks ({options.model.name} has {layers} "
                          f"block(s)); give --ginter {layers} or less, or more --layers")
    shard = local_sequences(options)
    if shard % options.microbatches:
        raise ConfigError(f"--microbatches {options.microbatches} does not divide the batch shard of {shard} "
                          f"sequence(s) per rank (global batch {options.model.batch} / (G_data {options.grid.data} "
                          f"x G_z {options.grid.z})); give a divisor of {shard}")
    if options.pipeline_schedule not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {options.pipeline_schedule!r}: choose one of "
                          f"{', '.join(SCHEDULES)}")


def stage_blocks(layers: int, stages: int, stage: int) -> range:
    """The blocks of ``stage`` (contiguous, balanced to one block; the first ``layers mod stages`` get one more)."""
    base, extra = divmod(layers, stages)
    first = stage * base + min(stage, extra)
    return range(first, first + base + (1 if stage < extra else 0))


def place(world_rank: int, stages: int, tensor_size: int) -> Tuple[int, int]:
    """``(stage, rank in the stage's 4D grid)`` of a world rank (:data:`RANK_ORDER`)."""
    replica, rest = divmod(world_rank, stages * tensor_size)
    stage, tensor_rank = divmod(rest, tensor_size)
    return stage, replica * tensor_size + tensor_rank


def world_rank(stage: int, stage_rank: int, stages: int, tensor_size: int) -> int:
    """Inverse of :func:`place`."""
    replica, tensor_rank = divmod(stage_rank, tensor_size)
    return (replica * stages + stage) * tensor_size + tensor_rank


def grid_dims(options) -> Dict[str, int]:
    """The run's grid, axis -> size in rank order (:data:`RANK_ORDER`, ``data, inter, z, y, x``): world ranks
    are row-major over them (:func:`place`), the axes of :class:`fourd_mpi.core.grid.ProcessGrid` of the whole
    world (its family's ``grid_dims`` hook). Pure."""
    sizes = grid5d(options)
    return {axis: sizes[axis] for axis in RANK_ORDER}


def grid5d(options) -> Dict[str, int]:
    """``{"inter", "data", "z", "y", "x"}`` sizes."""
    g = options.grid
    return {"inter": options.ginter, "data": g.data, "z": g.z, "y": g.y, "x": g.x}


def grid5d_text(options) -> str:
    """``2x1x2x1x2`` (``inter x data x z x y x x``)."""
    return "x".join(str(v) for v in grid5d(options).values())


def inflight(schedule: str, stages: int, microbatches: int, stage: int) -> int:
    """The most micro-batches whose activations ``stage`` holds at once: 1F1B ``min(p - s, m)``; AxoNN
    ``min(p, m)`` on every stage (stage 0 admits ``p``, and a later stage may forward all of them before
    the first backward comes back)."""
    if schedule == "axonn":
        return min(stages, microbatches)
    return min(stages - stage, microbatches)


def one_f_one_b_warmup(stages: int, microbatches: int, stage: int) -> int:
    """Forwards before the first backward on ``stage`` under 1F1B: ``min(P - s - 1, m)``."""
    return min(stages - stage - 1, microbatches)
