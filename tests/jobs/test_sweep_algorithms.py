"""``algorithm`` as a sweep key: spec -> plan -> render -> (local) submit -> collect -> analysis.

Each algorithm runs only the grids it allows (``all``: the factorizations with its fixed axes; a list:
the listed grids it allows; ``auto``: its predicted best); run ids end in the algorithm's name.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from conftest import mpi_env  # noqa: F401  (the tests/ helpers on sys.path)
from test_sweep import fourd

from fourd_mpi.algorithms.registry import get
from fourd_mpi.errors import ConfigError
from fourd_mpi.jobs.sites import load_site
from fourd_mpi.jobs.spec import load_spec
from fourd_mpi.jobs.sweep import build_manifest, plan_rows, write_sweep

CROSS = """\
name: algos
study: strong
ranks: [4, 8]
grids: all
model: {preset: gpt-tiny, batch: 8}
options: {steps: 3}
matrix: {algorithm: [axonn4d, megatron1d, fsdp, dp]}
"""


def write(tmp_path, text, name="spec.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_each_algorithm_runs_the_grids_it_allows(tmp_path):
    runs = load_spec(write(tmp_path, CROSS)).expand()
    by = {}
    for r in runs:
        by.setdefault((r.ranks, r.option("algorithm")), []).append(str(r.grid))
        fixed = get(r.option("algorithm")).fixed
        assert all(getattr(r.grid, a) == s for a, s in fixed.items()), r.run_id
        assert r.run_id.endswith("-" + r.option("algorithm"))
        assert f"--algorithm={r.option('algorithm')}" in r.run_argv("results/algos")
    assert by[(8, "dp")] == ["8x1x1x1"]
    assert sorted(by[(8, "megatron1d")]) == ["1x1x8x1", "2x1x4x1", "4x1x2x1", "8x1x1x1"]
    assert sorted(by[(4, "fsdp")]) == ["1x4x1x1", "2x2x1x1", "4x1x1x1"]
    assert len(by[(8, "axonn4d")]) == 20
    assert len({r.run_id for r in runs}) == len(runs)


def test_listed_grids_are_kept_per_algorithm_and_auto_asks_the_model(tmp_path):
    text = CROSS.replace("grids: all", "grids: [1x2x2x2, 1x1x8x1, 1x1x4x1]").replace(
        "[axonn4d, megatron1d, fsdp, dp]", "[axonn4d, megatron1d]")
    runs = load_spec(write(tmp_path, text)).expand()
    assert [(r.ranks, str(r.grid), r.option("algorithm")) for r in runs] == [
        (4, "1x1x4x1", "axonn4d"), (4, "1x1x4x1", "megatron1d"),
        (8, "1x2x2x2", "axonn4d"), (8, "1x1x8x1", "axonn4d"), (8, "1x1x8x1", "megatron1d")]
    auto = load_spec(write(tmp_path, CROSS.replace("grids: all", "grids: auto:2"), "auto.yaml")).expand()
    for r in auto:
        assert all(getattr(r.grid, a) == s for a, s in get(r.option("algorithm")).fixed.items())
    assert len([r for r in auto if r.option("algorithm") == "dp" and r.ranks == 8]) == 1  # one dp grid


def test_a_grid_list_without_a_grid_of_the_algorithm_names_key_and_line(tmp_path):
    text = CROSS.replace("grids: all", "grids: [1x2x2x2, 1x2x1x2]").replace("ranks: [4, 8]", "ranks: [8]")
    with pytest.raises(ConfigError) as err:
        load_spec(write(tmp_path, text.replace("1x2x1x2", "2x1x2x2")))  # (a repeated grid is refused first)
    assert "is a grid of algorithm megatron1d" in str(err.value) and "grids" in str(err.value)
    assert "\n" not in str(err.value)


def test_plan_and_render_carry_the_algorithm(tmp_path):
    spec = load_spec(write(tmp_path, CROSS.replace("ranks: [4, 8]", "ranks: [8]")))
    site = load_site("perlmutter")
    spec.job["account"] = "proj1"
    manifest = build_manifest(spec, site, "spec.yaml", "jobscripts/algos")
    rows = plan_rows(manifest)
    assert {r["algorithm"] for r in rows} == {"axonn4d", "megatron1d", "fsdp", "dp"}
    written = write_sweep(manifest, spec, site, str(tmp_path / "jobscripts/algos"))
    scripts = [p for p in written if p.endswith(".sh") and "megatron1d" in p]
    assert len(scripts) == 4
    text = open(scripts[0]).read()
    assert "--algorithm=megatron1d" in text
    plan = fourd(["sweep", "plan", write(tmp_path, CROSS), "--format", "json"], tmp_path)
    assert plan.returncode == 0, plan.stderr
    data = json.loads(plan.stdout)
    assert {r["options"]["algorithm"] for r in data["runs"]} == {"axonn4d", "megatron1d", "fsdp", "dp"}
    table = fourd(["sweep", "plan", write(tmp_path, CROSS)], tmp_path)
    assert "algorithm" in table.stdout.splitlines()[1] and " megatron1d " in table.stdout


@pytest.mark.mpi
def test_local_sweep_across_algorithms_collects_a_comparison(tmp_path):
    """Two 2-rank runs (megatron1d, fsdp) on the local site; collect shows both, side by side."""
    spec = write(tmp_path, CROSS.replace("ranks: [4, 8]", "ranks: [2]").replace("options: {steps: 3}",
                 "options: {steps: 3, warmup: 1}").replace("[axonn4d, megatron1d, fsdp, dp]", "[megatron1d, fsdp]")
                 .replace("grids: all", "grids: [1x1x2x1, 1x2x1x1]"))
    assert fourd(["sweep", "render", spec, "--site", "local", "--python", sys.executable], tmp_path).returncode == 0
    done = fourd(["sweep", "submit", "results/algos/local/jobs"], tmp_path)
    assert done.returncode == 0 and "2 submitted" in done.stdout, done.stdout + done.stderr
    collected = fourd(["sweep", "collect", "results/algos/local/jobs"], tmp_path)
    assert collected.returncode == 0, collected.stderr
    out = collected.stdout
    assert "== compare ==" in out
    runs = out.split("== compare ==")[0]
    rows = [line.split()[:3] for line in runs.splitlines() if line.startswith("algos-")]
    assert rows == [["algos-000-n2-1x1x2x1-megatron1d", "megatron1d", "1x1x2x1"],
                    ["algos-001-n2-1x2x1x1-fsdp", "fsdp", "1x2x1x1"]]
    compared = [line.split() for line in out.split("== compare ==")[1].splitlines() if " algos-" in line]
    assert sorted(r[3] for r in compared) == ["fsdp", "megatron1d"]


PIPELINE = """\
name: stages
study: strong
ranks: [8]
grids: [1x1x2x2, 1x2x2x2]
model: {preset: gpt-tiny, batch: 8}
options: {steps: 3}
zip:
  algorithm: [axonn4d, pipeline]
  ginter: [1, 2]
