"""Model terms of the systems the suite's predictions are compared against, one function per term (pure).

Each term has its source and a known-answer test (``tests/perf/test_<term>.py``); :mod:`fourd_mpi.perf.step_terms`
calls them at small call sites.

**Uneven pipeline stages.** ``L`` blocks on ``p`` stages where ``p`` does not divide ``L`` (Llama 3 405B's 126
layers on 16 stages). Two distributions:

- the default: contiguous and balanced to one block, the first ``L mod p`` stages hold ``ceil(L/p)``, the
  others ``floor(L/p)`` (this suite's own pipeline, :func:`~fourd_mpi.algorithms.pipeline_plan.stage_blocks`;
  DeepSpeed's ``PipelineModule(partition_method="uniform")``, ``deepspeed/runtime/utils.py``
  ``partition_uniform``, gives the first ``L mod p`` parts one more item the same way);
- Megatron-LM's ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``
  (``megatron/core/transformer/transformer_block.py``, ``get_num_layers_to_build``): the first and/or the last
  stage hold the given counts and the remaining stages split the rest evenly (Megatron-LM refuses a rest that
  does not divide, and uneven stages with the interleaved schedule). Without these flags Megatron-LM requires
  ``p | L``; Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2) takes one layer from
  each of the first and the last stage: 126 on 16 = 7, 14 x 8, 7.

The step's time is set by the fullest stage (every slot of the schedule waits for it); memory is counted for the
first and the last stage with their own block counts.

**FP8 GEMMs** (``--dtype float8``, alias ``fp8``), as NVIDIA Transformer Engine runs them inside Megatron-LM
(``--fp8-format hybrid``): the 4D layers' GEMMs (QKV, projection, the two MLP GEMMs) take FP8 inputs and run at the
data sheet's dense FP8 rate (H100 SXM and H200 1,979 TFLOP/s, :mod:`fourd_mpi.perf.peaks`; A100 has no FP8 tensor
cores: refused), priced at the profile's sustained ``compute.gemm_tflops.float8``. Everything else is BF16, the
dtype the FP8 run is stored in (:data:`FP8_STORAGE`): parameters and gradients (TE's ``fp8_autocast`` keeps the
weights in their higher precision and casts them to FP8 on the fly, TE documentation "Using FP8 with Transformer
Engine"; Megatron-LM's mixed-precision optimizer keeps the fp32 master copy and Adam moments as with BF16),
activations (stored in BF16: an upper bound, TE saves some GEMM inputs in FP8), the attention core, the LM head
(Megatron-LM's ``output_layer`` is a ``tensor_parallel.ColumnParallelLinear``, not a TE layer) and every collective.
Memory adds TE's FP8 weight cache (:func:`fp8_weight_cache_bytes`): ``transformer_engine.pytorch.Linear``'s
``is_first_microbatch`` caches the FP8 copy of each weight across the micro-batches of a step, and Hopper's FP8
GEMMs take only the TN layout (cuBLAS, ``cublasLtMatmul`` FP8 requirements), so the weight's FP8 transpose is kept
too: 2 bytes per local GEMM weight element.

**The distributed optimizer's communication** (``shard_optimizer="data"``: Megatron-LM's
``--use-distributed-optimizer``, ZeRO stage 1, Rajbhandari et al. SC'20, section 7.1; Megatron-LM
``docs/source/api-guide/dist_optimizer.md``, "Data flow"): each rank updates ``1/G_data`` of the parameters, so
the data axis' gradient all-reduce becomes a reduce-scatter of the gradients (before the optimizer) and an
all-gather of the updated parameters (after it):
with rings the same wire volume, ``(p-1)/p S + (p-1)/p S = 2 (p-1)/p S`` (:func:`distributed_optimizer_volumes`),
in two collectives. The reduce-scatters take the all-reduces' place, hidden behind the backward pass in the same
proportion; the all-gathers run after the update, blocking (Megatron-LM's default: ``--overlap-param-gather`` off),
and are added to the step's gradient synchronization ``S``.

**FSDP as PyTorch runs it** (``implementation="pytorch-fsdp"``, algorithm ``fsdp``): Zhao et al., "PyTorch FSDP:
Experiences on Scaling Fully Sharded Data Parallel", PVLDB 16(12) 2023; PyTorch's API reference of
``FullyShardedDataParallel.no_sync``. Without ``no_sync`` each micro-batch's backward reduce-scatters every
gradient and adds the shard to the gradient shard already held: the partial sums are sharded (memory ``1/G_z``
of the gradients, the ``gradients`` part the state already counts, no full-size sums), and the reduce-scatters run
``m`` times per step, each hidden behind its micro-batch's backward as the step's are (:func:`fsdp_microbatch_sync`).
``no_sync`` (this suite's step: token-partial sums of full size, one reduce-scatter per step) is the other
implementation, ``fourd``. The forward and backward prefetch of the next unit's all-gather is the OAG overlap with
``prefetch_depth`` 1 (FSDP's ``BackwardPrefetch.BACKWARD_PRE``, ``forward_prefetch``).

**Context parallelism** (``context_parallel = cp``; Megatron-LM's ``--context-parallel-size``, Megatron Core's
user guide "Context parallel"; the ring of Liu et al. 2023, "Ring Attention with Blockwise Transformers",
arXiv 2310.01889, section 3): each sequence is split over ``cp`` ranks (``s/cp`` tokens each, in ``2 cp``
chunks for a balanced causal mask). Every term but attention sees ``cp`` times more data-parallel ranks holding
``cp`` times more, ``cp`` times shorter sequences (:func:`context_parallel_view`: the same tokens per rank, the
gradients reduced over data x context ranks, as Megatron-LM does). Attention differs: the rank's queries attend to
the whole sequence, ``cp`` times the work of its own chunk, and the K and V chunks travel around the ring, one
point-to-point message per step (:func:`context_parallel_kv_bytes`, :func:`context_parallel_ring_messages`),
hidden behind that attention while it lasts longer (:func:`context_parallel_exposed`). Llama 3 shares K and V
the other way (``context_parallel_comm = "allgather"``; The Llama 3 Herd of Models, arXiv 2407.21783, section
3.3.2): every block all-gathers the sequence's K and V before attention, "the all-gather communication latency is
exposed in the critical path", and the backward reduce-scatters their gradients
(:func:`context_parallel_allgather_messages`), each collective priced at the context ranks' placement and added
to the slot in full.
"""

