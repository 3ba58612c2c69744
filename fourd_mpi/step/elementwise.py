"""Elementwise and row-wise math of the step, lean: GeLU, LayerNorm pieces, softmax, loss, optimizers.

Every function writes into arrays it is given (``out=``) or updates in place, so a
step allocates nothing here but what the caller hands in (the caller takes its
arrays from the backend's pool, :meth:`fourd_mpi.core.backend.ArrayBackend.empty`).

Two implementations of the same math:

* **NumPy** (and any array module with NumPy's ufunc ``out=`` semantics): chains of
  in-place ufuncs with at most one scratch array, and BLAS products for the row and
  column sums (``dy @ gamma``, ``diff . diff``) instead of an elementwise product
  followed by a sum.
* **CuPy**: one fused kernel per function (``cupy.ElementwiseKernel`` /
  ``cupy.ReductionKernel``, compiled once per dtype), instead of a chain of separate
  launches each reading and writing the whole tensor. float16, bfloat16 and float32
  compute in float, float64 in double; where CuPy cannot compile bfloat16 kernels
  (before CuPy 14) bfloat16 takes the chained path with ``out=`` arguments.

No communication: where a reduction over a sharded dimension is needed (LayerNorm
statistics over X) the functions take the already reduced sums, and the layer does
the collective in between.
"""

from __future__ import annotations

import functools
import math

import numpy as np

GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715


def _is_numpy(x) -> bool:
    return isinstance(x, np.ndarray)


# CuPy kernels ---------------------------------------------------------------------
_COMPUTE_TYPES = {"float16": "float", "bfloat16": "float", "float32": "float", "float64": "double"}


@functools.lru_cache(maxsize=None)
def _fused_ok(dtype_name: str) -> bool:
    """Whether this CuPy compiles and runs our kernels in ``dtype_name`` (probed once: an
    elementwise and a reduction kernel on a few elements). bfloat16 needs CuPy >= 14; where
    the probe fails the chained path runs instead of the step failing."""
    if dtype_name != "bfloat16":
        return True
    import cupy

    from fourd_mpi.core.backend import parse_dtype

    try:
        k = _build_kernels(dtype_name)
        x = cupy.arange(4, dtype=np.float32).astype(parse_dtype(dtype_name))
        k["gelu"](x)
        k["product_sum"](x, x, axis=0)
        cupy.cuda.get_current_stream().synchronize()
        return True
    except Exception:  # noqa: BLE001 - compilation errors come as several CuPy/NVRTC types
        return False


@functools.lru_cache(maxsize=None)
def _cupy_kernels(dtype_name: str):
    """The fused kernels for one dtype (None: no kernel for it, use the chained path)."""
    if dtype_name not in _COMPUTE_TYPES or not _fused_ok(dtype_name):
        return None
    return _build_kernels(dtype_name)


