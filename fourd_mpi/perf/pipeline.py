"""The performance model of ``--algorithm pipeline`` (AxoNN inter-layer pipeline x 4D tensor). Pure.

Notation: ``p = G_inter`` stages, ``m`` micro-batches per batch shard, ``L`` blocks, stage ``s``
holding ``L_s`` blocks (:func:`~fourd_mpi.algorithms.pipeline_plan.stage_blocks`, the most
``ceil(L/p)``), each stage a 4D grid ``G_data x G_z x G_y x G_x``, ``e`` the dtype's bytes,
``m_loc = B s / (G_data G_z)`` local tokens of a rank.

**Point-to-point volume** (:func:`p2p_volumes`, exact: the trace's ``send``/``recv`` events hold the
same bytes): one message is a micro-batch's activation or its gradient, ``[m_loc/m, h/G_x]``, so
``msg = m_loc/m * h/G_x * e`` bytes. Per step a rank of stage ``s`` sends ``m`` forward messages if
``s < p-1`` and ``m`` backward messages if ``s > 0`` (and receives as many): ``m*msg`` or ``2*m*msg``
bytes, i.e. ``2*m_loc*h/G_x*e`` for a middle stage, whatever ``m``.

**Idle share** (:func:`~fourd_mpi.perf.schedules.idle_share`; :func:`~fourd_mpi.perf.schedules.bubble_fraction`
is the bubble over the ideal time ``(p - 1)/m``): with equal stage times and a forward+backward slot ``t`` per micro-batch, a
step of either schedule takes ``(m + p - 1) t`` of which every stage idles ``(p - 1) t``:
``bubble = (p - 1) / (m + p - 1)`` (1F1B; Narayanan et al. SC'21). AxoNN's message-driven schedule
(stage 0 keeps ``min(p, m)`` micro-batches in flight, the others react to the first message to
arrive) settles into the same one-forward-one-backward order in the steady state, so its bubble
with equal stage times is the same ``(p - 1)/(m + p - 1)``; what the message-driven order saves is
the extra idling a fixed order adds when stage or message times vary (a stage runs whatever
arrived instead of waiting for the message the order names), which this model does not count.

**Memory** (:func:`pipeline_memory`): stage ``s`` stores the weights, gradients and optimizer state of
its ``L_s`` blocks; activations of at most :func:`~fourd_mpi.algorithms.pipeline_plan.inflight`
micro-batches (1F1B ``min(p - s, m)``, AxoNN ``min(p, m)``; stage 0 the most, ``min(p, m)``, in both): what each
keeps for its backward (with full recompute only its blocks' stored inputs ``L_s x m_loc/m x h/G_x``), while one
block's recompute working set, the step's input/target and the largest transient are counted once; the token-partial gradient sums of its FC layers (``n k/(G_x G_y)``
each, only with ``m > 1``: gradients accumulate before the reduce-scatter over Z) and two posted
receive buffers of ``msg`` bytes.

**Time** (:func:`predict_pipeline`, same inputs and output as :func:`fourd_mpi.perf.predict.predict`):
the 4D prediction of one **micro-batch** on the fullest stage (``L_s = ceil(L/p)`` blocks, ``B/m``
sequences: every collective at its micro-batch size and with its own latency, the Z weight gathers
of every micro-batch included) gives the work of one slot ``W_mb``: that step less its exposed
gradient synchronization ``S`` (the Z reduce-scatters, the Z and data all-reduces of gradients) and
its optimizer update ``U``, which both run once, after the last micro-batch;
``step = W (m + p - 1) + U + S + 2 (p - 1) t_msg``: ``m`` slots plus the bubble of ``p - 1`` slots,
plus the messages on the critical path of the fill and the drain (the forward chain and the
backward chain through ``p - 1`` boundaries). In the steady state each slot also sends one message
each way, which ``Isend`` overlaps with compute as far as the profile's overlap efficiency ``e``
allows: ``W = max(W_mb, t_msg) + (1 - e) min(W_mb, t_msg)`` (:func:`link_bound_slot`; a slot is never
shorter than its message). A message costs ``t_msg`` at the placement of the inter axis (intra-node
when the stage neighbours share a node, :func:`inter_placement`): across nodes from a calibrated
profile's measured 2-rank points with every rank of a node's stage sending at once, else from the
profile's all-gather fit on 2 ranks (whose ring moves exactly one message each way),
``alpha + msg * beta`` (:func:`message_time`). Because each slot is predicted at its own size, the
per-micro-batch latencies of the 4D collectives (``m`` times more, ``m`` times smaller messages) and
the GEMMs' lower efficiency on smaller shapes are counted: more micro-batches shrink the bubble but
cost latency, and the prediction has an optimum in ``m``.
"""

from __future__ import annotations