from __future__ import annotations

import functools
import os
from typing import Dict, Optional, Tuple

from fourd_mpi.errors import ConfigError
from fourd_mpi.perf import peaks

#: the FP8 GEMM dtype of the model (not of ``run``: NumPy and this suite's step have no FP8 arithmetic)
FP8 = peaks.FP8
#: what an FP8 run stores parameters, gradients, activations and messages in
FP8_STORAGE = "bfloat16"
#: other names the model's ``--dtype`` takes
DTYPE_ALIASES = {"fp8": FP8}


def stage_layers(layers: int, stages: int, first: Optional[int] = None,
                 last: Optional[int] = None) -> Tuple[int, ...]:
    """Blocks per stage, first to last (module docstring). Known answers: 70 on 12 = 10 x 6, 2 x 5; 126 on 16 =
    14 x 8, 2 x 7; 126 on 16 with first 7, last 7 = 7, 14 x 8, 7. One-line :class:`ConfigError` for counts that
    do not add up."""
    if stages < 1 or stages > layers:
        raise ConfigError(f"--ginter (pipeline stages) must be between 1 and the {layers} layers, got {stages}")
    if first is None and last is None:
        from fourd_mpi.algorithms.pipeline_plan import stage_blocks

        return tuple(len(stage_blocks(layers, stages, s)) for s in range(stages))
    if stages < 2:
        raise ConfigError("--first-stage-layers and --last-stage-layers need --ginter 2 or more (pipeline stages)")
    for name, value in (("first", first), ("last", last)):
        if value is not None and not 1 <= value < layers:
            raise ConfigError(f"--{name}-stage-layers must be between 1 and {layers - 1}, got {value}")
    rest = layers - (first or 0) - (last or 0)
    middle = stages - (first is not None) - (last is not None)
    if middle == 0:
        if rest:
            raise ConfigError(f"2 stages: --first-stage-layers {first} + --last-stage-layers {last} != {layers} layers")
        return (first, last)
    if rest < middle or rest % middle:
        raise ConfigError(f"{layers} layers less --first/--last-stage-layers ({first}, {last}) leave {rest} for "
                          f"{middle} stage(s): not an equal whole number each (Megatron-LM requires it)")
    each = rest // middle
    return ((first,) if first is not None else (each,)) + (each,) * (stages - 2) + \
        ((last,) if last is not None else (each,))


def model_dtype(name: str) -> str:
    """The model's dtype for ``name`` (:data:`DTYPE_ALIASES`: ``fp8`` is ``float8``)."""
    return DTYPE_ALIASES.get(name, name)


def storage_dtype(dtype: str) -> str:
    """The dtype a run of ``dtype`` stores and sends: :data:`FP8_STORAGE` for ``float8``, else ``dtype``."""
    return FP8_STORAGE if dtype == FP8 else dtype


