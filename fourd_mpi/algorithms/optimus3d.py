"""Optimus-CUBE 3D tensor parallelism + data (Bian, Xu, Wang, You 2021, arXiv 2104.05343; Colossal-AI's
``legacy/nn/layer/parallel_3d``) on ``G_data x q x q x q``: the hooks of an algorithm module
(:mod:`fourd_mpi.algorithms.tensor4d` lists them).

Cube axes ``(i, j, l)`` run on the grid's ``(x, y, z)`` communicators (rank order and layouts:
:mod:`fourd_mpi.algorithms.cube`; the layers: :mod:`fourd_mpi.algorithms.optimus_layers`).

A GPT block, activations ``[m, h/q]`` (tokens over data, X, Y; hidden over Z) in and out:
LN1 (statistics over Z) -> QKV (parity 0: X all-gathered over Y, output reduce-scattered over Z:
``[m, 3h/q]`` with whole heads over Y, tokens over data, X, Z) -> causal attention on the local heads
and sequences -> proj (parity 1: gathered over Z, scattered over Y: back to ``[m, h/q]``) -> residual ->
LN2 -> FC1 (parity 0) -> GeLU -> FC2 (parity 1) -> residual. The parities alternate as Colossal-AI's
``swap_in_out_group`` alternates the input and output groups after each ``Linear3D``, so no layer
needs a redistribution. An MLP block is FC1 -> GeLU -> FC2.

The same parameters (names, global shapes, and values from ``(seed, name, global index)``) as the 4D
model, so ``fourd-mpi verify --algorithm optimus3d`` compares every gradient with the serial reference.
The trainer is the 4D step engine (:class:`~fourd_mpi.step.engine.Trainer`): weight all-gathers over X
are prefetched with ``oag``, the gathered weights are kept for the backward (Colossal-AI's
``save_for_backward``: ``cache`` is always on), ``oar`` keeps the dX reduce-scatter in flight during
the dW GEMM, ``ors`` the dW reduce-scatters until the optimizer, ``dp`` the data all-reduces; ``od``
has no effect (the forward ends in a reduce-scatter). Activation recompute (``--recompute``) as in
:mod:`fourd_mpi.step.model`: ``full`` keeps each block's input and runs the block's forward again
(its input all-gathers, output reduce-scatters and LayerNorm statistics again, phase ``recompute``;
the weights come from the forward's cache); ``selective`` keeps the QKV output instead of the
attention probabilities and proj's gathered input, and rebuilds both before proj's backward (one
all-gather over Z per block).
"""

from __future__ import annotations

from typing import List

from fourd_mpi.algorithms import cube
from fourd_mpi.algorithms.optimus_layers import CubeLayerNorm, CubeLinear, cube_linear_backward, cube_linear_forward
from fourd_mpi.core.layout import Layout
from fourd_mpi.step import kernels
from fourd_mpi.step.engine import Trainer
from fourd_mpi.step.model import GPTBlock, MLPBlock, Model, SyntheticData
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.schedule import StepContext

#: activations between blocks: tokens over (data, X, Y), hidden over Z, no replicas
ACTIVATION_LAYOUT = Layout(("tokens", "hidden"), (("data", "x", "y"), ("z",)))


class CubeGPTBlock(GPTBlock):
    """One transformer block on the cube. Input and output ``[m, h/q]`` (module docstring): the
    :class:`~fourd_mpi.step.model.GPTBlock` with the cube's layers (each keeps its gathered input), its
    LayerNorm gradient reductions, and proj's gathered input rebuilt after a selective recompute."""

    linear_cls, norm_cls, pair = CubeLinear, CubeLayerNorm, (0, 1)  # parities
    linear_forward = staticmethod(cube_linear_forward)  # (y, gathered input)
    linear_backward = staticmethod(cube_linear_backward)

    @staticmethod
    def _local_batch_heads(cfg, shape):
        """The attention's local sequences (QKV's output holds whole sequences over data, X, Z:
        ``B/(G_data q^2)``) and heads (over Y: ``heads/q``)."""
        q = shape.x
        return cfg.batch // (shape.data * q * q), cfg.heads // q

    def _proj_input(self, attn_out, ctx: StepContext):
        """proj's input all-gathered again over its gather axis (Z) (phase ``recompute``)."""
        with ctx.comm.tracer.layer(self.proj.name, "recompute"):
            return self.proj.gather_input(attn_out, ctx.comm).wait().reshape(-1, self.proj.block_shape[1])

    def _reduce_norm_grads(self, norm, ctx: StepContext) -> None:
        """gamma/beta gradients all-reduced over X, then Y (issued), then data (the engine)."""
        for param, handle in norm.reduce_param_grads(ctx.comm):
            ctx.grads.add(param, handle)


