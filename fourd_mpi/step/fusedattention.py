"""Fused causal attention on a GPU: PyTorch's ``scaled_dot_product_attention`` on the step's CuPy arrays.

The unfused attention of :mod:`fourd_mpi.step.kernels` materialises the scores ``[b, nh, s, s]``
and runs a separate softmax; a fused kernel (FlashAttention-2, cuDNN's SDPA) streams blocks of
``K`` and ``V`` through on-chip memory and keeps only the log-sum-exp of each query row for the
backward pass. This module hands the step's arrays to PyTorch through DLPack (no copies: the
``q``, ``k``, ``v`` views of the QKV output keep their strides) and lets PyTorch's
``scaled_dot_product_attention`` pick among the kernels the chosen mode allows:

- ``fused``: cuDNN attention, then FlashAttention-2, then memory-efficient attention (the first
  that supports the dtype and head size; float32 has only the last);
- ``cudnn`` / ``flash``: that kernel alone (a refusal at start-up if it cannot run the shape).

Shapes (this rank's heads): ``qkv [b*s, nh*3*hd]`` (per head ``[q | k | v]``, Megatron order)
-> ``ctx [b*s, nh*hd]``; backward ``dctx [b*s, nh*hd]`` -> ``dqkv [b*s, nh*3*hd]``. The math is
:func:`fourd_mpi.step.kernels.attention_forward`'s: ``softmax(q k^T / sqrt(hd) + causal mask) v``.
No communication here (attention is local to a rank's heads).

Streams: the kernels run on the backend's compute stream (PyTorch is pointed at it), so they are
ordered with the CuPy kernels before and after them without any host synchronisation.
FLOPs counted (:class:`~fourd_mpi.step.kernels.ComputeCounter`): those of the unfused
products, ``4 b nh s^2 hd`` forward and ``8 b nh s^2 hd`` backward, so attention TFLOP/s compare
between the implementations (a causal kernel executes about half, and its backward recomputes
the scores: the hardware count is a property of the kernel, not recorded here).
"""

from __future__ import annotations

import contextlib
import math
from typing import Tuple

from fourd_mpi.errors import BackendError
from fourd_mpi.step import elementwise
from fourd_mpi.step.kernels import device_op

#: ``--attention`` values: auto = fused on CuPy where PyTorch can run it, else unfused
ATTENTION_MODES = ("auto", "unfused", "fused", "cudnn", "flash")

#: the PyTorch SDPA back ends each fused mode allows, in priority order
_KERNELS = {"fused": ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"),
            "cudnn": ("CUDNN_ATTENTION",), "flash": ("FLASH_ATTENTION",)}


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def choose(mode: str, backend, head_dim: int) -> Tuple[str, str]:
    """``(implementation, why)`` for ``--attention mode`` on ``backend``: ``unfused`` or one of the fused
    modes. ``auto`` falls back to ``unfused`` with the reason; an explicit fused mode that cannot run raises
    :class:`BackendError` (one line). Runs a small probe of the chosen kernels with the run's dtype and
    ``head_dim`` on the GPU, so a refusal happens before the model is allocated. Local (no MPI)."""
    if mode not in ATTENTION_MODES:
        raise BackendError(f"unknown attention mode {mode!r}: choose one of {', '.join(ATTENTION_MODES)}")
    if mode == "unfused":
        return "unfused", "--attention unfused"
    wanted = "fused" if mode == "auto" else mode
    reason = _unavailable(backend, wanted, head_dim)
    if reason is None:
        torch = _torch()
        kernels = ", ".join(k.split("_")[0].lower() for k in _KERNELS[wanted])
        return wanted, f"PyTorch {torch.__version__} scaled_dot_product_attention ({kernels})"
    if mode == "auto":
        return "unfused", f"auto: {reason}"
    raise BackendError(f"--attention {mode}: {reason}; use --attention unfused")


def _unavailable(backend, mode: str, head_dim: int):
    """Why ``mode`` cannot run here (None: it can)."""
    if backend.name != "cupy":
        return "the numpy backend has no fused attention kernel (a GPU run with --backend cupy has)"
    torch = _torch()
    if torch is None:
        return "PyTorch is not installed (its scaled_dot_product_attention provides the fused kernels)"
    if not torch.cuda.is_available() or getattr(torch.version, "cuda", None) is None:
        return f"PyTorch {torch.__version__} has no CUDA device (a CPU-only or ROCm build?)"
    try:  # the step's own forward and backward on 2 sequences of 128 tokens, one head
        ctx, saved = attention_forward(backend, mode, backend.xp.zeros((256, 3 * head_dim), dtype=backend.dtype),
                                       2, 128, 1, head_dim)
        attention_backward(backend, mode, ctx, saved, 2, 128, 1, head_dim)
        backend.synchronize()
    except Exception as exc:  # noqa: BLE001 - whatever PyTorch or DLPack refuses is the reason, in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"PyTorch's kernels refuse {backend.dtype} with head size {head_dim}: {first}"
    return None


