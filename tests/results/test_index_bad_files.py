"""An index the commands cannot use, and lines in it they must skip.

``results list`` / ``results reindex`` refuse an index they cannot use in one line. Before: ``results reindex DIR``
on a read-only mount ended in ``OSError: [Errno 30]`` from ``_locked``; an ``index.jsonl`` that is a directory raised
``IsADirectoryError`` in ``list`` and ``reindex``; a FIFO as the index hung. Real files, a real read-only tmpfs (root
only: skipped elsewhere with the reason).

A line nested 100,000 levels deep is skipped with the warning every bad line gets (before: a RecursionError
traceback in ``results list``, ``results show`` and ``compare``); ``results reindex DIR`` never rewrites a
``DIR/index.jsonl`` that is a symbolic link to another directory's file (before: it rewrote the shared index through
the link, dropping the other directory's entries). No MPI."""

import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, mpi_env

from fourd_mpi.cli.main import main
from fourd_mpi.results.index import MAX_LINE_DEPTH, parse_line

SAMPLES = REPO / "results" / "samples"
SAMPLE = SAMPLES / "weak-1.h5"


def fourd(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=mpi_env(), cwd=REPO)


def one_line(proc):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fourd-mpi: error: "), proc.stderr
    return lines[0]


def a_trace() -> str:
    traces = sorted(SAMPLES.glob("*.h5"))
    if not traces:
        pytest.skip("no sample trace under results/samples")
    return str(traces[0])


@pytest.fixture
def readonly_results(tmp_path):
    where = tmp_path / "ro"
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {proc.stderr.strip()}")
    try:
        shutil.copy(a_trace(), where)
        subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True, capture_output=True)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_reindex_on_a_read_only_mount_is_one_line(readonly_results):
    line = one_line(fourd("results", "reindex", readonly_results))
    # checked before any trace is read
    assert line == (f"fourd-mpi: error: cannot write the index {readonly_results / 'index.jsonl'}: {readonly_results}: "
                    "Read-only file system")


@pytest.mark.parametrize("command", [["results", "list", "--index", "DIR/index.jsonl"], ["results", "reindex", "DIR"],
                                     ["results", "show", "x", "--index", "DIR"]])
def test_an_index_that_is_a_directory_is_one_line(tmp_path, command):
    shutil.copy(a_trace(), tmp_path)
    (tmp_path / "index.jsonl").mkdir()
    args = [a.replace("DIR", str(tmp_path)) for a in command]
    assert one_line(fourd(*args)) == f"fourd-mpi: error: {tmp_path / 'index.jsonl'} is a directory, not an index file"


@pytest.mark.parametrize("command", [["results", "list", "--index", "DIR"], ["results", "reindex", "DIR"]])
def test_an_index_that_is_a_fifo_is_one_line(tmp_path, command):
    shutil.copy(a_trace(), tmp_path)
    os.mkfifo(tmp_path / "index.jsonl")
    args = [a.replace("DIR", str(tmp_path)) for a in command]
    assert one_line(fourd(*args, timeout=30)) == (f"fourd-mpi: error: {tmp_path / 'index.jsonl'} is not a regular "
                                                  "file (a FIFO); give the index file itself")


def test_the_top_level_help_names_the_results_subcommands():
    proc = fourd("--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "list, show, reindex" in text and "rebuild" not in text


def test_reindex_keeps_a_line_appended_while_it_read_the_traces(tmp_path):
    """Reindex scanned, then truncated and rewrote the index, dropping the line of a run that
    finished meanwhile. It now rewrites under the lock runs append under, keeping such lines."""
    import fcntl
    import json
    import threading
    import time

    from fourd_mpi.results.index import append_entry
    from fourd_mpi.trace.indexing import reindex

    shutil.copy(a_trace(), tmp_path / "a.h5")
    index = tmp_path / "index.jsonl"
    index.touch()
    fd = os.open(index, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a run appending: reindex scans, then waits for the lock
    done = {}
    worker = threading.Thread(target=lambda: done.update(result=reindex(str(tmp_path))))
    worker.start()
    waiting = f":{os.fstat(fd).st_ino} "  # reindex has read the traces once it waits for the lock (/proc/locks)
    deadline = time.monotonic() + 300
    while not any(line.split()[1] == "->" and waiting in line for line in open("/proc/locks")):
        assert worker.is_alive() and time.monotonic() < deadline, "reindex never waited for the index's lock"
        time.sleep(0.05)
    shutil.copy(a_trace(), tmp_path / "b.h5")  # the run that finished during the reindex: trace, then its line
    entry = reindex(str(tmp_path / "b.h5"), output=str(tmp_path / "b-only.jsonl"))[0][0]
    os.write(fd, (json.dumps(dict(entry, run_id="late-run")) + "\n").encode())
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    worker.join(60)
    ids = [json.loads(line)["run_id"] for line in index.read_text().splitlines()]
    assert "late-run" in ids and len(ids) == 2, ids
    append_entry(str(index), dict(entry, run_id="after"))  # appends go on into the same file
    assert len(index.read_text().splitlines()) == 3


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