class CubeMLPBlock(MLPBlock):
    """FC1 (parity 0, h -> ffn) -> GeLU -> FC2 (parity 1, ffn -> h); ``[m, h/q]`` in and out, no residual:
    the :class:`~fourd_mpi.step.model.MLPBlock` with the cube's layers."""

    linear_cls, pair = CubeLinear, (0, 1)
    linear_forward = staticmethod(cube_linear_forward)
    linear_backward = staticmethod(cube_linear_backward)


class CubeModel(Model):
    """A stack of ``cfg.layers`` Optimus-CUBE blocks; forward, backward and the measured activation peak
    are :class:`~fourd_mpi.step.model.Model`'s (they only walk the blocks)."""

    #: the output has no replicas: the loss sums over every axis
    loss_axes = ("data", "z", "y", "x")

    def __init__(self, cfg, grid, backend, seed: int = 0, counter: kernels.ComputeCounter = None):
        self.cfg = cfg
        self.grid = grid
        self.backend = backend
        block_cls = CubeGPTBlock if cfg.kind == "gpt" else CubeMLPBlock
        self.blocks = [block_cls(i, cfg, grid, backend, seed, counter) for i in range(cfg.layers)]
        self.activation_layout = ACTIVATION_LAYOUT
        self.peak_activation_bytes = 0


class CubeData(SyntheticData):
    """:class:`~fourd_mpi.step.model.SyntheticData` (same global tensors) in the cube's activation layout:
    rows = whole sequences over (data, X, Y), columns = hidden over Z."""

    @staticmethod
    def _local_ranges(cfg, grid):
        return (cube.sequence_range(cfg.batch, grid.shape, grid.coords, "y"),
                cube.hidden_range(cfg.hidden, grid.shape, grid.coords, "z"))


class CubeOverlap(OverlapConfig):
    """The overlap options as optimus3d applies them (module docstring): ``cache`` always on."""

    def inapplicable(self, grid) -> List[str]:
        notes = []
        if self.oag and grid.x == 1:
            notes.append("oag has no effect: q = 1, weights are not all-gathered")
        if (self.ors or self.oar) and grid.x == 1:
            notes.append("ors/oar have no effect: q = 1, nothing is reduce-scattered")
        if self.dp and grid.data == 1:
            notes.append("dp has no effect: G_data = 1, there is no data-parallel all-reduce")
        if self.oup and grid.x == 1 and grid.data == 1:
            notes.append("oup has no effect: q = G_data = 1, no gradient collective and no weight all-gather to "
                         "overlap with the update")
        if self.od:
            notes.append("od has no effect on optimus3d: its forward ends in a reduce-scatter, not an all-reduce")
        return notes


def cube_overlap(options) -> CubeOverlap:
    """The run's overlap options with the weight cache on (Colossal-AI keeps the gathered weights)."""
    base = options.overlap
    return CubeOverlap(**{**base.__dict__, "cache": True})


def build_state(options, grid, backend, counter):
    """``(model, data)`` of this rank on the cube ``grid``."""
    model = CubeModel(options.model, grid, backend, seed=options.seed, counter=counter)
    data = CubeData(options.model, grid, backend, seed=options.seed, batches=min(options.data_batches, options.steps))
    return model, data


def make_trainer(model, data, comm, optimizer, options):
    return Trainer(model, data, comm, optimizer, overlap=cube_overlap(options), recompute=options.recompute)

