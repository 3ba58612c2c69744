"""The terms of a scenario's step equation, one function each, and its memory per rank (pure).

:func:`fourd_mpi.perf.prediction.predict_scenario` sums these terms (the equation is in its module docstring);
each function here states its term's formula and where it comes from. The :class:`Slot` is one micro-batch
through the fullest stage; the terms that change the slot, the gradient synchronization ``S`` or the exposed
seconds per axis (the implementations, the distributed optimizer) update it in place and record their own
diagnostic seconds in ``Slot.extra``.

**Sequence parallelism** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.2.2; Megatron-like grids): each tensor-parallel all-reduce of ``S`` bytes becomes a
reduce-scatter and an all-gather of ``S``: the wire volume is the same (``2 (p-1)/p S``,
:func:`sequence_parallel_volumes`) and so is its ring time; what changes is memory: the block inputs and
LayerNorm/residual activations ``[m, h/G_x]`` are split over Y too.

**Memory** per rank (:func:`stage_memory`), the larger of the first and the last stage: parameter state of the
stage's blocks (and the embedding shard ``V h/T`` on the first and last stage); activations = stored inputs
of the in-flight block passes (:func:`~fourd_mpi.perf.schedules.inflight_block_passes`) ``x b s h/G_x
e`` with full recompute, plus ONE block's recompute working set (it is recomputed and freed block by
block), the step's input and target and the largest transient; without recompute every in-flight
block keeps its full saved set; the last stage adds the logits ``m V/T (e + 4)``; communication
buffers at micro-batch size with at most ``dw_window`` dW blocks in flight; the token-partial
gradient sums of the FC blocks when ``m > 1`` and ``G_z > 1`` (gradients accumulate before the
reduce-scatter); two receive buffers per pipeline neighbour.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional

from fourd_mpi.core.backend import dtype_bytes
from fourd_mpi.perf import megatron_ddp, schedules, terms, vocab, zero3_2021
from fourd_mpi.perf.machine import MachineProfile, inter_placement, message_time
from fourd_mpi.perf.memory import (
    ALLOCATOR_MARGIN,
    GPU_RUNTIME_RESERVE_BYTES,
    activation_elements,
    block_elements,
    block_saved_elements,
    comm_buffer_elements,
    fc_weights,
    parameter_elements,
    state_bytes,
)
from fourd_mpi.perf.predict import collective_time, compute_time, gemm_rate_tflops, predict
from fourd_mpi.perf.scenario import Scenario, stage_text
from fourd_mpi.perf.volumes import Collective
from fourd_mpi.util.units import GIB

#: passes of 4-byte elements over the logits for the cross entropy (cast, max, exp-sum, softmax, and
#: the backward's write): an assumption, stated once
CE_PASSES = 6
#: the gradient synchronization's (axis, collective) keys: run once per step, not once per micro-batch
SYNC_KEYS = (("data", "allreduce"), ("z", "reduce_scatter"), ("z", "allreduce"))


@dataclass
class Slot:
    """One micro-batch (``B/m`` sequences) through the fullest stage's ``L/p`` blocks: the 4D prediction
    ``micro`` and its compute split ``comp``; ``sync`` (``S``, exposed gradient synchronization) and ``update``
    (``U``, the optimizer) run once per step; ``slot`` = ``W - S - U``; ``exposed`` seconds per axis and step
    (the sync keys once, the rest ``m`` times); ``once``: other seconds run once per step (ZeRO-3 2021's
    persistent-parameter gather); ``extra``: the implementations' and the distributed optimizer's seconds per
    step by name (diagnosis; already inside ``slot``, ``sync`` or ``once``)."""

    micro: Any
    comp: Dict[str, float]
    slot: float
    sync: float
    update: float
    exposed: Dict[str, float]
    once: float = 0.0
    extra: Dict[str, float] = field(default_factory=dict)


def opening_notes(sc: Scenario, profile: MachineProfile) -> List[str]:
    """The notes that open a prediction: FP8 GEMMs (:func:`fourd_mpi.perf.terms.check_fp8` refuses a profile
    without an FP8 rate, in one line) and uneven stages (:func:`fourd_mpi.perf.terms.stage_layers`)."""
    notes: List[str] = []
    gemm_dtype = sc.gemm_dtype
    if gemm_dtype:
        terms.check_fp8(profile)
        notes.append(f"float8: the blocks' GEMMs at the profile's FP8 rate {profile.gemm_tflops(gemm_dtype):g} "
                     f"TFLOP/s, everything else in {sc.store_dtype}; % of peak against the FP8 data-sheet peak")
    if len(set(sc.stage_layers)) > 1:
        notes.append(f"uneven stages: {stage_text(sc.stage_layers)} blocks, first to last; each slot takes the "
                     f"fullest stage's {max(sc.stage_layers)} (fourd_mpi/perf/terms.py)")
    return notes


def block_slot(sc: Scenario, profile: MachineProfile, rpn: int) -> Slot:
    """The slot term ``t = W - S - U`` of one micro-batch through the fullest stage's blocks. ``W``: the 4D model's
    step of that micro-batch (:func:`~fourd_mpi.perf.predict.predict`: GEMMs at the profile's GEMM rate,
    element-wise work at its memory bandwidth, each collective by the alpha-beta fit of its placement level, less
    what its overlap option hides; the profile cites a source per constant), its axes placed in the pipeline's
    world (:meth:`~fourd_mpi.perf.scenario.Scenario.world_levels`); ``S = sum of W's exposed seconds over
    :data:`SYNC_KEYS``` (the gradient synchronization, once per step); ``U`` the optimizer update
    (:func:`~fourd_mpi.perf.predict.compute_time`'s ``optimizer``, once per step). ``exposed``: ``S``'s keys
    once, every other axis' exposed seconds ``m`` times."""
    micro_cfg, grid, m = sc.micro_config, sc.grid, sc.microbatches
    overlap = sc.overlap_config
    levels, strides = sc.world_levels(rpn)
    store, gemm_dtype = sc.store_dtype, sc.gemm_dtype  # float8: FP8 GEMMs, BF16 everything else
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
    return Slot(micro, comp, micro.step_s - sync - update, sync, update, exposed)


def framework_gemm(sc: Scenario, t: Slot, notes: List[str]) -> float:
    """The blocks' GEMM seconds of one slot at the framework's efficiency ``f``: ``t_gemm / f``, the difference
    added to the slot (:func:`fourd_mpi.perf.terms.framework_efficiency`; each ``f`` with its published
    measurement, or 1.0 marked not measured, in ``fourd_mpi/perf/published/framework_efficiency.yaml``)."""
    fw = terms.framework_efficiency(sc.implementation)
    gemm = terms.framework_gemm_time(t.comp["gemm"], fw["factor"])
    t.slot += gemm - t.comp["gemm"]
    if sc.implementation != "fourd":
        notes.append(f"framework GEMM efficiency of {sc.implementation}: x {fw['factor']:.2f} "
                     f"on the profile's GEMM rate ({'measured' if fw['measured'] else 'not measured'}: {fw['source']}; "
                     f"fourd_mpi/perf/published/framework_efficiency.yaml)")
    return gemm


def deepspeed_2021(sc: Scenario, profile: MachineProfile, rpn: int, t: Slot) -> None:
    """Implementation ``deepspeed-2021`` (:mod:`fourd_mpi.perf.zero3_2021`, DeepSpeed v0.3.13-v0.5.4's
    ``stage3.py``): all on Z, all blocking. ``t += t_regather + t_copies + max(0, t_grad - t_gemm_bwd)`` (the
    gradient reduce-scatters, hidden by the backward GEMMs at most: every fetch's ``torch.cuda.synchronize()``
    waits for them), ``S -= min(t_LN + X_rs, S)`` (the LayerNorm gradient all-reduces it does not run, and the
    ``fsdp`` step's exposed reduce-scatters ``X_rs``, which ``t_grad`` replaces), once per step ``+
    t_persistent`` (the persistent parameters' gather). Nothing otherwise."""
    if sc.implementation != zero3_2021.NAME:
        return
    grid, m = sc.grid, sc.microbatches
    placement, inner = sc.placement(rpn)
    ds = zero3_2021.terms(sc.micro_config, grid, profile, placement, rpn, inner, sc.store_dtype, sc.recompute,
                          sc.overlap_config)
    ds["ln_grad_allreduce"] = min(ds["ln_grad_allreduce"], t.sync)  # priced as the sync term it replaces
    t.sync -= ds["ln_grad_allreduce"]
    fifo = min(t.micro.exposed_s.get(("z", "reduce_scatter"), 0.0), t.sync)  # the fsdp step's, replaced
    t.sync -= fifo
    grad = max(0.0, ds["grad_reduce"] - t.comp["gemm_bwd"])
    t.slot += ds["regather"] + ds["gather_copies"] + grad
    t.exposed["z"] = t.exposed.get("z", 0.0) + (ds["regather"] + ds["gather_copies"] + grad) * m \
        + ds["persistent_gather"] - ds["ln_grad_allreduce"] - fifo
    t.once = ds["persistent_gather"]
    # per step: third gathers, copy loops, gradient reduce-scatters; LayerNorm all-reduces and the fsdp step's
    # exposed reduce-scatters taken away
    t.extra.update({"zero3_regather": ds["regather"] * m, "zero3_gather_copies": ds["gather_copies"] * m,
                    "zero3_persistent_gather": ds["persistent_gather"],
                    "zero3_ln_allreduce_removed": ds["ln_grad_allreduce"],
                    "zero3_grad_reduce": grad * m, "zero3_fsdp_reduce_scatter_removed": fifo})


def megatron_ddp_sync(sc: Scenario, profile: MachineProfile, rpn: int, t: Slot) -> bool:
    """Implementation ``megatron-lm`` (:mod:`fourd_mpi.perf.megatron_ddp`, Megatron-LM 2020-2021's
    ``--DDP-impl local``): ``S``'s data-axis part becomes one all-reduce of every gradient a rank holds,
    ``S += t_ar(G e) - t_ar,data`` with ``G`` the rank's parameter and embedding elements. True when it applies
    (the coalesced all-reduce then carries the embedding's data-axis gradient too)."""
    grid = sc.grid
    if not (sc.implementation == megatron_ddp.NAME
            and megatron_ddp.applies(sc.overlap_config.dp, sc.shard_optimizer, grid)):
        return False
    grads = parameter_elements(sc.micro_config, grid) + vocab.embedding_elements(sc.model.hidden, sc.vocab,
                                                                                   grid.x * grid.y)
    placement, inner = sc.placement(rpn)
    t_ddp = megatron_ddp.grad_sync_time(grads, dtype_bytes(sc.store_dtype), grid, profile, placement, rpn, inner)
    old = t.micro.exposed_s.get(("data", "allreduce"), 0.0)
    t.sync += t_ddp - old
    t.exposed["data"] = t.exposed.get("data", 0.0) + t_ddp - old
    return True


def pytorch_fsdp_sync(sc: Scenario, t: Slot) -> None:
    """Implementation ``pytorch-fsdp`` (:func:`fourd_mpi.perf.terms.fsdp_microbatch_sync`, Zhao et al. VLDB 2023,
    "PyTorch FSDP", sections 3.3 and 4: gradients reduce-scattered after every micro-batch's backward): the Z
    reduce-scatter per micro-batch, moved from ``S`` into every slot. Nothing otherwise."""
    if sc.implementation != terms.PYTORCH_FSDP:
        return
    fsdp = terms.fsdp_microbatch_sync(t.micro.exposed_s.get(("z", "reduce_scatter"), 0.0), sc.microbatches)
    t.sync -= fsdp["once"]
    t.slot += fsdp["per_slot"]
    t.exposed["z"] = t.exposed.get("z", 0.0) + fsdp["step"] - fsdp["once"]
    t.extra["fsdp_reduce_scatter"] = fsdp["step"]  # per step, part of the slot


def distributed_optimizer(sc: Scenario, profile: MachineProfile, rpn: int, t: Slot, coalesced: bool) -> None:
    """``shard_optimizer="data"`` (:func:`fourd_mpi.perf.terms.distributed_optimizer_times`: ZeRO-1,
    Rajbhandari et al. SC'20 section 7.1, as Megatron-LM's ``--use-distributed-optimizer``): ``S``'s data-axis
    gradient all-reduces ``t_g`` become reduce-scatters, hidden in the same proportion
    (``t_g t_rs / t_ar``), plus blocking all-gathers of the updated parameters: ``S += t_g t_rs/t_ar + t_ag - t_g``.
    Nothing without it, with ``G_data = 1``, Megatron's coalesced all-reduce or ZeRO-3 2021."""
    grid = sc.grid
    if sc.shard_optimizer != "data" or grid.data == 1 or coalesced or sc.implementation == zero3_2021.NAME:
        return
    placement, inner = sc.placement(rpn)
    times = terms.distributed_optimizer_times(sc.micro_config, grid, sc.overlap_config, sc.store_dtype, profile,
                                              placement, rpn, inner)
    old = t.micro.exposed_s.get(("data", "allreduce"), 0.0)
    grads = max(0.0, old - times["loss"])  # the exposed gradient all-reduces (the loss's is blocking)
    dist = {"reduce_scatter": grads * times["reduce_scatter"] / times["allreduce"] if times["allreduce"] else 0.0,
            "allgather": times["allgather"]}
    change = dist["reduce_scatter"] + dist["allgather"] - grads
    t.sync += change
    t.exposed["data"] = t.exposed.get("data", 0.0) + change
    # per step, part of grad_sync
    t.extra.update({"dist_opt_reduce_scatter": dist["reduce_scatter"], "dist_opt_allgather": dist["allgather"]})


def lm_head(sc: Scenario, profile: MachineProfile, rpn: int, exposed: Dict[str, float], notes: List[str]) -> tuple:
    """``(t_head, t_head_comm)`` per micro-batch on the last stage (:mod:`fourd_mpi.perf.vocab`; the head's
    ``6 B s h V`` FLOPs are Megatron's vocabulary term, Narayanan et al. SC'21 section 5.1, and its vocabulary split
    over the tensor ranks ``T = G_x G_y`` Megatron-LM's vocab-parallel cross entropy):
    ``t_head = 6 m h V/T / R_gemm + CE_PASSES m V/T 4 / BW_mem`` (:data:`CE_PASSES` passes of fp32 logits),
    ``m`` this micro-batch's local tokens, ``R_gemm`` the storage dtype's GEMM rate (the head is not an FP8
    layer); ``t_head_comm`` the sum of its collectives (:func:`~fourd_mpi.perf.vocab.microbatch_collectives`),
    blocking (added to ``exposed``, ``m`` times). ``(0, 0)`` with ``V = 0``."""
    if not sc.vocab:
        return 0.0, 0.0
    grid, m = sc.grid, sc.microbatches
    tokens, tp = sc.microbatch_size * sc.model.seq, grid.x * grid.y
    placement, inner = sc.placement(rpn)
    rate = gemm_rate_tflops(profile, sc.store_dtype, notes) * 1e12  # the head is not an FP8 layer
    t_head = vocab.head_flops_per_rank(tokens, sc.model.hidden, sc.vocab, tp) / rate
    t_head += CE_PASSES * tokens * (sc.vocab // tp) * 4 / profile.mem_bandwidth
    t_comm = 0.0
    for axis, op, size, nbytes in vocab.microbatch_collectives(tokens, sc.model.hidden, grid.x, grid.y,
                                                               dtype_bytes(sc.store_dtype)):
        t = collective_time(_coll(axis, op, size, nbytes, "forward", "vocab"), profile, placement, rpn, inner)
        t_comm += t
        exposed[axis] = exposed.get(axis, 0.0) + t * m
    return t_head, t_comm


def pipeline_messages(sc: Scenario, profile: MachineProfile, rpn: int) -> tuple:
    """``(t_p2p, t_critical, t_msg)``: the blocking schedules' ``t_p2p = 2 v t_msg`` per slot
    (:func:`~fourd_mpi.perf.schedules.p2p_messages_per_microbatch`; Megatron-LM waits on every
    ``batch_isend_irecv``), or AxoNN's fill and drain chain ``t_critical = 2 (p - 1) t_msg`` (its steady-state
    messages overlap compute: :func:`message_wait`; AxoNN inter-layer, arXiv 2110.13005). A message of
    ``b s h/G_x e`` bytes at the inter axis' placement (:func:`~fourd_mpi.perf.machine.inter_placement`; without
    a network model, every rank of a node's stage sending at once: :func:`~fourd_mpi.perf.machine.message_time`);
    Megatron's scatter/gather (1f1b/interleaved, ``G_y > 1``; Narayanan et al. SC'21 section 4.1) sends ``1/G_y``
    of it and all-gathers over Y. ``(0, 0, 0)`` for one stage."""
    p, grid = sc.stages, sc.grid
    if p == 1:
        return 0.0, 0.0, 0.0
    level = inter_placement(grid, p, rpn)
    msg = sc.microbatch_size * sc.model.seq * (sc.model.hidden // grid.x) * dtype_bytes(sc.store_dtype)
    scatter = sc.schedule in ("1f1b", "interleaved") and grid.y > 1
    wire = msg // grid.y if scatter else msg
    if profile.has_network:
        t_msg = profile.network_time("allgather", 2, 2 * wire, grid.x * grid.y * grid.z, level, rpn)
    else:
        t_msg = message_time(profile, level, wire, min(rpn, grid.size))
    if scatter:
        placement, inner = sc.placement(rpn)
        t_msg += collective_time(_coll("y", "allgather", grid.y, msg, "forward", "p2p_gather"), profile, placement,
                                 rpn, inner)
    if sc.schedule == "axonn":
        return 0.0, 2 * (p - 1) * t_msg, t_msg
    return schedules.p2p_messages_per_microbatch(sc.schedule, p, sc.interleaving) * t_msg, 0.0, t_msg


def message_wait(sc: Scenario, profile: MachineProfile, slot: float, t_msg: float) -> float:
    """AxoNN's steady state (asynchronous, message-driven: AxoNN inter-layer, arXiv 2110.13005): each slot's
    message each way overlaps the slot's compute only as far as the profile's overlap efficiency ``e`` allows (0
    on a host-driven CPU without progress), so a slot waits
    ``max(W, t) + (1 - e) min(W, t) - W`` (:func:`~fourd_mpi.perf.schedules.link_bound_slot`: never shorter than
    its message). 0 for the blocking schedules (their messages are ``t_p2p``) and one stage."""
    if sc.schedule != "axonn" or sc.stages == 1:
        return 0.0
    efficiency = 0.0 if profile.host_driven and sc.progress == "none" else profile.overlap_efficiency
    return schedules.link_bound_slot(slot, t_msg, efficiency) - slot


def embedding_sync(sc: Scenario, profile: MachineProfile, rpn: int, coalesced: bool,
                   exposed: Dict[str, float]) -> float:
    """``t_emb = t_ar,z(E) + t_ar,data(E) [+ t_ar,inter(E) with p > 1]``, ``E = V h/T e`` bytes of the embedding's
    gradient shard (:func:`~fourd_mpi.perf.vocab.embedding_elements`): the per-step all-reduces over Z and data
    (not data when ``coalesced`` into Megatron's one all-reduce; gathered and reduce-scattered under ZeRO-3 2021,
    :func:`~fourd_mpi.perf.zero3_2021.embedding_time`) and, with ``p > 1``, the one between the first and last
    stage that keeps the tied input and output embeddings equal (Megatron-LM's ``_allreduce_embedding_grads``;
    Narayanan et al. SC'21 section 2); blocking, added to ``exposed``."""
    if not sc.vocab:
        return 0.0
    grid, p = sc.grid, sc.stages
    placement, inner = sc.placement(rpn)
    emb_bytes = vocab.embedding_elements(sc.model.hidden, sc.vocab, grid.x * grid.y) * dtype_bytes(sc.store_dtype)
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


def context_parallel_slot(sc: Scenario, view: Scenario, profile: MachineProfile, attention: float) -> tuple:
    """``(t_cp_attention, t_cp_ring)`` added to every slot with context parallelism ``cp > 1``
    (:mod:`fourd_mpi.perf.terms`, "Context parallelism": Megatron-LM's context parallelism with the ring of Liu et
    al. 2023, "Ring Attention", section 3): the attention of the rest of the sequence, ``(cp - 1) t_att`` with
    ``t_att`` one slot's attention over the rank's own chunk, and the exposed part of the K/V ring,
    ``max(0, L_s n_ring t_msg - cp t_att)`` (:func:`~fourd_mpi.perf.terms.context_parallel_exposed`), ``L_s`` the
    fullest stage's blocks, ``n_ring`` the ring's messages per block
    (:func:`~fourd_mpi.perf.terms.context_parallel_ring_messages`), ``t_msg`` one K/V chunk's message at the
    context ranks' placement (tensor ranks innermost, then context ranks, as Megatron-LM orders them). ``view``:
    ``sc``'s context view, resolved (``b`` and ``m`` set)."""
    cp, cfg, grid = sc.context_parallel, sc.model, sc.grid
    e = dtype_bytes(terms.storage_dtype(sc.dtype))
    msg = terms.context_parallel_kv_bytes(view.microbatch_size * view.model.seq, cfg.hidden, cfg.heads,
                                          cfg.kv_head_count, grid.y, e)
    rpn = sc.node_ranks(profile)
    stride = grid.x * grid.y * grid.z  # Megatron-LM's order: tensor ranks innermost, then context ranks
    level = "intra" if stride * cp <= rpn else "inter"
    if sc.context_parallel_comm == "allgather":  # Llama 3: the collectives before attention, exposed in full
        gathers, scatters = terms.context_parallel_allgather_messages(sc.recompute)
        exposed = gathers * _cp_collective(profile, "allgather", cp, cp * msg, stride, level, rpn) + \
            scatters * _cp_collective(profile, "reduce_scatter", cp, cp * msg, stride, level, rpn)
        return (cp - 1) * attention, max(sc.stage_layers) * exposed
    t_msg = _cp_collective(profile, "allgather", 2, 2 * msg, stride, level, rpn)  # one ring step: a pair's swap
    ring = max(sc.stage_layers) * terms.context_parallel_ring_messages(cp, sc.recompute) * t_msg
    return (cp - 1) * attention, terms.context_parallel_exposed(ring, cp * attention)


def _cp_collective(profile: MachineProfile, op: str, cp: int, size: int, stride: int, level: str, rpn: int) -> float:
    """Seconds of one ``op`` over the ``cp`` context ranks of nccl-tests size ``size`` (the gathered K and V),
    at the profile's network table, else its alpha-beta fit: ``(cp - 1)`` chunks of ``size/cp`` each way."""
    if profile.has_network:
        return profile.network_time(op, cp, size, stride, level, rpn)
    return (cp - 1) * message_time(profile, level, size // cp)


def pipeline_bubble(sc: Scenario, slot: float) -> float:
    """``t_bubble = t_slot (p - 1)/v``: the fill and drain of the pipeline in slots
    (:func:`~fourd_mpi.perf.schedules.bubble_slots`; Narayanan et al. SC'21, arXiv 2104.04473, section 2.2: 1F1B's
    bubble ``(p - 1)/m`` of the ideal time, the interleaved schedule's ``(p - 1)/(v m)``; AxoNN's message-driven
    schedule the same as 1F1B with equal stages). 0 for one stage."""
    return slot * schedules.bubble_slots(sc.schedule, sc.stages, sc.interleaving)


def larger_stage_memory(sc: Scenario, profile: MachineProfile) -> tuple:
    """``(bytes by part, "first" | "last" | "only")``: the larger of the first and last stage."""
    first = stage_memory(sc, 0, profile)
    last = stage_memory(sc, sc.stages - 1, profile) if sc.stages > 1 else first
    memory, which = (first, "first") if first["required"] >= last["required"] else (last, "last")
    return memory, "only" if sc.stages == 1 else which


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
    b, m = sc.microbatch_size, sc.microbatches
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
    passes = schedules.inflight_block_passes(sc.schedule, p, m, layers * p, sc.interleaving, stage)
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
    overlap = sc.overlap_config
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



def scenario_memory(sc: Scenario, profile: MachineProfile) -> Dict[str, int]:
    """Bytes per rank by part of the larger of the first and last stage (no time prediction: cheap, so a
    search can drop what does not fit before predicting it)."""
    if sc.context_parallel > 1:
        return scenario_memory(sc.context_view(), profile)
    return larger_stage_memory(sc.resolved(), profile)[0]


def fits_memory(sc: Scenario, profile: MachineProfile) -> bool:
    """``required <= memory_limit_gib`` (True without a limit)."""
    return sc.memory_limit_gib is None or scenario_memory(sc, profile)["required"] <= sc.memory_limit_gib * GIB
