"""The one table of collectives: known answers, and every user reads the same numbers."""

import random

import numpy as np
import pytest

from fourd_mpi.analysis.tables import COMM_FORMULAS
from fourd_mpi.core.colltable import COLLECTIVES, collective, wire_factor
from fourd_mpi.perf.calibration import KIND_OF, OPS, bus_factor, fit_alpha_beta
from fourd_mpi.perf.machine import Fit
from fourd_mpi.perf.volumes import Collective
from fourd_mpi.run.collbench import FORMULAS


@pytest.mark.parametrize("op, p, factor, alphas", [
    ("allgather", 4, 0.75, 3), ("reduce_scatter", 4, 0.75, 3), ("allreduce", 4, 1.5, 6),
    ("allreduce", 2, 1.0, 2), ("allgather", 1, 0.0, 0), ("allreduce", 1, 0.0, 0), ("allreduce", 3, 4 / 3, 4),
])
def test_ring_factors(op, p, factor, alphas):
    kind = COLLECTIVES[op]
    assert kind.wire_factor(p) == pytest.approx(factor) and kind.bus_factor(p) == pytest.approx(factor)
    assert kind.alpha_count(p) == alphas
    assert wire_factor(op, p) == pytest.approx(factor) and bus_factor(op, p) == pytest.approx(factor)


@pytest.mark.parametrize("size", [1, 7, 1000, 1_000_003, 2 ** 31 + 5])
@pytest.mark.parametrize("p", [1, 2, 3, 8, 12])
def test_wire_bytes_is_the_exact_integer_formula(size, p):
    for kind in COLLECTIVES.values():
        expected = size * kind.rounds * (p - 1) // p if p > 1 else 0
        assert kind.wire_bytes(size, p) == expected


def test_mpi_calls_and_names():
    assert {k: (c.nonblocking, c.blocking) for k, c in COLLECTIVES.items()} == {
        "allgather": ("Iallgather", "Allgather"),
        "reduce_scatter": ("Ireduce_scatter_block", "Reduce_scatter_block"),
        "allreduce": ("Iallreduce", "Allreduce")}
    expected = {"iallgather": "allgather", "ireduce_scatter": "reduce_scatter", "iallreduce": "allreduce",
                "allgather": "allgather", "reduce_scatter": "reduce_scatter", "allreduce": "allreduce"}
    assert set(OPS) == set(expected)
    for op in OPS:  # every name the benchmark uses resolves, i-prefixed or not
        assert collective(op) is COLLECTIVES[expected[op]] and KIND_OF[op] == expected[op]
    with pytest.raises(KeyError, match="unknown collective 'bcast'"):
        collective("bcast")


def test_model_and_benchmark_use_the_table():
    alpha, beta, size = 2e-6, 1e-9, 1 << 20
    for op, kind in COLLECTIVES.items():
        assert Fit(alpha, beta).time(op, 4, size) == pytest.approx(kind.ring_time(4, size, alpha, beta))
        assert Fit(alpha, beta).time(op, 1, size) == 0.0
        c = Collective(layer="block0.fc1", role="fwd_allreduce", op=op, axis="x", p=4, phase="forward", count=3,
                       message_bytes=size)
        assert c.wire_bytes == 3 * kind.wire_bytes(size, 4) and c.steps == 3 * kind.alpha_count(4)
    # the alpha-beta fit recovers the parameters it was given (a known answer)
    points = [(op, p, s, COLLECTIVES[op].ring_time(p, s, alpha, beta))
              for op in COLLECTIVES for p in (2, 4, 8) for s in (8, 4096, 1 << 22)]
    fit = fit_alpha_beta(points)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6) and fit["beta_s_per_byte"] == pytest.approx(beta, rel=1e-6)


def _old_k(op):  # the per-site expressions the table replaced
    return 2 if op == "allreduce" else 1


def test_bit_for_bit_with_the_replaced_expressions():
    rng = random.Random(7)
    for _ in range(20000):
        op, p = rng.choice(list(COLLECTIVES)), rng.randint(1, 96)
        size = rng.choice([rng.randint(0, 1 << 34), rng.uniform(1.0, 1e9)])
        alpha, beta = rng.uniform(1e-7, 1e-4), rng.uniform(1e-12, 1e-8)
        share = rng.choice([1.0, 2.0, rng.uniform(1, 8)])
        k, kind = _old_k(op), COLLECTIVES[op]
        # trace.events.wire_factor and collbench.bus_factor before the table
        old_float = (2.0 if op == "allreduce" else 1.0) * (p - 1) / p if p > 1 else 0.0
        assert wire_factor(op, p) == old_float and bus_factor(op, p) == old_float
        assert kind.wire_bytes(size, p) == size * k * (p - 1) // p  # volumes.Collective.wire_bytes
        assert kind.alpha_count(p) == k * (p - 1)  # volumes.Collective.steps, the fit's alpha column
        old_time = 0.0 if p <= 1 else k * (p - 1) * alpha + k * (p - 1) / p * size * beta * share  # machine.Fit
        assert Fit(alpha, beta).time(op, p, size, share) == old_time


def test_vectorized_wire_bytes_in_integers():
    sizes = np.array([0, 1, 7, 4096, 1_000_003, 2 ** 40 + 3], dtype=np.int64)
    for p in (1, 2, 3, 4, 6, 64):
        group = np.full(len(sizes), p, dtype=np.int64)
        for kind in COLLECTIVES.values():
            got = kind.wire_bytes(sizes, group)
            assert got.dtype == np.int64
            assert got.tolist() == [int(s) * kind.rounds * (p - 1) // p for s in sizes.tolist()]
            assert got.tolist() == [kind.wire_bytes(int(s), p) for s in sizes.tolist()]


def test_printed_formulas_are_unchanged():
    assert FORMULAS[1] == ("algbw = S / latency;  busbw = algbw * (p-1)/p (allgather, reduce_scatter), "
                           "algbw * 2(p-1)/p (allreduce)")
    assert FORMULAS[-1] == ("fit: t = k(p-1)*alpha + k(p-1)/p*S*beta, k = 2 for allreduce else 1 (least squares on "
                            "relative error, nonblocking forms)")
    assert COMM_FORMULAS["busbw_gbps"] == ("busbw = algbw * k * (n - 1) / n, k = 2 for allreduce, 1 for allgather "
                                           "and reduce_scatter, n = size of the axis")


def test_the_table_is_pure():
    """Importable without MPI: the module imports nothing beyond the standard library."""
    import ast

    import fourd_mpi.core.colltable as mod
    tree = ast.parse(open(mod.__file__).read())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "dataclasses", "typing"}
