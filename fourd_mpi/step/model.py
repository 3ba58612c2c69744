"""GPT and MLP stacks built from 4D layers, the loss, and the synthetic data.

Between blocks activations are ``[m, h/x]`` replicated over Y (m = local tokens =
``batch*seq/(G_data*G_z)``). A GPT block is, in Megatron-AxoNN order:
LN1 -> QKV (normal, h->3h, whole heads per Y block) -> causal attention on the
local heads -> attention output (transposed, h->h) -> residual -> LN2 -> FC1
(normal, h->4h) -> GeLU -> FC2 (transposed, 4h->h) -> residual. An MLP block is
FC1 (normal) -> GeLU -> FC2 (transposed), no residual.

Activation recompute (``--recompute``, docs/design.md section 3): what a block keeps between
its forward and its backward.

- ``none``: every activation the backward needs (LayerNorm outputs and statistics, QKV,
  the attention probabilities ``[b, heads/y, s, s]`` and context, FC1 output, GeLU output).
- ``selective``: as ``none`` without the attention core: the probabilities and the context are
  dropped after the forward and recomputed from the kept QKV output just before the attention
  output projection's backward (no communication; ``4 B s^2 h`` FLOPs per block, whole model).
- ``full``: only the block's input ``[m, h/x]``; the backward of a block starts by running the
  block's forward again (phase ``recompute``: its GEMMs, collectives and elementwise ops are
  traced with that phase), which rebuilds everything ``none`` keeps; the weights that recompute
  forward gathers over Z (or takes from the forward cache) are kept for the block's backward.

Memory (:func:`held_bytes`) is measured from the arrays actually held, not from a formula.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Iterable, List

import numpy as np

from fourd_mpi.core.collectives import Collectives
from fourd_mpi.core.layout import activation_layout, block_range, local_sequences
from fourd_mpi.step import elementwise, fusedattention, kernels
from fourd_mpi.step.layers import FullyConnected4D, LayerNorm4D, Parameter
from fourd_mpi.step.presets import RECOMPUTE_MODES, ModelConfig
from fourd_mpi.step.schedule import StepContext, linear_backward, linear_forward
from fourd_mpi.step.synthetic import stream_id, uniform_block

#: the axes :func:`mse_loss` sums over for the 4D layout (Y holds replicas)
LOSS_AXES = ("data", "z", "x")


def _forward_keeping_input(layer, x, ctx: StepContext):
    """:func:`~fourd_mpi.step.schedule.linear_forward` as a block calls its layers: ``(y, x)``, the output and
    what the layer's backward needs (its input, kept as it is)."""
    return linear_forward(layer, x, ctx), x


