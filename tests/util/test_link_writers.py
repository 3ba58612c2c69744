"""Every writer and a symbolic link where it writes: fourd-mpi makes no link there, so a link is never provably
its own; it is neither written through (which would replace another directory's file, or anyone's) nor replaced
(which would drop someone's link). Each writer refuses in one line that names the link and what it points to,
and leaves both as they were. The ``-o``/``--out``/``--report``/``--json``/``--emit-sweep`` outputs of every
command are in tests/cli/test_output_options.py (case ``symbolic-link``); here the files commands write under
names of their own: a run's trace, parts and index line, a recovery's index line, a sweep's scripts, marker,
jobs file, job logs, collected traces and set-aside attempts, the index's appends, the test bed's state.
The index's own rule (a link within its directory is its own and followed) is kept. One process unless MPI
runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, mpi_env

from fourd_mpi.cli.main import main
from fourd_mpi.errors import ConfigError
from fourd_mpi.util.files import MARKER

SPEC = REPO / "jobscripts" / "weak-gpt-tiny.yaml"
SAMPLE = REPO / "results" / "samples" / "weak-1.h5"
OTHERS = "another directory's file\n"


@pytest.fixture
def shared(tmp_path):
    """``shared/file`` (another directory's file) and ``results/`` (where the writer writes)."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "file").write_text(OTHERS)
    (tmp_path / "results").mkdir()
    return tmp_path


def linked(where: Path, target: Path) -> Path:
    os.symlink(os.path.relpath(target, where.parent), where)
    return where


def one_line(err: str, *words: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fourd-mpi: error: ") and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def unchanged(tmp_path: Path, link: Path) -> None:
    assert os.path.islink(link), f"{link} was replaced"
    assert (tmp_path / "shared" / "file").read_text() == OTHERS
    assert sorted(os.listdir(tmp_path / "shared")) == ["file"]


# -- a run: its trace, its parts, its index line (refused before the first step) ----------------------

@pytest.mark.parametrize("name", ["r.h5", "r.parts", "index.jsonl"])
def test_a_run_refuses_a_link_where_it_would_write(shared, name):
    link = linked(shared / "results" / name, shared / "shared" / "file")
    proc = subprocess.run([sys.executable, "-m", "fourd_mpi", "run", "--steps", "2", "--warmup", "0",
                           "--results-dir", str(shared / "results"), "--run-id", "r", "--display", "quiet", "--force"],
                          capture_output=True, text=True, timeout=300, env=mpi_env(), cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    one_line(proc.stderr, str(link), "symbolic link", "shared/file")
    unchanged(shared, link)
    assert sorted(os.listdir(shared / "results")) == [name]  # no spool made: refused before the run


# -- trace recover: its line in the index beside the trace --------------------------------------------

def test_recover_refuses_to_append_through_an_index_link(shared, capfd):
    spool = shared / "results" / "run.ranks"
    spool.mkdir()
    (spool / "run.json").write_text('{"run_id": "run", "world_size": 1, "layers": [""], "level": "op"}')
    link = linked(shared / "results" / "index.jsonl", shared / "shared" / "file")
    assert main(["trace", "recover", str(spool)]) == 2
    one_line(capfd.readouterr().err, str(link), "symbolic link", "a file of another directory", "trace recover")
    unchanged(shared, link)
    assert sorted(os.listdir(spool)) == ["run.json"]


# -- the index: appends --------------------------------------------------------------------------------

def test_an_index_append_never_goes_through_a_link_to_another_directory(shared):
    from fourd_mpi.results.index import append_entry

    link = linked(shared / "results" / "index.jsonl", shared / "shared" / "file")
    with pytest.raises(ConfigError, match="a file of another directory"):
        append_entry(str(link), {"run_id": "x"})
    unchanged(shared, link)
    os.remove(link)
    (shared / "results" / "2024.jsonl").write_text("")
    own = linked(shared / "results" / "index.jsonl", shared / "results" / "2024.jsonl")
    append_entry(str(own), {"run_id": "x"})  # a link within the directory: the directory's own index
    assert (shared / "results" / "2024.jsonl").read_text() == '{"run_id":"x"}\n' and os.path.islink(own)


# -- sweep render: the directory, its scripts, its marker ----------------------------------------------

@pytest.fixture
def rendered(shared, monkeypatch, capfd):
    monkeypatch.chdir(shared)
    assert main(["sweep", "render", str(SPEC), "--out", "jobs"]) == 0
    capfd.readouterr()
    return shared / "jobs"


@pytest.mark.parametrize("which", ["script", MARKER, "manifest.json"])
def test_render_again_refuses_a_link_in_place_of_its_file(rendered, shared, which, capfd):
    name = sorted(p.name for p in rendered.glob("*.sh"))[0] if which == "script" else which
    os.remove(rendered / name)
    link = linked(rendered / name, shared / "shared" / "file")
    before = {p.name: p.read_bytes() for p in rendered.iterdir() if p.is_file() and not p.is_symlink()}
    assert main(["sweep", "render", str(SPEC), "--out", "jobs", "--force"]) == 2
    one_line(capfd.readouterr().err, name, "symbolic link", "shared/file")
    unchanged(shared, link)
    assert {p.name: p.read_bytes() for p in rendered.iterdir() if p.is_file() and not p.is_symlink()} == before
    assert not [p for p in rendered.iterdir() if p.name.startswith(".render-")]


def test_render_through_a_link_to_a_directory_it_made(rendered, shared, capfd):
    """Its marker proves the directory is fourd-mpi's: reached through a link, it is rendered again."""
    link = linked(shared / "alias", rendered)
    assert main(["sweep", "render", str(SPEC), "--out", str(link), "--force"]) == 0
    assert os.path.islink(link) and (rendered / "manifest.json").exists()


def test_render_refuses_a_link_to_a_directory_it_did_not_make(shared, monkeypatch, capfd):
    monkeypatch.chdir(shared)
    (shared / "shared" / "empty").mkdir()
    link = linked(shared / "jobs", shared / "shared" / "empty")
    assert main(["sweep", "render", str(SPEC), "--out", "jobs"]) == 2
    one_line(capfd.readouterr().err, "--out jobs is a symbolic link to", "did not make")
    assert os.listdir(shared / "shared" / "empty") == [] and os.path.islink(link)


# -- sweep submit, status, collect: jobs file, job logs, pack scripts, set-aside attempts, copies ---------

def test_the_jobs_file_is_not_replaced_when_a_link(rendered, shared):
    from fourd_mpi.jobs.sweep import save_jobs

    link = linked(rendered / "jobs.json", shared / "shared" / "file")
    with pytest.raises(ConfigError, match="symbolic link"):
        save_jobs(str(rendered), {"a": {}})
    unchanged(shared, link)


@pytest.mark.parametrize("where", ["log", "logs"])
def test_a_local_job_log_is_not_written_through_a_link(shared, where):
    from fourd_mpi.jobs.schedulers import Local

    script = shared / "results" / "job.sh"
    script.write_text("echo ran > ran.txt\n")
    if where == "logs":
        (shared / "shared" / "dir").mkdir()
        link = linked(shared / "results" / "logs", shared / "shared" / "dir")
    else:
        (shared / "results" / "logs").mkdir()
        link = linked(shared / "results" / "logs" / "job.log", shared / "shared" / "file")
    with pytest.raises(ConfigError, match="symbolic link"):
        Local().run(str(script), "logs/job.log", str(shared / "results"))
    assert os.path.islink(link) and (shared / "shared" / "file").read_text() == OTHERS
    assert not (shared / "results" / "ran.txt").exists()  # refused before the job ran
    if where == "logs":
        assert os.listdir(shared / "shared" / "dir") == []


def test_a_pack_script_is_not_written_through_a_link(shared):
    from fourd_mpi.jobs.sweep import write_job_file

    link = linked(shared / "results" / "pack-1.sh", shared / "shared" / "file")
    with pytest.raises(ConfigError, match="symbolic link"):
        write_job_file(str(link), "#!/bin/bash\n", executable=True)
    unchanged(shared, link)


def test_an_earlier_attempt_is_not_set_aside_through_a_link(shared):
    from fourd_mpi.jobs.sweep import set_aside

    (shared / "results" / "r.h5").write_text("not a complete trace\n")
    (shared / "shared" / "dir").mkdir()
    link = linked(shared / "results" / "superseded", shared / "shared" / "dir")
    with pytest.raises(ConfigError, match="superseded is a symbolic link"):
        set_aside(str(shared / "results" / "r.h5"))
    assert (shared / "results" / "r.h5").exists() and os.listdir(shared / "shared" / "dir") == []
    assert os.path.islink(link)


def test_collect_never_copies_through_a_link(shared, capfd):
    """A dangling link in --into named like a trace: ``shutil.copy2`` would have made the file it points to."""
    from fourd_mpi.jobs.sweep import collect

    (shared / "runs").mkdir()
    shutil.copy(SAMPLE, shared / "runs" / "weak-1.h5")
    into = shared / "into"
    into.mkdir()
    link = linked(into / "weak-1.h5", shared / "shared" / "made-by-copy.h5")
    manifest = {"sweep": "s", "study": "weak",
                "runs": [{"run_id": "weak-1", "trace": str(shared / "runs" / "weak-1.h5")}]}
    with pytest.raises(ConfigError, match="symbolic link that leads nowhere"):
        collect(manifest, str(into))
    assert os.path.islink(link) and not (shared / "shared" / "made-by-copy.h5").exists()


# -- the test bed's state and shim (root): never through a link planted under the temporary name -----

def test_a_temporary_name_is_never_followed(shared):
    from fourd_mpi.util.files import open_no_follow

    link = linked(shared / "results" / "state.json.tmp", shared / "shared" / "file")
    with pytest.raises(OSError):
        open_no_follow(str(link))
    unchanged(shared, link)
