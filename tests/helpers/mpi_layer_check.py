"""Run under mpiexec: one 4D FC layer (normal and transposed) against plain NumPy.

For every grid that factors the world size (or those given with --grid), each
rank builds the global X, W and dY itself, computes ``Y = X W^T``, ``dX = dY W``
and ``dW = dY^T X`` serially, and compares its own pieces of the distributed
results with them. Prints one line per (grid, layer kind) on rank 0 and exits 1
if any relative error exceeds the tolerance.
"""

import argparse
import sys

import numpy as np
from mpi4py import MPI

from fourd_mpi.core.backend import make_backend
from fourd_mpi.core.collectives import Collectives
from fourd_mpi.core.grid import GridShape, ProcessGrid, grid_factorizations
from fourd_mpi.core.layout import block_range, local_sequences
from fourd_mpi.step.layers import FullyConnected4D
from fourd_mpi.step.synthetic import stream_id, uniform_block
from fourd_mpi.trace.events import Tracer


def check(world, shape, transposed, n, k, tokens, dtype, seed=3):
    grid = ProcessGrid(world, shape)
    backend = make_backend("numpy", dtype)
    comm = Collectives(grid, backend, tracer=Tracer(level="step"))
    layer = FullyConnected4D("probe", n, k, transposed, grid, backend, seed)
    c = grid.coords
    in_axis, out_axis = layer.in_axis, layer.out_axis

    # independent global reference
    w_global = np.full(n * k, np.nan)
    w_global[layer.weight.global_index()] = layer.weight.data  # this rank's shard ...
    pieces = world.allgather((layer.weight.global_index(), np.asarray(layer.weight.data, np.float64)))
    for idx, val in pieces:  # ... and everybody else's
        w_global[idx] = val
    assert not np.isnan(w_global).any(), "weight shards do not tile W"
    W = w_global.reshape(n, k)
    X = uniform_block(seed, stream_id("x"), (tokens, k), slice(0, tokens), slice(0, k))
    dY = uniform_block(seed, stream_id("dy"), (tokens, n), slice(0, tokens), slice(0, n))

    t0, t1 = local_sequences(tokens, shape, c["data"], c["z"])
    i0, i1 = block_range(k, shape[in_axis], c[in_axis])
    o0, o1 = block_range(n, shape[out_axis], c[out_axis])
    x = backend.asarray(X[t0:t1, i0:i1])
    dy = backend.asarray(dY[t0:t1, o0:o1])

    w = layer.gather_weight(comm).wait()
    y = layer.forward(x, w, comm).wait()
    dx = layer.backward_input(dy, w, comm).wait()
    dw = layer.reduce_weight_grad(layer.backward_weight(dy, x), comm).wait()
    dw = comm.allreduce("data", dw).wait()

    def rel(a, b):
        return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-300))

    errors = [
        rel(y, (X @ W.T)[t0:t1, o0:o1]),
        rel(dx, (dY @ W)[t0:t1, i0:i1]),
        rel(dw, (dY.T @ X).ravel()[layer.weight.global_index()]),
    ]
    worst = world.allreduce(max(errors), op=MPI.MAX)
    grid.free()
    return worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", action="append", default=[])
    ap.add_argument("--dtype", default="float64")
    ap.add_argument("--tol", type=float, default=None)
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    size = world.Get_size()
    grids = [GridShape.parse(g) for g in args.grid] or list(grid_factorizations(size))
    tol = args.tol or {"float64": 1e-12, "float32": 1e-5}[args.dtype]
    failures = 0
    for shape in grids:
        for transposed in (False, True):
            # sizes divisible by every axis size and leaving a G_z-divisible block
            n = k = 2 * size
            err = check(world, shape, transposed, n, k, tokens=2 * size, dtype=np.dtype(args.dtype))
            ok = err <= tol
            failures += not ok
            if world.Get_rank() == 0:
                kind = "transposed" if transposed else "normal"
                print(f"{str(shape):>10} {kind:<10} max rel error {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