class GPTBlock:
    """One transformer block on the 4D grid. Input and output ``[m, h/x]`` rep Y.

    The block's math and order are written once here; an algorithm with other layers subclasses it and
    names its layer classes, their forward and backward functions, and how LayerNorm gradients and the
    attention's local shape come about (:class:`~fourd_mpi.algorithms.optimus3d.CubeGPTBlock`)."""

    #: the linear and LayerNorm layer classes, and the layout argument of the first and second layer of
    #: each pair (QKV/proj, FC1/FC2): 4D ``transposed``
    linear_cls, norm_cls, pair = FullyConnected4D, LayerNorm4D, (False, True)
    #: ``(layer, x, ctx) -> (y, saved)``: saved is what ``linear_backward`` needs as its input
    linear_forward = staticmethod(_forward_keeping_input)
    #: ``(layer, dy, saved, ctx) -> dx``; the weight gradient goes to ``ctx.grads``
    linear_backward = staticmethod(linear_backward)

    def __init__(self, index: int, cfg: ModelConfig, grid, backend, seed: int, counter):
        h, f = cfg.hidden, cfg.ffn_hidden
        p = f"block{index}"
        residual_scale = 1.0 / math.sqrt(2 * cfg.layers)
        first, second = self.pair
        self.ln1 = self.norm_cls(f"{p}.ln1", h, grid, backend)
        self.qkv = self.linear_cls(f"{p}.qkv", 3 * h, h, first, grid, backend, seed, counter=counter)
        self.proj = self.linear_cls(f"{p}.proj", h, h, second, grid, backend, seed, residual_scale, counter)
        self.ln2 = self.norm_cls(f"{p}.ln2", h, grid, backend)
        self.fc1 = self.linear_cls(f"{p}.fc1", f, h, first, grid, backend, seed, counter=counter)
        self.fc2 = self.linear_cls(f"{p}.fc2", h, f, second, grid, backend, seed, residual_scale, counter)
        self.xp = backend.xp
        self.empty = backend.empty
        self.counter = counter
        self.backend = backend
        self.local_batch, self.local_heads = self._local_batch_heads(cfg, grid.shape)
        self.seq = cfg.seq
        self.head_dim = cfg.head_dim
        self.attn_name, self.gelu_name = f"{p}.attn", f"{p}.gelu"
        #: bytes of this block's activations right after a selective recompute (0: none happened)
        self.rebuilt_bytes = 0

    @staticmethod
    def _local_batch_heads(cfg: ModelConfig, shape):
        """The attention's local sequences (over data and Z) and heads (over Y)."""
        return cfg.batch // (shape.data * shape.z), cfg.heads // shape.y

    def layer_names(self) -> List[str]:
        """Trace names of this block's layers, in forward order."""
        return [self.ln1.name, self.qkv.name, self.attn_name, self.proj.name, self.ln2.name, self.fc1.name,
                self.gelu_name, self.fc2.name]

    def parameters(self) -> List[Parameter]:
        return (self.ln1.parameters() + [self.qkv.weight, self.proj.weight]
                + self.ln2.parameters() + [self.fc1.weight, self.fc2.weight])

    def _attention_shape(self):
        return self.local_batch, self.seq, self.local_heads, self.head_dim

    def fc_layers(self) -> List[FullyConnected4D]:
        """The linear layers in the order forward uses them."""
        return [self.qkv, self.proj, self.fc1, self.fc2]

    def _attention_forward(self, qkv, progress):
        """``qkv [m, 3h/y]`` -> ``(ctx [m, h/y], saved)`` on this rank's heads, by the backend's attention
        kernels (:attr:`~fourd_mpi.core.backend.Backend.attention`); local, no communication."""
        mode = self.backend.attention
        if mode == "unfused":
            return kernels.attention_forward(self.xp, qkv, *self._attention_shape(), self.counter, progress,
                                             self.empty)
        return fusedattention.attention_forward(self.backend, mode, qkv, *self._attention_shape(), self.counter,
                                                progress, self.empty)

    def _attention_backward(self, dctx, saved, progress):
        """``dctx [m, h/y]`` -> ``dqkv [m, 3h/y]`` (:meth:`_attention_forward`'s kernels); local."""
        mode = self.backend.attention
        if mode == "unfused":
            return kernels.attention_backward(self.xp, dctx, saved, *self._attention_shape(), self.counter,
                                              progress, self.empty)
        return fusedattention.attention_backward(self.backend, mode, dctx, saved, *self._attention_shape(),
                                                 self.counter, progress, self.empty)

    def forward(self, h, ctx: StepContext, recompute: str = "none"):
        """``h [m, h/x]`` rep Y -> ``(out [m, h/x], saved)``; ``saved`` holds what ``recompute`` keeps (each
        layer's input as :attr:`linear_forward` keeps it; ``selective``: the QKV output instead of the
        attention probabilities and proj's input; ``full``: only ``h``)."""
        comm, s, trace = ctx.comm, {}, ctx.comm.tracer
        with trace.layer(self.ln1.name, ctx.phase):
            a, s["ln1"] = self.ln1.forward(h, comm)
        qkv, s["a"] = self.linear_forward(self.qkv, a, ctx)  # [m, 3h/y] rep x
        del a
        with trace.layer(self.attn_name, ctx.phase), trace.op("attention"):
            attn_out, s["attn"] = self._attention_forward(qkv, comm.compute_hook)
        h1, s["ctx"] = self.linear_forward(self.proj, attn_out, ctx)  # [m, h/x] rep y
        del attn_out
        if recompute == "selective":  # the attention core (and proj's input) are rebuilt from QKV in backward
            s["qkv"] = qkv
            del s["ctx"], s["attn"]
        del qkv
        with trace.op("residual"):
            h1 += h
        with trace.layer(self.ln2.name, ctx.phase):
            b, s["ln2"] = self.ln2.forward(h1, comm)
        s["u"], s["b"] = self.linear_forward(self.fc1, b, ctx)  # [m, 4h/y] rep x
        del b
        with trace.layer(self.gelu_name, ctx.phase), trace.op("gelu"):
            g = elementwise.gelu(s["u"], self.empty(s["u"].shape))
        out, s["g"] = self.linear_forward(self.fc2, g, ctx)
        with trace.op("residual"):
            out += h1
        if recompute == "full":
            return out, {"input": h}
        return out, s

    def recompute(self, s, ctx: StepContext):
        """Full recompute: the block's forward again from the kept input (phase ``recompute``);
        returns the activations ``none`` would have kept. Same collectives as the forward."""
        return self.forward(s["input"], replace(ctx, phase="recompute"))[1]

    def _proj_input(self, attn_out, ctx: StepContext):
        """What proj's backward needs, rebuilt from the recomputed attention output: the output itself."""
        return attn_out

    def _recompute_attention(self, s, ctx: StepContext) -> None:
        """Selective recompute: probabilities and context from the kept QKV output, then proj's saved input
        (:meth:`_proj_input`; 4D: no communication)."""
        with ctx.comm.tracer.layer(self.attn_name, "recompute"), ctx.comm.tracer.op("attention"):
            attn_out, s["attn"] = self._attention_forward(s.pop("qkv"), ctx.comm.compute_hook)
        s["ctx"] = self._proj_input(attn_out, ctx)
        del attn_out
        self.rebuilt_bytes = held_bytes(s)  # this block's activations held right after the rebuild

    def _reduce_norm_grads(self, norm, ctx: StepContext) -> None:
        """Hand a LayerNorm's gamma/beta gradients to ``ctx.grads`` (4D: reduced over Z, then data)."""
        for param, first in norm.grad_reductions(ctx.comm):
            ctx.grads.reduce(param, param.grad, first)

    def backward(self, dh2, s, ctx: StepContext):
        comm, trace = ctx.comm, ctx.comm.tracer
        dg = self.linear_backward(self.fc2, dh2, s.pop("g"), ctx)
        with trace.layer(self.gelu_name, "backward"), trace.op("gelu"):
            du = elementwise.gelu_backward(s.pop("u"), dg, dg, self.empty)  # in place: dg is ours
        db = self.linear_backward(self.fc1, du, s.pop("b"), ctx)
        with trace.layer(self.ln2.name, "backward"):
            dh1 = self.ln2.backward(db, s.pop("ln2"), comm)
            with trace.op("residual"):
                dh1 += dh2
            self._reduce_norm_grads(self.ln2, ctx)
        if "qkv" in s:
            self._recompute_attention(s, ctx)
        dctx = self.linear_backward(self.proj, dh1, s.pop("ctx"), ctx)
        with trace.layer(self.attn_name, "backward"), trace.op("attention"):
            dqkv = self._attention_backward(dctx, s.pop("attn"), comm.compute_hook)
        da = self.linear_backward(self.qkv, dqkv, s.pop("a"), ctx)
        with trace.layer(self.ln1.name, "backward"):
            dh = self.ln1.backward(da, s.pop("ln1"), comm)
            with trace.op("residual"):
                dh += dh1
            self._reduce_norm_grads(self.ln1, ctx)
        return dh