def _build_kernels(dtype_name: str):
    ct = _COMPUTE_TYPES[dtype_name]
    import cupy

    c, a = repr(GELU_C), repr(GELU_A)
    ew, red = cupy.ElementwiseKernel, cupy.ReductionKernel
    k = {}
    k["gelu"] = ew("T u", "T g", f"""
        {ct} x = ({ct})u;
        {ct} t = tanh(({ct}){c} * (x + ({ct}){a} * x * x * x));
        g = (T)(({ct})0.5 * x * (({ct})1 + t));""", f"fourd_gelu_{dtype_name}")
    k["gelu_backward"] = ew("T u, T dg", "T du", f"""
        {ct} x = ({ct})u;
        {ct} t = tanh(({ct}){c} * (x + ({ct}){a} * x * x * x));
        {ct} dinner = ({ct}){c} * (({ct})1 + ({ct})(3 * {a}) * x * x);
        du = (T)(({ct})dg * ({ct})0.5 * (({ct})1 + t + x * (({ct})1 - t * t) * dinner));""",
                            f"fourd_gelu_backward_{dtype_name}")
    k["centered_squares"] = red("T x, T mean", "T s", f"(({ct})x - ({ct})mean) * (({ct})x - ({ct})mean)",
                                "a + b", "s = (T)a", "0", f"fourd_centered_squares_{dtype_name}",
                                reduce_type=ct)
    k["layernorm_apply"] = ew("T x, T mean, T rstd, T gamma, T beta", "T y, T xhat", f"""
        {ct} h = (({ct})x - ({ct})mean) * ({ct})rstd;
        xhat = (T)h;
        y = (T)(h * ({ct})gamma + ({ct})beta);""", f"fourd_layernorm_apply_{dtype_name}")
    k["product_sum"] = red("T a, T b", "T s", f"({ct})a * ({ct})b", "a + b", "s = (T)a", "0",
                           f"fourd_product_sum_{dtype_name}", reduce_type=ct)
    k["triple_sum"] = red("T a, T b, T c", "T s", f"({ct})a * ({ct})b * ({ct})c", "a + b", "s = (T)a", "0",
                          f"fourd_triple_sum_{dtype_name}", reduce_type=ct)
    k["layernorm_finish"] = ew("T dy, T gamma, T xhat, T rstd, T sum_g, T sum_gx, float64 inv_h", "T dx", f"""
        dx = (T)(({ct})rstd * (({ct})dy * ({ct})gamma - ({ct})sum_g * ({ct})inv_h
                               - ({ct})xhat * ({ct})sum_gx * ({ct})inv_h));""",
                               f"fourd_layernorm_finish_{dtype_name}")
    # causal mask and scale in one pass: the flat index gives (row, col) of the s x s score matrix
    k["scale_mask"] = ew("float64 scale, int64 s", "T x", f"""
        long long col = i % s;
        long long row = (i / s) % s;
        // -inf above the diagonal (future positions)
        x = col > row ? (T)__int_as_float(0xff800000) : (T)(({ct})x * ({ct})scale);""",
                         f"fourd_scale_mask_{dtype_name}")
    k["exp_shift"] = ew("T m", "T x", f"x = (T)exp(({ct})x - ({ct})m);", f"fourd_exp_shift_{dtype_name}")
    k["softmax_backward"] = ew("T p, T r, float64 scale", "T d", f"""
        d = (T)(({ct})p * (({ct})d - ({ct})r) * ({ct})scale);""", f"fourd_softmax_backward_{dtype_name}")
    k["diff_scaled"] = ew("T y, T t, float64 n", "T d", f"d = (T)((({ct})y - ({ct})t) / ({ct})n);",
                          f"fourd_diff_scaled_{dtype_name}")
    k["squared_diff_sum"] = red("T y, T t", "T s", f"(({ct})y - ({ct})t) * (({ct})y - ({ct})t)", "a + b",
                                "s = (T)a", "0", f"fourd_squared_diff_sum_{dtype_name}", reduce_type=ct)
    k["adam"] = ew("T g, float64 lr, float64 b1, float64 b2, float64 c1, float64 c2, float64 eps", "T p, T m, T v", f"""
        {ct} gg = ({ct})g;
        {ct} mm = ({ct})b1 * ({ct})m + (({ct})1 - ({ct})b1) * gg;
        {ct} vv = ({ct})b2 * ({ct})v + (({ct})1 - ({ct})b2) * gg * gg;
        m = (T)mm;
        v = (T)vv;
        p = (T)(({ct})p - ({ct})lr * (mm / ({ct})c1) / (sqrt(vv / ({ct})c2) + ({ct})eps));""",
                   f"fourd_adam_{dtype_name}")
    k["axpy"] = ew("T x, float64 alpha", "T y", f"y = (T)(({ct})y + ({ct})alpha * ({ct})x);",
                   f"fourd_axpy_{dtype_name}")
    k["sgd"] = ew("T g, float64 lr, float64 momentum", "T p, T v", f"""
        {ct} vv = ({ct})momentum * ({ct})v + ({ct})g;
        v = (T)vv;
        p = (T)(({ct})p - ({ct})lr * vv);""", f"fourd_sgd_{dtype_name}")
    return k


def _kernels_for(x):
    """The fused kernels for ``x`` (a CuPy array), or None (NumPy, or a dtype without kernels)."""
    if _is_numpy(x):
        return None
    return _cupy_kernels(np.dtype(x.dtype).name)