"""


def test_pipeline_runs_launch_every_stage_and_grid_one_stage(tmp_path):
    """A pipeline run of 8 ranks with --ginter 2 has a 4D grid of 4 ranks per stage and launches 8 processes;
    the run it renders resolves as ``fourd-mpi run`` will (per-option checks accept ``ginter`` in a spec)."""
    from fourd_mpi.run.options import resolve_values

    runs = load_spec(write(tmp_path, PIPELINE)).expand()
    assert [(r.ranks, str(r.grid), r.option("algorithm")) for r in runs] == [
        (8, "1x2x2x2", "axonn4d"), (8, "1x1x2x2", "pipeline")]
    for r in runs:
        resolved = resolve_values(r.values(), r.ranks)
        assert resolved.grid == r.grid and resolved.grid.size * (r.option("ginter") or 1) == r.ranks
    crossed = PIPELINE.replace("zip:", "matrix:")
    with pytest.raises(ConfigError, match="has no pipeline stages"):
        load_spec(write(tmp_path, crossed, "crossed.yaml")).expand()


def test_the_plan_estimates_memory_with_each_algorithms_own_model(tmp_path):
    """The plan's memory per rank is what admission will check at launch: the pipeline's fullest stage
    and Optimus-CUBE's layouts, not the 4D model of the same grid (which a plan used before for every
    algorithm)."""
    from fourd_mpi.jobs.sweep import memory_per_rank
    from fourd_mpi.perf.memory import estimate_memory
    from fourd_mpi.run.admission import memory_need
    from fourd_mpi.run.options import resolve_values

    text = PIPELINE.replace("algorithm: [axonn4d, pipeline]\n  ginter: [1, 2]",
                            "algorithm: [axonn4d, pipeline, optimus3d]\n  ginter: [1, 2, 1]")
    runs = load_spec(write(tmp_path, text)).expand()
    assert sorted((r.option("algorithm"), str(r.grid)) for r in runs) == [
        ("axonn4d", "1x2x2x2"), ("optimus3d", "1x2x2x2"), ("pipeline", "1x1x2x2")]
    plan = {r.option("algorithm"): memory_per_rank(r) for r in runs}
    for r in runs:
        assert plan[r.option("algorithm")] == memory_need(resolve_values(r.values(), r.ranks)).total
    four_d = {r.option("algorithm"): estimate_memory(r.model, r.grid).total for r in runs}
    # two stages hold half the blocks each: less than one 4D grid of the same 4 ranks holding them all
    assert plan["pipeline"] < four_d["pipeline"]
    assert plan["optimus3d"] != four_d["optimus3d"]
    manifest = build_manifest(load_spec(write(tmp_path, text)), load_site("local"), str(tmp_path / "s.yaml"),
                              str(tmp_path / "jobscripts"))
    assert [entry["memory_per_rank"] for entry in manifest["runs"]] == [plan[r.option("algorithm")] for r in runs]
