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

import math
import time
from dataclasses import replace
from typing import List

from fourd_mpi.algorithms import cube
from fourd_mpi.algorithms.optimus_layers import CubeLayerNorm, CubeLinear, cube_linear_backward, cube_linear_forward
from fourd_mpi.core.layout import Layout
from fourd_mpi.step import elementwise, kernels
from fourd_mpi.step.engine import Trainer
from fourd_mpi.step.model import DEFAULT_DATA_BATCHES, Model, SyntheticData, held_bytes
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.schedule import StepContext

#: activations between blocks: tokens over (data, X, Y), hidden over Z, no replicas
ACTIVATION_LAYOUT = Layout(("tokens", "hidden"), (("data", "x", "y"), ("z",)))


class CubeGPTBlock:
    """One transformer block on the cube. Input and output ``[m, h/q]`` (module docstring)."""

    def __init__(self, index: int, cfg, grid, backend, seed: int, counter):
        h, f = cfg.hidden, cfg.ffn_hidden
        p = f"block{index}"
        residual_scale = 1.0 / math.sqrt(2 * cfg.layers)
        self.ln1 = CubeLayerNorm(f"{p}.ln1", h, grid, backend)
        self.qkv = CubeLinear(f"{p}.qkv", 3 * h, h, 0, grid, backend, seed, counter=counter)
        self.proj = CubeLinear(f"{p}.proj", h, h, 1, grid, backend, seed, residual_scale, counter)
        self.ln2 = CubeLayerNorm(f"{p}.ln2", h, grid, backend)
        self.fc1 = CubeLinear(f"{p}.fc1", f, h, 0, grid, backend, seed, counter=counter)
        self.fc2 = CubeLinear(f"{p}.fc2", h, f, 1, grid, backend, seed, residual_scale, counter)
        self.xp = backend.xp
        self.empty = backend.empty
        self.counter = counter
        q = grid.shape.x
        self.local_batch = cfg.batch // (grid.shape.data * q * q)
        self.seq = cfg.seq
        self.local_heads = cfg.heads // q
        self.head_dim = cfg.head_dim
        self.attn_name, self.gelu_name = f"{p}.attn", f"{p}.gelu"
        self.rebuilt_bytes = 0

    def layer_names(self) -> List[str]:
        return [self.ln1.name, self.qkv.name, self.attn_name, self.proj.name, self.ln2.name, self.fc1.name,
                self.gelu_name, self.fc2.name]

    def parameters(self):
        return (self.ln1.parameters() + [self.qkv.weight, self.proj.weight]
                + self.ln2.parameters() + [self.fc1.weight, self.fc2.weight])

    def fc_layers(self) -> List[CubeLinear]:
        return [self.qkv, self.proj, self.fc1, self.fc2]

    def forward(self, h, ctx: StepContext, recompute: str = "none"):
        """``h [m, h/q]`` -> ``(out [m, h/q], saved)``; ``saved`` keeps the gathered inputs of the four layers
        (``selective``: the QKV output instead of the attention probabilities and proj's gathered input;
        ``full``: only ``h``)."""
        comm, xp, s, trace = ctx.comm, self.xp, {}, ctx.comm.tracer
        with trace.layer(self.ln1.name, ctx.phase):
            a, s["ln1"] = self.ln1.forward(h, comm)
        qkv, s["a"] = cube_linear_forward(self.qkv, a, ctx)  # [m', 3h/q], tokens over (data, x, z)
        del a
        with trace.layer(self.attn_name, ctx.phase), trace.op("attention"):
            attn_out, s["attn"] = kernels.attention_forward(xp, qkv, self.local_batch, self.seq, self.local_heads,
                                                            self.head_dim, self.counter, comm.compute_hook,
                                                            self.empty)
        h1, s["ctx"] = cube_linear_forward(self.proj, attn_out, ctx)  # [m, h/q]
        del attn_out
        if recompute == "selective":  # the attention core and proj's gathered input are rebuilt in backward
            s["qkv"] = qkv
            del s["ctx"], s["attn"]
        del qkv
        with trace.op("residual"):
            h1 += h
        with trace.layer(self.ln2.name, ctx.phase):
            b, s["ln2"] = self.ln2.forward(h1, comm)
        s["u"], s["b"] = cube_linear_forward(self.fc1, b, ctx)  # [m', f/q]
        del b
        with trace.layer(self.gelu_name, ctx.phase), trace.op("gelu"):
            g = elementwise.gelu(s["u"], self.empty(s["u"].shape))
        out, s["g"] = cube_linear_forward(self.fc2, g, ctx)
        with trace.op("residual"):
            out += h1
        if recompute == "full":
            return out, {"input": h}
        return out, s

    def recompute(self, s, ctx: StepContext):
        """Full recompute: the block's forward again from the kept input (phase ``recompute``: the same
        collectives as the forward but the weight gathers, kept from the forward)."""
        return self.forward(s["input"], replace(ctx, phase="recompute"))[1]

    def _recompute_attention(self, s, ctx: StepContext) -> None:
        """Selective recompute: the attention core from the kept QKV output, then proj's input all-gathered
        again over its gather axis (Z) (phase ``recompute``)."""
        comm = ctx.comm
        with comm.tracer.layer(self.attn_name, "recompute"), comm.tracer.op("attention"):
            attn_out, s["attn"] = kernels.attention_forward(self.xp, s.pop("qkv"), self.local_batch, self.seq,
                                                            self.local_heads, self.head_dim, self.counter,
                                                            comm.compute_hook, self.empty)
        with comm.tracer.layer(self.proj.name, "recompute"):
            s["ctx"] = self.proj.gather_input(attn_out, comm).wait().reshape(-1, self.proj.block_shape[1])
        del attn_out
        self.rebuilt_bytes = held_bytes(s)

    def backward(self, dh2, s, ctx: StepContext):
        comm, xp, trace = ctx.comm, self.xp, ctx.comm.tracer
        dg = cube_linear_backward(self.fc2, dh2, s.pop("g"), ctx)
        with trace.layer(self.gelu_name, "backward"), trace.op("gelu"):
            du = elementwise.gelu_backward(s.pop("u"), dg, dg, self.empty)
        db = cube_linear_backward(self.fc1, du, s.pop("b"), ctx)
        with trace.layer(self.ln2.name, "backward"):
            dh1 = self.ln2.backward(db, s.pop("ln2"), comm)
            with trace.op("residual"):
                dh1 += dh2
            for param, handle in self.ln2.reduce_param_grads(comm):
                ctx.grads.add(param, handle)
        if "qkv" in s:
            self._recompute_attention(s, ctx)
        dctx = cube_linear_backward(self.proj, dh1, s.pop("ctx"), ctx)
        with trace.layer(self.attn_name, "backward"), trace.op("attention"):
            dqkv = kernels.attention_backward(xp, dctx, s.pop("attn"), self.local_batch, self.seq, self.local_heads,
                                              self.head_dim, self.counter, comm.compute_hook, self.empty)
        da = cube_linear_backward(self.qkv, dqkv, s.pop("a"), ctx)
        with trace.layer(self.ln1.name, "backward"):
            dh = self.ln1.backward(da, s.pop("ln1"), comm)
            with trace.op("residual"):
                dh += dh1
            for param, handle in self.ln1.reduce_param_grads(comm):
                ctx.grads.add(param, handle)
        return dh


