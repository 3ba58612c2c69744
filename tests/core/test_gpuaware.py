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


# the rules table, per operation class ----------------------------------------------------------------
D, S = "direct", "staged"
CUDA = {"MPIX_Query_cuda_support": True}
NO_CUDA = {"MPIX_Query_cuda_support": False}


@pytest.mark.parametrize("text, library, queries, env, variant, cuda, routes, rule", [
    # Open MPI 4.1 CUDA-aware: smcuda/ob1 -> p2p and blocking direct, nonblocking collectives staged
    ("Open MPI v4.1.4, package: Debian OpenMPI", "Open MPI", CUDA, {}, "ob1", True, (D, D, S, S), "ob1"),
    # the PML unknown: the ob1 row (its routes are a subset of the UCX row's)
    ("Open MPI v4.0.7", "Open MPI", CUDA, {}, None, True, (D, D, S, S), "ob1"),
    # with UCX: Iallgather works, nonblocking reductions do not
    ("Open MPI v4.1.5", "Open MPI", CUDA, {}, "ucx", True, (D, D, D, S), "UCX"),
    ("Open MPI v5.0.3, package: Open MPI", "Open MPI", CUDA, {}, "ob1", True, (D, D, S, S), "5.x, ob1"),
    ("Open MPI v5.0.3", "Open MPI", CUDA, {}, "ucx", True, (D, D, D, S), "5.x, UCX"),
    ("Open MPI v4.1.4", "Open MPI", NO_CUDA, {}, "ob1", False, (S, S, S, S), "Open MPI 2.0-4.x"),
    ("Open MPI v5.0.11", "Open MPI", {}, {}, None, None, (S, S, S, S), "Open MPI 5.x"),
    # MPICH 4.0.2 built --with-cuda: all direct; the mpich wheel (no CUDA): all staged
    ("MPICH Version:      4.0.2\nMPICH Release date: ...", "MPICH", CUDA, {}, None, True, (D, D, D, D), "MPICH >= 3.4"),
    ("MPICH Version:      5.0.2", "MPICH", NO_CUDA, {}, None, False, (S, S, S, S), "MPICH >= 3.4"),
    ("MPICH Version:      4.0.2", "MPICH", NO_CUDA, {"MPIR_CVAR_ENABLE_GPU": "0"}, None, False, (S, S, S, S), "MPICH"),
    ("MPICH Version:      3.3.2", "MPICH", CUDA, {}, None, True, (S, S, S, S), ""),  # no documented rule
    # Cray MPICH: only with MPICH_GPU_SUPPORT_ENABLED=1
    ("CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)", "Cray MPICH", {}, {"MPICH_GPU_SUPPORT_ENABLED": "1"}, None,
     True, (D, D, D, D), "Cray"),
    ("CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)", "Cray MPICH", {}, {}, None, False, (S, S, S, S), "Cray"),
    ("MVAPICH2 Version      :\t2.3.7", "MVAPICH", {}, {"MV2_USE_CUDA": "1"}, None, True, (D, D, D, D), "GDR"),
    ("MVAPICH2 Version      :\t2.3.7", "MVAPICH", {}, {}, None, None, (S, S, S, S), "GDR"),
    ("MVAPICH-Plus 4.0", "MVAPICH", {}, {"MV2_USE_CUDA": "1"}, "plus", None, (S, S, S, S), "Plus"),
    # Intel MPI: p2p and blocking documented, nonblocking collectives not
    ("Intel(R) MPI Library 2021.15 for Linux* OS", "Intel MPI", {}, {"I_MPI_OFFLOAD": "1"}, None, True,
     (D, D, S, S), "2021.14"),
    ("Intel(R) MPI Library 2021.15 for Linux* OS", "Intel MPI", {}, {}, None, None, (S, S, S, S), "2021.14"),
    ("Intel(R) MPI Library 2021.10 for Linux* OS", "Intel MPI", {}, {"I_MPI_OFFLOAD": "1"}, None, False,
     (S, S, S, S), "< 2021.14"),
    ("Spectrum MPI 10.4", "unknown", {}, {}, None, None, (S, S, S, S), ""),
])
def test_route_rules_per_operation_class(text, library, queries, env, variant, cuda, routes, rule):
    from fourd_mpi.core.gpuaware import OP_CLASSES, parse_version, route_rules

    assert library_family(text) == library
    got_cuda, got_routes, got_rule, reason = route_rules(library, queries, env, parse_version(text), variant)
    assert got_cuda == cuda and rule in got_rule and reason
    assert tuple(got_routes[cls]["route"] for cls in OP_CLASSES) == routes
    for cls in OP_CLASSES:  # every direct verdict names its documented source; a staged one says why
        entry = got_routes[cls]
        assert entry["calls"] and entry["says"]
        if entry["route"] == "direct":
            assert entry["source"].startswith("http")


def test_every_rule_row_has_a_route_and_a_source_or_says_undocumented():
    from fourd_mpi.core.gpuaware import OP_CLASSES, ROUTE_RULES

    for rule in ROUTE_RULES:
        assert set(rule.routes) == set(OP_CLASSES), rule.name
        for cls, (route, source) in rule.routes.items():
            assert route in ("direct", "staged")
            assert source is not None or route == "staged", (rule.name, cls)  # nothing direct without a source


def test_open_mpi_pml_from_the_environment_or_the_loaded_component():
    from fourd_mpi.core.gpuaware import open_mpi_pml

    assert open_mpi_pml({"OMPI_MCA_pml": "ucx"}, "") == "ucx"
    assert open_mpi_pml({}, "7f0 r-xp /opt/ompi/lib/openmpi/mca_pml_ob1.so\n") == "ob1"
    assert open_mpi_pml({"OMPI_MCA_pml": "^ucx"}, "") is None  # an exclusion names no PML
    assert open_mpi_pml({}, "/x/mca_pml_ob1.so\n/x/mca_pml_ucx.so\n") is None  # ambiguous: the ob1 rows apply


def test_report_lines_name_library_version_and_each_class():
    from fourd_mpi.core.gpuaware import describe_routes, parse_version, route_rules

    cuda, routes, rule, reason = route_rules("Open MPI", CUDA, {}, parse_version("Open MPI v4.1.4"), "ob1")
    aw = GpuAwareness("Open MPI", "Open MPI v4.1.4", None, cuda_aware=cuda, reason=reason, version_number="4.1.4",
                      variant="ob1", rule=rule, routes=routes)
    lines = describe_routes(aw)
    assert lines[0].startswith("GPU-aware MPI: Open MPI 4.1.4, ob1: CUDA-aware yes")
    assert len(lines) == 5 and "p2p" in lines[1] and "direct" in lines[1] and "open-mpi.org" in lines[1]
    assert "nb_reduce" in lines[4] and "staged" in lines[4]
    forced = describe_routes(aw, {"p2p": "staged", "blocking": "staged", "nb_gather": "staged", "nb_reduce": "staged"})
    assert "staged (rules: direct)" in forced[1]