def check_fp8(profile) -> None:
    """Refuse FP8 on a profile whose device has no FP8 data-sheet rate, in one line (A100, MI250X, CPUs)."""
    if profile.peak_tflops(FP8) is None:
        dev = profile.device
        what = f"the {dev.title} data sheet gives no FP8 rate" if dev is not None else "it has no FP8 peak"
        raise ConfigError(f"--dtype float8 on machine profile {profile.name}: {what} (FP8 tensor cores start with "
                          f"NVIDIA Hopper: dgx-h100, alps-gh200)")


def fp8_weight_cache_bytes(gemm_weight_elements: int) -> int:
    """Bytes of Transformer Engine's FP8 weight cache for ``gemm_weight_elements`` local GEMM weight elements: the
    FP8 weight and its FP8 transpose, 1 byte each (module docstring). Known answer: a 4096 x 4096 weight, 32 MiB."""
    return 2 * gemm_weight_elements


def distributed_optimizer_volumes(grad_bytes: int, p: int) -> Dict[str, int]:
    """Wire bytes per rank of synchronizing ``grad_bytes`` of gradients over ``p`` data-parallel ranks: the plain
    ``allreduce`` ``2 (p-1)/p S``; the distributed optimizer's ``reduce_scatter`` and ``allgather`` ``(p-1)/p S``
    each, and their ``sum``, equal to the all-reduce's (module docstring)."""
    one = (p - 1) * grad_bytes // p
    return {"allreduce": 2 * one, "reduce_scatter": one, "allgather": one, "sum": 2 * one}


#: roles of the data axis' gradient all-reduces the distributed optimizer replaces
GRADIENT_ROLES = ("grad_allreduce", "ln_grad_allreduce")


def distributed_optimizer_times(micro_cfg, grid, overlap, dtype: str, profile, placement, ranks_on_node: int,
                                inner) -> Dict[str, float]:
    """Seconds per step over the data axis of one stage's gradients (``micro_cfg``: its blocks) synchronized three
    ways, each gradient as this suite's step issues it (one collective per weight and LayerNorm,
    :func:`~fourd_mpi.perf.volumes.collective_rows`): ``allreduce`` (the plain step), ``reduce_scatter`` and
    ``allgather`` of the same messages (the distributed optimizer, module docstring); ``loss``: the loss all-reduce
    over the data axis (once per micro-batch, the same either way)."""
    from dataclasses import replace

    from fourd_mpi.perf.predict import back_to_back, collective_time
    from fourd_mpi.perf.volumes import Collective, collective_rows

    out = {"allreduce": 0.0, "reduce_scatter": 0.0, "allgather": 0.0, "loss": 0.0}
    for row in collective_rows(replace(micro_cfg, layers=1), grid, overlap, dtype):
        layer, role, op, axis, p, phase, count, nbytes = row
        if axis == "data" and role == "loss":
            out["loss"] += collective_time(Collective(*row), profile, placement, ranks_on_node, inner)
        if axis != "data" or role not in GRADIENT_ROLES:
            continue
        for kind in ("allreduce", "reduce_scatter", "allgather"):
            c = Collective(layer, role, kind, axis, p, phase, count, nbytes)
            out[kind] += micro_cfg.layers * collective_time(c, profile, placement, ranks_on_node, inner,
                                                            back_to_back(role, axis, overlap))
    return out


#: ``Scenario.implementation`` of PyTorch FSDP's gradient accumulation (module docstring)
PYTORCH_FSDP = "pytorch-fsdp"


def fsdp_microbatch_sync(exposed_reduce_scatter: float, microbatches: int) -> Dict[str, float]:
    """Seconds per step of PyTorch FSDP's reduce-scatters when the step accumulates ``microbatches`` micro-batches,
    from the exposed seconds of one micro-batch's (the Z reduce-scatters of the slot's prediction): ``per_slot``
    joins every slot (``m`` per step, the bubble's too), ``step`` is their total ``m x t``, ``once`` what a
    ``no_sync`` step (one reduce-scatter per step) pays. Known answer: 3 ms exposed, 8 micro-batches: 24 ms."""
    return {"per_slot": exposed_reduce_scatter, "step": microbatches * exposed_reduce_scatter,
            "once": exposed_reduce_scatter}


# --- context parallelism ----------------------------------------------------------------------------------------

#: Megatron-LM splits each sequence into ``2 cp`` chunks and gives rank ``r`` chunks ``r`` and ``2 cp - 1 - r`` (the
#: causal mask's work balanced): the sequence must divide by ``2 cp``
CP_CHUNKS_PER_RANK = 2


