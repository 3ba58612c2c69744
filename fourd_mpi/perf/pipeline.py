"""The performance model of ``--algorithm pipeline`` (AxoNN inter-layer pipeline x 4D tensor). Pure.

Notation: ``p = G_inter`` stages, ``m`` micro-batches per batch shard, ``L`` blocks, stage ``s``
holding ``L_s`` blocks (:func:`~fourd_mpi.perf.terms.stage_layers`, the model's one rule: run's
:func:`~fourd_mpi.algorithms.pipeline_plan.stage_blocks`, the first ``L mod p`` stages one block more, the most
``ceil(L/p)``), each stage a 4D grid ``G_data x G_z x G_y x G_x``, ``e`` the dtype's bytes,
``m_loc = B s / (G_data G_z)`` local tokens of a rank.

**Point-to-point volume** (:func:`p2p_volumes`, exact: the trace's ``send``/``recv`` events hold the
same bytes): one message is a micro-batch's activation or its gradient, ``[m_loc/m, h/G_x]``, so
``msg = m_loc/m * h/G_x * e`` bytes. Per step a rank of stage ``s`` sends ``m`` forward messages if
``s < p-1`` and ``m`` backward messages if ``s > 0`` (and receives as many): ``m*msg`` or ``2*m*msg``
bytes, i.e. ``2*m_loc*h/G_x*e`` for a middle stage, whatever ``m``.

**Idle share** (:func:`~fourd_mpi.perf.schedules.idle_share`; :func:`~fourd_mpi.perf.schedules.bubble_fraction`
is the bubble over the ideal time ``(p - 1)/m``): with equal stage times and a forward+backward slot ``t``
per micro-batch, a step of either schedule takes ``(m + p - 1) t`` of which every stage idles ``(p - 1) t``:
``bubble = (p - 1) / (m + p - 1)`` (1F1B; Narayanan et al. SC'21). AxoNN's message-driven schedule
(stage 0 keeps ``min(p, m)`` micro-batches in flight, the others react to the first message to
arrive) settles into the same one-forward-one-backward order in the steady state, so its bubble
with equal stage times is the same ``(p - 1)/(m + p - 1)``; what the message-driven order saves is
the extra idling a fixed order adds when stage or message times vary (a stage runs whatever
arrived instead of waiting for the message the order names), which this model does not count.

**Memory** (:func:`pipeline_memory`: :func:`fourd_mpi.perf.step_terms.stage_memory`, the one pipeline memory
estimate, with this suite's step's buffers): stage ``s`` stores the weights, gradients and optimizer state of
its ``L_s`` blocks; activations of at most :func:`~fourd_mpi.algorithms.pipeline_plan.inflight`
micro-batches (1F1B ``min(p - s, m)``, AxoNN ``min(p, m)``; stage 0 the most, ``min(p, m)``, in both): what each
keeps for its backward (with full recompute only its blocks' stored inputs ``L_s x m_loc/m x h/G_x``), while one
block's recompute working set, the step's input/target and the largest transient are counted once; the
token-partial gradient sums of its FC layers (``n k/(G_x G_y)`` each, only with ``m > 1``: gradients
accumulate before the reduce-scatter over Z) and two posted
receive buffers of ``msg`` bytes.

**Time** (:func:`predict_pipeline`, same inputs and output as :func:`fourd_mpi.perf.predict.predict`): the
one pipeline model, :func:`fourd_mpi.perf.prediction.predict_scenario` (``model predict``'s), of the scenario
this suite's run is (no vocabulary, every dW block in flight): the 4D prediction of one **micro-batch** on
the fullest stage (``ceil(L/p)`` blocks, ``B/m`` sequences, its axes placed in the pipeline's world:
:func:`~fourd_mpi.perf.machine.world_levels`) gives the work of one slot ``W_mb``: that step less its exposed
gradient synchronization ``S`` and its optimizer update ``U``, which both run once, after the last
micro-batch; ``step = W (m + p - 1) + U + S + 2 (p - 1) t_msg`` for AxoNN's schedule, with
``W = max(W_mb, t_msg) + (1 - e) min(W_mb, t_msg)`` (:func:`~fourd_mpi.perf.schedules.link_bound_slot`: each
slot's message overlaps compute as far as the profile's overlap efficiency ``e`` allows), ``(W_mb + 2 t_msg)
(m + p - 1) + U + S`` for 1F1B (Megatron-LM blocks on each message). A message costs ``t_msg`` at the placement
of the inter axis (:func:`~fourd_mpi.perf.machine.inter_placement`, :func:`~fourd_mpi.perf.machine.message_time`).
Because each slot is predicted at its own size, the per-micro-batch latencies of the 4D collectives and the
GEMMs' lower efficiency on smaller shapes are counted: the prediction has an optimum in ``m``.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

from fourd_mpi.core.backend import dtype_bytes
from fourd_mpi.core.grid import GridShape
from fourd_mpi.perf import schedules
from fourd_mpi.perf.machine import MachineProfile, inter_placement
from fourd_mpi.perf.memory import MemoryEstimate, local_tokens
from fourd_mpi.perf.predict import Prediction
from fourd_mpi.perf.prediction import predict_scenario, slot_lower_bound
from fourd_mpi.perf.scenario import Scenario
from fourd_mpi.perf.step_terms import SYNC_KEYS, stage_memory
from fourd_mpi.perf.terms import stage_layers
from fourd_mpi.perf.volumes import Collective, step_collectives
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import ModelConfig

BUBBLE_FORMULA = ("idle share of the step = (p - 1) / (m + p - 1), p stages, m micro-batches "
                  "(1F1B and AxoNN, equal stages)")
P2P_FORMULA = ("p2p bytes per rank and step = m * msg * (1 if first or last stage else 2), "
               "msg = B s / (G_data G_z) / m * h / G_x * e")
STEP_FORMULA = ("step = W_mb (m + p - 1) + U + S + 2 (p - 1) t_msg; W_mb: one micro-batch's 4D step on the "
                "fullest stage less U (optimizer update) and S (gradient sync), both once per step; "
                "t_msg = alpha + msg beta")


def message_bytes(cfg: ModelConfig, grid: GridShape, microbatches: int, dtype: str = "float32") -> int:
    """Bytes of one activation (or its gradient) between stages: ``m_loc/m * h/G_x * e``."""
    tokens = cfg.batch // (grid.data * grid.z) * cfg.seq
    return tokens // microbatches * (cfg.hidden // grid.x) * dtype_bytes(dtype)


def p2p_volumes(cfg: ModelConfig, grid: GridShape, stages: int, microbatches: int,
                dtype: str = "float32") -> Dict[int, Dict[str, int]]:
    """Per stage, one rank's messages and bytes per step: ``{stage: {"send_messages", "send_bytes",
    "recv_messages", "recv_bytes"}}`` (:data:`P2P_FORMULA`)."""
    msg = message_bytes(cfg, grid, microbatches, dtype)
    out = {}
    for s in range(stages):
        links = (s < stages - 1) + (s > 0)
        count = microbatches * links
        out[s] = {"send_messages": count, "send_bytes": count * msg, "recv_messages": count, "recv_bytes": count * msg}
    return out


def world_p2p_bytes(cfg: ModelConfig, grid: GridShape, stages: int, microbatches: int, dtype: str = "float32") -> int:
    """Bytes all ranks send between stages per step: ``2 (p - 1) m msg`` per 4D position, times
    ``G_data G_z G_y G_x``."""
    per_stage = p2p_volumes(cfg, grid, stages, microbatches, dtype)
    return grid.size * sum(v["send_bytes"] for v in per_stage.values())


#: 4D collectives repeated for every micro-batch (their messages scale with its tokens, or, for the weight
#: all-gathers, each micro-batch's forward and backward gathers the weights again); the gradient collectives
#: (Z reduce-scatters, Z and data all-reduces of gradients) run once, after the last micro-batch
PER_MICROBATCH_ROLES = ("ln_allreduce", "weight_allgather", "fwd_allreduce", "bwd_allreduce")

def pipeline_collectives(cfg: ModelConfig, grid: GridShape, stages: int, microbatches: int, stage: int,
                         overlap: Optional[OverlapConfig] = None, dtype: str = "float32") -> List[Collective]:
    """Every 4D collective of one rank of ``stage`` per step (:func:`~fourd_mpi.perf.volumes.step_collectives`
    of the stage's blocks on one micro-batch, :data:`PER_MICROBATCH_ROLES` ``m`` times, the gradient
    synchronization once; the loss is one world all-reduce outside the collectives, not listed). Exact
    for the trace without ``cache`` (with it, whether a backward finds its weights cached depends on the
    schedule: a backward right after a forward does, after another backward does not; counted as cached)."""
    sizes = stage_layers(cfg.layers, stages)
    first = sum(sizes[:stage])  # the stage's first block
    micro = replace(cfg, layers=sizes[stage], batch=cfg.batch // microbatches)
    out = []
    for c in step_collectives(micro, grid, overlap, dtype):
        if c.role == "loss":
            continue
        index, rest = c.layer[len("block"):].split(".", 1)
        count = c.count * microbatches if c.role in PER_MICROBATCH_ROLES else c.count
        out.append(replace(c, layer=f"block{first + int(index)}.{rest}", count=count))
    return out


def stage_config(cfg: ModelConfig, stages: int) -> ModelConfig:
    """The fullest stage's model: ``ceil(L/p)`` blocks (stage 0, :func:`~fourd_mpi.perf.terms.stage_layers`)."""
    return replace(cfg, layers=max(stage_layers(cfg.layers, stages)))


