"""The CuPy path on a real GPU: correctness against NumPy, direct vs staged buffers, GEMM timing.

Skipped, with the reason, where no GPU is usable (CuPy missing or
``cupy.cuda.is_available()`` False): CI and the dev machines. On a GPU machine:

- ``fourd-mpi verify --backend cupy --reference-backend numpy`` with 1, 2 and 4 ranks
  sharing the GPU(s), every grid and all overlap options, staged buffers (and direct ones
  where the MPI is CUDA-aware), float32 and TF32;
- direct and staged device buffers give the same losses and gradients (only where the
  MPI takes device buffers: the mpich wheel is built without CUDA);
- GEMMs timed with CUDA events: positive, below the step time, below any GPU's peak,
  the same order as a standalone GEMM of the same shape;
- the staged path's copies are on the copy stream and the pinned pool is reused.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, find_mpiexec, mpi_env

from fourd_mpi.core.backend import cupy_usable

GPU = cupy_usable()
needs_gpu = pytest.mark.skipif(not GPU, reason="no usable GPU: CuPy is not installed or "
                                                "cupy.cuda.is_available() is False")


def _direct_possible() -> bool:
    from mpi4py import MPI  # noqa: F401  (initializes MPI for the query)

    from fourd_mpi.core.gpuaware import detect

    return detect().direct_ok


@needs_gpu
@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [1, 2, 4])
@pytest.mark.parametrize("numerics", [["--dtype", "float32"], ["--dtype", "float32", "--tf32"]],
                         ids=["float32", "tf32"])
def test_cupy_step_matches_numpy_reference(run_mpi, nranks, numerics):
    modes = ["staged"] + (["direct"] if _direct_possible() else [])
    for mode in modes:
        proc = run_mpi(nranks, ["verify", "--backend", "cupy", "--reference-backend", "numpy", *numerics,
                                "--device-buffers", mode, "--all-grids", "--overlap", "none",
                                "--overlap", "all", "--steps", "3"], timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert " 0 failed" in proc.stdout, proc.stdout


@needs_gpu
@pytest.mark.mpi
def test_cupy_float16_runs(run_mpi, tmp_path):
    proc = run_mpi(2, ["run", "--backend", "cupy", "--dtype", "float16", "--gx", "2", "--steps", "2",
                       "--results-dir", tmp_path, "--display", "quiet"], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_gpu
@pytest.mark.mpi
def test_direct_and_staged_device_buffers_agree():
    if not _direct_possible():
        pytest.skip("this MPI does not take device buffers in nonblocking collectives (detection): "
                    "direct mode cannot run here")
    proc = subprocess.run([find_mpiexec(), "-n", "4", sys.executable, "-c", _DIRECT_VS_STAGED],
                          capture_output=True, text=True, timeout=300, env=mpi_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "direct == staged" in proc.stdout


_DIRECT_VS_STAGED = """
from dataclasses import replace
import numpy as np
from mpi4py import MPI
from fourd_mpi.step.presets import resolve_model
from fourd_mpi.core.grid import GridShape
from fourd_mpi.run.build import Run
from fourd_mpi.run.options import run_options

world = MPI.COMM_WORLD
base = run_options(model=resolve_model("gpt-tiny"), grid=GridShape(1, 2, 1, 2), dtype="float64",
                  backend="cupy", overlap="all")
out = {}
for mode in ("direct", "staged"):
    run = Run.build(world, replace(base, device_buffers=mode))
    assert run.mpi_buffers.mode == mode, run.mpi_buffers
    loss, y = run.trainer.forward_backward(0)
    grads = [run.backend.to_host(p.grad).copy() for p in run.model.parameters()]
    losses = [run.trainer.step(i).loss for i in range(3)]
    out[mode] = (loss, run.backend.to_host(y).copy(), grads, losses)
    run.close()
