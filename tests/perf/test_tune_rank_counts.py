"""``tune`` answers for any rank count it accepts, and refuses the rest in one line (before: ``tune
--ranks 65536`` hung in an O(ranks) search; 2^63 grew without bound). Offline: no MPI."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, mpi_env

from fourd_mpi.core.grid import divisors, grid_factorizations
from fourd_mpi.perf.tune import _nearby_rank_counts
from fourd_mpi.step.presets import model_problems, resolve_model


def fourd(*args):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=mpi_env(), cwd=REPO)


@pytest.mark.parametrize("n", [1, 2, 12, 36, 97, 4096, 65536, 99991])
def test_divisors_match_the_definition(n):
    assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


def test_divisors_known_answers():
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert len(divisors(720720)) == 240  # 2^4 3^2 5 7 11 13: 5*3*2*2*2*2


def test_grid_factorizations_are_every_ordered_factorization_once():
    grids = list(grid_factorizations(12))
    assert len(grids) == len(set(grids)) == 40  # ordered 4-factorizations of 2^2 * 3: C(5,3) * C(4,3)
    assert all(g.data * g.z * g.y * g.x == 12 for g in grids)


def test_nearby_rank_counts_are_the_closest_valid_ones():
    cfg = resolve_model("gpt-tiny")
    valid = [n for n in range(1, 5000) if any(not model_problems(cfg, g) for g in grid_factorizations(n))]
    for ranks in (3, 100, 65536, 720720):
        near = _nearby_rank_counts(cfg, ranks)
        assert near == sorted(sorted(valid, key=lambda v: (abs(v - ranks), v))[:6]), ranks


@pytest.mark.parametrize("ranks", [65536, 720720, 10 ** 7])
def test_tune_names_the_nearest_rank_counts_at_once(ranks):
    proc = fourd("tune", "--ranks", ranks, "--top", 1)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().endswith("rank counts with a valid grid: 128, 256, 512, 1024, 2048, 4096"), proc.stderr


@pytest.mark.parametrize("ranks", [2 ** 63, 2 ** 24 + 1])
def test_tune_refuses_rank_counts_past_the_bound_in_one_line(ranks):
    proc = fourd("tune", "--ranks", ranks)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "expected an integer from 1 to 16,777,216" in proc.stderr
