"""Hardening, unclear messages: an ``-o`` that is not a regular file is said first (not "already exists
(use --force)"); ``--help``/``--version`` print with a lone launcher rank variable; ``sweep render --out ""``
and ``results list --grid 1x1x`` are refused in one line. One process, no MPI."""

from __future__ import annotations

import os
import sys

import pytest
from conftest import REPO

from fourd_mpi.cli.main import main
from fourd_mpi.errors import ConfigError
from fourd_mpi.util.files import refuse_output


def one_error(argv, capfd) -> str:
    assert main(argv) == 2
    err = capfd.readouterr().err
    lines = [l for l in err.strip().splitlines() if "warning" not in l]
    assert len(lines) == 1 and lines[0].startswith("fourd-mpi: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("kind, words", [("dir", "it is a directory"), ("fifo", "not a regular file (a FIFO)"),
                                         ("dangling", "a symbolic link that leads nowhere"),
                                         ("device", "not a regular file (a character device)")])
@pytest.mark.parametrize("force", [False, True])
def test_an_output_that_is_not_a_regular_file_is_said_first(tmp_path, kind, words, force):
    path = tmp_path / "out.json"
    if kind == "dir":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dangling":
        os.symlink(tmp_path / "nowhere" / "x", path)
    else:
        path = "/dev/null"
    with pytest.raises(ConfigError) as info:
        refuse_output(str(path), force)
    assert words in str(info.value) and "--force" not in str(info.value)


@pytest.mark.parametrize("env", [{"PMI_RANK": "3"}, {"SLURM_PROCID": "2"}, {"SLURM_PROCID": "1", "SLURM_NTASKS": "1"}])
@pytest.mark.parametrize("flag, words", [("--version", "fourd-mpi "), ("--help", "usage: fourd-mpi")])
def test_help_and_version_print_with_a_lone_rank_variable(env, flag, words, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        main([flag])
    assert info.value.code == 0 and words in capsys.readouterr().out


def test_help_prints_once_per_launch(monkeypatch, capsys):
    # before MPI starts (as a launched command): an initialized MPI in this pytest process would decide instead
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("PMI_SIZE", "4")
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out == ""


def test_an_empty_out_is_refused(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    line = one_error(["sweep", "render", str(REPO / "jobscripts" / "weak-gpt-tiny.yaml"), "--out", ""], capfd)
    assert "argument --out: expected a value, got ''" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [["--grid", "1x1x"], ["grid=2x4"]])
def test_a_malformed_grid_filter_is_a_format_error(argv, tmp_path, monkeypatch, capfd):
    import shutil

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    shutil.copy(REPO / "results" / "samples" / "weak-1.h5", tmp_path / "a")
    assert main(["results", "reindex", "a"]) == 0
    capfd.readouterr()
    line = one_error(["results", "list", "--index", "a", *argv], capfd)
    assert "is not four positive sizes G_data x G_z x G_y x G_x" in line


# --- round 2: gzip header, YAML 1.1 numbers, --explain, --unit run, the pipeline search, empty paths -----------

def test_a_gzip_export_names_the_final_file_in_its_header(tmp_path, monkeypatch):
    """Before: the FNAME field named the temporary file (.tmp-PID-a.json)."""
    monkeypatch.chdir(tmp_path)
    assert main(["export", "perfetto", str(REPO / "results" / "samples" / "weak-1.h5"), "-o", "a.json.gz"]) == 0
    head = (tmp_path / "a.json.gz").read_bytes()
    assert head[:2] == b"\x1f\x8b" and head[3] & 0x08  # FNAME present
    fname = head[10:head.index(b"\0", 10)]
    assert fname == b"a.json"  # as gzip a.json writes it
    assert [p.name for p in tmp_path.iterdir()] == ["a.json.gz"]


@pytest.mark.parametrize("literal, value", [("1e30", 1e30), ("5E-6", 5e-6), ("+2e3", 2000.0), ("1.5e2", 150.0)])
def test_a_yaml_1_2_float_is_a_number_where_the_schema_wants_one(literal, value, tmp_path):
    """Before: 'float32: 1e30' was "'1e30' is not of type 'number'" (PyYAML reads YAML 1.1: 1e30 is text)."""
    from fourd_mpi.perf.machine import load_profile

    path = tmp_path / "p.yaml"
    path.write_text(f"base: dgx-h100\nname: mine\ncompute:\n  gemm_tflops: {{float32: {literal}}}\n")
    assert load_profile(str(path)).data["compute"]["gemm_tflops"]["float32"] == value


def test_a_quoted_number_stays_text_and_says_so(tmp_path):
    from fourd_mpi.perf.machine import load_profile

    path = tmp_path / "p.yaml"
    path.write_text('base: dgx-h100\nname: mine\ncompute:\n  gemm_tflops: {float32: "1e30"}\n')
    with pytest.raises(ConfigError, match=r"p.yaml:4: compute.gemm_tflops.float32: '1e30' is not of type 'number' "
                                          r"\(a quoted number is text: write it without quotes\)"):
        load_profile(str(path))


def test_yaml_numbers_for_every_schema_validated_file():
    """The class: YamlDocument.validate reads the numbers (sweep specs, sites, profiles); an integer field takes
    an integral 1e3 as 1000; a name that looks like a number stays a name."""
    from fourd_mpi.util.yamlspec import YamlDocument

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"},
                                               "name": {"type": "string"}, "k": {"type": "integer"}}}
    doc = YamlDocument("n: 1e3\nx: 2e-3\nname: 1e3\nk: 1.5e0\n", "s.yaml")
    with pytest.raises(ConfigError, match="s.yaml:4: k: '1.5e0' is not of type 'integer'"):
        doc.validate(schema)
    assert doc.data["n"] == 1000 and isinstance(doc.data["n"], int) and doc.data["x"] == 2e-3
    assert doc.data["name"] == "1e3"


