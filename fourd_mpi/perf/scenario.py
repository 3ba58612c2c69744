"""``fourd-mpi model predict``: one fully forced configuration (a *scenario*) through the model (pure).

A :class:`Scenario` fixes every choice: the model (with its vocabulary), the algorithm and its 4D grid
per pipeline stage ``G_data x G_z x G_y x G_x``, ``p`` stages, the schedule (``1f1b``,
``interleaved`` with ``v`` chunks per stage, ``axonn``), the micro-batch size ``b`` and count ``m``
(``B = b m G_data G_z``: gradient accumulation for every algorithm, ``p = 1`` included), sequence
parallelism, recompute, dtype, attention, optimizer sharding, overlap, the dW window, the machine
profile and ranks per node.

**Time** (per rank and step): :func:`~fourd_mpi.perf.predict.predict` of one micro-batch (``B/m``
sequences) through the fullest stage's blocks (``L/p``; uneven stages, :func:`fourd_mpi.perf.terms.stage_layers`:
the most any stage holds) gives ``W``; less its exposed gradient
synchronization ``S`` (Z reduce-scatters, Z and data all-reduces) and optimizer update ``U``, which
run once per step, it is the slot ``t = W - S - U``, to which the last stage adds the LM head
(:mod:`fourd_mpi.perf.vocab`: ``6 m h V/T`` FLOPs at the GEMM rate, the cross entropy's 6 passes of
fp32 logits at the memory bandwidth, its collectives blocking) and, for the blocking schedules
(``1f1b``, ``interleaved``: Megatron-LM waits on every ``batch_isend_irecv``), ``2 v`` point-to-point
messages (``t_p2p``). Then

    ``step = (t + t_head + t_p2p) (m + (p - 1)/v) + U + S + t_emb``

where ``(p - 1)/v`` slots are the bubble (:mod:`fourd_mpi.perf.schedules`) and ``t_emb`` the
per-step embedding-gradient all-reduces (over data and Z, and between the first and last stage
when ``p > 1``: tied weights), blocking. With the ``axonn`` schedule the messages overlap compute
(Isend) as far as the profile's overlap efficiency ``e`` allows: a slot waits ``max(t, t_msg) + (1 - e)
min(t, t_msg) - t`` for its message (:func:`~fourd_mpi.perf.schedules.link_bound_slot`), and the fill and
drain chain ``2 (p - 1) t_msg`` is added. A message of ``b s h/G_x e`` bytes crosses the pipeline axis at
its placement; with Megatron's scatter/gather optimisation (``1f1b``/``interleaved`` and ``G_y > 1``) each
rank sends ``1/G_y`` of it and the receivers all-gather over Y. With ``p > 1`` every axis is placed in the
pipeline's world (rank order data, inter, z, y, x: :func:`~fourd_mpi.perf.machine.world_levels`): the data
axis' stride is ``G_z G_y G_x p``. This is the one pipeline model: ``tune``'s pipeline candidates and
``model validate`` price a pipeline through it (:func:`fourd_mpi.perf.pipeline.predict_pipeline`, a thin
wrapper).

**Distributed optimizer** (``shard_optimizer="data"``, :mod:`fourd_mpi.perf.terms`): ``S``'s data-axis gradient
all-reduces become reduce-scatters (hidden as they were) plus blocking all-gathers of the updated parameters.

**FP8** (``dtype="float8"``, :mod:`fourd_mpi.perf.terms`): the blocks' GEMMs at the profile's FP8 rate, everything
else (state, activations, messages, attention, the LM head) in BF16, plus Transformer Engine's FP8 weight cache.

**Sequence parallelism** (Korthikanti et al. 2022, Megatron-like grids): each tensor-parallel
all-reduce of ``S`` bytes becomes a reduce-scatter and an all-gather of ``S``: the wire volume is the
same (``2 (p-1)/p S``, :func:`sequence_parallel_volumes`) and so is its ring time; what changes is
memory: the block inputs and LayerNorm/residual activations ``[m, h/G_x]`` are split over Y too.

**Memory** per rank, the larger of the first and the last stage: parameter state of the stage's
blocks (and the embedding shard ``V h/T`` on the first and last stage); activations = stored inputs
of the in-flight block passes (:func:`~fourd_mpi.perf.schedules.inflight_block_passes`) ``x b s h/G_x
e`` with full recompute, plus ONE block's recompute working set (it is recomputed and freed block by
block), the step's input and target and the largest transient; without recompute every in-flight
block keeps its full saved set; the last stage adds the logits ``m V/T (e + 4)``; communication
buffers at micro-batch size with at most ``dw_window`` dW blocks in flight; the token-partial
gradient sums of the FC blocks when ``m > 1`` and ``G_z > 1`` (gradients accumulate before the
reduce-scatter); two receive buffers per pipeline neighbour.

**FLOP conventions** (printed with % of the data-sheet peak):
Megatron's ``96 B s l h^2 (1 + s/6h + V/16lh)`` with full recompute (``72 ... V/12lh`` without:
``selective`` counts as without), hardware FLOPs (what the step executes: the model's counted GEMM
and attention FLOPs with recompute, plus the head ``6 B s h V``) and model FLOPs (the 72 convention
whatever the recompute, as PaLM's MFU).

**Implementation** ``deepspeed-2021`` (``fsdp`` on ``1 x N x 1 x 1`` only): DeepSpeed's ZeRO-3 of 2021 instead of
this suite's step (:mod:`fourd_mpi.perf.zero3_2021`): each slot adds its third gathers and the per-rank loops of
its gathers, the step its persistent-parameter gather, and ``S`` loses the LayerNorm gradient all-reduces; the
embedding is partitioned over Z like every parameter (memory ``ceil(V h / G_z)``, two gathers per micro-batch and
a reduce-scatter per step). Implementation ``megatron-lm`` (``megatron1d`` or ``dp``): Megatron-LM 2020-2021's
DDP=local, where ``S``'s data-axis part is one all-reduce of every gradient a rank holds
(:mod:`fourd_mpi.perf.megatron_ddp`) instead of one per weight; with ``dp`` overlap or a sharded optimizer
nothing changes.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional

from fourd_mpi.core.backend import dtype_bytes
from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf import megatron_ddp, schedules, terms, vocab, zero3_2021
from fourd_mpi.perf.machine import (MachineProfile, axis_inner_products, axis_placement, inter_placement, message_time,
                                   world_levels, world_strides)
from fourd_mpi.perf.memory import (ALLOCATOR_MARGIN, GPU_RUNTIME_RESERVE_BYTES, activation_elements,
                                   block_saved_elements, comm_buffer_elements, block_elements, fc_weights,
                                   parameter_elements, state_bytes)
from fourd_mpi.perf.predict import collective_time, compute_time, gemm_rate_tflops, predict
from fourd_mpi.perf.volumes import Collective
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import ModelConfig, model_problems

GIB = 2.0 ** 30
#: the 4D-family algorithms ``model predict`` takes (``pipeline`` = ``axonn4d`` with stages)
ALGORITHMS = ("axonn4d", "megatron1d", "fsdp", "dp", "pipeline")
#: what the % of the data-sheet peak of each FLOP convention is called: model FLOPs give MFU, executed
#: (hardware) FLOPs HFU; Megatron's convention counts recompute only with full recompute (its "% of peak")
UTILIZATION_NAME = {"model": "MFU", "hardware": "HFU", "megatron": "Megatron-convention"}
MEGATRON_FORMULA = {"full": "96 B s l h^2 (1 + s/6h + V/16lh)", "none": "72 B s l h^2 (1 + s/6h + V/12lh)"}
#: passes of 4-byte elements over the logits for the cross entropy (cast, max, exp-sum, softmax, and
#: the backward's write): an assumption, stated once
CE_PASSES = 6
SYNC_KEYS = (("data", "allreduce"), ("z", "reduce_scatter"), ("z", "allreduce"))
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
        schedules.check_schedule(self.schedule, self.stages, self.chunks, self.model.layers, m)
        return replace(self, microbatch_size=b, microbatches=m)


#: scenario options run has no option for (``model predict``'s own): the interleaved schedule's chunks, the
#: micro-batch size, the vocabulary, sequence parallelism, precision, optimizer sharding, the dW window, the node
#: shape, whose implementation; the model's only terms (:mod:`fourd_mpi.perf.terms`): grouped-query attention and
#: the SwiGLU MLP, Megatron-LM's first/last stage sizes, context parallelism
SCENARIO_ONLY = ("chunks-per-stage", "microbatch-size", "vocab", "sequence-parallel", "precision", "shard-optimizer",
                 "dw-window", "ranks-per-node", "implementation", "kv-heads", "mlp", "first-stage-layers",
                 "last-stage-layers", "context-parallel")


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
                    context_parallel=get("context-parallel", 1))


def _stage_text(layers: tuple) -> str:
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
        raise ConfigError(f"--ginter (pipeline stages) must be between 1 and the {sc.model.layers} layers, got {sc.stages}")
    uneven = len(set(sc.stage_layers)) > 1  # refuses counts that do not add up
    if uneven and sc.schedule == "interleaved":
        raise ConfigError(f"--pipeline-schedule interleaved needs equal stages (Megatron-LM refuses uneven ones): "
                          f"{sc.model.layers} layers on {sc.stages} stages are {_stage_text(sc.stage_layers)}")
    if sc.context_parallel < 1:
        raise ConfigError(f"--context-parallel must be at least 1, got {sc.context_parallel}")
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


@dataclass
class ScenarioResult:
    """What the model says about a :class:`Scenario` (seconds per step, bytes per rank)."""

    scenario: Scenario
    step_s: float
    compute_s: float
    exposed_s: Dict[str, float]          # axis (x, y, z, data, pipeline) -> exposed seconds
    bubble_s: float
    memory: Dict[str, int]               # part -> bytes (the larger stage), plus total and required
    memory_stage: str
    flops: Dict[str, float]              # convention -> FLOPs per step, whole model
    peak_tflops: Optional[float]         # None: the profile states none (a CPU); % of peak is then refused
    terms: Dict[str, float] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    #: one micro-batch through one stage (:class:`_Slot`: its 4D prediction, ``S``, ``U``), for the wrappers
    slot: Any = None

    @property
    def gpus(self) -> int:
        return self.scenario.world

    def tflops_per_gpu(self, convention: str = "megatron") -> float:
        """``F / (t_step N) / 1e12``."""
        return self.flops[convention] / (self.step_s * self.gpus) / 1e12

    def pct_peak(self, convention: str = "megatron") -> float:
        """``100 F / (t_step N peak)``."""
        if self.peak_tflops is None:
            raise ConfigError(f"machine profile {self.scenario.profile} has no data-sheet peak for "
                              f"{self.scenario.dtype}: add compute.peak_tflops.{self.scenario.dtype}")
        return 100.0 * self.tflops_per_gpu(convention) / self.peak_tflops

    def fits(self) -> Optional[bool]:
        limit = self.scenario.memory_limit_gib
        return None if limit is None else self.memory["required"] <= limit * GIB

    def as_dict(self) -> Dict[str, Any]:
        sc = self.scenario
        return {"scenario": {**{k: v for k, v in asdict(sc).items() if k not in ("model", "grid")},
                             "model": sc.model.as_dict(), "grid": str(sc.grid), "gpus": self.gpus},
                "step_s": self.step_s, "compute_s": self.compute_s, "exposed_s": self.exposed_s,
                "bubble_s": self.bubble_s, "terms_s": self.terms, "memory_bytes": self.memory,
                "memory_stage": self.memory_stage, "fits": self.fits(), "flops_per_step": self.flops,
                "peak_tflops": self.peak_tflops,
                "tflops_per_gpu": {c: self.tflops_per_gpu(c) for c in self.flops},
                "pct_peak": {c: self.pct_peak(c) for c in self.flops}, "formulas": formulas(sc),
                "notes": self.notes}


def megatron_flops(cfg: ModelConfig, vocab_size: int, recompute: str) -> float:
    """Megatron's convention: ``96 B s l h^2 (1 + s/6h + V/16lh)`` with full recompute, else
    ``72 B s l h^2 (1 + s/6h + V/12lh)`` (Narayanan et al. SC'21, section 5.1)."""
    B, s, l, h, V = cfg.batch, cfg.seq, cfg.layers, cfg.hidden, vocab_size
    if recompute == "full":
        return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return 72.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def step_flops(cfg: ModelConfig, vocab_size: int, recompute: str) -> Dict[str, float]:
    """FLOPs per step by convention (:func:`formulas`): Megatron's, hardware (recompute and the head included),
    model (Megatron's 72 convention; with grouped-query attention or SwiGLU the actual weights' count)."""
    head = vocab.head_flops(cfg.batch, cfg.seq, cfg.hidden, vocab_size)
    model = cfg.flops_per_step() + head if _gqa_or_swiglu(cfg) else megatron_flops(cfg, vocab_size, "none")
    return {"megatron": megatron_flops(cfg, vocab_size, "full" if recompute == "full" else "none"),
            "hardware": cfg.hardware_flops_per_step(recompute) + head, "model": model}


def _gqa_or_swiglu(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` has grouped-query attention or a SwiGLU MLP (Megatron's FLOP formula does not fit it)."""
    return cfg.kv_heads not in (None, cfg.heads) or cfg.mlp != "gelu"


def formulas(sc: Scenario) -> Dict[str, str]:
    conv = "full" if sc.recompute == "full" else "none"
    model = ("6 B s l x block GEMM weights + 12 B s^2 l h + 6 B s h V" if _gqa_or_swiglu(sc.model)
             else "72 B s l h^2 (1 + s/6h + V/12lh)")
    return {"megatron": f"Megatron FLOPs = {MEGATRON_FORMULA[conv]} (recompute {sc.recompute})",
            "hardware": "hardware FLOPs = executed GEMM + attention FLOPs with recompute + LM head 6 B s h V",
            "model": f"model FLOPs = {model} (no recompute counted; MFU)",
            "pct_peak": "% of peak = 100 F / (t_step x GPUs x data-sheet peak of fourd_mpi/perf/peaks.py): MFU with "
                        "model FLOPs, HFU with hardware FLOPs",
            "step": "step = (t + t_head + t_p2p)(m + (p-1)/v) + U + S + t_emb" + {
                zero3_2021.NAME: "; deepspeed-2021: t += third gathers + gather loops, + persistent gather, S without "
                                 "LayerNorm all-reduces (fourd_mpi/perf/zero3_2021.py)",
                terms.PYTORCH_FSDP: "; pytorch-fsdp: the Z reduce-scatters in t (each micro-batch), not in S "
                                    "(fourd_mpi/perf/terms.py)"}.get(sc.implementation, ""),
            "bubble": schedules.BUBBLE_FORMULA[sc.schedule] if sc.stages > 1 else "no pipeline: no bubble"}


def sequence_parallel_volumes(tokens: int, hidden: int, gy: int, gx: int, e: int) -> Dict[str, int]:
    """Wire bytes per rank of one tensor-parallel all-reduce of ``[m, h/G_x]`` and of its sequence-parallel
    replacement (a reduce-scatter and an all-gather of the same array): ``allreduce = 2 (p-1)/p S``,
    ``reduce_scatter = allgather = (p-1)/p S``, ``S = m h/G_x e``, ``p = G_y``: the same total."""
    S = tokens * hidden // gx * e
    one = (gy - 1) * S // gy
    return {"allreduce": 2 * one, "reduce_scatter": one, "allgather": one, "sequence_parallel": 2 * one}


def _coll(axis: str, op: str, p: int, nbytes: int, phase: str, role: str) -> Collective:
    return Collective(layer="vocab", role=role, op=op, axis=axis, p=p, phase=phase, count=1, message_bytes=int(nbytes))


def stage_memory(sc: Scenario, stage: int, profile: Optional[MachineProfile] = None,
                 suite_step: bool = False) -> Dict[str, int]:
    """Bytes per rank of ``stage`` by part (module docstring), ``sc`` resolved: THE pipeline memory estimate
    (``model predict``, ``tune``, run's admission of ``--algorithm pipeline`` through
    :func:`fourd_mpi.perf.pipeline.pipeline_memory`). ``suite_step``: this suite's step
    (:class:`fourd_mpi.algorithms.pipeline.AccumulatingGrads` copies the token-partial gradient sums whenever
    ``m > 1``, whatever ``G_z``, and every stage posts two receive buffers, one stage included) instead of a
    Megatron-like step (sums only before a Z reduce-scatter; two receive buffers per pipeline neighbour).
    ``profile``: for ``required`` (the GPU reserve); None leaves ``total`` and ``required`` out."""
    cfg, grid, p = sc.model, sc.grid, sc.stages
    b, m, v = sc.microbatch_size, sc.microbatches, sc.chunks
    store = terms.storage_dtype(sc.dtype)  # float8: BF16 storage (terms module docstring)
    e = dtype_bytes(store)
    layers = sc.stage_layers[stage]
    stage_cfg = replace(cfg, layers=layers)
    micro = replace(stage_cfg, batch=b * grid.data * grid.z, layers=1)
    tokens = b * cfg.seq
    hx = cfg.hidden // grid.x
    sp = grid.y if sc.sequence_parallel else 1
    first, last = stage == 0, stage == p - 1
    params = parameter_elements(stage_cfg, grid)
    tp = grid.x * grid.y
    emb = vocab.embedding_elements(cfg.hidden, sc.vocab, tp) if (first or last) else 0
    if sc.implementation == zero3_2021.NAME:  # zero.Init partitions every parameter, the embedding too
        emb = -(-emb // grid.z)
    state = state_bytes(params + emb, grid, store, sc.optimizer, sc.precision, sc.shard_optimizer)
    # the schedule's in-flight micro-batches, each through this stage's own blocks (uneven stages: 1f1b, axonn)
    passes = schedules.inflight_block_passes(sc.schedule, p, m, layers * p, v if sc.schedule == "interleaved" else 1,
                                             stage)
    # the [m, h/G_x] tensors a block keeps (4 of them when not recomputed) are split over Y with SP
    sp_saving = 4 * tokens * (hx - hx // sp) if sp > 1 else 0
    if sc.recompute == "full":
        stored = passes * tokens * (hx // sp)
        working = block_saved_elements(micro, grid, sc.attention, "none") - sp_saving
        saved = stored + working
    else:
        per_block = block_saved_elements(micro, grid, sc.attention, sc.recompute) - sp_saving
        saved = passes * per_block
    extra = activation_elements(micro, grid, "none", sc.attention) - \
        block_saved_elements(micro, grid, sc.attention, "none")      # input, target and the largest transient
    activations = (saved + extra) * e
    if last and sc.vocab:
        activations += vocab.logits_bytes(tokens, sc.vocab, tp, e)
    overlap = _overlap(sc)
    comm = comm_buffer_elements(replace(stage_cfg, batch=b * grid.data * grid.z), grid, overlap, sc.dw_window) * e
    if m > 1 and (suite_step or (grid.z > 1 and sc.implementation != terms.PYTORCH_FSDP)):  # token-partial sums
        comm += sum(block_elements(n, k, t, grid) for _, n, k, t in fc_weights(stage_cfg, grid)) * layers * e
    if suite_step:
        comm += 2 * tokens * hx * e
    elif p > 1:
        comm += 2 * tokens * hx * e * (1 if first or last else 2)
    out = dict(state, activations=int(activations), comm_buffers=int(comm))
    if sc.dtype == terms.FP8:  # Transformer Engine's FP8 weight cache
        gemm_weights = sum(-(-block_elements(n, k, t, grid) // grid.z) for _, n, k, t in fc_weights(stage_cfg, grid))
        out["fp8_weights"] = terms.fp8_weight_cache_bytes(gemm_weights * layers)
    if profile is None:
        return out
    out["total"] = sum(out.values())
    reserve = GPU_RUNTIME_RESERVE_BYTES if profile.backend == "cupy" else 0
    out["required"] = int(math.ceil(out["total"] * (1 + ALLOCATOR_MARGIN))) + reserve
    return out


def _context_view(sc: Scenario) -> Scenario:
    """``sc`` as every term but attention sees it under context parallelism (:func:`terms.context_parallel_view`)."""
    cp = sc.context_parallel
    if sc.model.batch is None:
        return sc  # check() says what is missing
    view = terms.context_parallel_view(sc.model.seq, sc.model.batch, sc.grid.data, cp)
    return replace(sc, model=replace(sc.model, seq=view["seq"], batch=view["batch"]),
                   grid=replace(sc.grid, data=view["data"]), context_parallel=1)


def scenario_memory(sc: Scenario, profile: MachineProfile) -> Dict[str, int]:
    """Bytes per rank by part of the larger of the first and last stage (no time prediction: cheap, so a
    search can drop what does not fit before predicting it)."""
    if sc.context_parallel > 1:
        return scenario_memory(_context_view(sc), profile)
    return _larger_stage_memory(sc.resolved(), profile)[0]


def slot_lower_bound(micro_cfg: ModelConfig, grid: GridShape, profile: MachineProfile, overlap: OverlapConfig,
                     dtype: str, rpn: int, optimizer: str, recompute: str, attention: str, precision: Optional[str],
                     stages: int, microbatches: int, bubble_slots: float, communication: bool = True,
                     sync: bool = True, gemm_dtype: Optional[str] = None, context_parallel: int = 1) -> float:
    """Seconds never above :func:`predict_scenario`'s step of ``m`` slots of ``micro_cfg`` (the fullest stage's
    blocks on one micro-batch) on ``grid``: ``(c - U + X_n)(m + n_b) + U + X_s`` with ``c`` the slot's compute,
    ``U`` its optimizer update, ``n_b`` the bubble slots (``(p - 1)/v``, :func:`~fourd_mpi.perf.schedules.bubble_slots`)
    and ``X`` the communication any timeline exposes (:func:`~fourd_mpi.perf.predict.blocking_time`), ``X_s`` of the
    gradient synchronization's keys (:data:`SYNC_KEYS`), ``X_n`` of the others: the slot ``W - S - U`` is at least
    ``c - U + X_n``, ``S >= X_s``; the LM head, the messages between stages and the embedding sync are at least 0.
    ``communication=False``: ``X = 0`` (looser, cheaper); ``sync=False``: ``X_s = 0`` (a distributed optimizer
    replaces the data all-reduce). ``context_parallel`` ``cp > 1`` (``micro_cfg`` and ``grid`` the view's,
    :func:`_context_view`): every slot adds the rest of the sequence's attention, ``(cp - 1)`` times the view's
    (:func:`_predict_context_parallel`; its K/V ring's exposed part is at least 0). Memoized terms
    (:func:`~fourd_mpi.perf.predict.compute_time_shared`)."""
    from fourd_mpi.perf.predict import blocking_time, compute_time_shared

    comp = compute_time_shared(micro_cfg, grid, profile, overlap, dtype, rpn, optimizer, recompute=recompute,
                               attention=attention, precision=precision, gemm_dtype=gemm_dtype)
    slots = microbatches + bubble_slots
    c = comp["total"] - comp["optimizer"] + (context_parallel - 1) * comp["attention"]
    if not communication:
        return c * slots + comp["optimizer"]
    levels, strides = None, None
    if stages > 1:
        levels = {a: v for a, v in world_levels(grid, stages, rpn).items() if a != "inter" and v != "-"}
        strides = world_strides(grid, stages)
    blocking = blocking_time(micro_cfg, grid, profile, overlap, dtype, rpn, recompute, levels, strides)
    synced = sum(t for key, t in blocking.items() if key in SYNC_KEYS) if sync else 0.0
    other = sum(t for key, t in blocking.items() if key not in SYNC_KEYS)
    return (c + other) * slots + comp["optimizer"] + synced


def scenario_lower_bound(sc: Scenario, profile: MachineProfile, communication: bool = True,
                         sync: bool = True) -> float:
    """:func:`slot_lower_bound` of a scenario with ``b`` and ``m`` set (not checked: a search calls it on
    every candidate before predicting the few that can win); with context parallelism the view's bound
    (:func:`_context_view`) plus the attention of the rest of the sequence (the K/V ring only adds time)."""
    cp = sc.context_parallel
    rpn = sc.ranks_per_node or min(profile.ranks_per_node, sc.world)
    if cp > 1:
        sc = _context_view(sc)
    v = sc.chunks if sc.schedule == "interleaved" else 1
    slots = schedules.bubble_slots(sc.schedule, sc.stages, v) if sc.stages > 1 else 0.0
    return slot_lower_bound(_micro_config(sc), sc.grid, profile, _overlap(sc), _store(sc), rpn, sc.optimizer,
                            sc.recompute, sc.attention, sc.precision, sc.stages, sc.microbatches, slots,
                            communication, sync, _gemm_dtype(sc), cp)


def fits_memory(sc: Scenario, profile: MachineProfile) -> bool:
    """``required <= memory_limit_gib`` (True without a limit)."""
    return sc.memory_limit_gib is None or scenario_memory(sc, profile)["required"] <= sc.memory_limit_gib * GIB


def predict_scenario(sc: Scenario, profile: MachineProfile) -> ScenarioResult:
    """Predict one step of ``sc`` on ``profile`` (module docstring), one helper per term:
    ``step = (t + t_head + t_p2p)(m + (p-1)/v) + U + S + t_emb + t_critical (+ the ZeRO-3 persistent gather)``."""
    if sc.context_parallel > 1:                         # the view's step plus attention and the K/V ring
        return _predict_context_parallel(sc, profile)
    sc = sc.resolved()
    cfg, p, m = sc.model, sc.stages, sc.microbatches
    rpn = sc.ranks_per_node or min(profile.ranks_per_node, sc.world)
    notes = _dtype_and_stage_notes(sc, profile)         # FP8 (refused without an FP8 rate), uneven stages
    t = _block_slot(sc, profile, rpn)                   # t, S, U and the 4D exposure of one micro-batch
    gemm = _framework_gemm(sc, t, notes)                # the blocks' GEMMs at the framework's efficiency
    ds = _zero3_2021(sc, profile, rpn, t)               # implementation deepspeed-2021 (else {})
    coalesced = _megatron_ddp(sc, profile, rpn, t)      # implementation megatron-lm (else False)
    fsdp = _pytorch_fsdp(sc, t)                         # implementation pytorch-fsdp (else {})
    dist = _distributed_optimizer(sc, profile, rpn, t, coalesced)  # shard_optimizer data (else {})
    t_head, t_head_comm = _lm_head(sc, profile, rpn, t.exposed, notes)
    t_p2p, critical, t_msg = _pipeline_messages(sc, profile, rpn)
    wait = _message_wait(sc, profile, t.slot + t_head + t_head_comm, t_msg)
    full_slot = t.slot + t_head + t_head_comm + t_p2p + wait
    v = sc.chunks if sc.schedule == "interleaved" else 1
    bubble = full_slot * schedules.bubble_slots(sc.schedule, p, v)
    t_emb = _embedding_sync(sc, profile, rpn, coalesced, t.exposed)
    if p > 1:
        t.exposed["pipeline"] = t.exposed.get("pipeline", 0.0) + (t_p2p + wait) * m + critical
    step = full_slot * m + bubble + t.update + t.sync + t_emb + critical + ds.get("persistent_gather", 0.0)
    compute = (t.micro.compute_s - t.update + gemm - t.comp["gemm"]) * m + t.update + t_head * m
    if not math.isfinite(step) or step <= 0:
        raise ConfigError(f"the model gave a non-finite step time for {sc.grid}: {step}")
    memory, which = _larger_stage_memory(sc, profile)
    for n in _flop_notes(cfg) + t.micro.notes + profile.notes:
        if n not in notes:
            notes.append(n)
    comp = t.comp
    step_terms = {"slot_blocks": t.slot, "slot_head": t_head, "slot_head_comm": t_head_comm, "slot_p2p": t_p2p + wait,
                  "optimizer": t.update, "grad_sync": t.sync, "embedding_sync": t_emb, "pipeline_critical": critical,
                  # the compute per step by kind (diagnosis: which term makes an error): the blocks' GEMMs,
                  # attention, memory-bound work and kernel launches over m micro-batches; the head; the update
                  "step_gemm": gemm * m, "step_attention": comp["attention"] * m,
                  "step_elementwise": (comp["elementwise"] + comp["calls"] - comp["optimizer"]) * m,
                  "step_head": t_head * m}
    if fsdp:  # PyTorch FSDP's reduce-scatters (per step, part of slot_blocks)
        step_terms["fsdp_reduce_scatter"] = fsdp["step"]
    if dist:  # the distributed optimizer's exposed collectives (per step, part of grad_sync)
        step_terms.update({"dist_opt_reduce_scatter": dist["reduce_scatter"], "dist_opt_allgather": dist["allgather"]})
    if ds:  # DeepSpeed 2021's ZeRO-3 (per step): third gathers, copy loops, LayerNorm all-reduces taken away
        step_terms.update({"zero3_regather": ds["regather"] * m, "zero3_gather_copies": ds["gather_copies"] * m,
                           "zero3_persistent_gather": ds["persistent_gather"],
                           "zero3_ln_allreduce_removed": ds["ln_grad_allreduce"]})
    return ScenarioResult(sc, step, compute, t.exposed, bubble, memory, which, step_flops(cfg, sc.vocab, sc.recompute),
                          profile.peak_tflops(sc.dtype), step_terms, notes, t)


@dataclass
class _Slot:
    """One micro-batch (``B/m`` sequences) through the fullest stage's ``L/p`` blocks: the 4D prediction
    ``micro`` and its compute split ``comp``; ``sync`` (``S``, exposed gradient synchronization) and ``update``
    (``U``, the optimizer) run once per step; ``slot`` = ``W - S - U``; ``exposed`` seconds per axis and step
    (the sync keys once, the rest ``m`` times)."""

    micro: Any
    comp: Dict[str, float]
    slot: float
    sync: float
    update: float
    exposed: Dict[str, float]


def _overlap(sc: Scenario) -> OverlapConfig:
    """``sc.overlap`` parsed (a caller holding an :class:`OverlapConfig`, with its prefetch depth and chunks, may
    pass it as is)."""
    return sc.overlap if isinstance(sc.overlap, OverlapConfig) else OverlapConfig.parse(sc.overlap)


def _world_levels(sc: Scenario, rpn: int):
    """``(levels, strides)`` of the stage grid's axes in the pipeline's world (rank order data, inter, z, y, x:
    :func:`~fourd_mpi.perf.machine.world_levels`) for ``p > 1``; ``(None, None)`` (the 4D grid's own placement)
    for one stage."""
    if sc.stages == 1:
        return None, None
    levels = {a: v for a, v in world_levels(sc.grid, sc.stages, rpn).items() if a != "inter" and v != "-"}
    return levels, world_strides(sc.grid, sc.stages)


def _placement(sc: Scenario, rpn: int):
    """``(placement, inner)`` of the stage grid's axes, as :func:`~fourd_mpi.perf.predict.predict` places them
    with :func:`_world_levels` (``axis -> level``, ``axis -> ranks inside it``)."""
    levels, strides = _world_levels(sc, rpn)
    return ({**axis_placement(sc.grid, rpn), **(levels or {})},
            {**axis_inner_products(sc.grid), **(strides or {})})


def _store(sc: Scenario) -> str:
    """The dtype ``sc`` stores and sends (:func:`fourd_mpi.perf.terms.storage_dtype`: BF16 for ``float8``)."""
    return terms.storage_dtype(sc.dtype)


def _gemm_dtype(sc: Scenario) -> Optional[str]:
    """The blocks' GEMM dtype when it is not the storage dtype (``float8``), else None."""
    return sc.dtype if sc.dtype != _store(sc) else None


def _micro_config(sc: Scenario) -> ModelConfig:
    """One slot's model: the fullest stage's blocks (:attr:`Scenario.stage_layers`: ``ceil(L/p)`` by default,
    Megatron-LM's first/last counts otherwise) on ``B/m`` sequences."""
    return replace(sc.model, layers=max(sc.stage_layers), batch=sc.model.batch // sc.microbatches)


def _dtype_and_stage_notes(sc: Scenario, profile: MachineProfile) -> List[str]:
    """The notes that open a prediction: FP8 GEMMs (:func:`fourd_mpi.perf.terms.check_fp8` refuses a profile
    without an FP8 rate, in one line) and uneven stages (:func:`fourd_mpi.perf.terms.stage_layers`)."""
    notes: List[str] = []
    gemm_dtype = _gemm_dtype(sc)
    if gemm_dtype:
        terms.check_fp8(profile)
        notes.append(f"float8: the blocks' GEMMs at the profile's FP8 rate {profile.gemm_tflops(gemm_dtype):g} "
                     f"TFLOP/s, everything else in {_store(sc)}; % of peak against the FP8 data-sheet peak")
    if len(set(sc.stage_layers)) > 1:
        notes.append(f"uneven stages: {_stage_text(sc.stage_layers)} blocks, first to last; each slot takes the "
                     f"fullest stage's {max(sc.stage_layers)} (fourd_mpi/perf/terms.py)")
    return notes


def _block_slot(sc: Scenario, profile: MachineProfile, rpn: int) -> _Slot:
    """The slot term ``t = W - S - U`` (:func:`~fourd_mpi.perf.predict.predict` of one micro-batch)."""
    micro_cfg, grid, m = _micro_config(sc), sc.grid, sc.microbatches
    overlap = _overlap(sc)
    levels, strides = _world_levels(sc, rpn)
    store, gemm_dtype = _store(sc), _gemm_dtype(sc)  # float8: FP8 GEMMs, BF16 everything else
    micro = predict(micro_cfg, grid, profile, overlap, store, sc.progress, sc.optimizer, rpn, sc.recompute,
                    sc.attention, sc.precision, sc.shard_optimizer, levels=levels, strides=strides,
                    gemm_dtype=gemm_dtype)
    sync = sum(micro.exposed_s.get(k, 0.0) for k in SYNC_KEYS)
    comp = compute_time(micro_cfg, grid, profile, overlap, store, rpn, sc.optimizer, recompute=sc.recompute,
                        attention=sc.attention, precision=sc.precision, gemm_dtype=gemm_dtype)
    update = comp["optimizer"]
    exposed: Dict[str, float] = {}
    for (axis, op), t in micro.exposed_s.items():
        exposed[axis] = exposed.get(axis, 0.0) + t * (1 if (axis, op) in SYNC_KEYS else m)
    return _Slot(micro, comp, micro.step_s - sync - update, sync, update, exposed)


def _framework_gemm(sc: Scenario, t: _Slot, notes: List[str]) -> float:
    """The blocks' GEMM seconds of one slot at the framework's efficiency (:func:`fourd_mpi.perf.terms.
    framework_efficiency`, ``fourd_mpi/perf/published/framework_efficiency.yaml``): ``t_gemm / f``, the
    difference added to the slot."""
    fw = terms.framework_efficiency(sc.implementation)
    gemm = terms.framework_gemm_time(t.comp["gemm"], fw["factor"])
    t.slot += gemm - t.comp["gemm"]
    if sc.implementation != "fourd":
        notes.append(f"framework GEMM efficiency of {sc.implementation}: x {fw['factor']:.2f} on the profile's GEMM rate"
                     f" ({'measured' if fw['measured'] else 'not measured'}: {fw['source']}; "
                     f"fourd_mpi/perf/published/framework_efficiency.yaml)")
    return gemm


def _zero3_2021(sc: Scenario, profile: MachineProfile, rpn: int, t: _Slot) -> Dict[str, float]:
    """Implementation ``deepspeed-2021`` (:mod:`fourd_mpi.perf.zero3_2021`): all on Z, all blocking; the slot
    gains the third gathers and copy loops, ``S`` loses the LayerNorm all-reduces. ``{}`` otherwise."""
    if sc.implementation != zero3_2021.NAME:
        return {}
    grid, m = sc.grid, sc.microbatches
    placement, inner = _placement(sc, rpn)
    ds = zero3_2021.terms(_micro_config(sc), grid, profile, placement, rpn, inner, _store(sc), sc.recompute,
                          _overlap(sc))
    ds["ln_grad_allreduce"] = min(ds["ln_grad_allreduce"], t.sync)  # priced as the sync term it replaces
    t.sync -= ds["ln_grad_allreduce"]
    t.slot += ds["regather"] + ds["gather_copies"]
    t.exposed["z"] = t.exposed.get("z", 0.0) + (ds["regather"] + ds["gather_copies"]) * m \
        + ds["persistent_gather"] - ds["ln_grad_allreduce"]
    return ds


def _megatron_ddp(sc: Scenario, profile: MachineProfile, rpn: int, t: _Slot) -> bool:
    """Implementation ``megatron-lm`` (:mod:`fourd_mpi.perf.megatron_ddp`): ``S``'s data-axis part becomes one
    all-reduce of every gradient a rank holds. True when it applies."""
    grid = sc.grid
    if not (sc.implementation == megatron_ddp.NAME
            and megatron_ddp.applies(_overlap(sc).dp, sc.shard_optimizer, grid)):
        return False
    grads = parameter_elements(_micro_config(sc), grid) + vocab.embedding_elements(sc.model.hidden, sc.vocab,
                                                                                   grid.x * grid.y)
    placement, inner = _placement(sc, rpn)
    t_ddp = megatron_ddp.grad_sync_time(grads, dtype_bytes(_store(sc)), grid, profile, placement, rpn, inner)
    old = t.micro.exposed_s.get(("data", "allreduce"), 0.0)
    t.sync += t_ddp - old
    t.exposed["data"] = t.exposed.get("data", 0.0) + t_ddp - old
    return True


def _pytorch_fsdp(sc: Scenario, t: _Slot) -> Dict[str, float]:
    """Implementation ``pytorch-fsdp`` (:func:`fourd_mpi.perf.terms.fsdp_microbatch_sync`): the Z reduce-scatter
    per micro-batch, moved from ``S`` into every slot. ``{}`` otherwise."""
    if sc.implementation != terms.PYTORCH_FSDP:
        return {}
    fsdp = terms.fsdp_microbatch_sync(t.micro.exposed_s.get(("z", "reduce_scatter"), 0.0), sc.microbatches)
    t.sync -= fsdp["once"]
    t.slot += fsdp["per_slot"]
    t.exposed["z"] = t.exposed.get("z", 0.0) + fsdp["step"] - fsdp["once"]
    return fsdp


def _distributed_optimizer(sc: Scenario, profile: MachineProfile, rpn: int, t: _Slot,
                           coalesced: bool) -> Dict[str, float]:
    """``shard_optimizer="data"`` (:func:`fourd_mpi.perf.terms.distributed_optimizer_times`): ``S``'s data-axis
    gradient all-reduces become reduce-scatters, hidden in the same proportion, plus blocking all-gathers of the
    updated parameters. ``{}`` without it, with ``G_data = 1``, Megatron's coalesced all-reduce or ZeRO-3 2021."""
    grid = sc.grid
    if sc.shard_optimizer != "data" or grid.data == 1 or coalesced or sc.implementation == zero3_2021.NAME:
        return {}
    placement, inner = _placement(sc, rpn)
    times = terms.distributed_optimizer_times(_micro_config(sc), grid, _overlap(sc), _store(sc), profile, placement,
                                              rpn, inner)
    old = t.micro.exposed_s.get(("data", "allreduce"), 0.0)
    grads = max(0.0, old - times["loss"])  # the exposed gradient all-reduces (the loss's is blocking)
    dist = {"reduce_scatter": grads * times["reduce_scatter"] / times["allreduce"] if times["allreduce"] else 0.0,
            "allgather": times["allgather"]}
    change = dist["reduce_scatter"] + dist["allgather"] - grads
    t.sync += change
    t.exposed["data"] = t.exposed.get("data", 0.0) + change
    return dist


def _lm_head(sc: Scenario, profile: MachineProfile, rpn: int, exposed: Dict[str, float],
             notes: List[str]) -> tuple:
    """``(t_head, t_head_comm)`` per micro-batch on the last stage (:mod:`fourd_mpi.perf.vocab`): ``6 m h V/T``
    FLOPs at the GEMM rate plus the cross entropy's :data:`CE_PASSES` passes of fp32 logits at the memory
    bandwidth; its collectives blocking (added to ``exposed``, ``m`` times). ``(0, 0)`` with ``V = 0``."""
    if not sc.vocab:
        return 0.0, 0.0
    grid, m = sc.grid, sc.microbatches
    tokens, tp = sc.microbatch_size * sc.model.seq, grid.x * grid.y
    placement, inner = _placement(sc, rpn)
    rate = gemm_rate_tflops(profile, _store(sc), notes) * 1e12  # the head is not an FP8 layer
    t_head = vocab.head_flops_per_rank(tokens, sc.model.hidden, sc.vocab, tp) / rate
    t_head += CE_PASSES * tokens * (sc.vocab // tp) * 4 / profile.mem_bandwidth
    t_comm = 0.0
    for axis, op, size, nbytes in vocab.microbatch_collectives(tokens, sc.model.hidden, grid.x, grid.y,
                                                               dtype_bytes(_store(sc))):
        t = collective_time(_coll(axis, op, size, nbytes, "forward", "vocab"), profile, placement, rpn, inner)
        t_comm += t
        exposed[axis] = exposed.get(axis, 0.0) + t * m
    return t_head, t_comm


def _pipeline_messages(sc: Scenario, profile: MachineProfile, rpn: int) -> tuple:
    """``(t_p2p, t_critical, t_msg)``: the blocking schedules' ``2 v`` messages per slot, or AxoNN's fill and drain
    chain ``2 (p - 1) t_msg`` (its steady-state messages overlap compute: :func:`_message_wait`). A message of
    ``b s h/G_x e`` bytes at the inter axis' placement (:func:`~fourd_mpi.perf.machine.inter_placement`; without
    a network model, every rank of a node's stage sending at once: :func:`~fourd_mpi.perf.machine.message_time`);
    Megatron's scatter/gather (1f1b/interleaved, ``G_y > 1``) sends ``1/G_y`` of it and all-gathers over Y.
    ``(0, 0, 0)`` for one stage."""
    p, grid = sc.stages, sc.grid
    if p == 1:
        return 0.0, 0.0, 0.0
    level = inter_placement(grid, p, rpn)
    msg = sc.microbatch_size * sc.model.seq * (sc.model.hidden // grid.x) * dtype_bytes(_store(sc))
    scatter = sc.schedule in ("1f1b", "interleaved") and grid.y > 1
    wire = msg // grid.y if scatter else msg
    if profile.has_network:
        t_msg = profile.network_time("allgather", 2, 2 * wire, grid.x * grid.y * grid.z, level, rpn)
    else:
        t_msg = message_time(profile, level, wire, min(rpn, grid.size))
    if scatter:
        placement, inner = _placement(sc, rpn)
        t_msg += collective_time(_coll("y", "allgather", grid.y, msg, "forward", "p2p_gather"), profile, placement,
                                 rpn, inner)
    if sc.schedule == "axonn":
        return 0.0, 2 * (p - 1) * t_msg, t_msg
    v = sc.chunks if sc.schedule == "interleaved" else 1
    return schedules.p2p_messages_per_microbatch(sc.schedule, p, v) * t_msg, 0.0, t_msg


def _message_wait(sc: Scenario, profile: MachineProfile, slot: float, t_msg: float) -> float:
    """AxoNN's steady state: each slot's message each way overlaps the slot's compute only as far as the
    profile's overlap efficiency ``e`` allows (0 on a host-driven CPU without progress), so a slot waits
    ``max(W, t) + (1 - e) min(W, t) - W`` (:func:`~fourd_mpi.perf.schedules.link_bound_slot`: never shorter than
    its message). 0 for the blocking schedules (their messages are ``t_p2p``) and one stage."""
    if sc.schedule != "axonn" or sc.stages == 1:
        return 0.0
    efficiency = 0.0 if profile.host_driven and sc.progress == "none" else profile.overlap_efficiency
    return schedules.link_bound_slot(slot, t_msg, efficiency) - slot


def _embedding_sync(sc: Scenario, profile: MachineProfile, rpn: int, coalesced: bool,
                    exposed: Dict[str, float]) -> float:
    """``t_emb``: the per-step embedding-gradient all-reduces over Z and data (not data when ``coalesced`` into
    Megatron's one all-reduce; gathered and reduce-scattered under ZeRO-3 2021) and, with ``p > 1``, between the
    first and last stage (tied weights); blocking, added to ``exposed``."""
    if not sc.vocab:
        return 0.0
    grid, p = sc.grid, sc.stages
    placement, inner = _placement(sc, rpn)
    emb_bytes = vocab.embedding_elements(sc.model.hidden, sc.vocab, grid.x * grid.y) * dtype_bytes(_store(sc))
    t_emb = 0.0
    for axis in ("z", "data"):
        if grid[axis] > 1 and not (coalesced and axis == "data"):  # (in the coalesced all-reduce)
            if sc.implementation == zero3_2021.NAME:  # partitioned: gathered, its gradient reduce-scattered
                t = zero3_2021.embedding_time(emb_bytes, grid, sc.microbatches, profile, placement, rpn, inner)
            else:
                t = collective_time(_coll(axis, "allreduce", grid[axis], emb_bytes, "backward", "emb_grad"),
                                    profile, placement, rpn, inner)
            t_emb += t
            exposed[axis] = exposed.get(axis, 0.0) + t
    if p > 1:
        level = inter_placement(grid, p, rpn)
        if profile.has_network:
            t = profile.network_time("allreduce", 2, emb_bytes, grid.x * grid.y * grid.z, level, rpn)
        else:
            fit, _ = profile.fit(level, "allreduce", 2)
            t = fit.time("allreduce", 2, emb_bytes)
        t_emb += t
        exposed["pipeline"] = exposed.get("pipeline", 0.0) + t
    return t_emb


def _larger_stage_memory(sc: Scenario, profile: MachineProfile) -> tuple:
    """``(bytes by part, "first" | "last" | "only")``: the larger of the first and last stage."""
    first = stage_memory(sc, 0, profile)
    last = stage_memory(sc, sc.stages - 1, profile) if sc.stages > 1 else first
    memory, which = (first, "first") if first["required"] >= last["required"] else (last, "last")
    return memory, "only" if sc.stages == 1 else which


def _flop_notes(cfg: ModelConfig) -> List[str]:
    """Where Megatron's FLOP formula does not fit the model (:func:`step_flops`)."""
    notes = []
    if cfg.ffn_hidden != 4 * cfg.hidden:
        notes.append(f"ffn {cfg.ffn_hidden} is not 4h: Megatron's formula assumes it (the hardware count does not)")
    if _gqa_or_swiglu(cfg):
        notes.append("grouped-query attention / SwiGLU: Megatron's formula assumes 3h QKV and two h x f MLP GEMMs; "
                     "model and hardware FLOPs count the actual weights")
    return notes


def _predict_context_parallel(sc: Scenario, profile: MachineProfile) -> ScenarioResult:
    """:func:`predict_scenario` with ``cp > 1``: the view's prediction (:func:`_context_view`) plus, in every slot,
    the attention of the whole sequence (``cp - 1`` more times the chunk's) and the exposed part of the K/V ring
    (:mod:`fourd_mpi.perf.terms`, "Context parallelism"); FLOPs of the original model."""
    check(sc)
    cp, cfg, grid = sc.context_parallel, sc.model, sc.grid
    r = predict_scenario(_context_view(sc), profile)
    view = r.scenario
    b, m, p = view.microbatch_size, view.microbatches, sc.stages
    attention = r.terms["step_attention"] / m  # one slot's attention over the rank's own chunk
    e = dtype_bytes(terms.storage_dtype(sc.dtype))
    msg = terms.context_parallel_kv_bytes(b * view.model.seq, cfg.hidden, cfg.heads, cfg.kv_head_count, grid.y, e)
    rpn = sc.ranks_per_node or min(profile.ranks_per_node, sc.world)
    stride = grid.x * grid.y * grid.z  # Megatron-LM's order: tensor ranks innermost, then context ranks
    level = "intra" if stride * cp <= rpn else "inter"
    if profile.has_network:
        t_msg = profile.network_time("allgather", 2, 2 * msg, stride, level, rpn)
    else:
        t_msg = message_time(profile, level, msg)
    ring = max(sc.stage_layers) * terms.context_parallel_ring_messages(cp, sc.recompute) * t_msg
    extra_attention = (cp - 1) * attention
    exposed_ring = terms.context_parallel_exposed(ring, cp * attention)
    slots = schedules.bubble_slots(sc.schedule, p, sc.chunks) if p > 1 else 0.0
    per_slot = extra_attention + exposed_ring
    exposed = dict(r.exposed_s)
    exposed["context"] = exposed_ring * m
    flops = step_flops(cfg, sc.vocab, sc.recompute)
    step_terms = dict(r.terms, cp_attention=extra_attention * m, cp_ring_exposed=exposed_ring * m,
                      step_attention=r.terms["step_attention"] * cp)
    notes = [f"context parallel {cp}: {view.model.seq} tokens of each sequence per rank; every slot adds the rest of "
             f"the sequence's attention and the K/V ring's exposed part (fourd_mpi/perf/terms.py)"] + r.notes
    resolved = replace(sc, microbatch_size=b, microbatches=m)
    return ScenarioResult(resolved, r.step_s + per_slot * (m + slots), r.compute_s + extra_attention * m, exposed,
                          r.bubble_s + per_slot * slots, r.memory, r.memory_stage, flops, r.peak_tflops, step_terms,
                          notes)


def format_result(r: ScenarioResult, profile: MachineProfile) -> str:
    """The text of ``model predict``: configuration, step split, memory by part, % of peak per convention."""
    sc = r.scenario
    cfg = sc.model
    lines = [f"# fourd-mpi model predict: {profile.describe()}",
             f"# model {cfg.name}: {cfg.layers} layers, hidden {cfg.hidden}, heads {cfg.heads}"
             f"{f' ({cfg.kv_heads} K/V)' if cfg.kv_heads not in (None, cfg.heads) else ''}, ffn {cfg.ffn_hidden}"
             f"{f' {cfg.mlp}' if cfg.mlp != 'gelu' else ''}, "
             f"seq {cfg.seq}, vocab {sc.vocab}, global batch {cfg.batch}",
             f"# {sc.algorithm}: grid {sc.grid} (G_data x G_z x G_y x G_x) x {sc.stages} stage(s)"
             f"{f' x {sc.context_parallel} context-parallel' if sc.context_parallel > 1 else ''} = {r.gpus} GPUs, "
             f"{sc.ranks_per_node or min(profile.ranks_per_node, r.gpus)} per node; schedule {sc.schedule}"
             f"{f' v={sc.chunks}' if sc.schedule == 'interleaved' else ''}; micro-batch {sc.microbatch_size} x "
             f"{sc.microbatches}; {sc.dtype} ({sc.precision or 'default'} precision), recompute {sc.recompute}, "
             f"attention {sc.attention}, sequence parallel {'on' if sc.sequence_parallel else 'off'}, optimizer "
             f"{sc.optimizer} sharded {sc.shard_optimizer}, overlap {sc.overlap}"
             f"{'' if sc.progress == 'poll' else f' (progress {sc.progress})'}, dW window "
             f"{sc.dw_window if sc.dw_window is not None else 'unbounded'}"
             f"{'' if sc.implementation == 'fourd' else f'; implementation {sc.implementation}'}",
             f"# {formulas(sc)['step']}; {formulas(sc)['bubble']}",
             "",
             f"step {r.step_s:.4f} s = compute {r.compute_s:.4f} s + exposed communication "
             f"{sum(r.exposed_s.values()):.4f} s + bubble {r.bubble_s:.4f} s",
             "exposed communication by axis: " + (", ".join(f"{a} {t:.4f} s" for a, t in sorted(r.exposed_s.items())
                                                          if t > 0) or "none"),
             "terms: " + ", ".join(f"{k} {v:.4g} s" for k, v in r.terms.items()),
             f"memory per GPU ({r.memory_stage} stage): " + ", ".join(
                 f"{k} {v / GIB:.2f}" for k, v in r.memory.items() if k not in ("total", "required"))
             + f" GiB; total {r.memory['total'] / GIB:.2f} GiB, required {r.memory['required'] / GIB:.2f} GiB "
               f"(x {1 + ALLOCATOR_MARGIN:.2f} allocator margin + GPU reserve)"
             + ("" if r.fits() is None else f"; {'fits' if r.fits() else 'does NOT fit'} in "
                                             f"{sc.memory_limit_gib:g} GiB"),
             ""]
    f = formulas(sc)
    for conv in ("megatron", "hardware", "model"):
        lines.append(f"{conv:9s} {r.flops[conv]:.4g} FLOPs/step, {r.tflops_per_gpu(conv):.1f} TFLOP/s per GPU, "
                     f"{UTILIZATION_NAME[conv]} {r.pct_peak(conv):.1f} % of {r.peak_tflops:g} TFLOP/s peak  "
                     f"[{f[conv]}]")
    lines.append(f"({f['pct_peak']})")
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)
