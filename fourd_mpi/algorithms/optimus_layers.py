"""Optimus-CUBE's linear layer and LayerNorm on the cube ``q x q x q`` (layouts: :mod:`fourd_mpi.algorithms.cube`).

Each method reads as *communicate, compute, communicate* and returns a
:class:`~fourd_mpi.core.collectives.CommHandle`; the schedule (:func:`cube_linear_forward`,
:func:`cube_linear_backward`) decides where to wait. Local math is :mod:`fourd_mpi.step.kernels`
and :mod:`fourd_mpi.step.elementwise`; no communication hides inside them.

One layer ``y = x W^T``, ``W[n, k]``, parity 0 (``gather = y``, ``scatter = z``; parity 1 swaps
them), ``m`` this rank's tokens, ``q`` the cube's edge (Colossal-AI's ``_Linear3D``):

===========================  ============  ===================================================
step                         axis          shapes
===========================  ============  ===================================================
all-gather X                 gather        ``[m, k/q]`` -> ``Xg [q*m, k/q]``
all-gather W^T               x             ``[k/q^2, n/q]`` -> ``Wg [k/q, n/q]``
GEMM                         -             ``Yp = Xg Wg`` ``[q*m, n/q]`` (partial over scatter)
reduce-scatter Y             scatter       ``Yp`` -> ``Y [m, n/q]``
all-gather dY (backward)     scatter       ``[m, n/q]`` -> ``dYg [q*m, n/q]``
dX, reduce-scatter           gather        ``dYg Wg^T`` ``[q*m, k/q]`` -> ``dX [m, k/q]``
dW, reduce-scatter           x             ``Xg^T dYg`` ``[k/q, n/q]`` -> ``[k/q^2, n/q]``
gradient all-reduce          data          ``[k/q^2, n/q]`` (by the step engine)
===========================  ============  ===================================================

The forward keeps ``Xg`` for the backward (Colossal-AI saves the gathered input) and the gathered
weight (the step runs optimus3d with the weight cache on: Colossal-AI's ``save_for_backward``).
"""

from __future__ import annotations

import math
from typing import Optional

from fourd_mpi.algorithms import cube
from fourd_mpi.core.collectives import Collectives, CommHandle
from fourd_mpi.core.layout import Layout
from fourd_mpi.step import kernels
from fourd_mpi.step.layers import LayerNorm4D, Parameter
from fourd_mpi.step.synthetic import stream_id, uniform_at


