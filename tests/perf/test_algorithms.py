"""The performance model across algorithms (:mod:`fourd_mpi.perf.algorithms`), ``tune --algorithm`` and
``model validate`` per algorithm. One process, no MPI."""

import os
import subprocess
import sys
import textwrap

import pandas as pd
import pytest

from fourd_mpi.algorithms import families, registry
from fourd_mpi.algorithms.families import Family
from fourd_mpi.algorithms.registry import Algorithm
from fourd_mpi.analysis.model_check import by_algorithm
from fourd_mpi.core.grid import GridShape, grid_factorizations
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf import algorithms as across
from fourd_mpi.perf.machine import load_profile
from fourd_mpi.perf.predict import predict
from fourd_mpi.step.presets import model_problems, resolve_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLES = os.path.join(REPO, "results", "samples")
BASELINES = ["axonn4d", "megatron1d", "fsdp", "dp"]


def cli(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd or REPO, timeout=120)


@pytest.fixture(scope="module")
def small():
    return resolve_model("gpt-small")


@pytest.fixture(scope="module")
def laptop():
    return load_profile("laptop")


def test_algorithm_names():
    assert across.algorithm_names("all") == list(registry.names())
    assert across.algorithm_names("fsdp, dp,fsdp") == ["fsdp", "dp"]
    with pytest.raises(ConfigError, match="unknown algorithm 'zero'"):
        across.algorithm_names("fsdp,zero")


@pytest.mark.parametrize("ranks", [6, 8, 12])
@pytest.mark.parametrize("name", BASELINES)
def test_candidates_respect_fixed_axes_and_the_model(name, ranks):
    cfg = resolve_model("gpt-tiny", hidden=48, heads=12, ffn_hidden=96, batch=24)
    algorithm = registry.get(name)
    kept, dropped = across.candidates(algorithm, cfg, ranks)
    allowed = [g for g in grid_factorizations(ranks) if all(getattr(g, a) == s for a, s in algorithm.fixed.items())]
    assert [g for g, _ in kept] == [g for g in allowed if not model_problems(cfg, g)]
    assert [g for g, _ in dropped] == [g for g in allowed if model_problems(cfg, g)]
    assert all(why.startswith("divisibility: ") for _, why in dropped)


def test_ranking_across_algorithms(small, laptop):
    ranking = across.rank_algorithms(BASELINES, small, 8, laptop)
    steps = [e.prediction.step_s for e in ranking.entries]
    assert steps == sorted(steps)
    # every configuration of every algorithm is predicted; one computation is listed once, by its most
    # specific name (the dp grid 8x1x1x1 is axonn4d's too)
    assert len(ranking.every) == 20 + 4 + 4 + 1
    assert len(ranking.entries) == 20
    names = {(e.algorithm, str(e.grid)) for e in ranking.entries}
    assert ("dp", "8x1x1x1") in names and ("axonn4d", "8x1x1x1") not in names
    assert ("megatron1d", "1x1x8x1") in names and ("fsdp", "1x8x1x1") in names
    dp = next(e for e in ranking.entries if e.algorithm == "dp")
    assert sorted(dp.same_as) == ["axonn4d", "fsdp", "megatron1d"]  # 8x1x1x1 pins every tensor axis
    # a baseline is the 4D model on its pinned grid
    for e in ranking.every:
        assert e.prediction.step_s == pytest.approx(predict(small, e.grid, laptop).step_s)
    best = ranking.best_by_algorithm()
    assert set(best) == set(BASELINES)
    assert best["axonn4d"].prediction.step_s == min(steps)
    assert best["dp"].grid == GridShape(8, 1, 1, 1)
    table = across.format_across(ranking, 30)
    assert table.splitlines()[0].split()[:3] == ["rank", "algorithm", "configuration"]
    assert any(line.split()[1:3] == ["dp", "8x1x1x1"] for line in table.splitlines()[2:] if line.strip()[:1].isdigit())
    assert "listed once under the most specific name" in table
    assert "Megatron-LM 1D" in across.format_best(ranking)


