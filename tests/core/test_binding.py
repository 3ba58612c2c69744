"""The pinning rule of :mod:`fourd_mpi.core.binding` on known CPU sets (pure: no MPI), the cpulist format, and
the run-level summary read back from trace metadata (old traces: unknown)."""

from __future__ import annotations

import pytest

from fourd_mpi.core.binding import Binding, cpu_ranges, own_cpus, parse_ranges, pinned_of


@pytest.mark.parametrize("cpus, text", [([0], "0"), ([0, 1], "0-1"), ([0, 1, 2, 5, 7, 8], "0-2,5,7-8"),
                                        ([3, 1, 2, 1], "1-3"), ([], "")])
def test_cpu_ranges_round_trip(cpus, text):
    assert cpu_ranges(cpus) == text
    assert parse_ranges(text) == sorted(set(cpus))


@pytest.mark.parametrize("text", ["a", "3-1", "-1", "1-2-3"])
def test_bad_cpu_ranges_are_refused(text):
    with pytest.raises(ValueError):
        parse_ranges(text)


@pytest.mark.parametrize("cpus, nodes, node_cpus, pinned, shared, free", [
    # mpiexec -n 2 -bind-to core on 2 cores: one CPU each, disjoint
    ([[0], [1]], [0, 0], [2], True, 0, 0),
    # no binding on 2 CPUs: both on both, sharing
    ([[0, 1], [0, 1]], [0, 0], [2], False, 2, 2),
    # -n 3 -bind-to core on 2 cores: ranks 0 and 2 share core 0 (each on fewer CPUs than the node: not free)
    ([[0], [1], [0]], [0, 0, 0], [2], False, 2, 0),
    # hyperthreads: a core is 2 CPUs, one core per rank on a 4-CPU node
    ([[0, 2], [1, 3]], [0, 0], [4], True, 0, 0),
    # one rank per node, same CPU numbers on two nodes: numbers compared within a node only
    ([[0], [0]], [0, 1], [8, 8], True, 0, 0),
    # one rank alone on its node, free on all of it: not pinned
    ([[0, 1, 2, 3]], [0], [4], False, 0, 1),
    # socket binding: 2 ranks, a half of the node each
    ([[0, 1, 2, 3], [4, 5, 6, 7]], [0, 0], [8], True, 0, 0),
    # overlapping sets (not identical): ranks 0 and 1 share CPU 1
    ([[0, 1], [1, 2], [3]], [0, 0, 0], [4], False, 2, 0),
    # a node whose CPU count is unknown (0): the highest CPU named + 1
    ([[0], [1]], [0, 0], [0], True, 0, 0),
])
def test_the_pinning_rule(cpus, nodes, node_cpus, pinned, shared, free):
    b = Binding.from_ranks(cpus, nodes, node_cpus)
    assert b.pinned is pinned
    assert sum(b.shared) == shared and sum(b.free) == free
    d = b.as_dict()
    assert d["pinned"] is pinned and d["num_cpus"] == [len(c) for c in cpus]
    assert d["cpus"] == [cpu_ranges(c) for c in cpus] and (d["shared_ranks"], d["free_ranks"]) == (shared, free)
    assert d["summary"].endswith("(pinned)" if pinned else "(not pinned)")
    assert (b.advice() == "") is pinned
    again = Binding.from_dict(d, nodes)
    assert again.pinned is pinned and again.cpus == b.cpus


def test_the_summary_lines():
    assert Binding.from_ranks([[0], [1]], [0, 0], [2]).describe() == (
        "each rank on 1 CPU, no CPU shared by two ranks of a node (pinned)")
    free = Binding.from_ranks([[0, 1], [0, 1]], [0, 0], [2])
    assert free.describe() == ("each rank on 2 CPUs; 2 rank(s) may run on every CPU of their node (2 CPUs), 2 rank(s) "
                               "share a CPU with another rank of their node (not pinned)")
    assert "mpiexec -bind-to core" in free.advice() and "srun --cpu-bind=cores" in free.advice()
    assert "docs/guide/regressions.md" in free.advice()
    crowded = Binding.from_ranks([[0], [1], [0]], [0, 0, 0], [2])  # mpiexec -n 3 -bind-to core on 2 cores
    assert crowded.describe() == ("each rank on 1 CPU; 2 rank(s) share a CPU with another rank of their node "
                                  "(not pinned)")
    assert "each rank is bound, but some share CPUs" in crowded.advice() and "fewer ranks per node" in crowded.advice()


def test_a_rank_without_affinity_makes_the_binding_unknown():
    assert Binding.from_ranks([[0], None], [0, 0], [2]) is None
    assert Binding.from_ranks([], [], []) is None


def test_pinned_of_metadata():
    assert pinned_of({"binding": {"pinned": True}}) is True
    assert pinned_of({"binding": {"pinned": False}}) is False
    assert pinned_of({}) is None and pinned_of({"binding": None}) is None  # older traces, no affinity: unknown


def test_own_cpus_reads_this_process():
    import os

    cpus = own_cpus()
    if not hasattr(os, "sched_getaffinity"):
        assert cpus is None
    else:
        assert cpus == sorted(os.sched_getaffinity(0))