import math
from functools import lru_cache
from dataclasses import replace
from typing import Dict, List, Optional

from fourd_mpi.algorithms.pipeline_plan import inflight, stage_blocks
from fourd_mpi.core.backend import dtype_bytes
from fourd_mpi.core.grid import GridShape
from fourd_mpi.perf import schedules
from fourd_mpi.perf.machine import MachineProfile
from fourd_mpi.perf.memory import (MemoryEstimate, block_elements, estimate_memory, fc_weights, local_tokens,
                                   saved_activation_elements)
from fourd_mpi.perf.predict import Prediction, compute_time, predict
from fourd_mpi.perf.volumes import Collective, step_collectives
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import ModelConfig

BUBBLE_FORMULA = "idle share of the step = (p - 1) / (m + p - 1), p stages, m micro-batches (1F1B and AxoNN, equal stages)"
P2P_FORMULA = ("p2p bytes per rank and step = m * msg * (1 if first or last stage else 2), msg = B s / (G_data G_z) / m "
               "* h / G_x * e")
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
    """Bytes all ranks send between stages per step: ``2 (p - 1) m msg`` per 4D position, times ``G_data G_z G_y G_x``."""
    per_stage = p2p_volumes(cfg, grid, stages, microbatches, dtype)
    return grid.size * sum(v["send_bytes"] for v in per_stage.values())


#: 4D collectives repeated for every micro-batch (their messages scale with its tokens, or, for the weight
#: all-gathers, each micro-batch's forward and backward gathers the weights again); the gradient collectives
#: (Z reduce-scatters, Z and data all-reduces of gradients) run once, after the last micro-batch
PER_MICROBATCH_ROLES = ("ln_allreduce", "weight_allgather", "fwd_allreduce", "bwd_allreduce")
#: (axis, op) of the gradient synchronization, exposed once per step after the last micro-batch
SYNC_KEYS = (("data", "allreduce"), ("z", "reduce_scatter"), ("z", "allreduce"))


