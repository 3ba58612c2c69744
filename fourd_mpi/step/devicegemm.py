"""Batched 16-bit GEMMs on the GPU through cuBLAS ``gemmStridedBatchedEx``, float32 accumulation.

CuPy 14's ``matmul`` handles 2-D float16/bfloat16 products with ``gemmEx`` but not batched
ones (more than two dimensions, as in attention ``[b, nh, s, dh] @ [b, nh, dh, s]``):
bfloat16 falls through to its integer kernel and raises ``TypeError: data type 'E' not
understood``, and float16 is cast to float32 and multiplied on CUDA cores (cupy/cupy PR
#10317, open when this was written). :func:`matmul` sends those products to cuBLAS
directly; everything else goes to ``cupy.matmul``.

Math, per batch index ``i``: ``out[i] = a[i] @ b[i]`` with ``a[i]``: ``[M, K]``,
``b[i]``: ``[K, N]`` (or one 2-D ``b`` for every ``i``), ``out[i]``: ``[M, N]``, products
in the operands' dtype, sums in float32 (``CUBLAS_COMPUTE_32F``), result rounded to the
dtype. Row-major arrays are column-major transposes, so cuBLAS computes
``out^T = b^T a^T``; an operand whose last two axes are a transposed view (``k.transpose(0,
1, 3, 2)``) is passed with ``CUBLAS_OP_T`` and no copy. Leading axes are looped over except
the innermost, which is cuBLAS's strided batch. No communication.
"""

from __future__ import annotations

import itertools

import numpy as np

#: cudaDataType_t of the dtypes this module multiplies (library_types.h)
CUDA_R_16F, CUDA_R_16BF = 2, 14
_CUDA_TYPES = {"float16": CUDA_R_16F, "bfloat16": CUDA_R_16BF}
#: cublasComputeType_t CUBLAS_COMPUTE_32F; cublasGemmAlgo_t CUBLAS_GEMM_DEFAULT
CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT = 68, -1
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1

_ONE = np.ones(1, dtype=np.float32)
_ZERO = np.zeros(1, dtype=np.float32)


def handles(a, b) -> bool:
    """True where :func:`matmul` calls cuBLAS itself: 16-bit dtype, batched, same dtype everywhere."""
    name = np.dtype(a.dtype).name
    return name in _CUDA_TYPES and a.ndim > 2 and np.dtype(b.dtype) == np.dtype(a.dtype) and b.ndim in (2, a.ndim)


def _operand(x, rows: int, cols: int):
    """``(x, op, ld)`` of a row-major ``[rows, cols]`` matrix (last two axes of ``x``) as cuBLAS sees it.

    Row-major contiguous rows (last stride 1) are a column-major ``[cols, rows]`` matrix: op N,
    ``ld`` = row stride. A transposed view (second-to-last stride 1) is the column-major matrix
    itself: op T, ``ld`` = column stride. Anything else is copied to contiguous first.
    """
    item = x.itemsize
    s_row, s_col = x.strides[-2] // item, x.strides[-1] // item
    if s_col == 1 and s_row >= max(cols, 1):
        return x, CUBLAS_OP_N, s_row
    if s_row == 1 and s_col >= max(rows, 1):
        return x, CUBLAS_OP_T, s_col
    import cupy

    x = cupy.ascontiguousarray(x)
    return x, CUBLAS_OP_N, cols


def matmul(a, b, out=None):
    """``a @ b`` for CuPy arrays; 16-bit batched products through cuBLAS (see the module doc).

    a: ``[..., M, K]``; b: ``[..., K, N]`` with the same leading axes, or ``[K, N]``;
    out: ``[..., M, N]`` (allocated when None). Returns ``out``.
    """
    import cupy

    if not handles(a, b) or b.shape[:-2] not in ((), a.shape[:-2]):
        return cupy.matmul(a, b, out=out)
    lead, (m, k), n = a.shape[:-2], a.shape[-2:], b.shape[-1]
    if b.shape[-2] != k:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not multiply")
    target = out
    if out is None or out.strides[-1] != out.itemsize or out.strides[-2] < n * out.itemsize:
        target = cupy.empty(lead + (m, n), dtype=a.dtype)
    a, op_a, ld_a = _operand(a, m, k)
    b, op_b, ld_b = _operand(b, k, n)
    ld_c = target.strides[-2] // target.itemsize
    item = a.itemsize
    cuda_type = _CUDA_TYPES[np.dtype(a.dtype).name]
    from cupy_backends.cuda.libs import cublas

    handle = cupy.cuda.device.get_cublas_handle()
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)  # alpha, beta: host floats
    inner = lead[-1]
    stride_a, stride_c = a.strides[-3] // item, target.strides[-3] // item
    stride_b = b.strides[-3] // item if b.ndim > 2 else 0
    for outer in itertools.product(*(range(d) for d in lead[:-1])):
        off_a = sum(i * s for i, s in zip(outer, a.strides))
        off_b = sum(i * s for i, s in zip(outer, b.strides)) if b.ndim > 2 else 0
        off_c = sum(i * s for i, s in zip(outer, target.strides))
        # column-major: out^T [n, m] = b^T [n, k] @ a^T [k, m]
        cublas.gemmStridedBatchedEx(
            handle, op_b, op_a, n, m, k, _ONE.ctypes.data,
            b.data.ptr + off_b, cuda_type, ld_b, stride_b,
            a.data.ptr + off_a, cuda_type, ld_a, stride_a,
            _ZERO.ctypes.data, target.data.ptr + off_c, cuda_type, ld_c, stride_c,
            inner, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
    cublas.setPointerMode(handle, mode)
    if out is not None and target is not out:
        out[...] = target
        return out
    return target