def context_parallel_view(seq: int, batch: int, data: int, cp: int) -> Dict[str, int]:
    """What every term but attention sees under ``cp``-way context parallelism (module docstring, "Context
    parallelism"): ``s/cp`` tokens of each sequence per rank, and the ``cp`` ranks sharing a sequence as ``cp`` times
    more data-parallel ranks with ``cp`` times more (shorter) sequences, ``B s`` tokens in all: ``seq = s/cp``,
    ``batch = B cp``, ``data = G_data cp`` (Megatron-LM reduces the gradients over data x context parallel ranks).
    Known answer: s 8192, B 64, G_data 4, cp 2 -> 4096, 128, 8."""
    if cp < 1 or seq % (CP_CHUNKS_PER_RANK * cp):
        raise ConfigError(f"--context-parallel {cp}: the sequence length {seq} must be a multiple of 2 x {cp} "
                          f"(Megatron-LM's load-balanced split into 2 cp chunks)")
    return {"seq": seq // cp, "batch": batch * cp, "data": data * cp}


def context_parallel_kv_bytes(tokens: int, hidden: int, heads: int, kv_heads: int, gy: int, e: int) -> int:
    """Bytes of one ring step's message: the local K and V, ``2 x tokens x kv d / G_y x e`` (``d = h/heads``,
    ``tokens`` = the rank's ``b s/cp``). Known answer: 4096 tokens, h 8192, 64 heads, 8 K/V heads, G_y 8, bf16:
    2 x 4096 x 1024/8 x 2 = 2 MiB."""
    return 2 * tokens * (kv_heads * (hidden // heads) // gy) * e


def context_parallel_ring_messages(cp: int, recompute: str) -> int:
    """Ring steps per block and micro-batch: forward ``cp - 1`` (K, V), backward ``2 (cp - 1)`` (K, V again and the
    dK, dV partial sums), and ``cp - 1`` more with full recompute (the forward runs again)."""
    return (cp - 1) * (3 + (1 if recompute == "full" else 0))


#: how context-parallel ranks share K and V: ``ring`` (Megatron-LM, Liu et al. 2023: point-to-point steps hidden
#: behind attention) or ``allgather`` (Llama 3: collectives before attention, exposed)
CP_COMMS = ("ring", "allgather")


def context_parallel_allgather_messages(recompute: str) -> Tuple[int, int]:
    """``(all-gathers, reduce-scatters)`` per block and micro-batch when K and V are all-gathered (Llama 3): the
    forward's all-gather of K and V, the backward's reduce-scatter of dK and dV, and one more all-gather with full
    recompute (the forward runs again). Known answers: none -> (1, 1); full -> (2, 1)."""
    return (2 if recompute == "full" else 1), 1


def context_parallel_exposed(t_ring: float, t_attention: float) -> float:
    """Exposed seconds of a micro-batch's ring communication ``t_ring`` that overlaps the attention it feeds
    (``t_attention``, the full-sequence attention of the rank's queries): ``max(0, t_ring - t_attention)`` (Liu et al.
    2023, Ring Attention, section 3: hidden while a block's compute outlasts its transfer)."""
    return max(0.0, t_ring - t_attention)


#: the data file of the per-framework GEMM efficiency (:func:`framework_efficiency`)
FRAMEWORK_EFFICIENCY_FILE = "published/framework_efficiency.yaml"


def framework_efficiency(implementation: str) -> Dict[str, object]:
    """The per-framework GEMM efficiency of ``implementation`` (``Scenario.implementation``):
    ``{"factor": f, "measured": bool, "source": str}`` from ``fourd_mpi/perf/published/
    framework_efficiency.yaml``, where each value must come from a published measurement of that framework that
    is not one of the results it predicts (the file says what was searched; today every factor is 1.0, labelled
    "not measured"). A framework missing from the file: factor 1.0, not measured."""
    missing = {"factor": 1.0, "measured": False, "source": "not in the framework table"}
    entry = framework_table().get(implementation, missing)
    factor = float(entry["factor"])
    if not factor > 0:
        raise ConfigError(f"{FRAMEWORK_EFFICIENCY_FILE}: the factor of {implementation} must be positive, got {factor}")
    return {"factor": factor, "measured": bool(entry["measured"]), "source": str(entry["source"])}


def framework_gemm_time(gemm_s: float, factor: float) -> float:
    """The blocks' GEMM time at a framework's efficiency ``f`` on the profile's sustained rate ``R``: the GEMMs run
    at ``f R``, so ``t' = F / (f R) = t / f`` (``t`` at ``R``). Known answer: 0.3 s at f = 0.75 -> 0.4 s. Only the
    GEMMs change (attention, memory-bound work and the LM head keep their rates), and the overlap windows that
    hide communication keep their length (a slower GEMM hides no more: conservative)."""
    return gemm_s / factor


@functools.lru_cache(maxsize=None)
def framework_table() -> Dict[str, Dict[str, object]]:
    """The ``frameworks`` mapping of :data:`FRAMEWORK_EFFICIENCY_FILE`, read once per process."""
    import yaml

    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), FRAMEWORK_EFFICIENCY_FILE)) as fh:
        return yaml.safe_load(fh)["frameworks"]