class MLPBlock:
    """FC1 (normal, h->ffn) -> GeLU -> FC2 (transposed, ffn->h). ``[m, h/x]`` rep Y in and out.
    Layer classes and functions as :class:`GPTBlock`'s (an algorithm's subclass names its own)."""

    linear_cls, pair = GPTBlock.linear_cls, GPTBlock.pair
    linear_forward = staticmethod(_forward_keeping_input)
    linear_backward = staticmethod(linear_backward)

    def __init__(self, index: int, cfg: ModelConfig, grid, backend, seed: int, counter):
        p = f"block{index}"
        first, second = self.pair
        self.fc1 = self.linear_cls(f"{p}.fc1", cfg.ffn_hidden, cfg.hidden, first, grid, backend, seed,
                                   counter=counter)
        self.fc2 = self.linear_cls(f"{p}.fc2", cfg.hidden, cfg.ffn_hidden, second, grid, backend, seed,
                                   init_scale=2.0, counter=counter)
        self.empty = backend.empty
        self.gelu_name = f"{p}.gelu"
        self.rebuilt_bytes = 0

    def parameters(self) -> List[Parameter]:
        return [self.fc1.weight, self.fc2.weight]

    def fc_layers(self) -> List[FullyConnected4D]:
        return [self.fc1, self.fc2]

    def layer_names(self) -> List[str]:
        return [self.fc1.name, self.gelu_name, self.fc2.name]

    def forward(self, x, ctx: StepContext, recompute: str = "none"):
        """``x [m, h/x]`` rep Y -> ``(y, saved)``. No attention: ``selective`` keeps what ``none`` keeps."""
        s = {}
        s["u"], s["x"] = self.linear_forward(self.fc1, x, ctx)
        with ctx.comm.tracer.layer(self.gelu_name, ctx.phase), ctx.comm.tracer.op("gelu"):
            g = elementwise.gelu(s["u"], self.empty(s["u"].shape))
        y, s["g"] = self.linear_forward(self.fc2, g, ctx)
        if recompute == "full":
            return y, {"input": x}
        return y, s

    def recompute(self, s, ctx: StepContext):
        """Full recompute: FC1, GeLU and FC2 again from the kept input (phase ``recompute``)."""
        return self.forward(s["input"], replace(ctx, phase="recompute"))[1]

    def backward(self, dy, s, ctx: StepContext):
        dg = self.linear_backward(self.fc2, dy, s.pop("g"), ctx)
        with ctx.comm.tracer.layer(self.gelu_name, "backward"), ctx.comm.tracer.op("gelu"):
            du = elementwise.gelu_backward(s.pop("u"), dg, dg, self.empty)  # in place: dg is ours
        return self.linear_backward(self.fc1, du, s.pop("x"), ctx)