def _heads(torch, qkv, batch: int, seq: int, heads: int, head_dim: int):
    """``q, k, v [b, nh, s, hd]``: PyTorch leaf tensors viewing ``qkv [b*s, nh*3*hd]`` (no copies; only the
    contiguous 2-D array crosses DLPack, the strided views are made on PyTorch's side)."""
    t = _as_torch(torch, qkv).view(batch, seq, heads, 3, head_dim)
    return tuple(t[:, :, :, i, :].transpose(1, 2).detach().requires_grad_() for i in range(3))


def _as_torch(torch, a):
    """A PyTorch view of the contiguous CuPy array ``a`` (same memory and shape; DLPack). 16-bit floats
    travel as int16 and are reinterpreted, so the exchange needs no bfloat16 support in DLPack."""
    name = str(a.dtype)
    if name in ("bfloat16", "float16"):
        return torch.from_dlpack(a.view("int16")).view(getattr(torch, name))
    return torch.from_dlpack(a)


def _on_stream(torch, backend):
    """PyTorch's current stream = the backend's compute stream (its legacy default stream: nothing to do)."""
    ptr = backend.stream.ptr
    if not ptr:
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.ExternalStream(ptr))


def _allowed(torch, mode: str):
    """PyTorch's SDPA restricted to ``mode``'s kernels, tried in the listed order."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = [getattr(SDPBackend, name) for name in _KERNELS[mode]]
    try:
        return sdpa_kernel(kernels, set_priority=True)
    except TypeError:  # PyTorch before 2.6: no priority, its own order
        return sdpa_kernel(kernels)


def attention_forward(backend, mode: str, qkv, batch: int, seq: int, heads: int, head_dim: int, counter=None,
                      progress=None, empty=None):
    """Fused causal attention: ``qkv [b*s, nh*3*hd]`` -> ``(ctx [b*s, nh*hd], saved)``; ``saved`` holds
    PyTorch's autograd record (the inputs' views, the output and the kernel's log-sum-exp), not the scores."""
    torch = _torch()
    out = elementwise.new_array(empty, backend.xp, (batch * seq, heads * head_dim), qkv.dtype)

    def run():
        with _on_stream(torch, backend), _allowed(torch, mode):
            with torch.enable_grad():
                tq, tk, tv = _heads(torch, qkv, batch, seq, heads, head_dim)
                o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True,
                                                                     scale=1.0 / math.sqrt(head_dim))
            with torch.no_grad():
                _as_torch(torch, out).view(batch, seq, heads, head_dim).copy_(o.transpose(1, 2))
        return tq, tk, tv, o

    flops = 4.0 * batch * heads * seq * seq * head_dim
    return out, device_op(run, counter, "attention", flops, progress)


def attention_backward(backend, mode: str, dctx, saved, batch: int, seq: int, heads: int, head_dim: int,
                       counter=None, progress=None, empty=None):
    """Gradient of :func:`attention_forward`: ``dctx [b*s, nh*hd]`` -> ``dqkv [b*s, nh*3*hd]`` (the fused
    kernel's backward: scores recomputed block by block from ``q``, ``k`` and the log-sum-exp)."""
    torch = _torch()
    tq, tk, tv, o = saved
    dqkv = elementwise.new_array(empty, backend.xp, (batch * seq, heads * 3 * head_dim), dctx.dtype)

    def run():
        with _on_stream(torch, backend), _allowed(torch, mode):
            d = _as_torch(torch, dctx).view(batch, seq, heads, head_dim).transpose(1, 2)
            grads = torch.autograd.grad(o, (tq, tk, tv), grad_outputs=d)
            with torch.no_grad():
                parts = _as_torch(torch, dqkv).view(batch, seq, heads, 3, head_dim)
                for i, g in enumerate(grads):
                    parts[:, :, :, i, :].copy_(g.transpose(1, 2))

    device_op(run, counter, "attention", 8.0 * batch * heads * seq * seq * head_dim, progress)
    return dqkv
