"""``--poll-flops auto`` (:class:`fourd_mpi.core.progress.AutoChunk`): the rule on known answers, the chunked
GEMM feeding it, and the option's grammar. The end-to-end effect (compute inside an overlapped step, hidden
share) is a benchmark (bench/multinode.py, results/benchmarks/), not a test."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from fourd_mpi.core.progress import (AUTO_MAX_FLOPS, AUTO_MIN_FLOPS, AUTO_START_FLOPS, POLL_BUDGET, AutoChunk,
                                     PollProgress, make_progress)
from fourd_mpi.errors import ConfigError
from fourd_mpi.step.kernels import matmul
from fourd_mpi.util.values import poll_flops_value


def test_rule_known_answers():
    auto = AutoChunk()
    assert auto.flops == AUTO_START_FLOPS  # nothing measured: the start size
    auto.observe_compute(2e7, 1e-3)  # 20 GFLOP/s
    assert auto.flops == AUTO_START_FLOPS  # one of the two measurements only
    auto.observe_poll(10e-6)  # 10 us: chunk 10 us / 2 % = 0.5 ms = 1e7 FLOPs at 20 GFLOP/s
    assert auto.flops == pytest.approx(20e9 * 10e-6 / POLL_BUDGET) == pytest.approx(1e7)
    slow = AutoChunk()
    slow.observe_compute(20e9, 1.0)
    slow.observe_poll(0.5e-3)  # 0.5 ms polls (TCP in flight): 25 ms chunks = 5e8 FLOPs
    assert slow.flops == pytest.approx(5e8)
    assert "5e+08 FLOPs" in slow.describe() and "20 GFLOP/s" in slow.describe() and "500 us" in slow.describe()


def test_rule_bounds_and_running_median():
    auto = AutoChunk()
    auto.observe_compute(1e9, 1.0)
    auto.observe_poll(1e-9)
    assert auto.flops == AUTO_MIN_FLOPS
    auto = AutoChunk()
    auto.observe_compute(1e12, 1.0)
    auto.observe_poll(1.0)
    assert auto.flops == AUTO_MAX_FLOPS
    auto = AutoChunk()
    auto.observe_compute(1e10, 1.0)
    for cost in (100e-6, 110e-6, 50e-3, 120e-6):  # one poll stretched by a preemption does not move the median
        auto.observe_poll(cost)
    assert auto.cost == pytest.approx(115e-6)
    assert auto.flops == pytest.approx(1e10 * 115e-6 / POLL_BUDGET)
    for _ in range(AutoChunk.WINDOW):  # the window forgets: a link that turned busy moves the size
        auto.observe_poll(1e-3)
    assert auto.cost == pytest.approx(1e-3)


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
    assert "auto" in make_progress("poll", "auto").describe() and "1e+07" in make_progress("poll").describe()
    for bad in (0, -1.0, "often"):
        with pytest.raises(ConfigError):
            PollProgress(bad)
    assert poll_flops_value("auto") == "auto" and poll_flops_value("AUTO") == "auto"
    assert poll_flops_value("1e9") == 1e9
    for bad in ("0", "-3", "nan", "inf", "often", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            poll_flops_value(bad)
