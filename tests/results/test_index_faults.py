"""Issue 19: ``results list`` / ``results reindex`` refuse an index they cannot use in one line.

Before: ``results reindex DIR`` on a read-only mount ended in ``OSError: [Errno 30]`` from ``_locked``;
an ``index.jsonl`` that is a directory raised ``IsADirectoryError`` in ``list`` and ``reindex``; a FIFO
as the index hung. Real files, a real read-only tmpfs (root only: skipped elsewhere with the reason).
"""

import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, mpi_env

SAMPLES = REPO / "results" / "samples"


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
    # issue 34: checked before any trace is read
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
    """Issue 34: reindex scanned, then truncated and rewrote the index, dropping the line of a run that
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