d, s = out["direct"], out["staged"]
assert d[0] == s[0] and d[3] == s[3], (d[3], s[3])
assert np.array_equal(d[1], s[1])
assert all(np.array_equal(a, b) for a, b in zip(d[2], s[2]))
if world.Get_rank() == 0:
    print("direct == staged")
"""


@needs_gpu
def test_event_timed_gemms_are_sane():
    from mpi4py import MPI

    from fourd_mpi.core.grid import GridShape
    from fourd_mpi.run.build import Run
    from fourd_mpi.run.options import run_options
    from fourd_mpi.step.kernels import standalone_gemm_tflops
    from fourd_mpi.step.presets import resolve_model

    model = resolve_model("gpt-small", hidden=1024, heads=16, layers=2, seq=256, batch=8)
    run = Run.build(MPI.COMM_SELF, run_options(model=model, grid=GridShape(1, 1, 1, 1), backend="cupy"),
                    count_flops=True)
    run.trainer.step(0)  # warm-up
    run.counter.reset()
    result = run.trainer.step(1)
    gemm_s, gemm_flops = run.counter.seconds["gemm"], run.counter.flops["gemm"]
    assert 0 < gemm_s < result.local_seconds
    tflops = gemm_flops / gemm_s / 1e12
    assert 0.01 < tflops < 5000  # no GPU reaches 5 PFLOP/s dense
    (m, n, k, _, _), _ = max(run.counter.shapes.items(), key=lambda kv: kv[0][0] * kv[0][1] * kv[0][2])
    alone = standalone_gemm_tflops(run.backend, m, n, k)
    assert 0.01 < alone < 5000
    assert tflops < 3 * alone  # in the step a GEMM cannot be much faster than alone
    run.close()


@needs_gpu
def test_staging_uses_pinned_pool_and_copy_stream():
    import cupy

    from fourd_mpi.core.backend import CupyBackend

    b = CupyBackend(np.float32, device_buffers="staged")
    x = cupy.arange(1024, dtype=cupy.float32)
    for _ in range(3):
        host, d2h = b.stage_to_host(x * 2)
        assert np.array_equal(host, np.arange(1024, dtype=np.float32) * 2)
        out, h2d = b.stage_to_device(host, (1024,))
        assert float((out - 2 * x).max()) == 0.0  # on the compute stream, after the copy's event
        b.synchronize()
        assert h2d.resolve().end_ns >= h2d.start_ns and d2h.end_ns >= d2h.start_ns
    assert b.pool.allocations == 1  # the same pinned buffer each time
    assert isinstance(cupy.cuda.alloc_pinned_memory(8), cupy.cuda.PinnedMemoryPointer)


@pytest.mark.skipif(GPU, reason="a GPU is usable here: the bench runs instead of failing")
def test_gpu_bench_fails_clearly_without_a_gpu():
    proc = subprocess.run([sys.executable, "bench/gpu_bench.py"], capture_output=True, text=True, timeout=120,
                          env=mpi_env(), cwd=REPO)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "gpu_bench: no usable GPU" in proc.stderr


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_batched_16bit_matmul_matches_float32(dtype):
    """cuBLAS gemmStridedBatchedEx path: every operand layout the attention uses, against float32."""
    import cupy

    from fourd_mpi.core.backend import parse_dtype
    from fourd_mpi.step import devicegemm

    dt = parse_dtype(dtype)
    rng = np.random.default_rng(0)
    b, h, s, d = 3, 4, 24, 16

    def rand(*shape):
        return cupy.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dt)

    qkv = rand(b, s, h, 3, d)  # the attention's non-collapsible views: [b, h, s, d] with strides (s*h*3d, 3d, h*3d, 1)
    q, k = qkv[:, :, :, 0, :].transpose(0, 2, 1, 3), qkv[:, :, :, 1, :].transpose(0, 2, 1, 3)
    probs = rand(b, h, s, s)
    cases = [(q, k.transpose(0, 1, 3, 2)), (probs, q), (probs.transpose(0, 1, 3, 2), k),
             (rand(5, 7, 9), rand(5, 9, 11)), (rand(5, 7, 9), rand(9, 11)), (rand(2, 3, 7, 9), rand(2, 3, 9, 1))]
    for x, y in cases:
        assert devicegemm.handles(x, y)
        ref = cupy.matmul(x.astype(cupy.float32), y.astype(cupy.float32))
        got = devicegemm.matmul(x, y)
        out = cupy.empty(x.shape[:-1] + (y.shape[-1],), dtype=dt)
        assert devicegemm.matmul(x, y, out=out) is out
        wide = cupy.zeros(x.shape[:-1] + (y.shape[-1] + 3,), dtype=dt)  # out with a row stride > n
        devicegemm.matmul(x, y, out=wide[..., :y.shape[-1]])
        for result in (got, out, wide[..., :y.shape[-1]]):
            err = float(cupy.linalg.norm(result.astype(cupy.float32) - ref) / cupy.linalg.norm(ref))
            assert err < (1e-2 if dtype == "bfloat16" else 2e-3), (x.shape, y.shape, err)
        assert float(cupy.abs(wide[..., y.shape[-1]:].astype(cupy.float32)).max()) == 0.0  # nothing outside out


@needs_gpu
def test_backend_names_its_gpu_runtime():
    """CUDA or HIP (CuPy's ROCm build), as the runtime says: what ``info`` and the run header print."""
    import cupy

    from fourd_mpi.core.backend import make_backend
    from fourd_mpi.run.metadata import device_info

    backend = make_backend("cupy", np.float32, device_buffers="staged")
    hip = bool(getattr(cupy.cuda.runtime, "is_hip", False))
    assert ("HIP " if hip else "CUDA ") in backend.describe()
    assert device_info(backend)["kind"] == ("hip" if hip else "cuda")


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@needs_gpu
@pytest.mark.skipif(not (GPU and _torch_cuda()), reason="PyTorch with CUDA is not installed: no fused attention")
@pytest.mark.parametrize("mode", ["fused", "cudnn", "flash"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_fused_attention_matches_unfused(mode, dtype):
    """PyTorch's SDPA kernels on the step's strided q/k/v views against the unfused attention, forward and
    backward, in float32 arithmetic: ||a-b||/||b|| within the dtype's verify tolerance."""
    import cupy

    from fourd_mpi.core.backend import make_backend, parse_dtype
    from fourd_mpi.errors import BackendError
    from fourd_mpi.step import fusedattention, kernels

    backend = make_backend("cupy", parse_dtype(dtype), device_buffers="staged")
    b, s, h, d = 2, 256, 4, 64
    try:
        chosen, _ = fusedattention.choose(mode, backend, d)
    except BackendError as exc:
        if mode == "fused":
            raise
        pytest.skip(str(exc))
    assert chosen == mode
    rng = np.random.default_rng(1)
    qkv32 = cupy.asarray(rng.standard_normal((b * s, h * 3 * d)).astype(np.float32))
    dctx32 = cupy.asarray(rng.standard_normal((b * s, h * d)).astype(np.float32))
    qkv, dctx = qkv32.astype(backend.dtype), dctx32.astype(backend.dtype)
    ref_ctx, saved = kernels.attention_forward(cupy, qkv32, b, s, h, d)
    ref_dqkv = kernels.attention_backward(cupy, dctx32, saved, b, s, h, d)
    ctx, saved = fusedattention.attention_forward(backend, mode, qkv, b, s, h, d)
    dqkv = fusedattention.attention_backward(backend, mode, dctx, saved, b, s, h, d)
    limit = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 1e-2}[dtype]
    for got, ref in ((ctx, ref_ctx), (dqkv, ref_dqkv)):
        assert got.shape == ref.shape and got.dtype == backend.dtype
        err = float(cupy.linalg.norm(got.astype(cupy.float32) - ref) / cupy.linalg.norm(ref))
        assert err < limit, (mode, dtype, got.shape, err)
