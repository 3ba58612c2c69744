"""The named baselines under real mpiexec: ``verify --algorithm megatron1d|fsdp|dp`` against one rank.

Every grid the baseline allows (``--all-grids`` lists the others as skipped, with the pinned axes as the
reason) at 8 ranks and at the odd-ish size 6;
float64, tolerance 1e-10 (norm-wise relative error of the output, every gradient and the losses).
"""

import json

import pytest
from conftest import rank_stderr

from fourd_mpi.algorithms.registry import get
from fourd_mpi.core.grid import grid_factorizations

pytestmark = pytest.mark.mpi

#: sizes that divide by 1, 2, 3, 4, 6 and 8 (heads 24, batch 24)
SIZES = ["--hidden", "48", "--heads", "24", "--ffn-hidden", "96", "--seq", "8", "--batch", "24"]


@pytest.mark.parametrize("nranks", [8, 6])
@pytest.mark.parametrize("name", ["megatron1d", "fsdp", "dp"])
def test_baseline_matches_one_rank_on_every_grid_it_allows(run_mpi, tmp_path, name, nranks):
    report = tmp_path / "verify.json"
    proc = run_mpi(nranks, ["verify", "--algorithm", name, "--all-grids", "--dtype", "float64", "--steps", "2",
                            "--model", "gpt-tiny", *SIZES, "--json", report])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    assert data["algorithm"] == name
    fixed = get(name).fixed
    expected = {str(g) for g in grid_factorizations(nranks) if all(getattr(g, a) == s for a, s in fixed.items())}
    assert {r["grid"] for r in data["results"]} == expected
    # the other factorizations are listed as skipped, each with the pinned axes as the reason
    assert {g for g, _ in data["skipped"]} == {str(g) for g in grid_factorizations(nranks)} - expected
    assert all(f"--algorithm {name}" in why and "contradicts it" in why for _, why in data["skipped"])
    for r in data["results"]:
        assert max(r["output_error"], r["grad_error"], r["loss_error"]) <= 1e-10, r
    assert f"with {name} against the serial 4D model" in proc.stdout


def test_verify_refuses_a_grid_the_baseline_does_not_allow_on_every_rank(run_mpi):
    proc = run_mpi(4, ["verify", "--algorithm", "megatron1d", "--grid", "1x1x2x2", "--model", "gpt-tiny"], timeout=120)
    assert proc.returncode == 2
    lines = [line for line in rank_stderr(proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 4 and len(set(lines)) == 1, proc.stderr
    assert "--algorithm megatron1d" in lines[0] and "--gx 2 contradicts it" in lines[0]
