"""``fourd-mpi model predict``: the step equation of one :class:`~fourd_mpi.perf.scenario.Scenario` (pure).

:func:`predict_scenario` sums the terms of :mod:`fourd_mpi.perf.step_terms` (one function per term, each with
its formula and source) into a :class:`ScenarioResult`; sequence parallelism and the memory per rank are
described there.

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

**FLOP conventions** (printed with % of the data-sheet peak):
Megatron's ``96 B s l h^2 (1 + s/6h + V/16lh)`` with full recompute (``72 ... V/12lh`` without:
``selective`` counts as without), hardware FLOPs (what the step executes: the model's counted GEMM
and attention FLOPs with recompute, plus the head ``6 B s h V``) and model FLOPs (the 72 convention
whatever the recompute, as PaLM's MFU).

**Implementation** ``deepspeed-2021`` (``fsdp`` on ``1 x N x 1 x 1`` only): DeepSpeed's ZeRO-3 of 2021 instead of
this suite's step (:mod:`fourd_mpi.perf.zero3_2021`): each slot adds its third gathers, the per-rank loops of
its gathers and its per-parameter gradient reduce-scatters (hidden by the backward GEMMs at most), the step its
persistent-parameter gather, and ``S`` loses the LayerNorm gradient all-reduces and the reduce-scatters; the
embedding is partitioned over Z like every parameter (memory ``ceil(V h / G_z)``, two gathers per micro-batch and
a reduce-scatter per step). Implementation ``megatron-lm`` (``megatron1d`` or ``dp``): Megatron-LM 2020-2021's
DDP=local, where ``S``'s data-axis part is one all-reduce of every gradient a rank holds
(:mod:`fourd_mpi.perf.megatron_ddp`) instead of one per weight; with ``dp`` overlap or a sharded optimizer
nothing changes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional

from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf import schedules, step_terms, terms, vocab, zero3_2021
from fourd_mpi.perf.machine import MachineProfile, world_levels, world_strides
from fourd_mpi.perf.memory import ALLOCATOR_MARGIN
from fourd_mpi.perf.scenario import Scenario, check
from fourd_mpi.perf.step_terms import SYNC_KEYS
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import ModelConfig
from fourd_mpi.util.units import GIB

#: what the % of the data-sheet peak of each FLOP convention is called: model FLOPs give MFU, executed
#: (hardware) FLOPs HFU; Megatron's convention counts recompute only with full recompute (its "% of peak")
UTILIZATION_NAME = {"model": "MFU", "hardware": "HFU", "megatron": "Megatron-convention"}
MEGATRON_FORMULA = {"full": "96 B s l h^2 (1 + s/6h + V/16lh)", "none": "72 B s l h^2 (1 + s/6h + V/12lh)"}


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
    #: one micro-batch through one stage (:class:`~fourd_mpi.perf.step_terms.Slot`: its 4D prediction, ``S``,
    #: ``U``), for the wrappers
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
                zero3_2021.NAME: "; deepspeed-2021: t += third gathers + gather loops + max(0, gradient "
                                 "reduce-scatters - backward GEMMs), + persistent gather, S without LayerNorm "
                                 "all-reduces and reduce-scatters (fourd_mpi/perf/zero3_2021.py)",
                terms.PYTORCH_FSDP: "; pytorch-fsdp: the Z reduce-scatters in t (each micro-batch), not in S "
                                    "(fourd_mpi/perf/terms.py)"}.get(sc.implementation, ""),
            "bubble": schedules.BUBBLE_FORMULA[sc.schedule] if sc.stages > 1 else "no pipeline: no bubble"}


def _flop_notes(cfg: ModelConfig) -> List[str]:
    """Where Megatron's FLOP formula does not fit the model (:func:`step_flops`)."""
    notes = []
    if cfg.ffn_hidden != 4 * cfg.hidden:
        notes.append(f"ffn {cfg.ffn_hidden} is not 4h: Megatron's formula assumes it (the hardware count does not)")
    if _gqa_or_swiglu(cfg):
        notes.append("grouped-query attention / SwiGLU: Megatron's formula assumes 3h QKV and two h x f MLP GEMMs; "
                     "model and hardware FLOPs count the actual weights")
    return notes



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
    :meth:`~fourd_mpi.perf.scenario.Scenario.context_view`): every slot adds the rest of the sequence's attention,
    ``(cp - 1)`` times the view's (:func:`_predict_context_parallel`; its K/V ring's exposed part is at least 0).
    Memoized terms
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
    (:meth:`~fourd_mpi.perf.scenario.Scenario.context_view`) plus the attention of the rest of the sequence (the
    K/V ring only adds time)."""
    cp = sc.context_parallel
    rpn = sc.node_ranks(profile)
    if cp > 1:
        sc = sc.context_view()
    slots = schedules.bubble_slots(sc.schedule, sc.stages, sc.interleaving) if sc.stages > 1 else 0.0
    return slot_lower_bound(sc.micro_config, sc.grid, profile, sc.overlap_config, sc.store_dtype, rpn, sc.optimizer,
                            sc.recompute, sc.attention, sc.precision, sc.stages, sc.microbatches, slots,
                            communication, sync, sc.gemm_dtype, cp)



def predict_scenario(sc: Scenario, profile: MachineProfile) -> ScenarioResult:
    """Predict one step of ``sc`` on ``profile`` (module docstring), one :mod:`~fourd_mpi.perf.step_terms` helper
    per term: ``step = (t + t_head + t_p2p)(m + (p-1)/v) + U + S + t_emb + t_critical (+ t_once)``."""
    if sc.context_parallel > 1:                         # the view's step plus attention and the K/V ring
        return _predict_context_parallel(sc, profile)
    sc = sc.resolved()
    m, rpn = sc.microbatches, sc.node_ranks(profile)
    notes = step_terms.opening_notes(sc, profile)       # FP8 (refused without an FP8 rate), uneven stages
    t = step_terms.block_slot(sc, profile, rpn)         # t = W - S - U, S, U and the 4D exposure of one micro-batch
    gemm = step_terms.framework_gemm(sc, t, notes)      # the blocks' GEMMs at the framework's efficiency
    step_terms.deepspeed_2021(sc, profile, rpn, t)      # implementation deepspeed-2021: t, S and t_once
    coalesced = step_terms.megatron_ddp_sync(sc, profile, rpn, t)  # implementation megatron-lm: S
    step_terms.pytorch_fsdp_sync(sc, t)                 # implementation pytorch-fsdp: S into t
    step_terms.distributed_optimizer(sc, profile, rpn, t, coalesced)  # shard_optimizer data: S
    t_head, t_head_comm = step_terms.lm_head(sc, profile, rpn, t.exposed, notes)
    t_p2p, critical, t_msg = step_terms.pipeline_messages(sc, profile, rpn)
    wait = step_terms.message_wait(sc, profile, t.slot + t_head + t_head_comm, t_msg)
    full_slot = t.slot + t_head + t_head_comm + t_p2p + wait
    bubble = step_terms.pipeline_bubble(sc, full_slot)  # (p - 1)/v slots
    t_emb = step_terms.embedding_sync(sc, profile, rpn, coalesced, t.exposed)
    if sc.stages > 1:
        t.exposed["pipeline"] = t.exposed.get("pipeline", 0.0) + (t_p2p + wait) * m + critical
    step = full_slot * m + bubble + t.update + t.sync + t_emb + critical + t.once
    compute = (t.micro.compute_s - t.update + gemm - t.comp["gemm"]) * m + t.update + t_head * m
    if not math.isfinite(step) or step <= 0:
        raise ConfigError(f"the model gave a non-finite step time for {sc.grid}: {step}")
    memory, which = step_terms.larger_stage_memory(sc, profile)
    for n in _flop_notes(sc.model) + t.micro.notes + profile.notes:
        if n not in notes:
            notes.append(n)
    comp = t.comp
    step_terms_s = {"slot_blocks": t.slot, "slot_head": t_head, "slot_head_comm": t_head_comm,
                    "slot_p2p": t_p2p + wait, "optimizer": t.update, "grad_sync": t.sync, "embedding_sync": t_emb,
                    "pipeline_critical": critical,
                    # the compute per step by kind (diagnosis: which term makes an error): the blocks' GEMMs,
                    # attention, memory-bound work and kernel launches over m micro-batches; the head; the update
                    "step_gemm": gemm * m, "step_attention": comp["attention"] * m,
                    "step_elementwise": (comp["elementwise"] + comp["calls"] - comp["optimizer"]) * m,
                    "step_head": t_head * m, **t.extra}
    return ScenarioResult(sc, step, compute, t.exposed, bubble, memory, which,
                          step_flops(sc.model, sc.vocab, sc.recompute), profile.peak_tflops(sc.dtype), step_terms_s,
                          notes, t)


def _predict_context_parallel(sc: Scenario, profile: MachineProfile) -> ScenarioResult:
    """:func:`predict_scenario` with ``cp > 1``: the view's prediction (:meth:`~fourd_mpi.perf.scenario.Scenario.
    context_view`) plus, in every slot, :func:`~fourd_mpi.perf.step_terms.context_parallel_slot` (the rest of the
    sequence's attention and the exposed part of sharing K and V: the ring's, or Llama 3's all-gathers in full);
    FLOPs of the original model."""
    check(sc)
    cp = sc.context_parallel
    r = predict_scenario(sc.context_view(), profile)
    view = r.scenario
    b, m, p = view.microbatch_size, view.microbatches, sc.stages
    attention = r.terms["step_attention"] / m  # one slot's attention over the rank's own chunk
    extra_attention, exposed_kv = step_terms.context_parallel_slot(sc, view, profile, attention)
    slots = schedules.bubble_slots(sc.schedule, p, sc.chunks) if p > 1 else 0.0
    per_slot = extra_attention + exposed_kv
    exposed = dict(r.exposed_s)
    exposed["context"] = exposed_kv * m
    step_terms_s = dict(r.terms, cp_attention=extra_attention * m, cp_comm_exposed=exposed_kv * m,
                        step_attention=r.terms["step_attention"] * cp)
    how = "the K/V ring's exposed part" if sc.context_parallel_comm == "ring" else \
        "the K/V all-gathers and dK/dV reduce-scatters, exposed (Llama 3's all-gather context parallelism)"
    notes = [f"context parallel {cp}: {view.model.seq} tokens of each sequence per rank; every slot adds the rest of "
             f"the sequence's attention and {how} (fourd_mpi/perf/terms.py)"] + r.notes
    resolved = replace(sc, microbatch_size=b, microbatches=m)
    return ScenarioResult(resolved, r.step_s + per_slot * (m + slots), r.compute_s + extra_attention * m, exposed,
                          r.bubble_s + per_slot * slots, r.memory, r.memory_stage,
                          step_flops(sc.model, sc.vocab, sc.recompute), r.peak_tflops, step_terms_s, notes)


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
