"""The one table of collectives: known answers, and every user reads the same numbers."""

import pytest

from fourd_mpi.core.colltable import COLLECTIVES, collective, wire_factor
from fourd_mpi.perf.collbench import OPS, bus_factor, fit_alpha_beta
from fourd_mpi.perf.machine import Fit
from fourd_mpi.perf.volumes import Collective


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
    for op in OPS:  # the benchmark's names, i-prefixed or not
        assert collective(op).name == op.lstrip("i") if op != "ireduce_scatter" else "reduce_scatter"
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
