"""The :class:`Scenario`: one fully forced configuration of ``fourd-mpi model predict``, its parsing and checks (pure).

A :class:`Scenario` fixes every choice: the model (with its vocabulary), the algorithm and its 4D grid
per pipeline stage ``G_data x G_z x G_y x G_x``, ``p`` stages, the schedule (``1f1b``,
``interleaved`` with ``v`` chunks per stage, ``axonn``), the micro-batch size ``b`` and count ``m``
(``B = b m G_data G_z``: gradient accumulation for every algorithm, ``p = 1`` included), sequence
parallelism, recompute, dtype, attention, optimizer sharding, overlap, the dW window, the machine
profile and ranks per node, whose implementation, and context parallelism.

The model lives in two modules above this one: :mod:`fourd_mpi.perf.step_terms` (one function per term of
the step equation, and the memory per rank) and :mod:`fourd_mpi.perf.prediction` (``predict_scenario``,
which sums them). This module holds the record, the one constructor from run's option words
(:meth:`Scenario.from_options`), the one-line refusals (:func:`check`) and the views every term takes of a
scenario (its storage and GEMM dtypes, one slot's model, the placement of its axes, the context-parallel
view).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any, List, Mapping, Optional

from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf import megatron_ddp, schedules, terms, vocab, zero3_2021
from fourd_mpi.perf.machine import MachineProfile, axis_inner_products, axis_placement, world_levels, world_strides
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import ModelConfig, model_problems
from fourd_mpi.util.units import GIB

#: the 4D-family algorithms ``model predict`` takes (``pipeline`` = ``axonn4d`` with stages)
ALGORITHMS = ("axonn4d", "megatron1d", "fsdp", "dp", "pipeline")
#: whose code a scenario models: this suite's step, DeepSpeed's ZeRO-3 of 2021, Megatron-LM's local DDP of 2020-2021
IMPLEMENTATIONS = ("fourd", zero3_2021.NAME, megatron_ddp.NAME, terms.PYTORCH_FSDP)


@dataclass(frozen=True)
class Scenario:
    """Every choice of one predicted configuration (module docstring). ``model.batch`` is the global
    batch ``B``; ``microbatch_size`` ``b`` and ``microbatches`` ``m`` satisfy ``B = b m G_data G_z``."""

    model: ModelConfig
    grid: GridShape
    profile: str
    algorithm: str = "axonn4d"
    stages: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    microbatch_size: Optional[int] = None
    microbatches: Optional[int] = None
    vocab: int = vocab.DEFAULT_VOCAB
    sequence_parallel: bool = False
    recompute: str = "full"
    dtype: str = "bfloat16"
    attention: str = "fused"
    precision: Optional[str] = None
    shard_optimizer: str = "none"
    optimizer: str = "adam"
    #: run's ``--overlap`` text, or an :class:`OverlapConfig` (with its prefetch depth and chunks)
    overlap: Any = "all"
    #: who progresses nonblocking collectives during compute (run's ``--progress``: poll, none, thread)
    progress: str = "poll"
    dw_window: Optional[int] = 2
    ranks_per_node: Optional[int] = None
    memory_limit_gib: Optional[float] = None
    #: ``fourd`` (this suite's step) or ``deepspeed-2021`` (``fsdp`` only: DeepSpeed ZeRO-3 v0.3.13-v0.5.4's
    #: extra gathers and host copies, :mod:`fourd_mpi.perf.zero3_2021`)
    implementation: str = "fourd"
    #: blocks of the first / the last stage (Megatron-LM's ``--decoder-first/last-pipeline-num-layers``); None:
    #: :func:`fourd_mpi.perf.terms.stage_layers`'s default (balanced to one block, the first stages fuller)
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    #: ranks sharing each sequence (Megatron-LM's context parallelism, :mod:`fourd_mpi.perf.terms`)
    context_parallel: int = 1
    #: how they share K and V (:data:`fourd_mpi.perf.terms.CP_COMMS`): ``ring`` (Megatron-LM) or ``allgather``
    #: (Llama 3)
    context_parallel_comm: str = "ring"

    @property
    def world(self) -> int:
        return self.grid.size * self.stages * self.context_parallel

    @property
    def stage_layers(self) -> tuple:
        """Blocks per stage, first to last (:func:`fourd_mpi.perf.terms.stage_layers`)."""
        return terms.stage_layers(self.model.layers, self.stages, self.first_stage_layers, self.last_stage_layers)

    @classmethod
    def from_options(cls, options: Mapping[str, Any], profile: MachineProfile) -> "Scenario":
        """The one way from options to a scenario (``model predict``; every caller outside ``perf``): ``options``
        maps run's option names (:data:`fourd_mpi.run.options.RUN_OPTIONS`, ``-`` or ``_``) to parsed values,
        with run's meanings: ``ginter`` stages, ``pipeline-schedule``, ``microbatches``, ``recompute``,
        ``overlap``, ``progress``, ``dtype``, ``gdata``/``gz``/``gy``/``gx`` (or ``grid``: ``16x1x8x1`` or a
        :class:`GridShape`), ``memory-limit`` (bytes, 0 none, missing: the profile's device memory) and the model
        (``model`` preset, ``layers`` ... ``batch``; or a resolved :class:`ModelConfig`); plus what run cannot
        choose (:data:`SCENARIO_ONLY`). A missing key takes the scenario's
        default (``dtype``: the profile's training dtype). Bad values: one-line :class:`ConfigError`."""
        return _from_options(options, profile)

    def resolved(self) -> "Scenario":
        """The scenario with ``b`` and ``m`` both filled in, or a :class:`ConfigError` (one line)."""
        check(self)
        shards = self.grid.data * self.grid.z
        replica = self.model.batch // shards
        b, m = self.microbatch_size, self.microbatches
        if b is None and m is None:
            b, m = replica, 1
        elif b is None:
            if replica % m:
                raise ConfigError(f"{replica} sequences per data x Z shard (batch {self.model.batch} / {shards}) do "
                                  f"not split into {m} micro-batches")
            b = replica // m
        elif m is None:
            if replica % b:
                raise ConfigError(f"{replica} sequences per data x Z shard (batch {self.model.batch} / {shards}) are "
                                  f"not a multiple of the micro-batch size {b}")
            m = replica // b
        elif b * m != replica:
            raise ConfigError(f"micro-batch size {b} x {m} micro-batches = {b * m} sequences, but batch "
                              f"{self.model.batch} / (G_data {self.grid.data} x G_z {self.grid.z}) = {replica}")
        schedules.check_schedule(self.schedule, self.stages, self.chunks, self.model.layers, m, self.stage_layers)
        return replace(self, microbatch_size=b, microbatches=m)

    # -- the views every term takes (fourd_mpi/perf/step_terms.py) ---------------------------------------------

    def node_ranks(self, profile: MachineProfile) -> int:
        """Ranks per node: ``ranks_per_node``, else the profile's (at most the world)."""
        return self.ranks_per_node or min(profile.ranks_per_node, self.world)

    @property
    def interleaving(self) -> int:
        """Model chunks ``v`` per stage the schedule runs: ``chunks`` when interleaved, else 1."""
        return self.chunks if self.schedule == "interleaved" else 1

    @property
    def overlap_config(self) -> OverlapConfig:
        """``overlap`` parsed (a caller holding an :class:`OverlapConfig`, with its prefetch depth and chunks, may
        pass it as is)."""
        return self.overlap if isinstance(self.overlap, OverlapConfig) else OverlapConfig.parse(self.overlap)

    @property
    def store_dtype(self) -> str:
        """The dtype the scenario stores and sends (:func:`fourd_mpi.perf.terms.storage_dtype`: BF16 for
        ``float8``)."""
        return terms.storage_dtype(self.dtype)

    @property
    def gemm_dtype(self) -> Optional[str]:
        """The blocks' GEMM dtype when it is not the storage dtype (``float8``), else None."""
        return self.dtype if self.dtype != self.store_dtype else None

    @property
    def micro_config(self) -> ModelConfig:
        """One slot's model (``m`` set): the fullest stage's blocks (:attr:`stage_layers`: ``ceil(L/p)`` by default,
        Megatron-LM's first/last counts otherwise) on ``B/m`` sequences."""
        return replace(self.model, layers=max(self.stage_layers), batch=self.model.batch // self.microbatches)

    def world_levels(self, rpn: int):
        """``(levels, strides)`` of the stage grid's axes in the pipeline's world (rank order data, inter, z, y, x:
        :func:`~fourd_mpi.perf.machine.world_levels`) for ``p > 1``; ``(None, None)`` (the 4D grid's own
        placement) for one stage."""
        if self.stages == 1:
            return None, None
        levels = {a: v for a, v in world_levels(self.grid, self.stages, rpn).items() if a != "inter" and v != "-"}
        return levels, world_strides(self.grid, self.stages)

    def placement(self, rpn: int):
        """``(placement, inner)`` of the stage grid's axes, as :func:`~fourd_mpi.perf.predict.predict` places them
        with :meth:`world_levels` (``axis -> level``, ``axis -> ranks inside it``)."""
        levels, strides = self.world_levels(rpn)
        return ({**axis_placement(self.grid, rpn), **(levels or {})},
                {**axis_inner_products(self.grid), **(strides or {})})

    def context_view(self) -> "Scenario":
        """The scenario as every term but attention sees it under context parallelism
        (:func:`fourd_mpi.perf.terms.context_parallel_view`: ``s/cp`` tokens per rank, ``cp`` times the data
        ranks)."""
        cp = self.context_parallel
        if self.model.batch is None:
            return self  # check() says what is missing
        view = terms.context_parallel_view(self.model.seq, self.model.batch, self.grid.data, cp)
        return replace(self, model=replace(self.model, seq=view["seq"], batch=view["batch"]),
                       grid=replace(self.grid, data=view["data"]), context_parallel=1)

    def options(self) -> dict:
        """The ``model predict`` options (run's words, :data:`SCENARIO_ONLY`) that give this scenario again through
        :meth:`from_options`: every size of the model, the grid, every choice; options left at their unset
        value (no precision, no node shape, no first/last stage size) are left out, ``sequence-parallel`` only
        when on. ``memory-limit`` in GiB (``none``: no limit)."""
        m = self.model
        overlap = self.overlap
        if isinstance(overlap, OverlapConfig):
            overlap = overlap.option_text + (",cache" if overlap.cache else "")
        limit = "none" if self.memory_limit_gib is None else f"{self.memory_limit_gib:.17g}GiB"
        out = {"profile": self.profile, "layers": m.layers, "hidden": m.hidden, "heads": m.heads,
               "kv-heads": m.kv_head_count, "ffn-hidden": m.ffn_hidden, "mlp": m.mlp, "seq": m.seq, "batch": m.batch,
               "vocab": self.vocab, "algorithm": self.algorithm, "grid": str(self.grid), "ginter": self.stages,
               "first-stage-layers": self.first_stage_layers, "last-stage-layers": self.last_stage_layers,
               "pipeline-schedule": self.schedule, "chunks-per-stage": self.chunks,
               "context-parallel": self.context_parallel, "context-parallel-comm": self.context_parallel_comm,
               "microbatch-size": self.microbatch_size, "microbatches": self.microbatches,
               "sequence-parallel": True if self.sequence_parallel else None, "recompute": self.recompute,
               "dtype": self.dtype, "attention": self.attention, "precision": self.precision,
               "shard-optimizer": self.shard_optimizer, "optimizer": self.optimizer, "overlap": str(overlap),
               "progress": self.progress, "dw-window": "none" if self.dw_window is None else self.dw_window,
               "ranks-per-node": self.ranks_per_node, "memory-limit": limit, "implementation": self.implementation}
        return {k: v for k, v in out.items() if v is not None}

    def predict_command(self) -> str:
        """``fourd-mpi model predict ...``: the command line of :meth:`options`, shell-quoted."""
        import shlex

        words = ["fourd-mpi", "model", "predict"]
        for name, value in self.options().items():
            words += [f"--{name}"] if value is True else [f"--{name}", str(value)]
        return shlex.join(words)


#: scenario options run has no option for (``model predict``'s own): the interleaved schedule's chunks, the
#: micro-batch size, the vocabulary, sequence parallelism, precision, optimizer sharding, the dW window, the node
#: shape, whose implementation; the model's only terms (:mod:`fourd_mpi.perf.terms`): grouped-query attention and
#: the SwiGLU MLP, Megatron-LM's first/last stage sizes, context parallelism
SCENARIO_ONLY = ("chunks-per-stage", "microbatch-size", "vocab", "sequence-parallel", "precision", "shard-optimizer",
                 "dw-window", "ranks-per-node", "implementation", "kv-heads", "mlp", "first-stage-layers",
                 "last-stage-layers", "context-parallel", "context-parallel-comm")


def _from_options(options: Mapping[str, Any], profile: MachineProfile) -> Scenario:
    """:meth:`Scenario.from_options`."""
    from fourd_mpi.core.backend import DTYPES
    from fourd_mpi.core.progress import PROGRESS_STRATEGIES
    from fourd_mpi.perf.memory import ATTENTION, OPTIMIZER_SHARDING, PRECISIONS, RECOMPUTE
    from fourd_mpi.step.presets import MLP_KINDS, resolve_labelled
    from fourd_mpi.util.values import layer_count, memory_limit

    def get(name: str, default: Any = None) -> Any:
        value = options.get(name, options.get(name.replace("-", "_")))
        return default if value is None else value

    for name, choices in (("recompute", RECOMPUTE), ("attention", ATTENTION), ("shard-optimizer", OPTIMIZER_SHARDING),
                          ("precision", PRECISIONS), ("progress", PROGRESS_STRATEGIES), ("mlp", MLP_KINDS)):
        if get(name) is not None and get(name) not in choices:
            raise ConfigError(f"--{name} {get(name)!r}: choose {', '.join(choices)}")
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn-hidden", "seq", "batch", "ginter", "chunks-per-stage",
                 "microbatch-size", "microbatches", "ranks-per-node", "gdata", "gz", "gy", "gx"):
        if get(name) is not None and get(name) < 1:
            raise ConfigError(f"--{name} must be positive, got {get(name)}")
    overlap = get("overlap", "all")
    if not isinstance(overlap, OverlapConfig):
        OverlapConfig.parse(overlap)  # one line for an unknown overlap
    cfg = get("model", "gpt-80b")
    if not isinstance(cfg, ModelConfig):  # a preset's name and run's size options; or a resolved model as is
        sizes = {k.replace("-", "_"): get(k) for k in ("layers", "hidden", "heads", "ffn-hidden", "seq", "kv-heads",
                                                       "mlp")}
        cfg = resolve_labelled(cfg, batch=get("batch"), **sizes)
    grid = get("grid")
    if grid is None and any(get(a) is not None for a in ("gdata", "gz", "gy", "gx")):
        grid = GridShape(*(get(a, 1) for a in ("gdata", "gz", "gy", "gx")))
    if grid is None:
        raise ConfigError("model predict needs --grid G_DATAxG_ZxG_YxG_X (one pipeline stage's 4D grid; or "
                          "--gdata --gz --gy --gx)")
    window = get("dw-window", 2)
    if str(window).lower() == "none":
        window = None
    elif not isinstance(window, int):
        try:
            window = layer_count(str(window))
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"--dw-window: {exc} (or none)") from None
    limit = get("memory-limit")
    if isinstance(limit, str):
        try:
            limit = memory_limit(limit)
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"--memory-limit: {exc}") from None
    limit_gib = profile.device_memory_gib if limit is None else (limit / GIB or None)
    dtype = terms.model_dtype(get("dtype", profile.training_dtype))  # fp8 is float8
    if dtype not in (*DTYPES, terms.FP8):
        raise ConfigError(f"--dtype {dtype!r}: choose {', '.join((*DTYPES, terms.FP8))} "
                          f"(or {', '.join(terms.DTYPE_ALIASES)})")
    return Scenario(cfg, grid if isinstance(grid, GridShape) else GridShape.parse(str(grid)), profile.name,
                    algorithm=get("algorithm", "axonn4d"), stages=get("ginter", 1),
                    schedule=get("pipeline-schedule", "1f1b"), chunks=get("chunks-per-stage", 1),
                    microbatch_size=get("microbatch-size"), microbatches=get("microbatches"),
                    vocab=get("vocab", vocab.DEFAULT_VOCAB), sequence_parallel=bool(get("sequence-parallel", False)),
                    recompute=get("recompute", "full"), dtype=dtype,
                    attention=get("attention", "fused"), precision=get("precision"),
                    shard_optimizer=get("shard-optimizer", "none"), optimizer=get("optimizer", "adam"),
                    overlap=overlap, progress=get("progress", "poll"), dw_window=window,
                    ranks_per_node=get("ranks-per-node"),
                    memory_limit_gib=limit_gib, implementation=get("implementation", "fourd"),
                    first_stage_layers=get("first-stage-layers"), last_stage_layers=get("last-stage-layers"),
                    context_parallel=get("context-parallel", 1),
                    context_parallel_comm=get("context-parallel-comm", "ring"))