def array_module(x):
    """NumPy for host arrays, CuPy otherwise."""
    if _is_numpy(x):
        return np
    import cupy

    return cupy


def new_array(empty, xp, shape, dtype):
    """An uninitialized array from ``empty(shape, dtype)`` (the caller's pool), or a fresh one without it."""
    return empty(shape, dtype) if empty is not None else xp.empty(shape, dtype=dtype)


#: dtypes for which CuPy's products (matmul, dot, einsum) have a BLAS path; CuPy 14 routes
#: bfloat16 products of more than two dimensions (and einsum) to its integer kernel, which
#: raises ``TypeError: data type 'E' not understood`` (cupy/cupy PR #10317)
_BLAS_DTYPES = ("float16", "float32", "float64")


def _for_products(x):
    """``x`` itself where its dtype has BLAS products, else a float32 copy (bfloat16 rows sums)."""
    if _is_numpy(x) or np.dtype(x.dtype).name in _BLAS_DTYPES:
        return x
    return x.astype(np.float32)


def _scratch(empty, like):
    """A scratch array shaped like ``like``."""
    return new_array(empty, array_module(like), like.shape, like.dtype)


#: exp's argument is clipped here in the chained GeLU so that ``exp(-2z)`` stays finite, per dtype
#: (where the clip acts, ``sigmoid(2z)`` is below 1e-4 (float16), 2e-35 (float32), 1e-304 (float64))
_EXP_CLIP = {"float16": 10.0, "float32": 80.0, "float64": 700.0}


def _neg_two_z(u, w):
    """``w = min(-2 c (u + a u^3), clip)``: minus twice tanh's argument (``z``), into ``w``."""
    xp = array_module(u)
    xp.multiply(u, u, out=w)
    w *= -2.0 * GELU_C * GELU_A
    w -= 2.0 * GELU_C
    w *= u
    xp.minimum(w, _EXP_CLIP.get(np.dtype(u.dtype).name, 80.0), out=w)
    return w


def gelu(u, out):
    """``out = 0.5 u (1 + tanh(z))``, ``z = c (u + a u^3)`` (tanh approximation, GPT-2 / Megatron); returns ``out``.

    ``u``, ``out``: same shape; ``out`` must not be ``u`` (backward needs ``u``). The chained path
    uses ``0.5 (1 + tanh(z)) = sigmoid(2z) = 1 / (1 + exp(-2z))``: the same function with one
    ``exp`` instead of ``tanh``, which NumPy vectorizes on every x86 (its SIMD ``tanh`` needs AVX-512).
    """
    k = _kernels_for(u)
    if k is not None:
        return k["gelu"](u, out)
    xp = array_module(u)
    xp.exp(_neg_two_z(u, out), out=out)
    out += 1.0
    xp.divide(u, out, out=out)                   # u sigmoid(2z)
    return out


def gelu_backward(u, dg, out, empty=None):
    """``out = dg * gelu'(u)``; ``out`` may be ``dg`` (in place). Returns ``out``.

    ``gelu'(u) = 0.5 [(1 + t) + u c (1 + 3 a u^2) (1 - t^2)]`` with ``t = tanh(z)``, recomputed
    from ``u`` (as Megatron's fused GeLU backward does) rather than saved. Chained path, with
    ``e = exp(-2z)`` and ``s = sigmoid(2z) = 1 / (1 + e)``: ``0.5 (1 + t) = s`` and
    ``0.5 (1 - t^2) = 2 s (1 - s) = 2 e s^2``, so ``gelu' = s (1 + 2 u c (1 + 3 a u^2) e s)``
    (no ``1 - s`` cancellation). ``empty(shape, dtype)``: where its three scratch arrays come from.
    """
    k = _kernels_for(u)
    if k is not None:
        return k["gelu_backward"](u, dg, out)
    xp = array_module(u)
    e, sig, d = _scratch(empty, u), _scratch(empty, u), _scratch(empty, u)
    xp.exp(_neg_two_z(u, e), out=e)              # e
    xp.add(e, 1.0, out=sig)
    xp.divide(1.0, sig, out=sig)                 # s
    e *= sig                                     # e s = 1 - s, without the cancellation (<= 1)
    xp.multiply(u, u, out=d)
    d *= 6.0 * GELU_A * GELU_C
    d += 2.0 * GELU_C
    d *= u                                       # 2 u c (1 + 3 a u^2)
    d *= e                                       # 2 u c (1 + 3 a u^2) (1 - s)
    d += 1.0
    d *= sig                                     # gelu'
    xp.multiply(dg, d, out=out)
    return out


