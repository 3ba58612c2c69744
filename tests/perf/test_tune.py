"""``fourd-mpi tune`` and ``fourd-mpi model validate`` (one process, no mpiexec)."""

import json
import os
import subprocess
import sys

import pytest

from fourd_mpi.analysis.model_check import average_ranks, spearman
from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.tune import top_grids
from fourd_mpi.step.presets import resolve_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLES = os.path.join(REPO, "results", "samples")


def cli(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd or REPO, timeout=120)


def test_tune_prints_the_top_k_with_breakdowns_and_why():
    proc = cli("tune", "--ranks", 8, "--model", "gpt-small", "--site", "perlmutter", "--top", 3)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "machine profile perlmutter" in out and "all 20 grids are valid" in out
    lines = [l for l in out.splitlines() if l.strip()[:1].isdigit() and "x" in l.split()[1]]
    assert len(lines) == 3
    assert " wins (" in out and "per step against" in out
    assert "comm data" in out and "mem GiB" in out


def test_tune_explains_dropped_grids_and_memory_limit():
    proc = cli("tune", "--ranks", 8, "--model", "gpt-small", "--heads", 2, "--top", 2)
    assert proc.returncode == 0, proc.stderr
    assert "grids dropped: " in proc.stdout and "divisibility" in proc.stdout
    proc = cli("tune", "--ranks", 8, "--model", "gpt-5b", "--batch", 8, "--memory-limit", 24, "--site", "frontier",
               "--dtype", "float32")  # frontier defaults to bf16 (half the bytes)
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert err.startswith("fourd-mpi: error: no grid of 8 ranks fits gpt-5b") and "in 24 GiB per rank" in err
    assert "raise --memory-limit to" in err and "ranks (fits)" in err
    assert len(err.splitlines()) == 1


def test_tune_ranks_that_fit_no_grid():
    with pytest.raises(ConfigError, match=r"no grid of 7 ranks fits gpt-small.*rank counts with a valid grid: "
                                          r"[0-9, ]*8"):
        top_grids(resolve_model("gpt-small"), 7, 3)
    proc = cli("tune", "--ranks", 7, "--model", "gpt-small")
    assert proc.returncode == 2 and "fourd-mpi: error: no grid of 7 ranks" in proc.stderr
    proc = cli("tune", "--ranks", 8, "--model", "gpt-small", "--site", "summit")
    assert proc.returncode == 2 and "no machine profile for site 'summit'" in proc.stderr
    proc = cli("tune", "--ranks", 64, "--model", "gpt-small", "--batch", 64, "--profile",
               os.path.join(REPO, "fourd_mpi", "perf", "profiles", "perlmutter.yaml"))
    assert proc.returncode == 0, proc.stderr


def test_top_grids_for_the_sweep_agent():
    cfg = resolve_model("gpt-tiny", batch=8)
    grids = top_grids(cfg, 8, 3, profile="perlmutter", overlap="all")
    assert len(grids) == 3 and all(isinstance(g, GridShape) and g.size == 8 for g in grids)
    assert top_grids(cfg, 8, 100) and len(top_grids(cfg, 8, 100)) == 20


def test_emit_sweep_loads_as_a_sweep_spec(tmp_path):
    sweepspec = pytest.importorskip("fourd_mpi.jobs.spec")
    path = tmp_path / "spec.yaml"
    proc = cli("tune", "--ranks", 8, "--model", "gpt-tiny", "--top", 3, "--overlap", "all", "--emit-sweep", path)
    assert proc.returncode == 0, proc.stderr
    spec = sweepspec.load_spec(str(path))
    assert spec.name == "tune-gpt-tiny-8"
    proc = cli("tune", "--ranks", 8, "--model", "gpt-tiny", "--emit-sweep", path)
    assert proc.returncode == 2 and "already exists" in proc.stderr


def test_an_overridden_preset_is_labelled_as_model_predict_labels_it(tmp_path):
    """``tune --model gpt-tiny --hidden 512`` is not gpt-tiny: its header and JSON say ``gpt-tiny with --hidden
    512`` (model predict's label); the sweep it writes still names the preset and the size; --memory-limit
    takes run's grammar (80G = 80 GiB)."""
    sweepspec = pytest.importorskip("fourd_mpi.jobs.spec")
    path = tmp_path / "spec.yaml"
    proc = cli("tune", "--ranks", 8, "--model", "gpt-tiny", "--hidden", 512, "--heads", 8,  # 8: the preset's
               "--top", 2, "--memory-limit", "80G", "--emit-sweep", path)
    assert proc.returncode == 0, proc.stderr
    assert "model gpt-tiny with --hidden 512: " in proc.stdout
    assert "memory limit: 80 GiB per rank (--memory-limit)" in proc.stdout
    spec = sweepspec.load_spec(str(path))
    assert spec.name == "tune-gpt-tiny-8" and spec.models[0]["preset"] == "gpt-tiny" and spec.models[0]["hidden"] == 512
    doc = json.loads(cli("tune", "--ranks", 8, "--model", "gpt-tiny", "--hidden", 512, "--format", "json").stdout)
    assert doc["model"]["name"] == "gpt-tiny with --hidden 512" and doc["model"]["hidden"] == 512


