"""Local math of the step: GEMMs, GeLU, LayerNorm pieces, causal attention.

Pure functions on backend arrays (``xp`` is NumPy or CuPy). No communication
here: where a reduction over a sharded dimension is needed, the functions take
the already-reduced statistics as arguments, and the layer code does the
collective in between.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Dict

import numpy as np


@dataclass
class ComputeCounter:
    """Optional accounting of local GEMM time and FLOPs, by kind.

    When ``enabled`` every GEMM is timed: on the host around the call (NumPy), with
    CUDA events recorded on the compute stream around the kernel (CuPy). Event
    times are read lazily (:attr:`seconds` synchronizes the recorded events), so
    counting does not serialize host and device.
    """

    backend: object = None
    enabled: bool = False
    #: a :class:`fourd_mpi.trace.events.Tracer` told about every GEMM (None: no tracing)
    tracer: object = None
    _seconds: Dict[str, float] = field(default_factory=dict)
    flops: Dict[str, float] = field(default_factory=dict)
    shapes: Dict[tuple, int] = field(default_factory=dict)
    _pending: list = field(default_factory=list)

    @property
    def seconds(self) -> Dict[str, float]:
        """Seconds per kind (event-timed GEMMs are resolved first: waits for them)."""
        if self._pending:
            for kind, watch in self._pending:
                self._seconds[kind] = self._seconds.get(kind, 0.0) + watch.elapsed_ns() * 1e-9
            self._pending.clear()
        return self._seconds

    def add(self, kind: str, seconds: float = 0.0, watch=None) -> None:
        if watch is not None:
            self._pending.append((kind, watch))
        else:
            self._seconds[kind] = self._seconds.get(kind, 0.0) + seconds

    def reset(self) -> None:
        self._pending.clear()
        self._seconds.clear()
        self.flops.clear()
        self.shapes.clear()

    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def total_flops(self) -> float:
        return sum(self.flops.values())


def matmul(a, b, counter: ComputeCounter = None, kind: str = "gemm", progress=None):
    """``a @ b`` for 2-D (or batched, leading dims) operands; counts ``2*M*N*K`` FLOPs.

    ``progress``: None, or a callable with a ``chunk_flops`` attribute, called so
    that MPI can advance collectives in flight. On the host the product is computed
    in pieces of about ``chunk_flops`` (see :func:`_chunked_matmul`) with
    ``progress()`` between pieces. On a GPU the GEMM is one asynchronous kernel and
    the host calls ``progress()`` until the kernel's event completes. The result is
    the same.

    Timing on a GPU uses CUDA events recorded around the kernel on the compute
    stream: host clocks are read only after a synchronization (trace level ``op``)
    or not at all (the durations are read from the events later).
    """
    m, k = a.shape[-2], a.shape[-1]
    n = b.shape[-1]
    batch = max(1, a.size // (m * k)) if a.ndim > 2 else 1
    flops = 2.0 * batch * m * n * k
    timing = counter is not None and counter.enabled
    tracer = counter.tracer if counter is not None else None
    sync_ops = tracer is not None and tracer.synchronize is not None and tracer.keep_ops
    device = not isinstance(a, np.ndarray)
    if sync_ops:
        tracer.synchronize()
    if tracer is not None:
        t_start = time.perf_counter_ns()
    watch = None
    if device:
        if timing or tracer is not None:
            watch = counter.backend.stopwatch()
            watch.start()
        out = a @ b
        if watch is not None:
            watch.stop()
        if progress is not None:
            _poll_until_done(progress)
        if timing:
            counter.add(kind, watch=watch)
    elif progress is None or flops <= progress.chunk_flops:
        t0 = time.perf_counter()
        out = a @ b
        if timing:
            counter.add(kind, time.perf_counter() - t0)
    else:
        out, seconds = _chunked_matmul(a, b, flops, progress, timing)
        if timing:
            counter.add(kind, seconds)
    if tracer is not None:
        if device and not sync_ops:
            tracer.compute_deferred(kind, watch, flops)
        else:
            if sync_ops:
                tracer.synchronize()
            t_end = time.perf_counter_ns()
            if device:  # the kernel's own duration, placed at the end of its synchronized bracket
                t_start = max(t_start, t_end - watch.elapsed_ns())
            tracer.compute(kind, t_start, t_end, flops)
    if timing:
        counter.flops[kind] = counter.flops.get(kind, 0.0) + flops
        if kind == "gemm":
            key = (m, n, k, a.strides[-1] == a.itemsize, b.strides[-1] == b.itemsize)
            counter.shapes[key] = counter.shapes.get(key, 0) + 1
    return out


def _poll_until_done(progress) -> None:
    """GPU: the kernel is asynchronous; poll MPI until the compute stream reaches this point."""
    import cupy

    event = cupy.cuda.Event(block=False, disable_timing=True)
    event.record()
    while not event.done:
        progress()


def _array_module(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy


#: Smallest extent of a GEMM chunk along the split dimension: thinner pieces run
#: at matrix-vector speed and cost more than the progress they buy.
MIN_CHUNK_EXTENT = 64


def _chunked_matmul(a, b, flops: float, progress, timing: bool):
    """The product in pieces, ``progress()`` between them.

    2-D: split the larger of M (rows of ``a``) and N (columns of ``b``), so each
    piece is still a real GEMM. Batched: split the leading batch dimension.
    """
    if a.ndim > 2:
        axis, length, floor = 0, a.shape[0], 1
    elif a.shape[0] >= b.shape[1]:
        axis, length, floor = 0, a.shape[0], MIN_CHUNK_EXTENT
    else:
        axis, length, floor = 1, b.shape[1], MIN_CHUNK_EXTENT
    floor = max(1, min(floor, length // 2))  # small operands: still at least two pieces
    pieces = max(1, min(length // floor, int(flops // progress.chunk_flops)))
    bounds = [(i * length // pieces, (i + 1) * length // pieces) for i in range(pieces)]
    batched_b = a.ndim > 2 and b.ndim == a.ndim and b.shape[0] == length
    xp = _array_module(a)
    row_split = a.ndim == 2 and axis == 0
    out = xp.empty((a.shape[0], b.shape[1]), dtype=xp.result_type(a.dtype, b.dtype)) if row_split else None
    parts, seconds = [], 0.0
    for i, (start, stop) in enumerate(bounds):
        t0 = time.perf_counter()
        if row_split:
            xp.matmul(a[start:stop], b, out=out[start:stop])  # contiguous rows of out: no copy
        elif a.ndim > 2:
            parts.append(a[start:stop] @ (b[start:stop] if batched_b else b))
        else:
            parts.append(a @ b[:, start:stop])
        if timing:
            seconds += time.perf_counter() - t0
        if i + 1 < pieces:
            progress()
    if row_split:
        return out, seconds
    return xp.concatenate(parts, axis=0 if a.ndim > 2 else 1), seconds


_GELU_C = math.sqrt(2.0 / math.pi)


def gelu(xp, x):
    """GeLU, tanh approximation (as in GPT-2 / Megatron)."""
    return 0.5 * x * (1.0 + xp.tanh(_GELU_C * (x + 0.044715 * x * x * x)))


def gelu_backward(xp, x, dy):
    """``dy * gelu'(x)``."""
    inner = _GELU_C * (x + 0.044715 * x * x * x)
    t = xp.tanh(inner)
    dinner = _GELU_C * (1.0 + 3 * 0.044715 * x * x)
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner)