@lru_cache(maxsize=65536)
def micro_config(cfg: ModelConfig, stages: int, microbatches: int) -> ModelConfig:
    """One slot's model: the fullest stage's blocks (:func:`stage_config`) on ``B/m`` sequences. Memoized
    (a search builds it for the bound and the prediction of every candidate)."""
    return replace(stage_config(cfg, stages), batch=cfg.batch // microbatches)


@lru_cache(maxsize=8192)
def pipeline_memory(cfg: ModelConfig, grid: GridShape, stages: int, microbatches: int, stage: int = 0,
                    dtype: str = "float32", optimizer: str = "adam", overlap: Optional[OverlapConfig] = None,
                    recompute: str = "none", attention: str = "unfused", precision: Optional[str] = None,
                    shard_optimizer: str = "none", schedule: str = "axonn") -> MemoryEstimate:
    """Bytes per rank of ``stage`` (module doc) by THE pipeline memory estimate,
    :func:`~fourd_mpi.perf.step_terms.stage_memory` with this suite's step's buffers, of the scenario this suite's
    run is (no vocabulary, every dW block in flight; ``overlap`` None: OAG on, as
    :func:`~fourd_mpi.perf.memory.estimate_memory` plans). Memoized (arguments and result frozen)."""
    shard = cfg.batch // (grid.data * grid.z)
    sc = Scenario(cfg, grid, "", algorithm="pipeline", stages=stages, schedule=schedule,
                  microbatch_size=shard // microbatches, microbatches=microbatches, vocab=0, recompute=recompute,
                  dtype=dtype, attention=attention, precision=precision, shard_optimizer=shard_optimizer,
                  optimizer=optimizer, overlap=overlap if overlap is not None else OverlapConfig(oag=True),
                  dw_window=None)
    parts = stage_memory(sc, stage, suite_step=True)
    return MemoryEstimate(weights=parts["weights"], gradients=parts["gradients"], optimizer=parts["optimizer"],
                          activations=parts["activations"], comm_buffers=parts["comm_buffers"],
                          master=parts.get("master", 0))


def pipeline_lower_bound(cfg: ModelConfig, grid: GridShape, profile: MachineProfile, stages: int = 1,
                         microbatches: int = 1, overlap: Optional[OverlapConfig] = None, dtype: str = "float32",
                         optimizer: str = "adam", ranks_per_node: Optional[int] = None, recompute: str = "none",
                         attention: str = "unfused", communication: bool = True, precision: Optional[str] = None,
                         **_) -> float:
    """Seconds never above :func:`predict_pipeline`'s step: ``(c - U + X_n)(m + p - 1) + U + X_s`` with ``c``
    one micro-batch's compute on the fullest stage, ``U`` its optimizer update and ``X`` the communication
    any timeline exposes (:func:`~fourd_mpi.perf.predict.blocking_time`), ``X_s`` of the gradient
    synchronization's keys, ``X_n`` of the others (the slot ``W_mb - S - U`` is at least ``c - U + X_n``;
    ``S >= X_s``; the messages on the critical path are at least 0). ``communication=False``: ``X = 0``, a
    looser and cheaper bound."""
    overlap = overlap or OverlapConfig()
    rpn = ranks_per_node or min(profile.ranks_per_node, grid.size * stages)
    return slot_lower_bound(micro_config(cfg, stages, microbatches), grid, profile, overlap, dtype, rpn, optimizer,
                            recompute, attention, precision, stages, microbatches, stages - 1, communication)


def predict_pipeline(cfg: ModelConfig, grid: GridShape, profile: MachineProfile, stages: int = 1,
                     microbatches: int = 1, schedule: str = "axonn", overlap: Optional[OverlapConfig] = None,
                     dtype: str = "float32", progress: str = "poll", optimizer: str = "adam",
                     ranks_per_node: Optional[int] = None, recompute: str = "none", attention: str = "unfused",
                     precision: Optional[str] = None, shard_optimizer: str = "none") -> Prediction:
    """The pipeline's step by THE pipeline model, :func:`~fourd_mpi.perf.prediction.predict_scenario` (this is a
    thin wrapper: tune, ``model validate`` and the benchmarks price a pipeline as ``model predict`` does), of the
    scenario (:meth:`~fourd_mpi.perf.scenario.Scenario.from_options`, run's words) this suite's run is: no
    vocabulary (their models have none), every dW block in flight, ``grid`` each stage's 4D grid, its blocks
    :func:`~fourd_mpi.perf.terms.stage_layers` (the first ``L mod p`` stages one more, as run places them). The
    result is a :class:`~fourd_mpi.perf.predict.Prediction` like :func:`~fourd_mpi.perf.predict.predict`'s, with the
    inter axis added: ``exposed_s`` keys ``("inter", "send")`` (the messages on the critical path and what a slot
    waits for its message) and ``("inter", "bubble")``; ``wire_bytes["inter"]`` (the fullest rank's bytes sent),
    ``placement["inter"]``; ``memory`` is stage 0's arrays in this suite's step (:func:`pipeline_memory`, run's
    admission estimate)."""
    overlap = overlap or OverlapConfig()
    sc = Scenario.from_options({"model": cfg, "grid": grid, "algorithm": "pipeline", "ginter": stages,
                                "pipeline-schedule": schedule, "microbatches": microbatches, "vocab": 0,
                                "recompute": recompute, "dtype": dtype, "attention": attention, "precision": precision,
                                "shard-optimizer": shard_optimizer, "optimizer": optimizer, "overlap": overlap,
                                "progress": progress, "dw-window": "none", "ranks-per-node": ranks_per_node}, profile)
    r = predict_scenario(sc, profile)
    micro, m = r.slot.micro, microbatches
    scale = {key: 1 if key in SYNC_KEYS else m for key in micro.comm_s}
    comm = {key: t * scale[key] for key, t in micro.comm_s.items()}
    exposed = {key: t * scale.get(key, m) for key, t in micro.exposed_s.items()}
    send = r.exposed_s.get("pipeline", 0.0)
    volumes = p2p_volumes(cfg, grid, stages, microbatches, dtype)
    comm[("inter", "send")] = send
    exposed[("inter", "send")] = send
    exposed[("inter", "bubble")] = r.bubble_s
    # stage 0's wire bytes by axis, as pipeline_collectives counts them (per-micro-batch roles m times)
    micro_cfg = micro_config(cfg, stages, microbatches)
    wire = {axis: 0 for axis in micro.wire_bytes}
    for c in step_collectives(replace(micro_cfg, layers=1), grid, overlap, dtype):  # every block's: L times
        if c.role != "loss" and c.axis in wire:
            wire[c.axis] += c.wire_bytes * (microbatches if c.role in PER_MICROBATCH_ROLES else 1) * micro_cfg.layers
    wire["inter"] = max(v["send_bytes"] for v in volumes.values())
    rpn = ranks_per_node or min(profile.ranks_per_node, sc.world)
    memory = pipeline_memory(cfg, grid, stages, microbatches, 0, dtype, optimizer, overlap, recompute, attention,
                             precision, shard_optimizer, schedule)
    share = schedules.idle_share(schedule, stages, microbatches)
    notes = list(r.notes) + ([f"pipeline {schedule}: {BUBBLE_FORMULA} = {share:.3f}"] if stages > 1 else [])
    return Prediction(grid=grid, step_s=r.step_s, compute_s=r.compute_s, gemm_s=micro.gemm_s * microbatches,
                      comm_s=comm, exposed_s=exposed, wire_bytes=wire,
                      placement=dict(micro.placement, inter=inter_placement(grid, stages, rpn)), memory=memory,
                      notes=notes)


def admission_memory(options, attention: str = "unfused") -> Tuple[MemoryEstimate, int]:
    """The pipeline's admission hook (:attr:`fourd_mpi.algorithms.families.Family.admission`): the fullest
    stage's :func:`pipeline_memory` (largest total over the ``G_inter`` stages) of a run's resolved options
    (:class:`~fourd_mpi.algorithms.runoptions.RunOptions`; ``attention`` is not used: the stage estimate keeps the
    score matrix), and the tokens per rank ``m = B*s/(G_data*G_z)`` (:func:`local_tokens`)."""
    cfg, grid = options.model, options.grid
    estimate = max((pipeline_memory(cfg, grid, options.ginter, options.microbatches, s, options.dtype,
                                    options.optimizer, options.overlap, schedule=options.pipeline_schedule)
                    for s in range(options.ginter)), key=lambda e: e.total)
    return estimate, local_tokens(cfg, grid)
