"""``--poll-flops auto`` (:class:`fourd_mpi.core.progress.AutoChunk`): the rule on known answers, the chunked
GEMM feeding it, and the option's grammar; ``--progress auto``'s choice (:func:`choose_progress`). The end-to-end
effect (compute inside an overlapped step, hidden share) is a benchmark (bench/multinode.py, results/benchmarks/),
not a test."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from fourd_mpi.core.binding import Binding
from fourd_mpi.core.progress import (
    AUTO_MAX_FLOPS,
    AUTO_MIN_FLOPS,
    AUTO_START_FLOPS,
    MIN_CHUNK_S,
    POLL_BUDGET,
    PROGRESS_STRATEGIES,
    THREAD_CPUS_PER_RANK,
    AutoChunk,
    PollProgress,
    choose_progress,
    make_progress,
)
from fourd_mpi.errors import ConfigError
from fourd_mpi.step.kernels import matmul
from fourd_mpi.util.values import poll_flops_value


def test_rule_known_answers():
    auto = AutoChunk()
    assert auto.flops == AUTO_START_FLOPS == 1e9  # nothing measured: the start size
    auto.observe_poll(10e-6)
    assert auto.flops == AUTO_START_FLOPS  # a poll cost without a GEMM rate: still the start size
    auto.observe_compute(4e7, 1e-3)  # 40 GFLOP/s
    # 10 us / 2 % = 0.5 ms is under the 50 ms floor: 50 ms at 40 GFLOP/s = 2e9 FLOPs
    assert MIN_CHUNK_S == 0.05 and POLL_BUDGET == 0.02
    assert auto.flops == pytest.approx(2e9)
    rate_only = AutoChunk()
    rate_only.observe_compute(2e7, 1e-3)  # 20 GFLOP/s, no poll timed yet: the floor, 1e9 FLOPs
    assert rate_only.flops == pytest.approx(1e9) and "no poll" in rate_only.describe()
    slow = AutoChunk()
    slow.observe_compute(20e9, 1.0)
    slow.observe_poll(4e-3)  # 4 ms polls (TCP in flight): 4 ms / 2 % = 200 ms chunks = 4e9 FLOPs
    assert slow.flops == pytest.approx(4e9)
    assert "4e+09 FLOPs" in slow.describe() and "20 GFLOP/s" in slow.describe() and "4e+03 us" in slow.describe()


def test_rule_bounds_and_running_median():
    auto = AutoChunk()
    auto.observe_compute(1e7, 1.0)  # 10 MFLOP/s x 50 ms = 5e5: the lower bound
    auto.observe_poll(1e-9)
    assert auto.flops == AUTO_MIN_FLOPS
    auto = AutoChunk()
    auto.observe_compute(1e12, 1.0)
    auto.observe_poll(1.0)
    assert auto.flops == AUTO_MAX_FLOPS
    auto = AutoChunk()
    auto.observe_compute(1e10, 1.0)
    for cost in (2.0e-3, 2.2e-3, 50e-3, 2.4e-3):  # one poll stretched by a preemption does not move the median
        auto.observe_poll(cost)
    assert auto.cost == pytest.approx(2.3e-3)
    assert auto.flops == pytest.approx(1e10 * 2.3e-3 / POLL_BUDGET) == pytest.approx(1.15e9)
    for _ in range(AutoChunk.WINDOW):  # the window forgets: a link that turned busy moves the size
        auto.observe_poll(4e-3)
    assert auto.cost == pytest.approx(4e-3) and auto.flops == pytest.approx(2e9)
    for _ in range(AutoChunk.WINDOW):  # cheap polls again: back to the floor
        auto.observe_poll(1e-6)
    assert auto.flops == pytest.approx(1e10 * MIN_CHUNK_S)


class _Owner:
    """The side of :class:`~fourd_mpi.core.collectives.Collectives` a hook touches: ``in_flight`` and ``poll``."""

    in_flight = True

    def __init__(self):
        self.polls = 0

    def poll(self, record=True):
        self.polls += 1


def test_chunked_gemm_feeds_the_rate_and_reads_the_size_each_gemm():
    strategy = PollProgress("auto")
    strategy.auto.flops = 2 * 64 * 64 * 64.0  # one piece = 64 rows of a 256x64 @ 64x64 product
    owner = _Owner()
    hook = strategy.compute_hook(owner)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((256, 64)), rng.standard_normal((64, 64))
    out = matmul(a, b, progress=hook)
    np.testing.assert_allclose(out, a @ b, rtol=1e-12)
    assert owner.polls == 3  # 4 pieces, a poll between each two
    assert strategy.auto.rate is not None and strategy.auto.rate > 0
    strategy.auto.flops = 1e12  # bigger than the product: one piece, no poll
    matmul(a, b, progress=hook)
    assert owner.polls == 3


def test_fixed_size_and_grammar():
    assert PollProgress(5e6).chunk_flops == 5e6 and PollProgress(5e6).auto is None
    assert "5e+06 FLOPs" in make_progress("poll", 5e6).describe()
    # make_progress("poll"): the default
    assert "auto" in make_progress("poll", "auto").describe() and "auto" in make_progress("poll").describe()
    for bad in (0, -1.0, "often"):
        with pytest.raises(ConfigError):
            PollProgress(bad)
    assert poll_flops_value("auto") == "auto" and poll_flops_value("AUTO") == "auto"
    assert poll_flops_value("1e9") == 1e9
    for bad in ("0", "-3", "nan", "inf", "often", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            poll_flops_value(bad)


def test_auto_strategy_rule():
    """``--progress auto``: a thread only where collectives overlap compute, every communicating axis stays on its
    node, the host computes, every node has two CPUs per rank and MPI allows threads; the reason names what
    decided, in that order."""
    ok = dict(backend="numpy", inter_node_axes=[], thread_multiple=True, overlap=True, cpus_per_rank=2.0)
    assert THREAD_CPUS_PER_RANK == 2
    assert choose_progress(**ok)[0] == "thread"
    assert choose_progress(**{**ok, "cpus_per_rank": 8.0})[0] == "thread"
    cases = [({"overlap": False}, "--overlap none"), ({"backend": "cupy"}, "GPU"),
             ({"inter_node_axes": ["data"]}, "data crosses nodes"),
             ({"inter_node_axes": ["z", "x"]}, "z, x cross nodes"),
             ({"cpus_per_rank": None}, "CPU sets are unknown"), ({"cpus_per_rank": 0.25}, "0.25 CPU(s) per rank"),
             ({"cpus_per_rank": 1.0}, "1 CPU(s) per rank on a node: a progress thread would take compute time"),
             ({"thread_multiple": False}, "MPI_THREAD_MULTIPLE")]
    for change, reason in cases:
        name, why = choose_progress(**{**ok, **change})
        assert name == "poll" and reason in why, (change, why)
    # the first failing condition speaks
    assert "--overlap none" in choose_progress(**{**ok, "overlap": False, "backend": "cupy"})[1]
    assert PROGRESS_STRATEGIES[0] == "auto"


def test_binding_cpus_per_rank():
    """The fewest distinct CPUs per rank over the nodes: 2 unpinned ranks on 2 CPUs have 1 each; 3 on 2, 2/3;
    pinned ranks their own sets."""
    assert Binding.from_ranks([[0, 1], [0, 1]], [0, 0], [2]).cpus_per_rank == 1.0
    assert Binding.from_ranks([[0, 1]] * 3, [0, 0, 0], [2]).cpus_per_rank == pytest.approx(2 / 3)
    assert Binding.from_ranks([[0], [1], [0, 1, 2, 3]], [0, 0, 1], [2, 4]).cpus_per_rank == 1.0
    assert Binding.from_ranks([[0, 1, 2, 3], [0], [0]], [0, 1, 1], [4, 4]).cpus_per_rank == 0.5


def test_auto_strategy_says_why():
    """``make_progress("auto", ...)`` builds the chosen strategy, and its description carries the reason (poll:
    no MPI needed to build it)."""
    strategy = make_progress("auto", "auto", backend="numpy", inter_node_axes=["z"], thread_multiple=True,
                             cpus_per_rank=2.0)
    assert isinstance(strategy, PollProgress) and strategy.name == "poll"
    assert strategy.describe().endswith("(--progress auto: z crosses nodes: a progress thread would compete with "
                                        "the network stack for the ranks' cores)")
    assert make_progress("poll").chosen is None and "auto:" not in make_progress("poll").describe()
