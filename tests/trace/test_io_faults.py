"""I/O errors that are not a full disk, and file systems without locks, on a real
FUSE mount (``tests/helpers/faultfs.py``): the kernel returns ``EIO`` (a failing disk, a Lustre OST that
went away) or ``ENOLCK`` (NFS mounted ``nolock``, some FUSE and Lustre mounts) to the real
``mpiexec`` run, ``trace recover`` and ``sweep submit``. Nothing in our processes is patched.

The fault starts at a known step: ``--inject-fault RANK:STEP:touch`` creates
``<results>/inject-fault.touch`` after a barrier, which arms the file system's EIO rule, and every rank
goes on after a second barrier (see :class:`fourd_mpi.run.session.Fault`). Nothing depends on timing.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
from conftest import HELPERS, REPO, mpi_env
from test_spool_faults import one_line_on_every_rank  # the same promise, the same 4 ranks

from fourd_mpi.trace.invariants import check_invariants
from fourd_mpi.trace.read import load_trace

NRANKS = 4
RUN = ["run", "--gx", "2", "--gy", "2", "--steps", "6", "--display", "lines", "--peak-tflops", "1"]
IN_CI = os.environ.get("CI", "").lower() == "true"
EIO_TEXT = "Input/output error (EIO)"


def _unavailable(reason: str):
    if IN_CI:  # CI installs fuse, libfuse2 and mfusepy and runs as root: this must run there
        pytest.fail(f"faultfs must run in CI: {reason}")
    pytest.skip(reason)


class FaultFS:
    """A mounted ``faultfs``: ``path`` the mount point, ``backing`` the directory under it."""

    def __init__(self, root, nolock: bool):
        self.backing, self.path, self.control = root / "backing", root / "mnt", root / "faults.json"
        self.backing.mkdir()
        self.path.mkdir()
        self.clear()
        cmd = [sys.executable, str(HELPERS / "faultfs.py"), str(self.backing), str(self.path), str(self.control)]
        self.proc = subprocess.Popen(cmd + (["--nolock"] if nolock else []), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 30
        while not os.path.ismount(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                out = self.stop()
                _unavailable(f"cannot mount the FUSE test file system: {' '.join(out.split()[-30:])}")
            time.sleep(0.05)

    def fail(self, match, ops=("write", "fsync"), armed_by=None, after_bytes=0):
        """EIO for ``ops`` on files whose name matches one of ``match`` (from now on, or once a file named
        ``armed_by`` is created in the mount)."""
        rule = {"match": list(match), "ops": list(ops), "after_bytes": after_bytes}
        if armed_by:
            rule["armed_by"] = armed_by
        self._control({"eio": rule})

    def clear(self):
        self._control({})

    def _control(self, payload):
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload))
        os.replace(tmp, self.control)

    def hits(self) -> dict:
        try:
            return json.loads((self.control.parent / (self.control.name + ".hits")).read_text())
        except FileNotFoundError:
            return {}

    def stop(self) -> str:
        if os.path.ismount(self.path):
            unmount = ["fusermount", "-u"] if shutil.which("fusermount") else ["umount"]
            if subprocess.run([*unmount, str(self.path)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        assert not os.path.ismount(self.path)
        return out or ""


def _mount(tmp_path, nolock: bool):
    if not os.path.exists("/dev/fuse"):
        _unavailable("no /dev/fuse on this machine")
    if shutil.which("fusermount") is None and os.geteuid() != 0:
        _unavailable("fusermount not found and not root (Debian: apt-get install fuse libfuse2)")
    probe = subprocess.run([sys.executable, "-c", "import mfusepy"], capture_output=True, text=True)
    if probe.returncode != 0:
        _unavailable(f"mfusepy or libfuse unavailable: {probe.stderr.strip().splitlines()[-1]}")
    return FaultFS(tmp_path, nolock)


def _mounted(tmp_path, nolock: bool):
    fs = _mount(tmp_path, nolock=nolock)
    try:
        yield fs
    finally:
        fs.stop()


@pytest.fixture
def faultfs(tmp_path):
    yield from _mounted(tmp_path, nolock=False)


@pytest.fixture
def nolockfs(tmp_path):
    yield from _mounted(tmp_path, nolock=True)


def leftovers(root) -> list:
    """Temporary files anywhere under ``root``: ``.tmp-`` in the name (ours), ``.fuse_hidden`` (FUSE)."""
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files
            if ".tmp-" in f or f.startswith(".fuse_hidden")]


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=mpi_env(), cwd=REPO)


# ---------------------------------------------------------------------------
# the file system itself
# ---------------------------------------------------------------------------

def test_faultfs_delivers_eio_and_enolck_from_the_kernel(tmp_path):
    import errno
    import fcntl

    fs = _mount(tmp_path, nolock=True)
    try:
        fd = os.open(fs.path / "x.events", os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            for lock in (lambda: fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB),
                         lambda: fcntl.flock(fd, fcntl.LOCK_EX)):
                with pytest.raises(OSError) as info:
                    lock()
                assert info.value.errno == errno.ENOLCK
            os.write(fd, b"abc")
            fs.fail(["*.events"], ops=["write", "read"], after_bytes=2)
            assert os.write(fd, b"0123") == 2  # a short write at the limit, then EIO
            with pytest.raises(OSError) as info:
                os.write(fd, b"23")
            assert info.value.errno == errno.EIO
            with pytest.raises(OSError) as info:
                os.pread(fd, 10, 0)
            assert info.value.errno == errno.EIO
            (fs.path / "other.txt").write_text("fine")  # not matched
            fs.clear()
            assert os.pread(fd, 10, 0) == b"abc01"
        finally:
            os.close(fd)
        assert fs.hits() == {"write": 1, "read": 1}
        assert sorted(os.listdir(fs.backing)) == ["other.txt", "x.events"]
    finally:
        fs.stop()


ORPHAN = """
import os, subprocess, sys, time
proc = subprocess.Popen([sys.executable, *sys.argv[1:]])
while not os.path.ismount(sys.argv[3]):
    time.sleep(0.05)
