"""A user file that is not a regular file is refused in one line, never waited on.

Before, a FIFO with no writer given as a trace, a config, a sweep spec, a site or a machine profile
hung forever in ``open`` (``timeout`` ended it, rc 124); a directory given as a trace printed an
HDF5 errno dump. Real FIFOs, real processes; ``timeout`` bounds every command.
"""

import os
import subprocess
import sys

import pytest
from conftest import REPO, mpi_env

JOBSCRIPTS = REPO / "jobscripts"


def fourd(*args, stdin=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=mpi_env(), cwd=REPO, stdin=stdin)


def one_line(proc):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("fourd-mpi: error: "), proc.stderr
    return lines


@pytest.fixture
def fifo(tmp_path):
    def make(name):
        path = tmp_path / name
        os.mkfifo(path)
        return path
    return make


@pytest.mark.parametrize("command", [["trace", "check"], ["trace", "show"], ["analyze"],
                                     ["export", "perfetto", "-o", "OUT", "--force"]])
def test_a_fifo_as_a_trace_is_refused(fifo, tmp_path, command):
    path = fifo("t.h5")
    args = [str(tmp_path / "out.json") if a == "OUT" else a for a in command]
    lines = one_line(fourd(*args, path, timeout=30))
    assert f"{path} is not a regular file (a FIFO)" in "\n".join(lines)


@pytest.mark.parametrize("args, what", [
    (["sweep", "plan", "FIFO"], "sweep spec"),
    (["sweep", "plan", str(JOBSCRIPTS / "weak-gpt-tiny.yaml"), "--site", "FIFO"], "site profile"),
    (["tune", "--ranks", "8", "--profile", "FIFO"], "machine profile"),
    (["model", "predict", "--config", "FIFO"], "predict config"),  # before: blocked forever
])
def test_a_fifo_as_a_spec_or_profile_is_refused(fifo, args, what):
    path = fifo("f.yaml")
    lines = one_line(fourd(*[str(path) if a == "FIFO" else a for a in args], timeout=30))
    assert lines == [f"fourd-mpi: error: {path} is not a regular file (a FIFO); give the {what} itself"]


@pytest.mark.mpi
def test_a_fifo_as_a_config_is_refused_on_every_rank(run_mpi, fifo, tmp_path):
    path = fifo("c.yaml")
    proc = run_mpi(2, ["run", "--config", path, "--steps", "2", "--results-dir", tmp_path], timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count(f"fourd-mpi: error: {path} is not a regular file (a FIFO); give the config file "
                             "itself") == 2, proc.stderr


def test_a_directory_as_a_trace_is_one_short_line(tmp_path):
    """Before: "not a readable HDF5 file (truncated or corrupted?)" and a long HDF5 errno dump."""
    (tmp_path / "dir.h5").mkdir()
    lines = one_line(fourd("trace", "check", tmp_path / "dir.h5"))
    assert lines == [f"fourd-mpi: error: {tmp_path / 'dir.h5'} is a directory, not a trace file"]


def test_a_pipe_with_a_writer_on_stdin_is_one_line(tmp_path):
    """``cat g.h5 | fourd-mpi trace check /dev/stdin``: one line (not a regular file), no traceback."""
    data = tmp_path / "g.h5"
    data.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(4096))
    with open(data, "rb") as fh:
        cat = subprocess.Popen(["cat"], stdin=fh, stdout=subprocess.PIPE)
        try:
            proc = fourd("trace", "check", "/dev/stdin", stdin=cat.stdout, timeout=30)
        finally:
            cat.stdout.close()
            cat.wait(timeout=30)
    assert one_line(proc) == ["fourd-mpi: error: /dev/stdin is not a regular file (a FIFO); give the trace file "
                              "itself"]
