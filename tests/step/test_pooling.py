"""Pooled arrays under real mpiexec: after the first steps a step allocates nothing, and reuse changes no result."""

import pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nranks, model, grids", [
    (8, "gpt-tiny", "1x2x2x2,2x2x1x2,1x1x8x1"),
    (3, "mlp-tiny", "1x1x3x1,1x3x1x1,3x1x1x1"),
])
def test_steady_state_steps_allocate_nothing(run_mpi, nranks, model, grids):
    extra = ["hidden=48", "ffn_hidden=96", "batch=6"] if nranks == 3 else []  # divisible by 3
    proc = run_mpi(nranks, [model, grids, *extra], script="tests/helpers/mpi_pool_check.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2 * len(grids.split(",")) and all(line.endswith(" ok") for line in lines), proc.stdout
