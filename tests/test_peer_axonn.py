"""The peer benchmark runs AxoNN's own layers and ours on the same grids, both match float64, and both
sides' timed steps compute the same gradients (the input gradient included).

Skipped (with the reason) where torch or AxoNN is not installed: ``pip install -e ".[peer]"``.
Asserts correctness and the table's shape, never a time.
"""

import json
import subprocess
import sys

import pytest
from conftest import REPO, mpi_env

pytest.importorskip("torch", reason="the peer benchmark needs torch: pip install -e '.[peer]'")
pytest.importorskip("axonn", reason="the peer benchmark needs AxoNN 0.2.0: pip install -e '.[peer]'")

pytestmark = pytest.mark.mpi


def test_axonn_and_ours_on_odd_grids_agree_with_float64(tmp_path):
    out = tmp_path / "peer.json"
    cmd = [sys.executable, "-m", "bench.peer_axonn", "--ranks", "4", "--grids", "2x2x1,1x4x1,1x1x4",
           "--hidden", "128", "--seq", "32", "--batch", "4", "--rounds", "1", "--steps", "2", "--warmup", "1",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=mpi_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = [line for line in proc.stdout.splitlines() if line.startswith("# check:")]
    assert len(checks) == 6 and sum(" axonn " in c for c in checks) == 3
    patches = [line for line in proc.stdout.splitlines() if line.startswith("# patch:")]
    assert any("gloo" in p for p in patches)  # CPU: every run-time patch of AxoNN is printed
    data = json.loads(out.read_text())
    # equal work: every timed step of both sides produced the same gradients, the input gradient included
    assert data["gradient_sets"] == {"axonn": ["dW1,dW2,dX"], "ours": ["dW1,dW2,dX"]}
    assert all(" dX " in c for c in checks)  # both sides' dX checked against float64
    assert sum(line.startswith("# step contains (") for line in proc.stdout.splitlines()) == 2
    rows = data["rows"]
    assert [(r["grid"], r["K"]) for r in rows] == [("2x2x1", 128), ("1x4x1", 128), ("1x1x4", 128)]
    for r in rows:
        assert r["axonn_s"] > 0 and r["ours_s"] > 0 and r["ratio"] == pytest.approx(r["ours_s"] / r["axonn_s"])


def test_a_grid_that_does_not_fit_the_ranks_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.peer_axonn", "--ranks", "4", "--grids", "2x2x2"],
                          capture_output=True, text=True, timeout=120, env=mpi_env(), cwd=REPO)
    assert proc.returncode != 0 and "do not multiply to --ranks 4" in proc.stderr