# LayerNorm (statistics over the full hidden dimension, sharded over X) -----------------------
def centered_squares(x, mean, centered):
    """Row sums of ``(x - mean)^2``: ``[m, 1]``, to be all-reduced over X for the variance.

    x: ``[m, h/x]``; mean: ``[m, 1]`` (over the full hidden dim). The chained path leaves
    ``x - mean`` in ``centered`` (``[m, h/x]``), which :func:`layernorm_apply` turns into
    ``xhat`` in place; the fused path reads ``x`` twice and never stores it.
    """
    k = _kernels_for(x)
    if k is not None:
        return k["centered_squares"](x, mean, axis=1, keepdims=True)
    xp = array_module(x)
    xp.subtract(x, mean, out=centered)
    c = _for_products(centered)
    return xp.einsum("ij,ij->i", c, c)[:, None].astype(x.dtype, copy=False)


def layernorm_apply(x, mean, rstd, gamma, beta, y, xhat):
    """``xhat = (x - mean) * rstd``, ``y = xhat * gamma + beta`` into ``y`` and ``xhat`` (``[m, h/x]``).

    mean, rstd: ``[m, 1]``; gamma, beta: ``[h/x]``. Chained path: ``xhat`` must hold ``x - mean``
    (from :func:`centered_squares`).
    """
    k = _kernels_for(x)
    if k is not None:
        k["layernorm_apply"](x, mean, rstd, gamma, beta, y, xhat)
        return y, xhat
    xp = array_module(x)
    xhat *= rstd
    xp.multiply(xhat, gamma, out=y)
    y += beta
    return y, xhat


def layernorm_backward_local(dy, xhat, gamma, partial, empty=None):
    """Local pieces of LayerNorm's backward; returns the token-partial ``(dgamma, dbeta)`` ``[h/x]``.

    Writes the per-token partial sums over this rank's hidden shard into ``partial`` ``[m, 2]``:
    ``[:, 0] = sum_j dy gamma``, ``[:, 1] = sum_j dy gamma xhat`` (all-reduced over X next).
    dgamma, dbeta are still to be summed over the tokens of other ranks (over Z and data).
    """
    k = _kernels_for(dy)
    if k is not None:
        partial[:, 0] = k["product_sum"](dy, gamma, axis=1)
        partial[:, 1] = k["triple_sum"](dy, gamma, xhat, axis=1)
        return k["product_sum"](dy, xhat, axis=0), dy.sum(axis=0)
    xp = array_module(dy)
    t = _scratch(empty, dy)
    xp.multiply(dy, xhat, out=t)
    g = _for_products(gamma)
    partial[:, 0] = (_for_products(dy) @ g).astype(partial.dtype, copy=False)  # BLAS matrix-vector
    partial[:, 1] = (_for_products(t) @ g).astype(partial.dtype, copy=False)   # products: no temporary
    return t.sum(axis=0), dy.sum(axis=0)


def layernorm_backward_finish(dy, xhat, gamma, rstd, sums, hidden: int, out, empty=None):
    """``dx = rstd * (dy gamma - sum_g / h - xhat sum_gx / h)`` into ``out`` ``[m, h/x]``.

    sums: ``[m, 2]``, the partial sums of :func:`layernorm_backward_local` all-reduced over X.
    """
    sum_g, sum_gx = sums[:, :1], sums[:, 1:]
    k = _kernels_for(dy)
    if k is not None:
        return k["layernorm_finish"](dy, gamma, xhat, rstd, sum_g, sum_gx, 1.0 / hidden, out)
    xp = array_module(dy)
    t = _scratch(empty, dy)
    xp.multiply(xhat, sum_gx / hidden, out=t)
    xp.multiply(dy, gamma, out=out)
    out -= t
    out -= sum_g / hidden
    out *= rstd
    return out


