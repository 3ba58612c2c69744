"""Overlap options and progress strategies: same losses and gradients as the blocking step.

Every overlap option alone, all of them, all with weight caching, under each
progress strategy, on grids with G_z > 1 and G_data > 1, compared with the
blocking single-rank reference (float64, tolerance 1e-10). A tiny poll chunk
forces the chunked GEMM path; ``--check-buffers`` proves no send buffer changes
while its collective is in flight; the engine itself checks that no request is
left un-waited at the end of every backward pass.
"""

import json

import pytest

from fourd_mpi.errors import ConfigError
from fourd_mpi.core.grid import GridShape
from fourd_mpi.step.overlap import OverlapConfig

GRIDS = ["2x2x1x2", "1x2x2x2", "2x2x2x1", "1x4x1x2"]
OVERLAPS = ["oag", "ors", "oar", "dp", "od", "cache", "all", "all,cache", "oag,ors"]


def test_parse_overlap_lists():
    assert OverlapConfig.parse("none").enabled == []
    assert OverlapConfig.parse("all").enabled == ["oag", "ors", "oar", "dp", "od", "oup"]
    c = OverlapConfig.parse("ORS, oag", prefetch_depth=3)
    assert c.enabled == ["oag", "ors"] and c.prefetch_depth == 3 and str(c).startswith("oag,ors")
    with pytest.raises(ConfigError, match="unknown overlap 'oaq'"):
        OverlapConfig.parse("oag,oaq")
    with pytest.raises(ConfigError, match="--chunks"):
        OverlapConfig.parse("od", chunks=0)


def test_inapplicable_options_are_named():
    notes = OverlapConfig.parse("all,cache").inapplicable(GridShape(1, 1, 2, 4))
    assert any(n.startswith("oag has no effect: G_z = 1") for n in notes)
    assert any(n.startswith("dp has no effect: G_data = 1") for n in notes)
    assert not any(n.startswith("oar") or n.startswith("od") for n in notes)
    assert OverlapConfig.parse("all").inapplicable(GridShape(2, 2, 1, 2)) == []


@pytest.mark.mpi
@pytest.mark.parametrize("progress", ["poll", "none", "thread"])
def test_every_overlap_matches_the_blocking_reference(run_mpi, tmp_path, progress):
    report = tmp_path / "overlap.json"
    args = ["verify", "--dtype", "float64", "--steps", "3", "--progress", progress, "--check-buffers",
            "--poll-flops", "3000", "--chunks", "3", "--prefetch-depth", "2", "--json", report]
    args += [a for g in GRIDS for a in ("--grid", g)] + [a for o in OVERLAPS for a in ("--overlap", o)]
    proc = run_mpi(8, args, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(report.read_text())["results"]
    assert len(results) == len(GRIDS) * len(OVERLAPS)
    assert all(r["ok"] and r["progress"] == progress for r in results)


@pytest.mark.mpi
def test_mlp_stack_with_all_overlaps(run_mpi):
    proc = run_mpi(8, ["verify", "--model", "mlp-tiny", "--dtype", "float64", "--all-grids",
                       "--overlap", "all,cache", "--poll-flops", "2000", "--check-buffers"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "20 passed, 0 failed" in proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [2, 4])
def test_request_bookkeeping_and_progress(run_mpi, nranks):
    proc = run_mpi(nranks, [], script="tests/helpers/mpi_overlap_check.py", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "overlap checks ok" in proc.stdout


@pytest.mark.mpi
def test_inapplicable_overlap_is_a_noop_said_once(run_mpi, tmp_path):
    proc = run_mpi(8, ["run", "--gx", "2", "--gy", "4", "--overlap", "oag,ors,oar", "--steps", "2",
                       "--results-dir", tmp_path])
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if line.startswith("fourd-mpi: note:") and " on grid " in line]
    assert notes == [  # notes: on stderr, once (rank 0)
        "fourd-mpi: note: oag has no effect: G_z = 1, weights are not all-gathered on grid 1x1x4x2",
        "fourd-mpi: note: ors has no effect: G_z = 1, gradients are not reduce-scattered on grid 1x1x4x2",
    ]
    assert "overlap oag,ors,oar" in proc.stdout