def test_spearman_and_ranks():
    assert list(average_ranks([3, 1, 2, 2])) == [4, 1, 2.5, 2.5]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2], [1, 2]) != spearman([1, 2], [1, 2])  # NaN below 3 points


def test_model_validate_on_the_sample_traces(tmp_path):
    out = tmp_path / "report.txt"
    proc = cli("model", "validate", SAMPLES, "--profile", "laptop")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "measured_ms" in text and "predicted_ms" in text and "step_err_%" in text
    assert "gpt-tiny/8/b16" in text and "Spearman" in text and "top 3" in text
    # -o: the report goes to the file instead of standard output (the one convention of -o)
    proc = cli("model", "validate", SAMPLES, "--profile", "laptop", "-o", out)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr.startswith(f"wrote {out}"), proc.stderr
    assert out.read_text().strip() == text.strip()
    doc = json.loads(cli("model", "validate", SAMPLES, "--profile", "laptop", "--format", "json").stdout)
    assert {"configurations", "groups", "summary"} <= set(doc) and doc["summary"]["runs"] == len(doc["configurations"])
    assert cli("model", "validate", SAMPLES, "--profile", "laptop", "--require").returncode in (0, 1)
    proc = cli("model", "validate", tmp_path / "nothing.h5")
    assert proc.returncode == 2 and "no readable trace" in proc.stderr


def test_tune_site_uses_the_sites_node_shape_and_says_where_the_figures_come_from(tmp_path):
    """--site emulated: the bed's measured profile (not laptop's with perlmutter's links) and the site's 4 ranks per
    node; the line naming the profile says where its figures come from."""
    proc = cli("tune", "--ranks", 8, "--model", "gpt-tiny", "--site", "emulated", "--top", 20)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    origin = [line for line in lines if line.startswith("machine profile emulated: figures ")]
    assert len(origin) == 1 and "measured on the test bed by fourd-mpi bench collectives" in origin[0]
    assert "200mbit links" in origin[0] and "level from profile" not in origin[0]  # no level is another machine's
    assert origin[0].endswith("; 4 ranks per node (site emulated's nodes; --ranks-per-node to change)")
    same = cli("tune", "--ranks", 8, "--model", "gpt-tiny", "--profile", "emulated", "--ranks-per-node", 4,
               "--top", 20)
    table = lambda out: [line for line in out.splitlines() if line.strip()[:1].isdigit()]  # noqa: E731
    assert table(proc.stdout) == table(same.stdout) and "4 ranks per node (--ranks-per-node)" in same.stdout
    # 8 ranks on nodes of 4: an 8-rank axis crosses nodes, a 4-rank one does not
    row = {line.split()[1]: line.split()[-1] for line in table(proc.stdout)}
    assert row["1x1x8x1"] == "-,inter,-,-" and row["1x1x2x4"] == "intra,inter,-,-"
    # a site of 2 ranks per node on the same profile: the x axis of 4 now crosses nodes
    site = open(os.path.join(REPO, "fourd_mpi", "jobs", "sites", "emulated.yaml")).read()
    (tmp_path / "bed2.yaml").write_text(site.replace("name: emulated", "name: bed2").replace(
        "ranks_per_node: 4", "ranks_per_node: 2"))
    two = cli("tune", "--ranks", 8, "--model", "gpt-tiny", "--site", str(tmp_path / "bed2.yaml"), "--top", 20)
    assert two.returncode == 0, two.stderr
    assert "; 2 ranks per node (site bed2's nodes; --ranks-per-node to change)" in two.stdout
    assert {line.split()[1]: line.split()[-1] for line in table(two.stdout)}["1x1x2x4"] == "inter,inter,-,-"
    # the generic CPU profile says which level is another machine's
    proc = cli("tune", "--ranks", 16, "--model", "gpt-tiny", "--top", 1)
    assert ("machine profile laptop: figures built-in (defaults); inter-node level from profile perlmutter "
            "(built-in (published figures, cited per constant in `sources`)); 8 ranks per node (profile laptop's)"
            ) in proc.stdout.splitlines()