class CubeLinear:
    """``y = x W^T`` with Optimus-CUBE's 3D matrix multiplication (module docstring).

    Parameters: name (seeds the weights, as :class:`~fourd_mpi.step.layers.FullyConnected4D`: same
    global tensor for the same name and seed), n_out, k_in, parity (0: input gathered over Y, output
    scattered over Z; 1: the other way round), grid, backend, seed, init_scale (uniform bound
    ``init_scale/sqrt(k_in)``), counter.
    """

    def __init__(self, name: str, n_out: int, k_in: int, parity: int, grid, backend, seed: int,
                 init_scale: float = 1.0, counter: Optional[kernels.ComputeCounter] = None):
        self.name = name
        self.n_out, self.k_in = n_out, k_in
        self.parity = parity
        self.gather_axis, self.scatter_axis = cube.axes_of(parity)
        self.backend = backend
        self.counter = counter
        q = grid.shape.x
        #: the gathered weight block ``W[n/q, k/q]`` (stored and gathered transposed: ``W^T[k/q, n/q]``)
        self.block_shape = (n_out // q, k_in // q)
        shape, coords = grid.shape, dict(grid.coords)

        def global_index():
            return cube.weight_shard_index(n_out, k_in, parity, shape, coords)

        bound = init_scale / math.sqrt(k_in)
        values = uniform_at(seed, stream_id("weight", name), global_index()) * bound
        self.weight = Parameter(
            name=f"{name}.weight",
            data=backend.asarray(values),
            layout=Layout(("in", "out"), ((self.scatter_axis, "x"), (self.gather_axis,))),
            reduce_axes=("data",),
            global_shape=(n_out, k_in),
            global_index=global_index,
        )

    # communication ---------------------------------------------------------
    def gather_weight(self, comm: Collectives, tag=None) -> CommHandle:
        """All-gather the ``W^T`` shards over X (cube axis i). Result: flat ``W^T[k/q, n/q]``."""
        return comm.allgather("x", self.weight.data, tag)

    def gather_input(self, x, comm: Collectives) -> CommHandle:
        """All-gather ``x [m, k/q]`` over the gather axis. Result: flat ``Xg [q*m, k/q]``."""
        return comm.allgather(self.gather_axis, x.reshape(-1))

    def gather_output_grad(self, dy, comm: Collectives) -> CommHandle:
        """All-gather ``dy [m, n/q]`` over the scatter axis. Result: flat ``dYg [q*m, n/q]``."""
        return comm.allgather(self.scatter_axis, dy.reshape(-1))

    def reduce_weight_grad(self, dw_block, comm: Collectives) -> CommHandle:
        """Reduce-scatter ``dW^T [k/q, n/q]`` over X (sums the X ranks' token blocks). Result: the shard."""
        return comm.reduce_scatter("x", dw_block.reshape(-1))

    # compute + the collective that completes it ------------------------------
    def forward(self, xg, weight_block, comm: Collectives) -> CommHandle:
        """``Xg [q*m, k/q]`` -> handle of ``y [m, n/q]``: local GEMM, reduce-scatter over the scatter axis
        (rows: this rank's token block). Result flat; reshape to ``(-1, n/q)``."""
        w_t = weight_block.reshape(self.block_shape[1], self.block_shape[0])
        y = kernels.matmul(xg, w_t, self.counter, progress=comm.compute_hook,
                           out=self.backend.empty((xg.shape[0], w_t.shape[1])))
        return comm.reduce_scatter(self.scatter_axis, y.reshape(-1))

    def backward_input(self, dyg, weight_block, comm: Collectives) -> CommHandle:
        """``dYg [q*m, n/q]`` -> handle of ``dx [m, k/q]`` (flat): GEMM with ``Wg^T``, reduce-scatter over the
        gather axis."""
        w_t = weight_block.reshape(self.block_shape[1], self.block_shape[0])
        dx = kernels.matmul(dyg, w_t.T, self.counter, progress=comm.compute_hook,
                            out=self.backend.empty((dyg.shape[0], w_t.shape[0])))
        return comm.reduce_scatter(self.gather_axis, dx.reshape(-1))

    def backward_weight(self, dyg, xg, comm: Optional[Collectives] = None):
        """``dW^T = Xg^T dYg`` ``[k/q, n/q]``, partial over this rank's tokens. No communication."""
        return kernels.matmul(xg.T, dyg, self.counter, progress=comm.compute_hook if comm else None,
                              out=self.backend.empty((self.block_shape[1], self.block_shape[0])))

    def flops_per_token(self) -> int:
        """Local forward GEMM FLOPs per gathered token on this rank."""
        return 2 * self.block_shape[0] * self.block_shape[1]


class CubeLayerNorm(LayerNorm4D):
    """LayerNorm over a hidden dimension sharded over Z (cube axis l): statistics all-reduced over Z.

    Input/output ``[m, h/q]`` (tokens over data, X, Y). ``gamma, beta`` ``[h/q]`` over Z, replicated
    over X and Y (Colossal-AI's ``LayerNorm3D``); their token-partial gradients are all-reduced over
    X, then Y (Colossal-AI: one all-reduce over the X x Y plane), then data (the engine). The math is
    :class:`~fourd_mpi.step.layers.LayerNorm4D`'s, on another axis.
    """

    stats_axis = "z"

    def reduce_param_grads(self, comm: Collectives):
        """All-reduce the token-partial gamma/beta grads over X (waited: ``[h/q]``, small), then issue the
        one over Y. Returns ``[(param, handle of the Y all-reduce)]`` (data follows: ``reduce_axes``).

        Two stages issued here, at one program point, so that the engine's lazily issued stages are only
        the data all-reduces (:mod:`fourd_mpi.step.schedule`: their order is then the same on every rank).
        """
        out = []
        for p in (self.gamma, self.beta):
            over_x = comm.allreduce("x", p.grad).wait()
            out.append((p, comm.allreduce("y", over_x)))
        return out


def cube_linear_forward(layer: CubeLinear, x, ctx):
    """Forward of one layer (phase ``ctx.phase``): all-gather X, all-gather W (or take it from the cache /
    the prefetch), GEMM, reduce-scatter Y. Returns ``(y [m, n/q], Xg [q*m, k/q])``."""
    comm = ctx.comm
    with comm.tracer.layer(layer.name, ctx.phase):
        gathering = layer.gather_input(x, comm)  # in flight while the weight gather is issued
        weight = ctx.weights.get(layer, keep=ctx.phase == "recompute")
        xg = gathering.wait().reshape(-1, layer.k_in // comm.grid.size("x"))
        y = layer.forward(xg, weight, comm).wait()
        return y.reshape(-1, layer.block_shape[0]), xg


def cube_linear_backward(layer: CubeLinear, dy, xg, ctx):
    """Backward of one layer; returns ``dx [m, k/q]``; the weight gradient goes to ``ctx.grads``.

    All-gather dY, dX GEMM and its reduce-scatter (in flight during the dW GEMM with OAR, as
    Colossal-AI waits it after the dW GEMM), dW GEMM and its reduce-scatter over X (kept in flight with
    ORS: Colossal-AI's asynchronous gradient bucket)."""
    comm = ctx.comm
    with comm.tracer.layer(layer.name, "backward"):
        dyg = layer.gather_output_grad(dy, comm).wait().reshape(-1, layer.block_shape[0])
        weight = ctx.weights.get(layer)
        dx = layer.backward_input(dyg, weight, comm)
        if not ctx.overlap.oar:
            dx.wait()
        dw = layer.backward_weight(dyg, xg, comm)
        ctx.grads.add(layer.weight, layer.reduce_weight_grad(dw, comm))
        return dx.wait().reshape(-1, layer.block_shape[1])
