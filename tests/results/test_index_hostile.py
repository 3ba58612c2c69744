"""Hardening of the results index: a line nested 100,000 levels deep is skipped with the warning every
bad line gets (before: a RecursionError traceback in ``results list``, ``results show`` and
``compare``); ``results reindex DIR`` never rewrites a ``DIR/index.jsonl`` that is a symbolic link to
another directory's file (before: it rewrote the shared index through the link, dropping the other
directory's entries). One process, no MPI."""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import REPO

from fourd_mpi.cli.main import main
from fourd_mpi.results.index import MAX_LINE_DEPTH, parse_line

SAMPLE = REPO / "results" / "samples" / "weak-1.h5"


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000,
                                  "[" * 100_000])
def test_a_deep_line_is_a_bad_line(text):
    entry, why = parse_line(text)
    assert entry is None and f"nested more than {MAX_LINE_DEPTH} levels" in why


def test_brackets_inside_strings_do_not_count():
    entry, why = parse_line('{"a": "' + "[" * 1000 + '"}')
    assert "nested" not in why


@pytest.fixture
def indexed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    shutil.copy(SAMPLE, tmp_path / "a" / "weak-1.h5")
    assert main(["results", "reindex", "a"]) == 0
    with open(tmp_path / "a" / "index.jsonl", "a") as fh:
        fh.write("[" * 100_000 + "]" * 100_000 + "\n")
    return tmp_path


@pytest.mark.parametrize("argv", [["results", "list", "--index", "a"], ["results", "show", "--index", "a", "weak-1"],
                                  ["compare", "weak-1", "--index", "a", "--baseline", "weak-1"]])
def test_a_deep_index_line_is_skipped_with_a_warning(indexed, argv, capfd):
    rc = main(argv)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "RecursionError" not in err
    assert f"a/index.jsonl:2: skipped: not an index entry (nested more than {MAX_LINE_DEPTH} levels)" in err, err
    if argv[0] == "results":
        assert rc == 0


def test_reindex_refuses_a_link_to_another_directorys_index(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "shared").mkdir()
    shutil.copy(SAMPLE, tmp_path / "a" / "weak-1.h5")
    shared = tmp_path / "shared" / "index.jsonl"
    shared.write_text('{"other": "entries"}\n')
    os.symlink("../shared/index.jsonl", tmp_path / "a" / "index.jsonl")
    assert main(["results", "reindex", "a"]) == 2
    line = capfd.readouterr().err.strip()
    assert line.startswith("fourd-mpi: error: a/index.jsonl is a symbolic link to ") and "\n" not in line, line
    assert "drop that directory's entries" in line
    assert shared.read_text() == '{"other": "entries"}\n'


def test_reindex_follows_a_link_within_its_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    shutil.copy(SAMPLE, tmp_path / "a" / "weak-1.h5")
    (tmp_path / "a" / "real.jsonl").write_text("")
    os.symlink("real.jsonl", tmp_path / "a" / "index.jsonl")
    assert main(["results", "reindex", "a"]) == 0
    assert "weak-1" in (tmp_path / "a" / "real.jsonl").read_text()
    assert os.path.islink(tmp_path / "a" / "index.jsonl")