# attention softmax -------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _causal_mask(seq: int) -> np.ndarray:
    """``[s, s]`` True above the diagonal (future positions), built once per sequence length."""
    return np.triu(np.ones((seq, seq), dtype=bool), k=1)


def causal_softmax_(scores, scale: float):
    """In place: ``scores [b, nh, s, s]`` -> ``softmax(scale * scores)`` over the last axis, causal mask."""
    seq = scores.shape[-1]
    k = _kernels_for(scores)
    if k is not None:
        k["scale_mask"](scale, seq, scores)
        k["exp_shift"](scores.max(axis=-1, keepdims=True), scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        return scores
    xp = array_module(scores)
    scores *= scale
    mask = _causal_mask(seq) if xp is np else xp.asarray(_causal_mask(seq))
    xp.copyto(scores, -xp.inf, where=mask)
    scores -= scores.max(axis=-1, keepdims=True)
    xp.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def softmax_backward_(probs, dprobs, scale: float):
    """In place: ``dprobs`` -> ``dscores = scale * probs * (dprobs - sum_j dprobs probs)`` (last axis)."""
    k = _kernels_for(probs)
    if k is not None:
        rows = k["product_sum"](dprobs, probs, axis=-1, keepdims=True)
        return k["softmax_backward"](probs, rows, scale, dprobs)
    xp = array_module(probs)
    rows = xp.einsum("...j,...j->...", _for_products(dprobs), _for_products(probs))[..., None]
    dprobs -= rows.astype(dprobs.dtype, copy=False)
    dprobs *= probs
    dprobs *= scale
    return dprobs


# loss -----------------------------------------------------------------------------------------
def mse_parts(y, target, dy, n: int):
    """Local ``sum((y - t)^2)`` and ``dy = (y - t) / n`` written into ``dy``.

    The sum is a host float on NumPy and a 0-d device array on CuPy: it is not read back here, so the
    host does not wait for the kernels queued before it (``float()`` it once the step's work is queued)."""
    k = _kernels_for(y)
    if k is not None:
        # per row first, then the rows: CuPy runs a ReductionKernel that reduces to one value in a single thread
        # block (one SM), which took 25-40 % of a bf16 h4096 step on an H200 (results/benchmarks/gpu/README.md);
        # one block per row spreads it over the GPU, and the rows are summed in float64 (not rounded to 16 bits)
        rows = k["squared_diff_sum"](y, target, axis=-1)
        k["diff_scaled"](y, target, float(n), dy)
        return rows.astype("float64").sum()
    xp = array_module(y)
    xp.subtract(y, target, out=dy)
    flat = _for_products(dy.reshape(-1))
    local = float(xp.dot(flat, flat))
    dy /= n
    return local


# optimizers -----------------------------------------------------------------------------------
def adam_update(p, g, m, v, lr: float, b1: float, b2: float, c1: float, c2: float, eps: float, empty=None):
    """Adam in place: ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``,
    ``p -= lr (m / c1) / (sqrt(v / c2) + eps)`` (``c1, c2``: the bias corrections ``1 - b^t``)."""
    k = _kernels_for(p)
    if k is not None:
        k["adam"](g, lr, b1, b2, c1, c2, eps, p, m, v)
        return
    xp = array_module(p)
    s = _scratch(empty, p)
    m *= b1
    xp.multiply(g, 1.0 - b1, out=s)
    m += s
    v *= b2
    xp.multiply(g, g, out=s)
    s *= 1.0 - b2
    v += s
    xp.divide(v, c2, out=s)
    xp.sqrt(s, out=s)
    s += eps
    xp.divide(m, s, out=s)
    s *= lr / c1
    p -= s


def sgd_update(p, g, v, lr: float, momentum: float, empty=None):
    """SGD in place: ``v = momentum v + g; p -= lr v`` (``v`` None: plain ``p -= lr g``)."""
    k = _kernels_for(p)
    if k is not None:
        if v is None:
            k["axpy"](g, -lr, p)
        else:
            k["sgd"](g, lr, momentum, p, v)
        return
    xp = array_module(p)
    if v is not None:
        v *= momentum
        v += g
        g = v
    s = _scratch(empty, p)
    xp.multiply(g, lr, out=s)
    p -= s