def layernorm_apply(x, mean, rstd, gamma, beta):
    """``xhat = (x - mean) * rstd``; returns ``(xhat * gamma + beta, xhat)``.

    x: ``[m, h_loc]``; mean, rstd: ``[m, 1]`` statistics over the *full* hidden dim.
    """
    xhat = (x - mean) * rstd
    return xhat * gamma + beta, xhat


def layernorm_backward_local(dy, xhat, gamma):
    """Local pieces of LayerNorm's backward.

    Returns ``g = dy*gamma`` ``[m, h_loc]``, the per-token partial sums
    ``[sum(g), sum(g*xhat)]`` ``[m, 2]`` (to be summed over the hidden shards), and
    the per-shard parameter gradients ``dgamma, dbeta`` ``[h_loc]`` (to be summed over tokens).
    """
    g = dy * gamma
    partial = (g.sum(axis=1, keepdims=True), (g * xhat).sum(axis=1, keepdims=True))
    dgamma = (dy * xhat).sum(axis=0)
    dbeta = dy.sum(axis=0)
    return g, partial, dgamma, dbeta


def layernorm_backward_finish(g, xhat, rstd, sum_g, sum_gx, hidden: int):
    """``dx = rstd * (g - mean(g) - xhat * mean(g*xhat))`` with means over the full hidden dim."""
    return rstd * (g - sum_g / hidden - xhat * (sum_gx / hidden))


