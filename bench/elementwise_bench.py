"""Elementwise work of the step, before and after: textbook expressions vs the lean kernels.

For each operation of :mod:`fourd_mpi.step.elementwise` this times, alternating
repeat by repeat on the same inputs, the expression the step used before (the
textbook formula with NumPy temporaries, as in fourd_mpi 0.1's ``kernels.py``,
``optim.py`` and ``model.py``; written out below as ``naive_*``) and the lean
version the step uses now (in-place ufuncs with pooled scratch on NumPy; one fused
kernel per operation on CuPy), checks that both give the same numbers, and prints

    op  shape  before (ms)  after (ms)  after/before  max rel. diff

Times are medians over ``--repeats`` alternating pairs (host clock around the call,
synchronized on CuPy). Single process, no MPI. Run with ``OMP_NUM_THREADS=1``::

    OMP_NUM_THREADS=1 python -m bench.elementwise_bench --rows 2048 --cols 1024
    python -m bench.elementwise_bench --backend cupy --dtype float32     # on a GPU
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import numpy as np

from fourd_mpi.step import elementwise

C, A = math.sqrt(2.0 / math.pi), 0.044715


# the step's elementwise code before (fourd_mpi 0.1) -------------------------------------------
def naive_gelu(xp, u):
    return 0.5 * u * (1.0 + xp.tanh(C * (u + 0.044715 * u * u * u)))


def naive_gelu_backward(xp, x, dy):
    inner = C * (x + 0.044715 * x * x * x)
    t = xp.tanh(inner)
    dinner = C * (1.0 + 3 * 0.044715 * x * x)
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner)


def naive_layernorm_forward(xp, x, mean, var, gamma, beta):
    centered = x - mean
    squares = (centered * centered).sum(axis=1, keepdims=True)
    rstd = 1.0 / xp.sqrt(var + 1e-5)
    xhat = (x - mean) * rstd
    return xhat * gamma + beta, xhat, squares


def naive_layernorm_backward(xp, dy, xhat, gamma, rstd, hidden):
    g = dy * gamma
    sum_g, sum_gx = g.sum(axis=1, keepdims=True), (g * xhat).sum(axis=1, keepdims=True)
    dgamma, dbeta = (dy * xhat).sum(axis=0), dy.sum(axis=0)
    partial = xp.concatenate([sum_g, sum_gx], axis=1)
    return rstd * (g - partial[:, :1] / hidden - xhat * (partial[:, 1:] / hidden)), dgamma, dbeta


def naive_softmax(xp, scores, scale):
    seq = scores.shape[-1]
    scores = scores * scale
    mask = xp.triu(xp.ones((seq, seq), dtype=bool), k=1)
    scores = xp.where(mask, -xp.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = xp.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def naive_softmax_backward(xp, probs, dprobs, scale):
    return probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True)) * scale


def naive_loss(xp, y, t, n):
    diff = y - t
    return float((diff * diff).sum()), diff / n


def naive_adam(xp, p, g, m, v, t):
    b1, b2, lr, eps = 0.9, 0.999, 1e-3, 1e-8
    c1, c2 = 1 - b1 ** t, 1 - b2 ** t
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p -= lr * (m / c1) / ((v / c2) ** 0.5 + eps)
    return p, m, v


def naive_residual(xp, a, b):
    return a + b


# --------------------------------------------------------------------------------------------
def cases(xp, rng, rows, cols, heads, seq, dtype, empty):
    def arr(*shape, scale=1.0):
        return xp.asarray((rng.standard_normal(shape) * scale).astype(dtype))

    u, dg = arr(rows, cols, scale=2.0), arr(rows, cols)
    x, gamma, beta = arr(rows, cols), arr(cols), arr(cols)
    mean = x.mean(axis=1, keepdims=True)
    var = x.var(axis=1, keepdims=True)
    rstd = 1.0 / xp.sqrt(var + 1e-5)
    xhat = (x - mean) * rstd
    batch = max(1, rows // seq)
    scores, dprobs = arr(batch, heads, seq, seq), arr(batch, heads, seq, seq)
    probs = naive_softmax(xp, scores, 0.125)
    p, m, v = arr(rows * cols), xp.zeros(rows * cols, dtype=dtype), xp.zeros(rows * cols, dtype=dtype)
    g = arr(rows * cols)
    n = rows * cols

    def lean_ln_fwd():
        xh = empty(x.shape, x.dtype)
        elementwise.centered_squares(x, mean, xh)
        return elementwise.layernorm_apply(x, mean, rstd, gamma, beta, empty(x.shape, x.dtype), xh)[0]

    def lean_ln_bwd():
        partial = empty((rows, 2), x.dtype)
        elementwise.layernorm_backward_local(dg, xhat, gamma, partial, empty)
        return elementwise.layernorm_backward_finish(dg, xhat, gamma, rstd, partial, cols, empty(x.shape, x.dtype),
                                                     empty)

    # in place, as in the step (on the GEMM's output, on the all-reduce's result): each keeps one
    # buffer that starts as a copy of the input (the first call is the one checked) and is then
    # updated in place again at every repeat (same work, values stay finite)
    soft, dsoft, res = scores.copy(), dprobs.copy(), u.copy()

    def lean_softmax():
        return elementwise.causal_softmax_(soft, 0.125)

    def lean_softmax_backward():
        return elementwise.softmax_backward_(probs, dsoft, 0.125)

    def lean_loss():
        dy = empty(u.shape, u.dtype)
        elementwise.mse_parts(u, x, dy, n)
        return dy

    def lean_residual():
        res[...] += x
        return res

    pa, ma, va = p.copy(), m.copy(), v.copy()

    def lean_adam():
        elementwise.adam_update(pa, g, ma, va, 1e-3, 0.9, 0.999, 0.1, 0.001, 1e-8, empty)
        return pa

    pb, mb, vb = p.copy(), m.copy(), v.copy()

    def before_adam():
        return naive_adam(xp, pb, g, mb, vb, 1)[0]

    return [
        ("gelu", (rows, cols), lambda: naive_gelu(xp, u), lambda: elementwise.gelu(u, empty(u.shape, u.dtype))),
        ("gelu backward", (rows, cols), lambda: naive_gelu_backward(xp, u, dg),
         lambda: elementwise.gelu_backward(u, dg, empty(u.shape, u.dtype), empty)),
        ("layernorm forward", (rows, cols), lambda: naive_layernorm_forward(xp, x, mean, var, gamma, beta)[0],
         lean_ln_fwd),
        ("layernorm backward", (rows, cols), lambda: naive_layernorm_backward(xp, dg, xhat, gamma, rstd, cols)[0],
         lean_ln_bwd),
        ("causal softmax", tuple(scores.shape), lambda: naive_softmax(xp, scores, 0.125), lean_softmax),
        ("softmax backward", tuple(scores.shape), lambda: naive_softmax_backward(xp, probs, dprobs, 0.125),
         lean_softmax_backward),
        ("mse loss", (rows, cols), lambda: naive_loss(xp, u, x, n)[1], lean_loss),
        ("residual add", (rows, cols), lambda: naive_residual(xp, u, x), lean_residual),
        ("adam update", (rows * cols,), before_adam, lean_adam),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2048, help="tokens per rank m (default 2048)")
    ap.add_argument("--cols", type=int, default=1024, help="local hidden/FFN width (default 1024)")
    ap.add_argument("--heads", type=int, default=4, help="local heads of the softmax case (default 4)")
    ap.add_argument("--seq", type=int, default=256, help="sequence length of the softmax case (default 256)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64", "float16"))
    ap.add_argument("--backend", default="numpy", choices=("numpy", "cupy"))
    ap.add_argument("--repeats", type=int, default=7, help="alternating before/after pairs (default 7)")
    args = ap.parse_args(argv)
    if args.backend == "cupy":
        import cupy as xp

        sync = xp.cuda.get_current_stream().synchronize

        def empty(shape, dtype):
            return xp.empty(shape, dtype=dtype)
    else:
        from fourd_mpi.core.bufferpool import HostArrayPool

        xp, sync, pool = np, (lambda: None), HostArrayPool()
        empty = pool.empty  # as in the step: the backend's pool
    rng = np.random.default_rng(0)
    print(f"# elementwise work before/after, {args.backend} {args.dtype}, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, median of {args.repeats} alternating pairs")
    print("# before: textbook NumPy/CuPy expressions (fourd_mpi 0.1); after: fourd_mpi.step.elementwise")
    print("# ratio = after / before (lower is better); diff = max |after - before| / max |before|")
    print(f"{'op':<20} {'shape':<22} {'before (ms)':>12} {'after (ms)':>11} {'ratio':>7} {'diff':>9}")
    for name, shape, before, after in cases(xp, rng, args.rows, args.cols, args.heads, args.seq,
                                            np.dtype(args.dtype), empty):
        ref, got = before(), after()  # warm-up: pool, kernel compilation, page faults
        diff = float(xp.max(xp.abs(got.astype(np.float64) - ref.astype(np.float64))) /
                     max(float(xp.max(xp.abs(ref.astype(np.float64)))), 1e-300))
        del ref, got
        tb, ta = [], []
        for _ in range(args.repeats):
            for fn, out in ((before, tb), (after, ta)):
                sync()
                t0 = time.perf_counter()
                r = fn()
                sync()
                out.append(time.perf_counter() - t0)
                del r
        b, a = statistics.median(tb) * 1e3, statistics.median(ta) * 1e3
        print(f"{name:<20} {'x'.join(map(str, shape)):<22} {b:12.3f} {a:11.3f} {a / b:7.2f} {diff:9.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
