"""Hardening, unclear messages: an ``-o`` that is not a regular file is said first (not "already exists
(use --force)"); ``--help``/``--version`` print with a lone launcher rank variable; ``sweep render --out ""``
and ``results list --grid 1x1x`` are refused in one line. One process, no MPI."""

from __future__ import annotations

import os

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
