"""Local math of the step: GEMMs and causal attention (elementwise math: :mod:`fourd_mpi.step.elementwise`).

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

from fourd_mpi.step import devicegemm, elementwise


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


def matmul(a, b, counter: ComputeCounter = None, kind: str = "gemm", progress=None, out=None):
    """``a @ b`` for 2-D (or batched, leading dims) operands; counts ``2*M*N*K`` FLOPs.

    ``out``: where the product goes (the caller's pooled array, shape ``a.shape[:-1] + (n,)``);
    None allocates a fresh one.

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
    if not isinstance(a, np.ndarray):  # cupy.matmul, or cuBLAS for batched 16-bit
        out = device_op(lambda: devicegemm.matmul(a, b, out=out), counter, kind, flops, progress)
    else:
        tracer = counter.tracer if counter is not None else None
        if tracer is not None:
            t_start = time.perf_counter_ns()
            mpi_before = tracer.mpi_ns  # polls inside this GEMM are MPI time, not compute
        if progress is None or flops <= progress.chunk_flops:
            t0 = time.perf_counter()
            out = np.matmul(a, b, out=out)
            if timing or progress is not None:
                seconds = time.perf_counter() - t0
                if timing:
                    counter.add(kind, seconds)
                observe = getattr(progress, "observe", None)  # --poll-flops auto learns the GEMM rate
                if observe is not None:
                    observe(flops, seconds)
        else:
            out, seconds = _chunked_matmul(a, b, flops, progress, timing, out)
            if timing:
                counter.add(kind, seconds)
        if tracer is not None:
            tracer.compute(kind, t_start, time.perf_counter_ns(), flops, tracer.mpi_ns - mpi_before)
        if timing:
            counter.flops[kind] = counter.flops.get(kind, 0.0) + flops
    if timing and kind == "gemm":
        key = (m, n, k, a.strides[-1] == a.itemsize, b.strides[-1] == b.itemsize)
        counter.shapes[key] = counter.shapes.get(key, 0) + 1
    return out


def device_op(run, counter: ComputeCounter = None, kind: str = "gemm", flops: float = 0.0, progress=None):
    """Launch ``run()`` (asynchronous GPU work on the compute stream) and account for it as ``kind``.

    ``flops``: what the work counts for (:attr:`ComputeCounter.flops`, the trace's compute events).
    CUDA events recorded around the launch time it on the compute stream: host clocks are read
    only after a synchronization (trace level ``op``) or not at all (read from the events later).
    ``progress``: as :func:`matmul`'s: the host polls MPI until the work's event completes.
    Returns what ``run`` returns. No communication here beyond those progress polls.
    """
    timing = counter is not None and counter.enabled
    tracer = counter.tracer if counter is not None else None
    sync_ops = tracer is not None and tracer.synchronize is not None and tracer.keep_ops
    if sync_ops:
        tracer.synchronize()
    t_start = time.perf_counter_ns() if tracer is not None else 0
    watch = None
    if timing or tracer is not None:
        watch = counter.backend.stopwatch()
        watch.start()
    result = run()
    if watch is not None:
        watch.stop()
    if progress is not None:
        _poll_until_done(progress)
    if timing:
        counter.add(kind, watch=watch)
        counter.flops[kind] = counter.flops.get(kind, 0.0) + flops
    if tracer is not None:
        if not sync_ops:
            tracer.compute_deferred(kind, watch, flops)
        else:
            tracer.synchronize()
            t_end = time.perf_counter_ns()
            # the kernels' own duration, placed at the end of their synchronized bracket
            tracer.compute(kind, max(t_start, t_end - watch.elapsed_ns()), t_end, flops, 0)
    return result


def _poll_until_done(progress) -> None:
    """GPU: the kernel is asynchronous; poll MPI until the compute stream reaches this point."""
    import cupy

    event = cupy.cuda.Event(block=False, disable_timing=True)
    event.record()
    while not event.done:
        # the GPU computes meanwhile: these polls are not host time taken from compute (not MPI time)
        progress(record=False)


#: Smallest extent of a GEMM chunk along the split dimension: thinner pieces run
#: at matrix-vector speed and cost more than the progress they buy.
MIN_CHUNK_EXTENT = 64


def _chunked_matmul(a, b, flops: float, progress, timing: bool, out=None):
    """The product in pieces, ``progress()`` between them, each piece written into its slice of ``out``.

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
    xp = elementwise.array_module(a)
    if out is None:
        out = xp.empty(_product_shape(a, b), dtype=xp.result_type(a.dtype, b.dtype))
    seconds = 0.0
    observe = getattr(progress, "observe", None)  # --poll-flops auto learns the GEMM rate from the pieces
    for i, (start, stop) in enumerate(bounds):
        t0 = time.perf_counter()
        if a.ndim > 2:
            xp.matmul(a[start:stop], b[start:stop] if batched_b else b, out=out[start:stop])
        elif axis == 0:
            xp.matmul(a[start:stop], b, out=out[start:stop])  # contiguous rows of out
        else:
            xp.matmul(a, b[:, start:stop], out=out[:, start:stop])
        piece = time.perf_counter() - t0
        seconds += piece
        if observe is not None:
            observe(flops * (stop - start) / length, piece)
        if i + 1 < pieces:
            progress()
    return out, seconds


def _product_shape(a, b):
    """Shape of ``a @ b`` (2-D, or batched with ``a``'s leading dims)."""
    return tuple(a.shape[:-1]) + (b.shape[-1],)


def attention_forward(xp, qkv, batch: int, seq: int, heads: int, head_dim: int, counter=None, progress=None,
                      empty=None):
    """Causal multi-head attention on this rank's heads.

    qkv: ``[batch*seq, heads*3*head_dim]``, per head ``[q | k | v]`` (Megatron order),
    so a contiguous block of columns holds whole heads.
    Returns ``ctx [batch*seq, heads*head_dim]`` and ``(q, k, v, probs)`` for backward
    (``probs [b, nh, s, s]``: this implementation keeps the score matrix, as unfused attention does).
    ``empty(shape, dtype)``: where the scores, probabilities and outputs are allocated (the pool).
    """
    t = qkv.reshape(batch, seq, heads, 3, head_dim)
    q = t[:, :, :, 0, :].transpose(0, 2, 1, 3)  # [b, nh, s, hd]
    k = t[:, :, :, 1, :].transpose(0, 2, 1, 3)
    v = t[:, :, :, 2, :].transpose(0, 2, 1, 3)
    dtype = qkv.dtype

    def new(shape):
        return elementwise.new_array(empty, xp, shape, dtype)

    probs = matmul(q, k.transpose(0, 1, 3, 2), counter, "attention", progress,
                   out=new((batch, heads, seq, seq)))
    elementwise.causal_softmax_(probs, 1.0 / math.sqrt(head_dim))
    ctx = matmul(probs, v, counter, "attention", progress, out=new((batch, heads, seq, head_dim)))
    out = new((batch * seq, heads * head_dim))
    xp.copyto(out.reshape(batch, seq, heads, head_dim), ctx.transpose(0, 2, 1, 3))
    return out, (q, k, v, probs)


def attention_backward(xp, dctx, saved, batch: int, seq: int, heads: int, head_dim: int, counter=None,
                       progress=None, empty=None):
    """Gradient of :func:`attention_forward`: ``dctx [b*s, nh*hd]`` -> ``dqkv [b*s, nh*3*hd]``."""
    q, k, v, probs = saved
    dtype = dctx.dtype

    def new(shape):
        return elementwise.new_array(empty, xp, shape, dtype)

    d = dctx.reshape(batch, seq, heads, head_dim).transpose(0, 2, 1, 3)
    per_head = (batch, heads, seq, head_dim)
    dqkv = new((batch * seq, heads * 3 * head_dim))
    parts = dqkv.reshape(batch, seq, heads, 3, head_dim)
    dv = matmul(probs.transpose(0, 1, 3, 2), d, counter, "attention", progress, out=new(per_head))
    xp.copyto(parts[:, :, :, 2, :], dv.transpose(0, 2, 1, 3))
    del dv
    dscores = matmul(d, v.transpose(0, 1, 3, 2), counter, "attention", progress,
                     out=new((batch, heads, seq, seq)))
    elementwise.softmax_backward_(probs, dscores, 1.0 / math.sqrt(head_dim))
    piece = new(per_head)
    matmul(dscores, k, counter, "attention", progress, out=piece)
    xp.copyto(parts[:, :, :, 0, :], piece.transpose(0, 2, 1, 3))
    matmul(dscores.transpose(0, 1, 3, 2), q, counter, "attention", progress, out=piece)
    xp.copyto(parts[:, :, :, 1, :], piece.transpose(0, 2, 1, 3))
    return dqkv


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
