"""Local math: chunked GEMMs with progress polls give the plain product."""

import numpy as np
import pytest

from fourd_mpi.core.backend import NumpyBackend
from fourd_mpi.step import elementwise, kernels


class CountingHook:
    def __init__(self, chunk_flops):
        self.chunk_flops = chunk_flops
        self.calls = 0

    def __call__(self):
        self.calls += 1


@pytest.mark.parametrize("m, k, n", [(5, 3, 7), (16, 8, 100), (300, 10, 20), (1, 4, 1), (640, 32, 64)])
def test_chunked_matmul_equals_plain(m, k, n):
    rng = np.random.default_rng(m * n)
    a, b = rng.random((m, k)), rng.random((k, n))
    hook = CountingHook(chunk_flops=1000)
    assert np.allclose(kernels.matmul(a, b, progress=hook), a @ b, rtol=1e-14, atol=0)
    assert np.allclose(kernels.matmul(a.T.copy().T, b.T.copy().T, progress=hook), a @ b)
    if 2 * m * n * k > 1000 and max(m, n) >= 2:
        assert hook.calls > 0


def test_chunks_stay_real_gemms():
    hook = CountingHook(chunk_flops=1.0)  # would be one poll per row without the floor
    a, b = np.ones((640, 8)), np.ones((8, 16))
    kernels.matmul(a, b, progress=hook)
    assert hook.calls == 640 // kernels.MIN_CHUNK_EXTENT - 1


def test_batched_chunks_and_flop_counting():
    rng = np.random.default_rng(1)
    a, b = rng.random((4, 3, 5, 6)), rng.random((4, 3, 6, 2))
    counter = kernels.ComputeCounter(backend=NumpyBackend(np.float64), enabled=True)
    out = kernels.matmul(a, b, counter, "attention", progress=CountingHook(10))
    assert np.allclose(out, a @ b)
    assert counter.flops["attention"] == 2 * 4 * 3 * 5 * 2 * 6


def test_gelu_backward_is_the_derivative():
    x = np.linspace(-4, 4, 101)
    eps = 1e-6
    numeric = (elementwise.gelu(x + eps, np.empty_like(x)) - elementwise.gelu(x - eps, np.empty_like(x))) / (2 * eps)
    assert np.allclose(elementwise.gelu_backward(x, np.ones_like(x), np.empty_like(x)), numeric, atol=1e-8)
