"""bench/multinode.py's offline part (``--from-results``): the report's part 3 read back, the ranking summary
(known answers) and the model again from the committed report and profiles (no bed, no MPI)."""

import importlib.util
import os
import subprocess
import sys

import pytest
from conftest import REPO, mpi_env

SCRIPT = os.path.join(REPO, "bench", "multinode.py")
REPORT = os.path.join(REPO, "results", "benchmarks", "multinode.txt")


def _module():
    spec = importlib.util.spec_from_file_location("bench_multinode", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rank_summary_known_answers():
    mn = _module()
    # the model orders 3 grids 2, 3, 1 where measured 1, 2, 3: its best (c) is measured third
    rows = [("a", 0.1, 0.2), ("b", 0.2, 0.3), ("c", 0.3, 0.1)]
    s = mn.rank_summary(rows)
    # Spearman = 1 - 6 sum d^2 / (n (n^2 - 1)) with ranks (1,2,3) vs (2,3,1): d = (-1,-1,2), 1 - 6*6/24 = -0.5
    assert s["spearman"] == pytest.approx(-0.5)
    assert (s["best"], s["position"], s["within_two"]) == ("c", 3, False)
    s = mn.rank_summary([("a", 0.1, 0.2), ("b", 0.2, 0.1), ("c", 0.3, 0.3)])
    assert (s["best"], s["position"], s["within_two"]) == ("b", 2, True) and s["spearman"] == pytest.approx(0.5)


def test_the_placement_of_x_and_z_is_read_from_the_run_header_or_its_full_configuration():
    mn = _module()
    short = ("fourd-mpi 0.1.0: axonn4d (AxoNN 4D) on grid 1x2x1x2 (DxZxYxX), 4 ranks on 2 node(s), 2 per node; "
             "axes across nodes: x\n")
    assert mn.placement_of(short, ("x", "z")) == {"x": "inter-node", "z": "intra-node"}
    full = ("  axis  size  stride  placement   communicates\n  x        2       1  intra-node  fwd all-reduce\n"
            "  z        2       2  inter-node  weight all-gather\n")
    assert mn.placement_of(full, ("x", "z")) == {"x": "intra-node", "z": "inter-node"}
    assert mn.placement_of("step time: median 0.4 s\n", ("x", "z")) == {}


def test_part_three_is_read_back_from_a_report():
    mn = _module()
    text = ("## 3. ranking: every grid of 8 ranks, 4 nodes x 2 (block), gpt-tiny h=256 seq=64 batch=8, 4 measured\n"
            "#   each: ...\ngrid      measured s  rank  model s model rank\n"
            "2x1x4x1        0.231     1    0.264          2\n1x1x4x2        0.275     2    0.256          1\n"
            "Spearman rank correlation (measured vs model, 2 grids): 1.00\n\n## 4. algorithms\n1x1x8x1 0.5\n")
    assert mn.parse_ranking(text) == [(4, 2, 256, 64, 8, {"2x1x4x1": 0.231, "1x1x4x2": 0.275})]


def test_from_results_reprices_the_committed_report_offline():
    proc = subprocess.run([sys.executable, SCRIPT, "--from-results", REPORT], capture_output=True, text=True,
                          timeout=300, env=mpi_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "## 3. 2 nodes x 4" in out and "## 3. 4 nodes x 2" in out
    assert out.count("Spearman rank correlation (measured vs model, 20 grids)") == 2
    # every inter-node axis names the measured points that priced it (p@g of its placement)
    assert "4x1x2x1" in out and "data" in out and "(inter, g=1, 4@1" in out


def test_from_results_refuses_a_file_without_part_three(tmp_path):
    bad = tmp_path / "r.txt"
    bad.write_text("nothing here\n")
    proc = subprocess.run([sys.executable, SCRIPT, "--from-results", str(bad)], capture_output=True, text=True,
                          timeout=120, env=mpi_env(), cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no '## 3. ranking' section" in proc.stderr
    proc = subprocess.run([sys.executable, SCRIPT, "--from-results", str(tmp_path / "missing.txt")],
                          capture_output=True, text=True, timeout=120, env=mpi_env(), cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1


def test_the_defaults_verdict_known_answers():
    """Part 2's hidden share and the defaults' targets: 0.02 s left of 0.1 s is 80 % hidden, 0.3 s of 0.1 s is
    -200 %; compute <= 1.05x and >= 80 % hidden meets, above comm/compute 0.5 the hiding target does not apply."""
    mn = _module()
    assert mn.hidden_pct(0.02, 0.1) == pytest.approx(80.0) and mn.hidden_pct(0.3, 0.1) == pytest.approx(-200.0)
    assert mn.defaults_meet(1.05, 80.0, 0.3) and mn.defaults_meet(0.86, 85.0, 0.15)
    assert not mn.defaults_meet(1.06, 95.0, 0.3) and not mn.defaults_meet(1.0, 79.0, 0.5)
    assert mn.defaults_meet(1.0, 36.0, 0.72) and not mn.defaults_meet(1.19, 64.0, 0.72)
