"""Megatron-LM's data-parallel gradient reduction as it ran in 2020-2021 (``Scenario.implementation =
"megatron-lm"``; pure): one all-reduce of every gradient, coalesced, after the backward pass.

Sources (NVIDIA/Megatron-LM): ``megatron/model/distributed.py`` at commit 5281919 (2020-09-11, the
release of the README's DGX A100 scaling tables) and at 50a4b5f (2021-04-08, the SC21 release of
Narayanan et al.). With ``--DDP-impl local``, the default of both (``megatron/arguments.py``), the
gradients are reduced once per step, after the last micro-batch: ``allreduce_params`` /
``allreduce_gradients`` packs every parameter's gradient of one type into one buffer
(``_flatten_dense_tensors``, or the contiguous buffer with ``--use-contiguous-buffers-in-ddp``) and calls
``torch.distributed.all_reduce`` on it once. In fp16 training the module is converted to half, so all
gradients share one type: one all-reduce per step, LayerNorm and embedding gradients included.

This suite's own ``megatron1d`` step all-reduces each weight's gradient (and the LayerNorms') on its own,
so a model of it pays the collective's latency once per weight: with 128 data-parallel ranks at AxoNN's
9 us per rank and per ring phase, 2.3 ms per all-reduce, about 0.47 s per step for a 24-layer model, where
Megatron-LM pays it once. ``--DDP-impl torch`` (PyTorch's bucketed DDP, overlapped with the backward pass:
``overlap`` with ``dp``) and the distributed optimizer are not changed here.
"""

from __future__ import annotations

from typing import Dict

from fourd_mpi.core.grid import GridShape
from fourd_mpi.perf.volumes import Collective

NAME = "megatron-lm"


def applies(overlap_dp: bool, shard_optimizer: str, grid: GridShape) -> bool:
    """Whether the coalesced all-reduce replaces the per-weight ones: DDP local (no ``dp`` overlap), no
    optimizer sharding, a data axis."""
    return not overlap_dp and shard_optimizer == "none" and grid.data > 1


def grad_sync_time(grad_elements: int, grad_bytes: int, grid: GridShape, profile, placement: Dict[str, str],
                   ranks_on_node: int, inner: Dict[str, int]) -> float:
    """Seconds per step of the coalesced gradient all-reduce over the data axis: one all-reduce of
    ``grad_elements x grad_bytes`` bytes (every gradient a rank holds, LayerNorms and its embedding
    shard included) plus the loss all-reduce for logging (``reduce_losses``, one float per step)."""
    from fourd_mpi.perf.predict import collective_time

    def t(role: str, nbytes: int) -> float:
        return collective_time(Collective("ddp", role, "allreduce", "data", grid.data, "step", 1, nbytes), profile,
                               placement, ranks_on_node, inner)

    return t("grad_allreduce_coalesced", grad_elements * grad_bytes) + t("loss", 4)