class Model:
    """A stack of ``cfg.layers`` blocks on a :class:`~fourd_mpi.core.grid.ProcessGrid`.

    Weights depend only on ``(seed, layer name, global index)``, so every grid
    shape holds pieces of the same global model.
    """

    #: axes the loss's partial sums are all-reduced over (:func:`mse_loss`)
    loss_axes = LOSS_AXES

    def __init__(self, cfg: ModelConfig, grid, backend, seed: int = 0,
                 counter: kernels.ComputeCounter = None):
        self.cfg = cfg
        self.grid = grid
        self.backend = backend
        block_cls = GPTBlock if cfg.kind == "gpt" else MLPBlock
        self.blocks = [block_cls(i, cfg, grid, backend, seed, counter) for i in range(cfg.layers)]
        self.activation_layout = activation_layout("x")
        #: the most activation bytes held at once during the last backward pass (:meth:`backward`)
        self.peak_activation_bytes = 0

    def parameters(self) -> List[Parameter]:
        return [p for block in self.blocks for p in block.parameters()]

    def fc_layers(self) -> List[FullyConnected4D]:
        """Every 4D layer in the order the forward pass uses it."""
        return [layer for block in self.blocks for layer in block.fc_layers()]

    def layer_names(self) -> List[str]:
        """The trace's layer vocabulary: every layer in forward order, then the loss."""
        return [name for block in self.blocks for name in block.layer_names()] + ["loss"]

    def forward(self, x, ctx: StepContext, recompute: str = "none"):
        """``x [m, h/x]`` -> ``(y [m, h/x], saved)``; both rep Y. ``saved``: per block, what
        ``recompute`` (:data:`~fourd_mpi.step.presets.RECOMPUTE_MODES`) keeps for the backward."""
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, not {recompute!r}")
        saved = []
        for block in self.blocks:
            x, s = block.forward(x, ctx, recompute)
            saved.append(s)
        return x, saved

    def backward_weight_order(self, recompute: str = "none") -> List[FullyConnected4D]:
        """The 4D layers in the order the backward pass first needs their gathered weights: reversed
        forward order; with full recompute each block's layers in forward order (its recompute forward
        comes first), last block first."""
        if recompute == "full":
            return [layer for block in reversed(self.blocks) for layer in block.fc_layers()]
        return list(reversed(self.fc_layers()))

    def backward(self, dy, saved, ctx: StepContext):
        """Backpropagate ``dy [m, h/x]``; hands every gradient to ``ctx.grads``; returns ``dx``.

        Full recompute: each block's forward runs again (phase ``recompute``) right before its
        backward. Empties ``saved`` as it goes (a block's activations are released after its backward).
        Sets :attr:`peak_activation_bytes`: the most activation bytes held at once during the pass
        (the blocks not yet back-propagated plus the one just recomputed), measured.
        """
        trace = ctx.comm.tracer
        held = [held_bytes(s) for s in saved]
        before = sum(held)
        peak = before
        for i in reversed(range(len(self.blocks))):
            block, s = self.blocks[i], saved[i]
            saved[i] = None
            before -= held[i]
            if "input" in s:
                trace.enter_phase("recompute")
                s = block.recompute(s, ctx)
                trace.enter_phase("backward")
            peak = max(peak, before + held_bytes(s))
            block.rebuilt_bytes = 0
            dy = block.backward(dy, s, ctx)
            peak = max(peak, before + block.rebuilt_bytes)  # selective: measured inside, after the rebuild
        self.peak_activation_bytes = peak
        return dy