def stage_text(layers: tuple) -> str:
    """``10 x 6, 2 x 5`` for ``(6,) * 10 + (5,) * 2``: runs of equal stages, first to last."""
    runs: List[List[int]] = []
    for n in layers:
        if runs and runs[-1][1] == n:
            runs[-1][0] += 1
        else:
            runs.append([1, n])
    return ", ".join(f"{k} x {n}" if k > 1 else str(n) for k, n in runs)


def check(sc: Scenario) -> None:
    """One-line refusals: an unknown algorithm, a grid the algorithm pins otherwise, sizes that do not
    divide, a pipeline deeper than the model."""
    from fourd_mpi.algorithms.registry import get as get_algorithm

    if sc.algorithm not in ALGORITHMS:
        raise ConfigError(f"model predict covers the algorithms {', '.join(ALGORITHMS)}, not {sc.algorithm!r} "
                          f"(fourd-mpi tune --algorithm {sc.algorithm} ranks its configurations)")
    algo = get_algorithm(sc.algorithm)
    for axis, size in algo.fixed.items():
        if sc.grid[axis] != size:
            raise ConfigError(f"algorithm {sc.algorithm} pins G_{axis} = {size}, got grid {sc.grid} "
                              f"(G_data x G_z x G_y x G_x)")
    if sc.model.batch is None:
        raise ConfigError(f"model {sc.model.name} needs the global batch: give --batch SEQUENCES")
    if sc.stages < 1 or sc.stages > sc.model.layers:
        raise ConfigError(f"--ginter (pipeline stages) must be between 1 and the {sc.model.layers} layers, "
                          f"got {sc.stages}")
    sc.stage_layers  # refuses counts that do not add up (interleaved on uneven stages: schedules.check_schedule)
    if sc.context_parallel < 1:
        raise ConfigError(f"--context-parallel must be at least 1, got {sc.context_parallel}")
    if sc.context_parallel_comm not in terms.CP_COMMS:
        raise ConfigError(f"--context-parallel-comm {sc.context_parallel_comm!r}: choose {', '.join(terms.CP_COMMS)}")
    if sc.context_parallel > 1 and sc.attention != "fused":
        raise ConfigError("--context-parallel runs flash attention on each K/V chunk (Megatron-LM with Transformer "
                          "Engine): --attention fused")
    if sc.vocab < 0:
        raise ConfigError(f"--vocab must be 0 or more, got {sc.vocab}")
    tp = sc.grid.x * sc.grid.y
    if sc.vocab % tp:
        raise ConfigError(f"vocabulary {sc.vocab} is not divisible by G_x G_y = {tp} (pad it, as Megatron-LM does)")
    if sc.sequence_parallel and sc.grid.y == 1:
        raise ConfigError("--sequence-parallel splits activations over the tensor-parallel axis Y: it needs G_y > 1")
    if sc.dw_window is not None and sc.dw_window < 1:
        raise ConfigError(f"--dw-window must be at least 1 (or none), got {sc.dw_window}")
    if sc.implementation not in IMPLEMENTATIONS:
        raise ConfigError(f"--implementation {sc.implementation!r}: choose {', '.join(IMPLEMENTATIONS)}")
    if sc.implementation == megatron_ddp.NAME and sc.algorithm not in ("megatron1d", "dp"):
        raise ConfigError(f"--implementation {megatron_ddp.NAME} models Megatron-LM's data-parallel reduction: "
                          f"algorithm megatron1d or dp (got {sc.algorithm})")
    if sc.implementation == terms.PYTORCH_FSDP and sc.algorithm != "fsdp":
        raise ConfigError(f"--implementation {terms.PYTORCH_FSDP} models PyTorch FSDP's gradient accumulation: "
                          f"algorithm fsdp (got {sc.algorithm})")
    if sc.implementation == zero3_2021.NAME and (sc.algorithm != "fsdp" or sc.stages != 1 or sc.grid.data != 1):
        raise ConfigError(f"--implementation {zero3_2021.NAME} models DeepSpeed's ZeRO-3 alone: algorithm fsdp, one "
                          f"stage, grid 1xNx1x1 (got {sc.algorithm}, {sc.stages} stage(s), grid {sc.grid})")
    problems = model_problems(sc.model, sc.grid, pad_z=sc.implementation == zero3_2021.NAME)
    if problems:
        raise ConfigError(f"model {sc.model.name} on grid {sc.grid}: {problems[0]}")
