"""The 4D fully connected layer (normal and transposed) and the sharded LayerNorm.

Each layer reads as *communicate, compute, communicate*: it asks the
:class:`~fourd_mpi.core.collectives.Collectives` object for a collective along a named
axis, gets a handle back, and waits on it only where the math needs the result.
The local math lives in :mod:`fourd_mpi.step.kernels`.

Notation (docs/design.md section 2): ``W[n_out, k_in]``, ``y = x W^T``, ``m`` local tokens.

=================  ==================  ==================  =====================
layer              input ``x``         weight block        output ``y``
=================  ==================  ==================  =====================
normal             ``[m, k/x]`` rep y  ``[n/y, k/x]``      ``[m, n/y]`` rep x
transposed         ``[m, k/y]`` rep x  ``[n/x, k/y]``      ``[m, n/x]`` rep y
=================  ==================  ==================  =====================

Each weight block is flattened and split in ``G_z`` shards; a rank stores one
shard (``n*k/(G_x*G_y*G_z)`` elements) and all-gathers the block over Z when it
needs it. The forward all-reduce is over the input-sharding axis, the backward
all-reduce of ``dx`` over the output-sharding axis, and ``dW`` is reduce-scattered
over Z (then all-reduced over data by the step engine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import numpy as np

from fourd_mpi.core.collectives import Collectives, CommHandle, GroupHandle
from fourd_mpi.core.layout import Layout, block_range, weight_layout, weight_shard_indices
from fourd_mpi.step import elementwise, kernels
from fourd_mpi.step.synthetic import stream_id, uniform_at


@dataclass
class Parameter:
    """A trainable tensor's local piece.

    data, grad: backend arrays of this rank's piece (``grad`` after the layer's own
    collective: the reduce-scatter over Z of FC weights, the all-reduce over Z of
    LayerNorm parameters). reduce_axes: axes over which the gradient still has to
    be summed by the step engine (``("data",)``). global_shape and
    global_index(): where the piece lives in the global tensor (for verification).
    """

    name: str
    data: object
    layout: Layout
    reduce_axes: Tuple[str, ...]
    global_shape: Tuple[int, ...]
    global_index: Callable[[], np.ndarray]
    grad: object = None


class FullyConnected4D:
    """``y = x W^T`` with the 3D parallel matrix multiplication.

    Parameters: name (used to seed the weights), n_out, k_in, transposed (swap
    the roles of X and Y), grid, backend, seed, init_scale (uniform init bound is
    ``init_scale/sqrt(k_in)``), counter (optional GEMM accounting).
    """

    def __init__(self, name: str, n_out: int, k_in: int, transposed: bool, grid, backend,
                 seed: int, init_scale: float = 1.0, counter: Optional[kernels.ComputeCounter] = None):
        self.name = name
        self.n_out, self.k_in = n_out, k_in
        self.transposed = transposed
        self.in_axis, self.out_axis = ("y", "x") if transposed else ("x", "y")
        self.backend = backend
        self.counter = counter
        shape = grid.shape
        self.block_shape = (n_out // shape[self.out_axis], k_in // shape[self.in_axis])
        coords = grid.coords
        index_args = (n_out, k_in, shape[self.out_axis], coords[self.out_axis],
                      shape[self.in_axis], coords[self.in_axis], shape.z, coords["z"])

        def global_index():
            rows, cols = weight_shard_indices(*index_args)
            return rows * k_in + cols

        bound = init_scale / math.sqrt(k_in)
        values = uniform_at(seed, stream_id("weight", name), global_index()) * bound
        self.weight = Parameter(
            name=f"{name}.weight",
            data=backend.asarray(values),
            layout=weight_layout(self.out_axis, self.in_axis),
            reduce_axes=("data",),
            global_shape=(n_out, k_in),
            global_index=global_index,
        )

    # communication ---------------------------------------------------------
    def gather_weight(self, comm: Collectives, tag=None) -> CommHandle:
        """All-gather the weight shards over Z. Result: flat block, reshape to ``block_shape``.

        Collective over Z. ``tag``: trace codes when issued ahead of the layer (prefetch).
        """
        return comm.allgather("z", self.weight.data, tag)

    def reduce_weight_grad(self, dw_block, comm: Collectives) -> CommHandle:
        """Reduce-scatter ``dW_blk`` over Z (sums the token shards of Z). Result: gradient shard.

        Collective over Z.
        """
        return comm.reduce_scatter("z", dw_block.reshape(-1))

    # compute + the collective that completes it ------------------------------
    def forward(self, x, weight_block, comm: Collectives, chunks: int = 1):
        """``x [m, k/in]`` -> handle of ``y [m, n/out]``: local GEMM, all-reduce over the in axis.

        With ``chunks > 1`` (over-decomposition) the tokens are split in ``chunks``
        pieces and each piece's all-reduce is issued as soon as its GEMM is done,
        so it overlaps the next piece's GEMM. Collective over the in axis.
        """
        w_t = weight_block.reshape(self.block_shape).T
        chunks = min(chunks, x.shape[0]) if comm.grid.size(self.in_axis) > 1 else 1
        n = self.block_shape[0]
        empty = self.backend.empty
        if chunks <= 1:
            y = kernels.matmul(x, w_t, self.counter, progress=comm.compute_hook, out=empty((x.shape[0], n)))
            return comm.allreduce(self.in_axis, y)
        m = x.shape[0]
        handles = []
        for i in range(chunks):
            rows = slice(i * m // chunks, (i + 1) * m // chunks)
            y_piece = kernels.matmul(x[rows], w_t, self.counter, progress=comm.compute_hook,
                                     out=empty((rows.stop - rows.start, n)))
            handles.append(comm.allreduce(self.in_axis, y_piece))
        xp = self.backend.xp
        return GroupHandle(handles, lambda pieces: xp.concatenate(pieces, axis=0))

    def backward_input(self, dy, weight_block, comm: Collectives) -> CommHandle:
        """``dy [m, n/out]`` -> handle of ``dx [m, k/in]``: local GEMM, all-reduce over the out axis."""
        w = weight_block.reshape(self.block_shape)
        dx_partial = kernels.matmul(dy, w, self.counter, progress=comm.compute_hook,
                                    out=self.backend.empty((dy.shape[0], self.block_shape[1])))
        return comm.allreduce(self.out_axis, dx_partial)

    def backward_weight(self, dy, x, comm: Optional[Collectives] = None):
        """``dW_blk = dy^T x`` ``[n/out, k/in]``, partial over this rank's tokens.

        No communication; ``comm`` only lends its progress hook to the GEMM.
        """
        return kernels.matmul(dy.T, x, self.counter, progress=comm.compute_hook if comm else None,
                              out=self.backend.empty(self.block_shape))

    def flops_per_token(self) -> int:
        """Local forward GEMM FLOPs per token on this rank."""
        return 2 * self.block_shape[0] * self.block_shape[1]


class LayerNorm4D:
    """LayerNorm over a hidden dimension sharded over X (statistics all-reduced over X).

    Input/output ``[m, h/x]`` replicated over Y. gamma, beta: ``[h/x]``, replicated
    over Y and Z; their gradients are summed over Z and data by the engine.
    Unlike AxoNN, which normalizes each shard on its own, the mean and variance
    are those of the full hidden vector (two-pass, for float32 accuracy).
    """

    #: the axis sharding the hidden dimension, over which the statistics are all-reduced
    stats_axis = "x"

    def __init__(self, name: str, hidden: int, grid, backend, eps: float = 1e-5):
        self.name = name
        self.hidden = hidden
        self.eps = eps
        self.backend = backend
        axis = self.stats_axis
        start, stop = block_range(hidden, grid.shape[axis], grid.coords[axis])
        xp = backend.xp
        layout = Layout(("hidden",), ((axis,),))

        def index():
            return np.arange(start, stop, dtype=np.int64)

        self.gamma = Parameter(f"{name}.gamma", backend.asarray(np.ones(stop - start)), layout,
                               ("data",), (hidden,), index)
        self.beta = Parameter(f"{name}.beta", backend.asarray(np.zeros(stop - start)), layout,
                              ("data",), (hidden,), index)
        self.xp = xp

    def forward(self, x, comm: Collectives):
        """``x [m, h/x]`` -> ``(y [m, h/x], saved)``. Two all-reduces over X of ``[m, 1]``."""
        trace = comm.tracer
        empty = self.backend.empty
        with trace.op("layernorm"):
            row_sums = x.sum(axis=1, keepdims=True)
        mean = comm.allreduce(self.stats_axis, row_sums).wait() / self.hidden
        with trace.op("layernorm"):
            xhat = empty(x.shape)
            squares = elementwise.centered_squares(x, mean, xhat)
        var = comm.allreduce(self.stats_axis, squares).wait() / self.hidden
        with trace.op("layernorm"):
            # CuPy promotes bfloat16 with a Python float to float32: back to x's dtype for the kernels
            rstd = (1.0 / self.xp.sqrt(var + self.eps)).astype(x.dtype, copy=False)
            y, xhat = elementwise.layernorm_apply(x, mean, rstd, self.gamma.data, self.beta.data, empty(x.shape),
                                                  xhat)
        return y, (xhat, rstd)

    def backward(self, dy, saved, comm: Collectives):
        """``dy [m, h/x]`` -> ``dx [m, h/x]``; sets the local (token-partial) gamma/beta grads.

        One all-reduce over X of ``[m, 2]``.
        """
        xhat, rstd = saved
        trace = comm.tracer
        empty = self.backend.empty
        with trace.op("layernorm"):
            partial_sums = empty((dy.shape[0], 2))
            dgamma, dbeta = elementwise.layernorm_backward_local(dy, xhat, self.gamma.data, partial_sums, empty)
        sums = comm.allreduce(self.stats_axis, partial_sums).wait()
        self.gamma.grad, self.beta.grad = dgamma, dbeta
        with trace.op("layernorm"):
            return elementwise.layernorm_backward_finish(dy, xhat, self.gamma.data, rstd, sums, self.hidden,
                                                         empty(dy.shape), empty)

    def reduce_param_grads(self, comm: Collectives):
        """All-reduce the token-partial gamma/beta grads over Z. Returns ``[(param, handle)]``.

        Collective over Z (then over data, by the engine: ``reduce_axes``).
        """
        return [(p, first(p.grad)) for p, first in self.grad_reductions(comm)]

    def grad_reductions(self, comm: Collectives):
        """``[(param, first)]``: ``first(partial)`` issues the all-reduce over Z of a token-partial gradient
        (for :meth:`~fourd_mpi.step.schedule.GradientSync.reduce`, which may accumulate micro-batches first)."""
        return [(p, lambda g: comm.allreduce("z", g)) for p in (self.gamma, self.beta)]

    def parameters(self):
        return [self.gamma, self.beta]