def _arrays(obj) -> Iterable:
    """Every array inside nested dicts, lists and tuples."""
    if isinstance(obj, dict):
        for value in obj.values():
            yield from _arrays(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _arrays(value)
    elif hasattr(obj, "nbytes") and hasattr(obj, "shape"):
        yield obj


def held_bytes(*objs) -> int:
    """Bytes of the distinct memory buffers that the arrays in ``objs`` keep alive (nested dicts,
    lists, tuples; NumPy or CuPy). A view counts its base array once: ``q``, ``k``, ``v`` of the
    attention are views of the QKV output and add nothing to it. Measured from the arrays held,
    not from a formula."""
    owners = {}
    for array in _arrays(objs):
        base = array
        while getattr(base, "base", None) is not None and hasattr(base.base, "nbytes"):
            base = base.base
        owners[id(base)] = int(base.nbytes)
    return sum(owners.values())


def mse_loss(y, target, comm: Collectives, global_elements: int, axes=LOSS_AXES):
    """``loss = sum((y - t)^2) / (2 * B*s*h)`` over the global batch; returns ``(loss, dy)``.

    y, target: ``[m, h/x]`` rep Y; ``dy = (y - t) / (B*s*h)``. The partial sum is all-reduced
    over ``axes``: data, Z and X (not Y, which holds replicas); a model whose output has another
    layout names its own (``Model.loss_axes``). :func:`mse_loss_parts` then :func:`reduce_loss`.
    """
    local, dy = mse_loss_parts(y, target, comm, global_elements)
    return reduce_loss(local, comm, global_elements, axes), dy


def mse_loss_parts(y, target, comm: Collectives, global_elements: int):
    """This rank's partial ``sum((y - t)^2)`` (on the device: not read back) and ``dy``; no communication."""
    with comm.tracer.op("loss"):
        dy = comm.backend.empty(y.shape)
        local = elementwise.mse_parts(y, target, dy, global_elements)
    return local, dy


def reduce_loss(local, comm: Collectives, global_elements: int, axes=LOSS_AXES) -> float:
    """The loss from every rank's partial sum ``local``: read back (waits for the kernels that made it) and
    all-reduced over ``axes`` (blocking; collective over those axes)."""
    (total,) = comm.allreduce_scalars([float(local)], axes=axes)
    return total / (2.0 * global_elements)


#: distinct batches prepared before the first step (``--data-batches``)
DEFAULT_DATA_BATCHES = 4


class SyntheticData:
    """Inputs and targets ``[B*s, h]``, this rank's ``[m, h/x]`` piece, prepared before the steps.

    Tokens are split by whole sequences over data (outer) and Z (inner); the
    hidden dimension over X. Like a data loader that has its batches ready, the
    constructor generates ``batches`` distinct global batches (each element a pure
    function of ``(seed, batch index, global index)``, so every grid shape sees the same
    global tensors) on the backend's device, and step ``i`` uses batch ``i mod batches``:
    :meth:`batch` only looks one up. Memory: ``2 * batches * m * h/x`` elements per rank.
    ``prep_seconds``: this rank's time to generate them (never inside a step).
    """

    def __init__(self, cfg: ModelConfig, grid, backend, seed: int = 0, batches: int = DEFAULT_DATA_BATCHES):
        if batches < 1:
            raise ValueError(f"batches must be at least 1, got {batches}")
        self.cfg = cfg
        self.backend = backend
        self.seed = seed
        (first, stop), (c0, c1) = self._local_ranges(cfg, grid)
        self.rows = slice(first * cfg.seq, stop * cfg.seq)
        self.cols = slice(c0, c1)
        self.global_shape = (cfg.batch * cfg.seq, cfg.hidden)
        t0 = time.perf_counter()
        self._pool = [self._generate(i) for i in range(batches)]
        backend.synchronize()
        self.prep_seconds = time.perf_counter() - t0

    @staticmethod
    def _local_ranges(cfg: ModelConfig, grid):
        """``((first, stop) sequence, (first, stop) hidden column)`` of this rank's piece: whole sequences
        over data (outer) and Z (inner), hidden over X. A layout of another algorithm overrides it."""
        return (local_sequences(cfg.batch, grid.shape, grid.coords["data"], grid.coords["z"]),
                block_range(cfg.hidden, grid.shape.x, grid.coords["x"]))

    @property
    def batches(self) -> int:
        return len(self._pool)

    @property
    def nbytes(self) -> int:
        """Bytes of the prepared batches on this rank."""
        return sum(x.nbytes + t.nbytes for x, t in self._pool)

    def _generate(self, index: int):
        xp = self.backend.xp  # generated where the step computes (no host-to-device copy per step)
        x = uniform_block(self.seed, stream_id("input", index), self.global_shape, self.rows, self.cols, xp)
        t = uniform_block(self.seed, stream_id("target", index), self.global_shape, self.rows, self.cols, xp)
        return self.backend.asarray(x), self.backend.asarray(0.5 * t)

    def batch(self, step: int):
        """``(x, target)`` for ``step``, each ``[m, h/x]``: prepared batch ``step mod batches`` (no work)."""
        return self._pool[step % len(self._pool)]

    def global_index(self) -> np.ndarray:
        """Flat indices into ``[B*s, h]`` of this rank's ``[m, h/x]`` piece (row-major)."""
        r = np.arange(self.rows.start, self.rows.stop, dtype=np.int64)[:, None]
        c = np.arange(self.cols.start, self.cols.stop, dtype=np.int64)[None, :]
        return (r * self.global_shape[1] + c).ravel()