print(proc.pid, flush=True)
os._exit(0)  # killed: no teardown
"""


def test_faultfs_unmounts_itself_when_its_parent_dies(tmp_path):
    _mount(tmp_path, nolock=False).stop()  # skips where FUSE is unavailable
    mnt, backing = tmp_path / "orphan", tmp_path / "orphan-backing"
    mnt.mkdir()
    backing.mkdir()
    out = subprocess.run([sys.executable, "-c", ORPHAN, str(HELPERS / "faultfs.py"), str(backing), str(mnt),
                          str(tmp_path / "none.json")], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout)
    try:
        deadline = time.monotonic() + 30
        while os.path.ismount(mnt) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.ismount(mnt)
    finally:
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------------------
# EIO in a run, at its merge, and in trace recover
# ---------------------------------------------------------------------------

@pytest.mark.mpi
def test_eio_on_every_file_during_the_steps(run_mpi, faultfs):
    """Every write fails (the whole disk is gone): still one line on every rank, no traceback, no temporary
    file; the reasons cannot be written, but each rank's reserve is renamed to its failure report (a
    rename writes no data), so the recovered trace says ``failed``, not ``partial``."""
    results = faultfs.path
    faultfs.fail(["*"], ops=["write", "fsync", "truncate"], armed_by="inject-fault.touch")
    proc = run_mpi(NRANKS, RUN + ["--results-dir", results, "--run-id", "all", "--inject-fault", "1:3:touch"],
                   timeout=180)
    line = one_line_on_every_rank(proc)
    assert EIO_TEXT in line and "the run stops after step 4" in line, line
    assert leftovers(faultfs.backing) == [] and not (results / "all.h5").exists()
    faultfs.clear()
    rec = cli("trace", "recover", results / "all.ranks")
    assert rec.returncode == 0, rec.stderr
    trace = load_trace(str(results / "all.h5"))
    assert trace.status == "failed" and list(trace.steps["step"]) == [0, 1, 2] and check_invariants(trace) == []
    # no reason could be written, but the renamed reserve says that every rank failed
    assert sorted(f["rank"] for f in trace.metadata["failures"]) == list(range(NRANKS))
    assert all("could not be written" in f["error"] for f in trace.metadata["failures"])


@pytest.mark.mpi
def test_eio_during_the_steps(run_mpi, faultfs):
    results = faultfs.path
    faultfs.fail(["*.events"], armed_by="inject-fault.touch")
    proc = run_mpi(NRANKS, RUN + ["--results-dir", results, "--run-id", "eio", "--inject-fault", "1:3:touch"],
                   timeout=180)
    line = one_line_on_every_rank(proc)
    assert faultfs.hits().get("write", 0) >= 1
    assert EIO_TEXT in line and "No space left" not in line and "once there is space" not in line, line
    assert "the run stops after step 4" in line
    spool = results / "eio.ranks"
    assert "fourd-mpi trace recover" in line and str(spool) in line
    assert leftovers(faultfs.backing) == [] and not (results / "eio.h5").exists()
    reports = [json.loads(p.read_text()) for p in sorted(spool.glob("*.failed.json"))]
    assert reports and all(EIO_TEXT in r["error"] for r in reports)
    faultfs.clear()
    rec = cli("trace", "recover", spool)
    assert rec.returncode == 0, rec.stderr
    trace = load_trace(str(results / "eio.h5"))
    assert trace.status == "failed" and list(trace.steps["step"]) == [0, 1, 2]
    assert EIO_TEXT in trace.metadata["failures"][0]["error"] and check_invariants(trace) == []


@pytest.mark.mpi
@pytest.mark.parametrize("group_size", [0, 2], ids=["one-file", "parts"])
def test_eio_at_the_merge_and_during_recover(run_mpi, faultfs, group_size):
    """EIO on the trace (one file) or on the second group's part file (written by rank 2): exit 2, one line
    on every rank, no segfault, the spool kept with rank 0's report; ``trace recover`` into the same failing
    file system: one line, exit 2, nothing left; once the fault is gone it recovers a ``failed`` trace."""
    results = faultfs.path
    target = ["*.h5*"] if group_size == 0 else ["part000001.h5"]
    faultfs.fail(target, armed_by="inject-fault.touch")
    proc = run_mpi(NRANKS, RUN + ["--results-dir", results, "--run-id", "m", "--trace-group-size", group_size,
                                  "--inject-fault", "1:6:touch"], timeout=180)
    line = one_line_on_every_rank(proc)  # exit 2: no rank segfaulted (rc 139) or aborted
    assert faultfs.hits().get("write", 0) >= 1
    assert EIO_TEXT in line and "No space left" not in line and ".tmp-" not in line, line
    written = results / ("m.h5" if group_size == 0 else "m.parts/part000001.h5")
    assert line.startswith(f"fourd-mpi: error: writing {written} failed: {EIO_TEXT}"), line
    spool = results / "m.ranks"
    assert "fourd-mpi trace recover" in line and str(spool) in line
    assert leftovers(faultfs.backing) == []
    assert sorted(f for f in os.listdir(results) if f != "inject-fault.touch") == ["m.ranks"]
    report = json.loads((spool / "rank000000.failed.json").read_text())["error"]
    assert report.startswith("merge: ") and EIO_TEXT in report
    for _ in range(2):  # the fault still there: one line, nothing left behind, the spool kept
        rec = cli("trace", "recover", spool, "--group-size", group_size, "--jobs", 2)
        assert rec.returncode == 2 and "Traceback" not in rec.stderr, rec.stderr
        assert len(rec.stderr.strip().splitlines()) == 1 and rec.stderr.startswith("fourd-mpi: error: ")
        assert rec.stderr.strip() == f"fourd-mpi: error: writing {written} failed: {EIO_TEXT}", rec.stderr
        assert leftovers(faultfs.backing) == []
        assert sorted(f for f in os.listdir(results) if f != "inject-fault.touch") == ["m.ranks"]
    faultfs.clear()
    rec = cli("trace", "recover", spool, "--group-size", group_size, "--jobs", 2)
    assert rec.returncode == 0, rec.stderr
    trace = load_trace(str(results / "m.h5"))
    assert trace.status == "failed" and list(trace.steps["step"]) == list(range(6))
    assert trace.metadata["failures"][0]["error"] == report and check_invariants(trace) == []
    assert f"{spool} can now be removed" in rec.stdout


@pytest.mark.mpi
def test_eio_reading_the_spool_at_the_merge(run_mpi, faultfs):
    """Rank 2 cannot read its own spool back for the final merge (EIO on read): the same one line on every
    rank naming the file, exit 2, no hang (the rank still takes part in the merge's collectives), the
    spool kept with rank 0's report."""
    results = faultfs.path
    faultfs.fail(["rank000002.events"], ops=["read"], armed_by="inject-fault.touch")
    proc = run_mpi(NRANKS, RUN + ["--results-dir", results, "--run-id", "rd", "--inject-fault", "1:6:touch"],
                   timeout=180)
    line = one_line_on_every_rank(proc)
    assert faultfs.hits().get("read", 0) >= 1
    assert "rank000002.events" in line and EIO_TEXT in line, line
    spool = results / "rd.ranks"
    assert leftovers(faultfs.backing) == [] and not (results / "rd.h5").exists()
    assert EIO_TEXT in json.loads((spool / "rank000000.failed.json").read_text())["error"]
    faultfs.clear()
    rec = cli("trace", "recover", spool)
    assert rec.returncode == 0, rec.stderr
    trace = load_trace(str(results / "rd.h5"))
    assert trace.status == "failed" and list(trace.steps["step"]) == list(range(6))


@pytest.mark.mpi
def test_eio_reading_the_spool_in_recover(run_mpi, faultfs):
    """A spool file that cannot be read (EIO on read: a failing disk): ``trace recover`` names it in one
    line, exit 2, writes nothing and keeps the spool; the same with two worker processes writing parts."""
    results = faultfs.path
    proc = run_mpi(NRANKS, RUN + ["--results-dir", results, "--run-id", "r", "--inject-fault", "2:4:kill"],
                   timeout=180)
    assert proc.returncode != 0 and (results / "r.ranks").is_dir()
    spool = results / "r.ranks"
    # .events: read by the writer of the group (a worker process with parts); .steps: in the first pass
    for name, variants in (("rank000002.events", ([], ["--group-size", 2, "--jobs", 2])), ("rank000001.steps", ([],))):
        faultfs.fail([name], ops=["read"])
        for args in variants:
            rec = cli("trace", "recover", spool, *args)
            assert rec.returncode == 2 and "Traceback" not in rec.stderr, rec.stderr
            assert rec.stderr.strip() == f"fourd-mpi: error: reading {spool / name} failed: {EIO_TEXT}", rec.stderr
            assert leftovers(faultfs.backing) == [] and sorted(os.listdir(results)) == ["r.ranks"]
    assert faultfs.hits().get("read", 0) >= 3
    faultfs.clear()
    rec = cli("trace", "recover", spool)
    assert rec.returncode == 0, rec.stderr
    assert load_trace(str(results / "r.h5")).status == "partial"


# ---------------------------------------------------------------------------
# a file system without POSIX or BSD locks
# ---------------------------------------------------------------------------

@pytest.mark.mpi
def test_a_run_without_locks_completes_and_is_indexed(run_mpi, nolockfs):
    results = nolockfs.path / "results"
    proc = run_mpi(NRANKS, RUN + ["--results-dir", results, "--run-id", "nl", "--trace-group-size", 2], timeout=180)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    trace = load_trace(str(results / "nl.h5"))
    assert trace.status == "complete" and list(trace.steps["step"]) == list(range(6)) and check_invariants(trace) == []
    assert trace.metadata.get("summary") and sorted(os.listdir(results)) == ["index.jsonl", "nl.h5", "nl.parts"]
    listed = cli("results", "list", "--index", results, "--format", "json")
    assert listed.returncode == 0, listed.stderr
    assert [e["run_id"] for e in json.loads(listed.stdout)] == ["nl"]
    rebuilt = cli("results", "reindex", results, "-o", results / "again.jsonl")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert [json.loads(x)["run_id"] for x in (results / "again.jsonl").read_text().splitlines()] == ["nl"]


HOLDER = """
import os, socket, sys
import numpy as np
from fourd_mpi.trace.events import EVENT_DTYPE, LANE_STEP, RANK_STEP_DTYPE
from fourd_mpi.trace.spool import RankSpool
rank = int(sys.argv[2])
spool = RankSpool(sys.argv[1], rank, {"rank": rank, "pid": os.getpid(), "hostname": socket.gethostname()})
record, span = np.zeros(1, RANK_STEP_DTYPE), np.zeros(1, EVENT_DTYPE)  # step 0: one step span
record["rank"], record["events"], record["end_ns"] = rank, 1, 10
span["rank"], span["lane"], span["end_ns"] = rank, LANE_STEP, 10
spool.append(span, record)
print("ready", spool.locked, flush=True)
sys.stdin.read()  # holds the spool until the test closes stdin
"""


def test_recover_refuses_a_live_run_without_locks(nolockfs):
    """No POSIX locks: a rank's liveness is its pid on this host (``"lock": false`` in its metadata)."""
    spool = nolockfs.path / "live.ranks"
    spool.mkdir()
    (spool / "run.json").write_text(json.dumps({"run_id": "live", "world_size": 2, "layers": ["block0.qkv"]}))
    holders = [subprocess.Popen([sys.executable, "-c", HOLDER, str(spool), str(rank)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=mpi_env(), cwd=REPO) for rank in (0, 1)]
    try:
        assert [h.stdout.readline().strip() for h in holders] == ["ready False"] * 2
        holders[0].stdin.close()
        holders[0].wait(timeout=60)  # rank 0 ended, rank 1 lives
        assert json.loads((spool / "rank000001.json").read_text())["lock"] is False
        rec = cli("trace", "recover", spool)
        assert rec.returncode == 2 and "Traceback" not in rec.stderr, rec.stderr
        assert (f"is still running: rank 1 (pid {holders[1].pid} on {socket.gethostname()}) hold their spool "
                "files") in rec.stderr
        assert not (nolockfs.path / "live.h5").exists()
    finally:
        for holder in holders:
            if holder.stdin and not holder.stdin.closed:
                holder.stdin.close()
            holder.wait(timeout=60)
    rec = cli("trace", "recover", spool)  # both ended: recovered, the spool may go
    assert rec.returncode == 0 and f"{spool} can now be removed" in rec.stdout, rec.stderr
    assert load_trace(str(nolockfs.path / "live.h5")).status == "partial"


SPEC = """\
name: s1
study: weak
ranks: [1, 2]
grids: {1: [1x1x1x1], 2: [1x1x1x2]}
model: {preset: gpt-tiny, batch: 4}
options: {steps: 2}
"""


@pytest.mark.mpi
def test_sweep_submit_without_locks(nolockfs):
    """``sweep submit`` into a sweep directory where ``flock`` fails (ENOLCK): it goes on, with one note that
    a concurrent submit is not excluded there, and every job runs once."""
    where = nolockfs.path
    (where / "spec.yaml").write_text(SPEC)
    render = subprocess.run([sys.executable, "-m", "fourd_mpi", "sweep", "render", "spec.yaml", "--site", "local",
                        "--python", sys.executable, "--out", "jobscripts/s1"], capture_output=True, text=True,
                       cwd=where, env=mpi_env(), timeout=120)
    assert render.returncode == 0, render.stderr
    submit = subprocess.run([sys.executable, "-m", "fourd_mpi", "sweep", "submit", "jobscripts/s1"],
                            capture_output=True, text=True, cwd=where, env=mpi_env(), timeout=300)
    assert submit.returncode == 0 and "Traceback" not in submit.stderr, submit.stdout + submit.stderr
    assert "2 submitted" in submit.stdout, submit.stdout
    notes = [line for line in submit.stderr.splitlines() if line.startswith("fourd-mpi: note: ")]
    assert len(notes) == 1 and "without file locks" in notes[0] and "concurrent" in notes[0], submit.stderr
    jobs = json.loads((where / "jobscripts/s1/jobs.json").read_text())
    assert sorted(job["state"] for job in jobs.values()) == ["COMPLETED", "COMPLETED"]
    status = subprocess.run([sys.executable, "-m", "fourd_mpi", "sweep", "status", "jobscripts/s1"],
                            capture_output=True, text=True, cwd=where, env=mpi_env(), timeout=120)
    assert status.returncode == 0 and "2/2 traces complete, 0 jobs failed" in status.stdout, status.stdout


@pytest.mark.mpi
def test_sweep_submit_when_jobs_json_cannot_be_written(faultfs):
    """EIO writing ``jobs.json`` (its temporary file): one line, exit 2, no temporary file, nothing launched."""
    where = faultfs.path
    (where / "spec.yaml").write_text(SPEC)
    render = subprocess.run([sys.executable, "-m", "fourd_mpi", "sweep", "render", "spec.yaml", "--site", "local",
                             "--python", sys.executable, "--out", "jobscripts/s1"], capture_output=True, text=True,
                            cwd=where, env=mpi_env(), timeout=120)
    assert render.returncode == 0, render.stderr
    assert not (where / "jobscripts/s1/jobs.json").exists()
    faultfs.fail([".jobs.json.*"], ops=["write", "fsync"])
    submit = subprocess.run([sys.executable, "-m", "fourd_mpi", "sweep", "submit", "jobscripts/s1"],
                            capture_output=True, text=True, cwd=where, env=mpi_env(), timeout=300)
    assert faultfs.hits()
    assert submit.returncode == 2 and "Traceback" not in submit.stderr, submit.stdout + submit.stderr
    assert submit.stderr.strip().splitlines() == [submit.stderr.strip()] and EIO_TEXT in submit.stderr, submit.stderr
    assert "jobs.json" in submit.stderr and "submitted" not in submit.stdout
    assert leftovers(faultfs.backing) == []
    assert not [f for f in os.listdir(where / "jobscripts/s1") if f.endswith(".tmp")]
    assert not (where / "jobscripts/s1/jobs.json").exists() and not (where / "results").exists()