def attention_forward(xp, qkv, batch: int, seq: int, heads: int, head_dim: int, counter=None, progress=None):
    """Causal multi-head attention on this rank's heads.

    qkv: ``[batch*seq, heads*3*head_dim]``, per head ``[q | k | v]`` (Megatron order),
    so a contiguous block of columns holds whole heads.
    Returns ``ctx [batch*seq, heads*head_dim]`` and ``(q, k, v, probs)`` for backward.
    """
    t = qkv.reshape(batch, seq, heads, 3, head_dim)
    q = t[:, :, :, 0, :].transpose(0, 2, 1, 3)  # [b, nh, s, hd]
    k = t[:, :, :, 1, :].transpose(0, 2, 1, 3)
    v = t[:, :, :, 2, :].transpose(0, 2, 1, 3)
    scale = 1.0 / math.sqrt(head_dim)
    scores = matmul(q, k.transpose(0, 1, 3, 2), counter, "attention", progress) * scale
    mask = xp.triu(xp.ones((seq, seq), dtype=bool), k=1)
    scores = xp.where(mask, -xp.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = xp.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    ctx = matmul(probs, v, counter, "attention", progress)  # [b, nh, s, hd]
    ctx = ctx.transpose(0, 2, 1, 3).reshape(batch * seq, heads * head_dim)
    return ctx, (q, k, v, probs)


def attention_backward(xp, dctx, saved, batch: int, seq: int, heads: int, head_dim: int, counter=None,
                       progress=None):
    """Gradient of :func:`attention_forward`: ``dctx [b*s, nh*hd]`` -> ``dqkv [b*s, nh*3*hd]``."""
    q, k, v, probs = saved
    scale = 1.0 / math.sqrt(head_dim)
    d = dctx.reshape(batch, seq, heads, head_dim).transpose(0, 2, 1, 3)
    dv = matmul(probs.transpose(0, 1, 3, 2), d, counter, "attention", progress)
    dprobs = matmul(d, v.transpose(0, 1, 3, 2), counter, "attention", progress)
    dscores = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True)) * scale
    dq = matmul(dscores, k, counter, "attention", progress)
    dk = matmul(dscores.transpose(0, 1, 3, 2), q, counter, "attention", progress)
    dqkv = xp.stack([dq, dk, dv], axis=3)  # [b, nh, s, 3, hd]
    return dqkv.transpose(0, 2, 1, 3, 4).reshape(batch * seq, heads * 3 * head_dim)


def standalone_gemm_tflops(backend, m: int, n: int, k: int, repeats: int = 5, min_seconds: float = 0.05) -> float:
    """Best TFLOP/s of ``[m, k] @ [k, n]`` in the backend's dtype, nothing else running on this rank.

    The reference "peak" of a run when the user names none: the local GEMM speed this
    rank can reach with this shape, library and dtype (and TF32 setting). Timed with the
    backend's stopwatch: host clock on NumPy, CUDA events on CuPy (host clocks are read
    only after the stop event completed).
    """
    xp = backend.xp
    rng = np.random.default_rng(1)
    a = backend.asarray(rng.standard_normal((m, k)))
    b = backend.asarray(rng.standard_normal((k, n)))
    a @ b  # warm-up: library initialization, page faults, cuBLAS heuristics
    backend.synchronize()
    watch = backend.stopwatch()
    watch.start()
    xp.matmul(a, b)
    watch.stop()
    one = max(watch.elapsed_ns() * 1e-9, 1e-9)
    calls = max(1, int(math.ceil(min_seconds / repeats / one)))
    best = math.inf
    for _ in range(repeats):
        watch = backend.stopwatch()
        watch.start()
        for _ in range(calls):
            xp.matmul(a, b)
        watch.stop()
        best = min(best, watch.elapsed_ns() * 1e-9 / calls)
    return 2.0 * m * n * k / max(best, 1e-12) / 1e12
