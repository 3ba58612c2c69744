"""DeepSpeed's ZeRO-3 as it ran in 2021 (v0.3.13 to v0.5.4): the host and gather costs this suite's own
``fsdp`` step does not have (``Scenario.implementation = "deepspeed-2021"``; pure, no per-rank loops).

Sources (deepspeedai/DeepSpeed, the same code in the tags v0.3.13 of 2021-03-16 to v0.5.4; PR #1188,
commit c0eeb69, released in v0.5.5 of November 2021, replaced it):

- ``deepspeed/runtime/zero/stage3.py``, ``PartitionedParameterCoordinator.fetch_sub_module``: every
  sub-module's parameters are gathered with ``_all_gather(..., async_op=True)``, i.e. one
  ``partition_parameters._allgather_param`` per parameter: ``torch.zeros`` of the whole weight,
  ``torch.cuda.synchronize()``, a Python loop over the world size building ``world_size`` views, and one
  ``torch.distributed.all_gather`` into that list. PyTorch's list all-gather gathers into a flat buffer and
  then copies it into each of the ``world_size`` outputs (PR #1188's commit message: "the
  ``torch.distributed.all_gather`` will do implicit memcpy at the end of each ``ncclAllgather``"): ``n`` copy
  kernels per gathered weight, and the weight's bytes written by ``torch.zeros``, then read and written once
  more by the copies.
- ``release_sub_module`` partitions (frees) a parameter after its sub-module ran unless
  ``_keep_for_later``: its reuse distance (the elements of the parameters of the sub-modules run between
  this use and the next, ``PrefetchCoordinator._distance_in_numel``) is below ``stage3_max_reuse_distance``
  (default 1e9 elements, ``zero/constants.py``). With full recompute a block's forward runs again in the
  backward pass (its forward hooks fetch and release again), so a weight whose later weights of the block,
  run forward (recompute) then backward before its own backward, exceed 1e9 elements is gathered a third
  time; the block's last weight (distance 0) is kept for its backward. (With the prefetch trace broken,
  PR #1170, the distance is 1e12 and the last weight would be gathered a third time too: not counted.)
- Parameters below ``stage3_param_persistence_threshold`` (default 1e5 elements) are persistent: never
  released, never gathered in forward or backward; but ``backward`` ends in ``_partition_all_parameters``
  and every optimizer step in ``_post_step``: ``persistent_parameters[0].all_gather(...)`` with
  ``async_op=False``, i.e. ``_allgather_params``: one all-gather of them all, then for every persistent
  parameter a Python loop over the world size with one ``copy_`` per rank whose slice holds elements.
- The embedding: Megatron-LM v1.1.5's ZeRO-3 example builds the model inside ``deepspeed.zero.Init``
  (microsoft/DeepSpeedExamples ``Megatron-LM-v1.1.5-ZeRO3/pretrain_gpt2.py``), which partitions every
  parameter, the word embedding included: it is stored as ``ceil(V h / n)`` elements per rank (this
  suite's ``fsdp`` step keeps it whole on every Z rank and all-reduces its gradient). Its LM head uses it
  outside the embedding module (``parallel_lm_logits(..., word_embeddings.weight)`` in ``gpt2_model.py``:
  an external parameter of the top module), so it is gathered for the forward pass and again for the
  backward pass of each micro-batch (recompute checkpoints the blocks only), and its gradient is
  reduce-scattered once per step like every other gradient: :func:`embedding_time`.
- The LayerNorm weights and biases (persistent) get their gradients reduced with every other gradient in
  the bucketed reduction (``overlap_comm`` default True for stage 3), not by the separate LayerNorm
  all-reduce this suite's ``fsdp`` step has (``ln_grad_allreduce``).
- The gradients (:func:`gradient_reduce_time`): with ``contiguous_gradients`` true, as DeepSpeed's Megatron
  example sets it (DeepSpeedExamples ``Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_3_config.json`` of
  March 2021: also ``reduce_bucket_size`` 5e7, ``overlap_comm`` true; an assumption, Table 2's config is
  not published), ``stage3.py`` ``reduce_ipg_grads`` -> ``average_tensor`` -> ``reduce_gradients_at_owner``
  runs ``partition_parameters._reduce_scatter_gradients``: one ``_reduce_scatter_gradient`` per parameter of
  the bucket, the small persistent ones too, i.e. a Python loop over the world size (rank ``i``'s slice
  ``param.grad.view(-1).narrow(...)``, or ``torch.zeros`` for a slice past the end) and one
  ``torch.distributed.reduce_scatter`` from that list, which copies the ``n`` inputs into a flat buffer on
  the NCCL stream before ``ncclReduceScatter`` (pytorch/pytorch ``torch/lib/c10d/ProcessGroupNCCL.cpp``,
  ``ProcessGroupNCCL::reduce_scatter`` of 2021: "Copy the input tensors to the flattened inputs"). They are
  issued by the gradient hooks while the backward GEMMs run, on the reduction stream; the next fetch's
  ``torch.cuda.synchronize()`` (``_allgather_param``, ``_synchronize_communication``) waits for every
  stream of the device, so they must end before the next sub-module's gathers: they hide behind the
  backward GEMMs at most, never behind the rest of the backward pass as this suite's ``ors`` assumes.

Prices (per gather of a weight of ``S`` bytes over ``n`` ranks, following the code above; each
``torch.cuda.synchronize()`` waits for the previous weight's transfer and copies and this one's
``torch.zeros``, so the parts add): the zeros write ``S`` bytes; then the host builds ``n`` views while the
device idles, ``n t_view``; it launches the transfer and ``n`` copy kernels, which the transfer hides up to
its own time ``t_ag``: ``max(0, n t_op - t_ag)``; the copies move ``2 S`` bytes after the transfer: in all
``n t_view + max(0, n t_op - t_ag) + 3 S / B_mem`` besides ``t_ag``. ``t_op`` is the profile's
``op_overhead_s`` (a kernel launch), ``B_mem`` its ``mem_bandwidth``, ``t_view`` = :data:`VIEW_OP_S`. The
persistent loop is host-bound: per copied rank three views and one copy launch. The third gathers cost the
profile's all-gather price (:func:`~fourd_mpi.perf.predict.collective_time`). The gradient reduce-scatter of a
parameter of ``S`` bytes (padded to ``n`` slices): two views per slice in the buffer, one ``torch.zeros``
launch per slice past the end, the ``n`` copy launches (their ``2 S`` bytes under them), then the transfer at
the profile's reduce-scatter price, one after another; a block's sum is hidden by the block's backward GEMMs
at most (a lower bound: each reduce-scatter only has the GEMMs between its hook and the next fetch). NOT
priced: ``torch.distributed.get_rank`` per rank in the loops, ``average_tensor``'s ``div_`` of each reduced
buffer, the copy of each rank's reduced slice into its gradient partition. Nothing here is fitted to a
published training result.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Tuple

from fourd_mpi.core.backend import dtype_bytes
from fourd_mpi.core.grid import GridShape
from fourd_mpi.perf.memory import block_elements, fc_weights
from fourd_mpi.perf.volumes import Collective, collective_rows
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import ModelConfig

NAME = "deepspeed-2021"
#: ``stage3_max_reuse_distance`` default (elements), DeepSpeed zero/constants.py v0.3.13-v0.5.4
MAX_REUSE_DISTANCE = 1_000_000_000
#: ``stage3_param_persistence_threshold`` default (elements): ``ds_numel < threshold`` is persistent
PERSISTENCE_THRESHOLD = 100_000
#: host seconds of a PyTorch operator called from Python that launches no kernel (a view: ``narrow``,
#: ``view``): pytorch/pytorch issue #41383 (July 2020, the PyTorch of 2021's DeepSpeed), a maintainer's
#: measurement: ``x*x`` from Python "approx 2 us", half of it Python parsing (the reporter measured 5-7 us
#: for an operation with a scalar, which the maintainer calls particularly slow; the lower figure is used)
VIEW_OP_S = 2.0e-6


def rank_copies(numel: int, ranks: int) -> int:
    """Copies ``_allgather_params`` makes for one parameter of ``numel`` elements over ``ranks``: the
    partition is ``c = ceil(numel / ranks)`` (padded to a multiple of the world size) and rank ``i`` is
    copied when ``i c < numel``: ``ceil(numel / c)``. Known answers: (12288, 384) -> 384 (32 each);
    (100, 384) -> 100 (1 each); (1000, 384) -> 334 (3 each)."""
    if numel <= 0 or ranks <= 0:
        return 0
    c = -(-numel // ranks)
    return -(-numel // c)


def gathers_per_microbatch(cfg: ModelConfig, grid: GridShape, recompute: str) -> List[Tuple[str, int, int]]:
    """``(name, elements, gathers)`` of each FC weight of one block, per micro-batch: 2 (forward and
    backward), 3 with full recompute when the later weights of the block, twice (recompute forward, then
    backward), exceed :data:`MAX_REUSE_DISTANCE` elements (module docstring). Known answer, 175B GPT
    (h = 12288): qkv, proj, fc1 3 (distances 2.72e9, 2.42e9, 1.21e9), fc2 2 (0)."""
    weights = [(name, block_elements(n, k, t, grid)) for name, n, k, t in fc_weights(cfg, grid)]
    out = []
    for j, (name, elements) in enumerate(weights):
        distance = 2 * sum(e for _, e in weights[j + 1:])
        out.append((name, elements, 3 if recompute == "full" and distance > MAX_REUSE_DISTANCE else 2))
    return out


def block_small_numels(cfg: ModelConfig, grid: GridShape) -> List[int]:
    """Elements of each parameter of one block besides its FC weights: for Megatron-LM's GPT the two
    LayerNorms' weight and bias (``h`` each), then the four FC biases (``3h, h, f, h`` over the output axis)."""
    per_block: List[int] = [cfg.hidden] * 4 if cfg.kind == "gpt" else []
    for _, n, _, t in fc_weights(cfg, grid):
        per_block.append(n // grid["x" if t else "y"])
    return per_block


def persistent_numels(cfg: ModelConfig, grid: GridShape) -> List[int]:
    """Elements of each persistent parameter of the model (below :data:`PERSISTENCE_THRESHOLD`): those of
    :func:`block_small_numels` in every block; the final LayerNorm's weight and bias."""
    h = cfg.hidden
    small = [e for e in block_small_numels(cfg, grid) if e < PERSISTENCE_THRESHOLD]
    final = [h, h] if cfg.kind == "gpt" and h < PERSISTENCE_THRESHOLD else []
    return small * cfg.layers + final


def padded_ranks(numel: int, ranks: int) -> int:
    """Ranks whose slice of a ``numel``-element gradient does not lie whole inside it in
    ``_reduce_scatter_gradient`` (each builds its input with ``torch.zeros``): slices of ``c = ceil(numel /
    ranks)``, rank ``i`` whole when ``(i + 1) c <= numel``: ``ranks - numel // c``. Known answers: (12288, 384)
    -> 0; (100, 384) -> 284; (1000, 384) -> 51 (333 slices of 3 whole)."""
    if numel <= 0 or ranks <= 0:
        return max(0, ranks)
    return ranks - numel // -(-numel // ranks)


def gradient_reduce_time(cfg: ModelConfig, grid: GridShape, profile, placement: Dict[str, str],
                         ranks_on_node: int, inner: Dict[str, int], dtype: str) -> float:
    """Seconds per block and micro-batch of DeepSpeed 2021's gradient reduce-scatters over Z (``n = G_z``),
    one per parameter (the FC weights and :func:`block_small_numels`; module docstring), one after another:
    ``sum_p [2 (n - z_p) t_view + z_p t_op + max(n t_op, 2 S_p / B) + t_rs(S_p)]`` with ``z_p`` =
    :func:`padded_ranks`, ``S_p = ceil(numel_p / n) n e`` bytes (the padded input), ``t_op`` =
    ``op_overhead_s``, ``t_view`` = :data:`VIEW_OP_S`, ``B`` = ``mem_bandwidth``, ``t_rs`` the profile's
    reduce-scatter price over Z."""
    from fourd_mpi.perf.predict import collective_time

    n, e = grid.z, dtype_bytes(dtype)
    t_op, bw = profile.op_overhead_s, profile.mem_bandwidth
    numels = [block_elements(m, k, t, grid) for _, m, k, t in fc_weights(cfg, grid)] + block_small_numels(cfg, grid)
    total = 0.0
    for numel in numels:
        z = padded_ranks(numel, n)
        nbytes = -(-numel // n) * n * e
        rs = collective_time(Collective("grad", "grad_reduce_scatter", "reduce_scatter", "z", n, "backward", 1,
                                        nbytes), profile, placement, ranks_on_node, inner)
        total += 2 * (n - z) * VIEW_OP_S + z * t_op + max(n * t_op, 2 * nbytes / bw) + rs
    return total


def terms(cfg: ModelConfig, grid: GridShape, profile, placement: Dict[str, str], ranks_on_node: int,
          inner: Dict[str, int], dtype: str, recompute: str, overlap: OverlapConfig) -> Dict[str, float]:
    """Seconds per rank of DeepSpeed 2021's extra costs on a ZeRO grid ``1 x n x 1 x 1`` (``n = G_z``):

    - ``regather`` (per micro-batch): ``L sum_w [g_w = 3] t_ag(w)``, the third blocking gathers;
    - ``gather_copies`` (per micro-batch): ``L sum_w g_w (n t_view + max(0, n t_op - t_ag(w)) + 3 S_w/B)``,
      the host loop, the copy launches the transfer does not hide, the zeros' and copies' bytes;
    - ``persistent_gather`` (per step): ``(sum_p rank_copies(p, n)) (3 t_view + t_op) + n (t_view + t_op)
      + t_ag(sum_p c_p n e)``, the loop after every optimizer step;
    - ``ln_grad_allreduce`` (per step, to take away): what the ``fsdp`` step's own LayerNorm gradient
      all-reduces over Z cost (DeepSpeed reduces them with the other gradients);
    - ``grad_reduce`` (per micro-batch): ``L`` :func:`gradient_reduce_time`, the gradient reduce-scatters
      before the backward GEMMs hide any of them.

    ``g_w``: :func:`gathers_per_microbatch`; ``t_op`` = ``op_overhead_s``, ``t_view`` = :data:`VIEW_OP_S`,
    ``B`` = ``mem_bandwidth``, ``S_w`` the weight's bytes, ``e`` the dtype's bytes, ``c_p`` a persistent
    parameter's padded partition, ``t_ag`` the profile's all-gather price over Z."""
    from fourd_mpi.perf.predict import collective_time

    n = grid.z
    e = dtype_bytes(dtype)
    t_op, bw = profile.op_overhead_s, profile.mem_bandwidth
    one = replace(cfg, layers=1)
    price: Dict[Tuple[str, str], float] = {}
    for row in collective_rows(one, grid, overlap, dtype):
        c = Collective(*row)
        if (c.role == "weight_allgather" and c.phase == "forward") or (c.role == "ln_grad_allreduce" and c.axis == "z"):
            key = (c.role, c.layer.split(".")[-1])
            price[key] = price.get(key, 0.0) + collective_time(c, profile, placement, ranks_on_node, inner)
    regather = copies = 0.0
    for name, elements, gathers in gathers_per_microbatch(cfg, grid, recompute):
        t_ag = price.get(("weight_allgather", name), 0.0)
        if gathers == 3:
            regather += t_ag
        nbytes = elements * e
        copies += gathers * (n * VIEW_OP_S + max(0.0, n * t_op - t_ag) + 3 * nbytes / bw)
    persistent = persistent_numels(cfg, grid)
    t_persist = 0.0
    if persistent and n > 1:
        padded = sum(-(-p // n) * n for p in persistent)
        t_persist = sum(rank_copies(p, n) for p in persistent) * (3 * VIEW_OP_S + t_op) + n * (VIEW_OP_S + t_op)
        t_persist += collective_time(Collective("persistent", "persistent_allgather", "allgather", "z", n, "step", 1,
                                                padded * e), profile, placement, ranks_on_node, inner)
    ln = sum(t for (role, _), t in price.items() if role == "ln_grad_allreduce")
    return {"regather": regather * cfg.layers, "gather_copies": copies * cfg.layers,
            "persistent_gather": t_persist, "ln_grad_allreduce": ln * cfg.layers,
            "grad_reduce": gradient_reduce_time(cfg, grid, profile, placement, ranks_on_node, inner, dtype)
            * cfg.layers}


def embedding_time(emb_bytes: int, grid: GridShape, microbatches: int, profile, placement: Dict[str, str],
                   ranks_on_node: int, inner: Dict[str, int]) -> float:
    """Seconds per step of the partitioned embedding's collectives over Z (module docstring): two
    all-gathers of its ``emb_bytes`` per micro-batch and one reduce-scatter per step,
    ``2 m t_ag + t_rs``; blocking, as every ZeRO-3 fetch of 2021."""
    from fourd_mpi.perf.predict import collective_time

    def t(op: str) -> float:
        return collective_time(Collective("vocab", "emb_" + op, op, "z", grid.z, "step", 1, emb_bytes), profile,
                               placement, ranks_on_node, inner)

    return 2 * microbatches * t("allgather") + t("reduce_scatter")