@pytest.mark.parametrize("grid, words", [
    ("9x9x9x9", "--explain 9x9x9x9: 6,561 ranks, not the --ranks 1,024 compared (G_data*G_z*G_y*G_x must equal "
                "--ranks)"),
    ("1024x1x1x1", "--explain 1024x1x1x1: G_data*G_z = 1,024 does not divide --batch 1,000"),
])
def test_compare_axonn_explain_is_a_grid_of_the_run(grid, words, capfd):
    line = one_error(["model", "compare-axonn", "--batch", "1000", "--explain", grid], capfd)
    assert words in line


def test_unit_run_below_min_runs_is_inconclusive_with_the_helps_number():
    """Before: 3 against 3 runs were tested (p >= 0.1: 'same', never slower) while the help said 4."""
    import numpy as np

    from fourd_mpi.analysis.compare import Settings, compare_runs, min_runs

    def runs(prefix, n, t):
        return [({"run_id": f"{prefix}{i}", "config_key": "k", "time": ""}, np.full(5, t * (1 + i / 100)), f"{prefix}{i}")
                for i in range(n)]

    assert min_runs(0.05) == 4
    three = compare_runs(runs("n", 3, 0.2), runs("o", 3, 0.1), Settings(resamples=200, unit="run"))[0]
    assert three.verdict == "inconclusive" and three.note.startswith("fewer than 4 runs on a side: no test")
    four = compare_runs(runs("n", 4, 0.2), runs("o", 4, 0.1), Settings(resamples=200, unit="run"))[0]
    assert four.verdict == "slower"


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


@pytest.mark.parametrize("argv", [
    ["export", "perfetto", "t.h5", "-o", ""], ["results", "list", "--index", ""], ["compare", "a", "--baseline", ""],
    ["tune", "--ranks", "8", "--profile", ""], ["analyze", ""], ["trace", "recover", "x", "-o", ""],
    ["model", "predict", "--config", ""], ["sweep", "plan", "s.yaml", "--results-dir", ""],
    ["bench", "collectives", "--report", ""], ["tune", "--ranks", "8", "--emit-sweep", ""]])
def test_an_empty_path_is_refused_by_every_command(argv, capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_error(argv, capfd)
    assert "expected a value, got ''" in line
    assert list(tmp_path.iterdir()) == []