class CubeMLPBlock:
    """FC1 (parity 0, h -> ffn) -> GeLU -> FC2 (parity 1, ffn -> h); ``[m, h/q]`` in and out, no residual."""

    def __init__(self, index: int, cfg, grid, backend, seed: int, counter):
        p = f"block{index}"
        self.fc1 = CubeLinear(f"{p}.fc1", cfg.ffn_hidden, cfg.hidden, 0, grid, backend, seed, counter=counter)
        self.fc2 = CubeLinear(f"{p}.fc2", cfg.hidden, cfg.ffn_hidden, 1, grid, backend, seed, init_scale=2.0,
                              counter=counter)
        self.empty = backend.empty
        self.gelu_name = f"{p}.gelu"
        self.rebuilt_bytes = 0

    def parameters(self):
        return [self.fc1.weight, self.fc2.weight]

    def fc_layers(self) -> List[CubeLinear]:
        return [self.fc1, self.fc2]

    def layer_names(self) -> List[str]:
        return [self.fc1.name, self.gelu_name, self.fc2.name]

    def forward(self, x, ctx: StepContext, recompute: str = "none"):
        """``x [m, h/q]`` -> ``(y, saved)``; ``selective`` keeps what ``none`` keeps, ``full`` only ``x``."""
        s = {}
        s["u"], s["x"] = cube_linear_forward(self.fc1, x, ctx)
        with ctx.comm.tracer.layer(self.gelu_name, ctx.phase), ctx.comm.tracer.op("gelu"):
            g = elementwise.gelu(s["u"], self.empty(s["u"].shape))
        y, s["g"] = cube_linear_forward(self.fc2, g, ctx)
        if recompute == "full":
            return y, {"input": x}
        return y, s

    def recompute(self, s, ctx: StepContext):
        """Full recompute: FC1, GeLU and FC2 again from the kept input (phase ``recompute``)."""
        return self.forward(s["input"], replace(ctx, phase="recompute"))[1]

    def backward(self, dy, s, ctx: StepContext):
        dg = cube_linear_backward(self.fc2, dy, s.pop("g"), ctx)
        with ctx.comm.tracer.layer(self.gelu_name, "backward"), ctx.comm.tracer.op("gelu"):
            du = elementwise.gelu_backward(s.pop("u"), dg, dg, self.empty)
        return cube_linear_backward(self.fc1, du, s.pop("x"), ctx)


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

    def __init__(self, cfg, grid, backend, seed: int = 0, batches: int = DEFAULT_DATA_BATCHES):
        if batches < 1:
            raise ValueError(f"batches must be at least 1, got {batches}")
        self.cfg = cfg
        self.backend = backend
        self.seed = seed
        first, stop = cube.sequence_range(cfg.batch, grid.shape, grid.coords, "y")
        self.rows = slice(first * cfg.seq, stop * cfg.seq)
        c0, c1 = cube.hidden_range(cfg.hidden, grid.shape, grid.coords, "z")
        self.cols = slice(c0, c1)
        self.global_shape = (cfg.batch * cfg.seq, cfg.hidden)
        t0 = time.perf_counter()
        self._pool = [self._generate(i) for i in range(batches)]
        backend.synchronize()
        self.prep_seconds = time.perf_counter() - t0


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
        if self.od:
            notes.append("od has no effect on optimus3d: its forward ends in a reduce-scatter, not an all-reduce")
        return notes


def cube_overlap(options) -> CubeOverlap:
    """The run's overlap options with the weight cache on (Colossal-AI keeps the gathered weights)."""
    base = options.overlap_config()
    return CubeOverlap(**{**base.__dict__, "cache": True})


def build_state(options, grid, backend, counter):
    """``(model, data)`` of this rank on the cube ``grid``."""
    model = CubeModel(options.model, grid, backend, seed=options.seed, counter=counter)
    data = CubeData(options.model, grid, backend, seed=options.seed, batches=min(options.data_batches, options.steps))
    return model, data


def make_trainer(model, data, comm, optimizer, options):
    return Trainer(model, data, comm, optimizer, overlap=cube_overlap(options), recompute=options.recompute)