def pipeline_collectives(cfg: ModelConfig, grid: GridShape, stages: int, microbatches: int, stage: int,
                         overlap: Optional[OverlapConfig] = None, dtype: str = "float32") -> List[Collective]:
    """Every 4D collective of one rank of ``stage`` per step (:func:`~fourd_mpi.perf.volumes.step_collectives`
    of the stage's blocks on one micro-batch, :data:`PER_MICROBATCH_ROLES` ``m`` times, the gradient
    synchronization once; the loss is one world all-reduce outside the collectives, not listed). Exact
    for the trace without ``cache`` (with it, whether a backward finds its weights cached depends on the
    schedule: a backward right after a forward does, after another backward does not; counted as cached)."""
    blocks = stage_blocks(cfg.layers, stages, stage)
    micro = replace(cfg, layers=len(blocks), batch=cfg.batch // microbatches)
    out = []
    for c in step_collectives(micro, grid, overlap, dtype):
        if c.role == "loss":
            continue
        index, rest = c.layer[len("block"):].split(".", 1)
        count = c.count * microbatches if c.role in PER_MICROBATCH_ROLES else c.count
        out.append(replace(c, layer=f"block{blocks.start + int(index)}.{rest}", count=count))
    return out


def world_levels(grid: GridShape, stages: int, ranks_per_node: int) -> Dict[str, str]:
    """``axis -> "intra" | "inter" | "-"`` of the pipeline's world, rank order data, inter, z, y, x (X
    innermost) on nodes of ``ranks_per_node`` consecutive ranks: an axis is intra-node when its span
    (stride x size) fits in a node and tiles it. The data axis' stride is ``G_z G_y G_x x stages``, not
    a stage grid's ``G_z G_y G_x``: with 2 stages of 2x1x2x1 on nodes of 4, the stages share a node
    and the data all-reduce crosses nodes."""
    out, stride = {}, 1
    for axis, size in (("x", grid.x), ("y", grid.y), ("z", grid.z), ("inter", stages), ("data", grid.data)):
        span = stride * size
        out[axis] = "-" if size == 1 else ("intra" if span <= ranks_per_node and ranks_per_node % span == 0
                                           else "inter")
        stride = span
    return out


def world_strides(grid: GridShape, stages: int) -> Dict[str, int]:
    """``{"data": G_z G_y G_x x stages}``: the data axis' stride in the pipeline's world order (data,
    inter, z, y, x); the stage grid's other axes keep their strides."""
    return {"data": grid.z * grid.y * grid.x * stages}


def inter_placement(grid: GridShape, stages: int, ranks_per_node: int) -> str:
    """``intra`` when a rank and its stage neighbours (``G_z G_y G_x`` world ranks apart, rank order data, inter,
    z, y, x) share a node, ``inter`` otherwise, ``-`` for one stage (:func:`world_levels`)."""
    return world_levels(grid, stages, ranks_per_node)["inter"]


def stage_config(cfg: ModelConfig, stages: int) -> ModelConfig:
    """The fullest stage's model: ``ceil(L/p)`` blocks (stage 0, :func:`stage_blocks`)."""
    return replace(cfg, layers=len(stage_blocks(cfg.layers, stages, 0)))


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
    """Bytes per rank of ``stage`` (module doc): its blocks' state, the activations of the micro-batches in
    flight under ``schedule``, gradient sums and two receive buffers. Memoized (arguments and result frozen)."""
    blocks = len(stage_blocks(cfg.layers, stages, stage))
    mine = replace(cfg, layers=blocks)
    state = estimate_memory(mine, grid, dtype, optimizer, overlap=overlap, recompute=recompute, attention=attention,
                            precision=precision, shard_optimizer=shard_optimizer)
    micro = estimate_memory(replace(mine, batch=cfg.batch // microbatches), grid, dtype, optimizer, overlap=overlap,
                            recompute=recompute, attention=attention, precision=precision,
                            shard_optimizer=shard_optimizer)
    in_flight = inflight(schedule, stages, microbatches, stage)
    e = dtype_bytes(dtype)
    # what each further in-flight micro-batch adds: its stored block inputs (full recompute) or its blocks'
    # saved sets; the recompute working set, the step's input/target and the largest transient exist once
    one_mb = replace(mine, batch=cfg.batch // microbatches)
    if recompute == "full":
        per_mb = blocks * local_tokens(one_mb, grid) * (cfg.hidden // grid.x) * e
    else:
        per_mb = saved_activation_elements(one_mb, grid, recompute, attention) * e
    activations = micro.activations + (in_flight - 1) * per_mb
    sums = (sum(block_elements(n, k, t, grid) for _, n, k, t in fc_weights(mine, grid)) * blocks * e
            if microbatches > 1 else 0)
    buffers = 2 * message_bytes(cfg, grid, microbatches, dtype)
    return replace(state, activations=activations,
                   comm_buffers=micro.comm_buffers + sums + buffers)


def message_time(profile: MachineProfile, level: str, nbytes: int, senders: Optional[int] = None) -> float:
    """Seconds of one point-to-point message: a 2-rank all-gather of a gathered buffer of ``2 * nbytes``
    (its ring moves exactly one message each way). Across nodes, from a calibrated profile's measured
    points of 2 ranks on 2 nodes (``2@1``) when it has them, with ``senders`` ranks of a node sending at
    once (the link share of :meth:`~fourd_mpi.perf.machine.MachineProfile.measured_time`: a stage's
    ranks all send their micro-batch through the node's link together); otherwise the level's
    all-gather fit on 2 ranks (``alpha + nbytes * beta``)."""
    if level == "-":
        return 0.0
    fit, shared_by = profile.fit(level, "allgather", 2)
    if level == "inter" and senders:
        measured = profile.measured_time(level, "allgather", 2, 2 * nbytes, senders / shared_by, per_node=1)
        if measured is not None:
            return measured
    return fit.time("allgather", 2, 2 * nbytes)


def link_bound_slot(slot: float, t_msg: float, efficiency: float) -> float:
    """One steady-state slot when each micro-batch's message must also cross the stage boundary:
    ``max(W, t) + (1 - e) min(W, t)`` = ``W + t - e min(W, t)`` for compute ``W``, message ``t`` and
    overlap efficiency ``e`` (the share of the shorter one hidden behind the longer, as the 4D model
    hides collectives: :attr:`~fourd_mpi.perf.machine.MachineProfile.overlap_efficiency`, 0 without
    progress). ``e = 1``: ``max(W, t)`` (a message per slot each way, the link full duplex); a slot
    never runs faster than its link."""
    return max(slot, t_msg) + (1.0 - efficiency) * min(slot, t_msg)


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
    from fourd_mpi.perf.predict import blocking_time, compute_time_shared

    overlap = overlap or OverlapConfig()
    world = grid.size * stages
    rpn = ranks_per_node or min(profile.ranks_per_node, world)
    micro_cfg = micro_config(cfg, stages, microbatches)
    comp = compute_time_shared(micro_cfg, grid, profile, overlap, dtype, rpn, optimizer, recompute=recompute,
                               attention=attention, precision=precision)
    if not communication:
        return (comp["total"] - comp["optimizer"]) * (microbatches + stages - 1) + comp["optimizer"]
    levels = {a: v for a, v in world_levels(grid, stages, rpn).items() if a != "inter" and v != "-"}
    blocking = blocking_time(micro_cfg, grid, profile, overlap, dtype, rpn, recompute, levels,
                             world_strides(grid, stages))
    sync = sum(t for key, t in blocking.items() if key in SYNC_KEYS)
    other = sum(t for key, t in blocking.items() if key not in SYNC_KEYS)
    return (comp["total"] - comp["optimizer"] + other) * (microbatches + stages - 1) + comp["optimizer"] + sync


def predict_pipeline(cfg: ModelConfig, grid: GridShape, profile: MachineProfile, stages: int = 1,
                     microbatches: int = 1, schedule: str = "axonn", overlap: Optional[OverlapConfig] = None,
                     dtype: str = "float32", progress: str = "poll", optimizer: str = "adam",
                     ranks_per_node: Optional[int] = None, recompute: str = "none", attention: str = "unfused",
                     precision: Optional[str] = None, shard_optimizer: str = "none") -> Prediction:
    """Predict one step of the pipeline (module doc; ``grid`` is each stage's 4D grid). The result is a
    :class:`~fourd_mpi.perf.predict.Prediction` like :func:`~fourd_mpi.perf.predict.predict`'s, with the
    inter axis added: ``comm_s``/``exposed_s`` key ``("inter", "send")`` (the messages on the critical
    path) and ``("inter", "bubble")`` (the bubble), ``wire_bytes["inter"]`` (the fullest rank's bytes sent),
    ``placement["inter"]``; ``memory`` is stage 0's (the most activations in flight)."""
    world = grid.size * stages
    rpn = ranks_per_node or min(profile.ranks_per_node, world)
    # one slot: one micro-batch (B/m sequences) through the fullest stage's blocks
    micro_cfg = micro_config(cfg, stages, microbatches)
    levels = {a: v for a, v in world_levels(grid, stages, rpn).items() if a != "inter" and v != "-"}
    micro = predict(micro_cfg, grid, profile, overlap, dtype, progress, optimizer, rpn, recompute, attention,
                    precision, shard_optimizer, levels=levels, strides=world_strides(grid, stages))
    sync_keys = SYNC_KEYS
    sync = sum(micro.exposed_s.get(key, 0.0) for key in sync_keys)
    # the optimizer updates the stage's weights once per step, after the last micro-batch
    update = compute_time(micro_cfg, grid, profile, overlap or OverlapConfig(), dtype, rpn, optimizer,
                          recompute=recompute, attention=attention, precision=precision)["optimizer"]
    slot = micro.step_s - sync - update
    level = inter_placement(grid, stages, rpn)
    msg = message_bytes(cfg, grid, microbatches, dtype)
    t_msg = message_time(profile, level, msg, min(rpn, grid.size))
    critical = 2 * (stages - 1) * t_msg
    efficiency = 0.0 if profile.host_driven and progress == "none" else profile.overlap_efficiency
    waiting = link_bound_slot(slot, t_msg, efficiency) - slot  # per steady slot: the message not hidden
    slot += waiting
    bubble = slot * (stages - 1)
    # every collective but the gradient synchronization runs once per micro-batch
    comm = {key: t * (1 if key in sync_keys else microbatches) for key, t in micro.comm_s.items()}
    exposed = {key: t * (1 if key in sync_keys else microbatches) for key, t in micro.exposed_s.items()}
    volumes = p2p_volumes(cfg, grid, stages, microbatches, dtype)
    comm[("inter", "send")] = max(v["send_messages"] for v in volumes.values()) * t_msg
    exposed[("inter", "send")] = critical + waiting * microbatches
    exposed[("inter", "bubble")] = bubble
    # stage 0's wire bytes by axis, as pipeline_collectives counts them (per-micro-batch roles m times)
    wire = {axis: 0 for axis in micro.wire_bytes}
    for c in step_collectives(replace(micro_cfg, layers=1), grid, overlap, dtype):  # every block's: L times
        if c.role != "loss" and c.axis in wire:
            wire[c.axis] += c.wire_bytes * (microbatches if c.role in PER_MICROBATCH_ROLES else 1) * micro_cfg.layers
    wire["inter"] = max(v["send_bytes"] for v in volumes.values())
    placement = dict(micro.placement, inter=level)
    memory = pipeline_memory(cfg, grid, stages, microbatches, 0, dtype, optimizer, overlap, recompute, attention,
                             precision, shard_optimizer, schedule)
    share = schedules.idle_share(schedule, stages, microbatches)
    notes = list(micro.notes) + [f"pipeline {schedule}: {BUBBLE_FORMULA} = {share:.3f}"]
    step = slot * (microbatches + stages - 1) + update + sync + critical
    if not math.isfinite(step):
        raise ValueError(f"non-finite prediction {step}")
    return Prediction(grid=grid, step_s=step, compute_s=(micro.compute_s - update) * microbatches + update,
                      gemm_s=micro.gemm_s * microbatches, comm_s=comm,
                      exposed_s=exposed, wire_bytes=wire, placement=placement, memory=memory, notes=notes)