def test_memory_limit_drops_configurations_of_every_algorithm(small, laptop):
    full = across.rank_algorithms(["megatron1d", "dp"], small, 8, laptop)
    limit = sorted(e.need_bytes for e in full.every)[1]
    ranking = across.rank_algorithms(["megatron1d", "dp"], small, 8, laptop, memory_limit_bytes=limit)
    assert all(e.need_bytes <= limit for e in ranking.every) and len(ranking.every) == 2
    assert "memory" in ranking.dropped_summary()
    with pytest.raises(ConfigError, match="no configuration of megatron1d, dp on 8 ranks fits"):
        across.rank_algorithms(["megatron1d", "dp"], small, 8, laptop, memory_limit_bytes=1)


def test_an_algorithm_without_a_predictor_is_skipped_with_a_note(small, laptop, monkeypatch):
    monkeypatch.setitem(registry.ALGORITHMS, "cube", Algorithm("cube", "a cube", "nofamily", "-"))
    ranking = across.rank_algorithms(["cube", "dp"], small, 8, laptop)
    assert ranking.skipped == [("cube", "the performance model has no predictor for family 'nofamily' yet")]
    assert {e.algorithm for e in ranking.entries} == {"dp"}


def test_a_family_plugs_in_with_one_line(small, laptop, tmp_path, monkeypatch):
    """A predictor module with its own candidates and run options, registered by one family record."""
    (tmp_path / "toy_family.py").write_text(textwrap.dedent('''
        from fourd_mpi.core.grid import GridShape
        from fourd_mpi.perf.predict import predict as predict_4d

        def candidates(cfg, ranks, algorithm):
            return [(GridShape(ranks // s, 1, s, 1), {"stages": s}) for s in (1, 2, 4) if ranks % s == 0]

        def run_options(run_options):
            return {"stages": int(run_options.get("stages", 1))}

        def predict(cfg, grid, profile, overlap, dtype, progress, optimizer, ranks_per_node, stages=1, **kw):
            p = predict_4d(cfg, grid, profile, overlap, dtype, progress, optimizer, ranks_per_node, **kw)
            p.step_s *= 1 + stages  # a made-up bubble
            return p
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    toy = Family("toy", "nomodule", "toy_family", candidates="candidates", run_options="run_options")
    monkeypatch.setitem(families.FAMILIES, "toy", toy)
    monkeypatch.setitem(registry.ALGORITHMS, "toy", Algorithm("toy", "a toy", "toy", "-"))
    ranking = across.rank_algorithms(["toy"], small, 8, laptop)
    assert [e.label for e in ranking.entries] == ["8x1x1x1 stages=1", "4x1x2x1 stages=2", "2x1x4x1 stages=4"]
    assert across.run_predict_options(registry.get("toy"), {"stages": 2}) == {"stages": 2}
    assert across.predictor("toy") is toy and registry.get("toy").spec is toy


def test_by_algorithm_summary():
    df = pd.DataFrame({"algorithm": ["axonn4d", "axonn4d", "fsdp", "pipeline"],
                       "predicted_s": [1.0, 1.0, 2.0, float("nan")],
                       "step_err": [0.1, -0.3, 0.2, float("nan")],
                       "exposed_err": [0.5, float("nan"), -0.4, float("nan")]})
    rows = {r["algorithm"]: r for r in by_algorithm(df)}
    assert rows["axonn4d"]["runs"] == 2 and rows["axonn4d"]["median_abs_step_err"] == pytest.approx(0.2)
    assert rows["axonn4d"]["median_step_err"] == pytest.approx(-0.1)
    assert rows["fsdp"]["median_abs_exposed_err"] == pytest.approx(0.4)
    assert rows["pipeline"]["predicted"] == 0


def test_tune_all_prints_one_table_and_the_best_per_algorithm(tmp_path):
    spec = tmp_path / "top.yaml"
    proc = cli("tune", "--ranks", 8, "--model", "gpt-small", "--algorithm", "all", "--top", 6, "--emit-sweep", spec)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "algorithms " + ", ".join(registry.names()) + ";" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and len(line.split()) > 4]
    assert len(rows) == 6 and all(r[1] in registry.names() for r in rows)
    assert "best configuration per algorithm" in out and "DP" in out
    from fourd_mpi.jobs.spec import load_spec

    loaded = load_spec(str(spec))
    assert loaded.matrix["algorithm"] and set(loaded.matrix["algorithm"]) <= set(registry.names())
    for run in loaded.expand():  # each algorithm runs only the listed grids it allows
        fixed = registry.get(run.option("algorithm")).fixed
        assert all(getattr(run.grid, a) == s for a, s in fixed.items())


def test_tune_default_is_unchanged_and_bad_names_are_one_line():
    proc = cli("tune", "--ranks", 8, "--model", "gpt-small", "--top", 2)
    assert proc.returncode == 0 and " wins (" in proc.stdout and "algorithm" not in proc.stdout.split("\n")[-4]
    proc = cli("tune", "--ranks", 8, "--model", "gpt-small", "--algorithm", "megatron3d")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "unknown algorithm 'megatron3d'" in proc.stderr


def test_model_validate_reports_errors_per_algorithm():
    proc = cli("model", "validate", *[os.path.join(SAMPLES, f) for f in sorted(os.listdir(SAMPLES))
                                      if f.startswith("grid-")])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "per algorithm (metadata algorithm; older traces: axonn4d):" in out
    section = out.split("per algorithm")[1].splitlines()
    assert section[1].split()[:3] == ["algorithm", "runs", "predicted"] \
        and section[3].split()[:3] == ["axonn4d", "4", "4"]


def test_a_family_whose_module_is_not_installed_has_no_predictor(monkeypatch):
    monkeypatch.setitem(families.FAMILIES, "ghost", Family("ghost", "nomodule", "fourd_mpi.perf.no_such_module"))
    assert across.predictor("ghost") is None and across.predictor("tensor4d") is not None
    assert across.predictor("not-listed") is None


def test_the_pipeline_search_counts_its_candidates_and_is_bounded():
    """Known answers, counted by hand: 4 layers, batch 4, 4 ranks. Stages 2 (2 ranks a stage): G_data G_z = 1
    gives 1 x 2 ordered (G_y, G_x) x 3 micro-batch counts of a shard of 4 (1, 2, 4) = 6, G_data G_z = 2 gives
    2 ordered (G_data, G_z) x 1 x 2 (1, 2) = 4; stages 4: 1 x 1 x 3 = 3; 13 in all. With 3 layers stage count
    4 is deeper than the model: 10; with 1 layer none. The count is a deterministic bound of the search, and
    the largest preset's shape at 32,768 ranks stays under it."""
    from dataclasses import replace

    from fourd_mpi.perf.algorithms import MAX_PIPELINE_CONFIGS, pipeline_count

    tiny = resolve_model("gpt-tiny", batch=4, layers=4)
    assert [pipeline_count(replace(tiny, layers=n), 4) for n in (4, 6, 3, 1)] == [13, 13, 10, 0]
    big = resolve_model("gpt-80b", batch=2048, layers=80)
    # by hand: stages 2^k (k = 1..6: at most 80 and dividing 2^15), G_data G_z = 2^j (j <= 11: a shard of
    # 2^(11-j) >= 1): (j + 1) ordered (G_data, G_z) x (16 - k - j) ordered (G_y, G_x) x the micro-batch counts
    # <= 1,024 of the shard (11 for 2,048, else 12 - j)
    by_hand = sum((j + 1) * (16 - k - j) * (11 if j == 0 else 12 - j) for k in range(1, 7)
                  for j in range(min(15 - k, 11) + 1))
    assert pipeline_count(big, 32768) == by_hand == 15225 <= MAX_PIPELINE_CONFIGS
