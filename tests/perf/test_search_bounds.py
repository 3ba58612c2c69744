"""``tune``'s search is bounded, and profile ``base:``/``fallback:`` chains are checked.

Before: ``tune --ranks 720720`` with a divisible model predicted all 89,600 grids with no output for
600 s (1.26 GB), ``--ranks 55440`` took 44 s; a ``fallback:`` cycle was a RecursionError traceback
(tune, model predict, ``--fallback-profile``); a 1,500-file ``base:`` chain was reported as "not valid
YAML". After: one line each, exit 2, before any prediction. One process, no MPI.
"""

from __future__ import annotations

import pytest

from fourd_mpi.cli.main import main
from fourd_mpi.core.grid import grid_count, grid_factorizations
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.machine import MAX_PROFILE_CHAIN, load_profile
from fourd_mpi.perf.tune import MAX_TUNE_GRIDS, check_search_size, top_grids
from fourd_mpi.step.presets import resolve_model


def one_error(argv, capfd) -> str:
    assert main(argv) == 2
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fourd-mpi: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("n", [1, 2, 7, 12, 64, 360, 5040, 97 * 97, 2310])
def test_grid_count_counts_the_factorizations(n):
    assert grid_count(n) == sum(1 for _ in grid_factorizations(n))


def test_every_power_of_two_the_model_plans_for_is_searchable():
    for k in range(25):
        check_search_size(1 << k)
    assert grid_count(1 << 24) <= MAX_TUNE_GRIDS


@pytest.mark.parametrize("ranks, grids", [(720720, 16524), (55440, 5508)])  # of 89,600 and 22,400 grids
def test_tune_refuses_a_rank_count_with_too_many_grids_before_predicting(ranks, grids, capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    import fourd_mpi.perf.tune as tune

    monkeypatch.setattr(tune, "predict", lambda *a, **k: pytest.fail("predicted a grid"))
    line = one_error(["tune", "--ranks", str(ranks), "--model", "gpt-tiny", "--batch", str(ranks),
                      "--hidden", "720720", "--ffn-hidden", "720720"], capfd)
    assert (f"--ranks {ranks:,} has {grids:,} candidate grids that the sizes of gpt-tiny "
            f"with --hidden 720720 --ffn-hidden 720720 divide, more than the {MAX_TUNE_GRIDS:,}") in line
    assert "fourd-mpi model predict --grid" in line


def test_grids_auto_is_bounded_too():
    with pytest.raises(ConfigError, match="candidate grids that the sizes of gpt-tiny divide"):
        top_grids(resolve_model("gpt-tiny", batch=720720, hidden=720720, ffn_hidden=720720), 720720, 3)
    # 89,600 grids of 720,720 ranks, of which gpt-tiny's sizes divide 34: searched, not refused
    assert len(top_grids(resolve_model("gpt-tiny", batch=720720), 720720, 3)) == 3


def _profile(path, **keys):
    path.write_text("".join(f"{k}: {v}\n" for k, v in {"base": "laptop", **keys}.items()))
    return path


@pytest.mark.parametrize("command", [["tune", "--ranks", "8", "--model", "gpt-tiny", "--profile", "A"],
                                     ["model", "predict", "--grid", "1x1x1x1", "--batch", "8", "--profile", "A"],
                                     ["tune", "--ranks", "8", "--model", "gpt-tiny", "--fallback-profile", "A"]])
def test_a_fallback_cycle_is_one_line_naming_the_chain(command, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    _profile(tmp_path / "a.yaml", name="a", fallback="b.yaml")
    _profile(tmp_path / "b.yaml", name="b", fallback="a.yaml")
    line = one_error(["a.yaml" if a == "A" else a for a in command], capfd)
    assert "base:/fallback: chain is a cycle: " in line and "a.yaml -> b.yaml -> a.yaml" in line, line


def test_a_base_cycle_under_another_name_is_found(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.yaml").write_text(f"name: a\nbase: {tmp_path / 'sub' / '..' / 'a.yaml'}\n")
    with pytest.raises(ConfigError, match="chain is a cycle"):
        load_profile(str(tmp_path / "a.yaml"))


def test_a_long_base_chain_is_refused_naming_it(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for i in range(1, 1501):
        (tmp_path / f"c{i}.yaml").write_text(f"base: c{i + 1}.yaml\n")
    _profile(tmp_path / "c1501.yaml", name="deep")
    line = one_error(["tune", "--ranks", "8", "--model", "gpt-tiny", "--profile", "c1.yaml"], capfd)
    assert f"chain longer than {MAX_PROFILE_CHAIN} profiles (c1.yaml -> c2.yaml" in line, line
    assert "not valid YAML" not in line


def test_a_short_chain_and_a_shared_fallback_still_load(tmp_path):
    _profile(tmp_path / "c.yaml", name="c")
    _profile(tmp_path / "a.yaml", name="a", fallback=str(tmp_path / "c.yaml"))
    (tmp_path / "top.yaml").write_text(f"name: top\nbase: {tmp_path / 'a.yaml'}\nfallback: {tmp_path / 'c.yaml'}\n")
    assert load_profile(str(tmp_path / "top.yaml")).fallback.name == "c"
    assert load_profile("laptop", str(tmp_path / "a.yaml")).fallback.name == "a"


def test_the_pipeline_search_is_counted_and_bounded(capfd, tmp_path, monkeypatch):
    """Before: tune --algorithm all at 2^24 ranks with a divisible model ran for over 300 s."""
    import fourd_mpi.perf.algorithms as algorithms
    from fourd_mpi.algorithms.registry import get
    from fourd_mpi.step.presets import resolve_model

    for ranks, layers, batch in ((1024, 80, 2048), (48, 12, 96), (64, 96, 24)):
        cfg = resolve_model("gpt-tiny", layers=layers, batch=batch)
        listed = algorithms.pipeline_candidates(cfg, ranks, get("pipeline"))
        assert len(listed) <= algorithms.pipeline_count(cfg, ranks)
    assert algorithms.pipeline_count(resolve_model("gpt-tiny", layers=80, batch=2048), 1024) == 5583
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(algorithms, "predict_one", lambda *a, **k: pytest.fail("predicted a configuration"))
    line = one_error(["tune", "--ranks", str(1 << 24), "--algorithm", "pipeline", "--model", "gpt-tiny", "--layers",
                      "128", "--batch", str(1 << 20)], capfd)
    assert "pipeline on 16,777,216 ranks has 111,060 configurations" in line and "more than the 20,000" in line
