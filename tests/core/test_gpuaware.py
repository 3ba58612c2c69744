"""GPU-aware MPI detection: library identification, the decision table, and this machine's MPI."""

from __future__ import annotations

import pytest

from fourd_mpi.core.gpuaware import GpuAwareness, decide, detect, library_family

VERSIONS = [
    ("MPICH Version:      5.0.2\nMPICH Release date: ...", "MPICH"),
    ("Open MPI v5.0.3, package: Open MPI builder Distribution, ident: 5.0.3, repo rev: v5.0.3", "Open MPI"),
    ("MPI VERSION    : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)", "Cray MPICH"),
    ("MVAPICH2 Version      :\t2.3.7", "MVAPICH"),
    ("Intel(R) MPI Library 2021.10 for Linux* OS", "Intel MPI"),
    ("Spectrum MPI 10.4", "unknown"),
]


@pytest.mark.parametrize("text, family", VERSIONS, ids=[f for _, f in VERSIONS])
def test_library_family(text, family):
    assert library_family(text) == family


@pytest.mark.parametrize("library, queries, env, cuda, direct, words", [
    ("Cray MPICH", {}, {"MPICH_GPU_SUPPORT_ENABLED": "1"}, True, True, "MPICH_GPU_SUPPORT_ENABLED=1"),
    ("Cray MPICH", {}, {}, False, False, "set it"),
    ("Cray MPICH", {}, {"MPICH_GPU_SUPPORT_ENABLED": "0"}, False, False, "without"),
    ("MPICH", {"MPIX_Query_cuda_support": True}, {}, True, True, "reports CUDA support"),
    ("MPICH", {"MPIX_Query_cuda_support": False}, {}, False, False, "built without CUDA"),
    ("MPICH", {"MPIX_Query_cuda_support": False}, {"MPIR_CVAR_ENABLE_GPU": "0"}, False, False,
     "MPIR_CVAR_ENABLE_GPU=0"),
    ("MPICH", {}, {}, None, False, "no way to ask"),
    # CUDA-aware Open MPI: its nonblocking collectives on device buffers are unsupported
    ("Open MPI", {"MPIX_Query_cuda_support": True}, {}, True, False, "MPI_Iallgather"),
    ("Open MPI", {"MPIX_Query_cuda_support": False}, {}, False, False, "no CUDA support"),
    ("Open MPI", {}, {}, None, False, "without the CUDA extension"),
    ("MVAPICH", {}, {"MV2_USE_CUDA": "1"}, True, True, "MV2_USE_CUDA=1"),
    ("MVAPICH", {}, {}, None, False, "without MV2_USE_CUDA"),
    ("Intel MPI", {}, {}, None, False, "staging"),
])
def test_decision_table(library, queries, env, cuda, direct, words):
    got_cuda, got_direct, reason = decide(library, queries, env)
    assert (got_cuda, got_direct) == (cuda, direct)
    assert words in reason


def test_this_machines_mpi_is_detected_without_touching_a_device():
    report = detect()
    assert isinstance(report, GpuAwareness)
    from mpi4py import MPI

    assert report.library == library_family(MPI.Get_library_version())
    assert report.libmpi and "libmpi" in report.libmpi
    if report.library == "MPICH":  # the embedded default: the mpich wheel, built without CUDA
        assert report.queries.get("MPIX_Query_cuda_support") is False
        assert report.cuda_aware is False and report.direct_ok is False
    as_dict = report.as_dict()
    assert set(as_dict) >= {"library", "version", "libmpi", "queries", "env", "cuda_aware", "direct_ok", "reason"}


def test_smoke_expected_sum_is_exact():
    import numpy as np

    from fourd_mpi.core.gpuaware import smoke_expected

    for size in (1, 2, 5, 64):
        contributions = [(np.arange(1024) % 251 + r).astype(np.float32) for r in range(size)]
        total = np.zeros(1024, dtype=np.float32)
        for c in contributions:
            total += c  # float32, any order: small integers are exact
        assert np.array_equal(total.astype(np.float64), smoke_expected(size))
