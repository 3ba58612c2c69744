"""The spool under faults: a full disk at every stage, a spool deleted mid-run,
``trace recover`` on a live run. Real ``mpiexec``, real files on a real tmpfs (mounted here: root only).

A fault happens at a known point through ``--inject-fault RANK:STEP:MODE`` (``fill-disk`` fills the
test's tmpfs, ``remove-spool`` deletes the spool directory; STEP = --steps: before the final merge),
after a barrier, so nothing depends on timing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, mounted_tmpfs, mpi_env

from fourd_mpi.errors import TraceError
from fourd_mpi.trace.events import EVENT_DTYPE, LANE_STEP, RANK_STEP_DTYPE
from fourd_mpi.trace.files import write_json_atomic
from fourd_mpi.trace.invariants import check_invariants
from fourd_mpi.trace.read import load_trace
from fourd_mpi.trace.recover import recover
from fourd_mpi.trace.spool import RankSpool, live_ranks, read_records
from fourd_mpi.trace.writer import TraceFileWriter

NRANKS = 4
RUN = ["run", "--gx", "2", "--gy", "2", "--steps", "6", "--display", "lines", "--peak-tflops", "1"]


@pytest.fixture
def tmpfs(tmp_path):
    """A 4 MiB tmpfs (a full one is made by the run's ``fill-disk`` fault or by :func:`fill`)."""
    where = tmp_path / "tmpfs"
    where.mkdir()
    yield from mounted_tmpfs(where, "size=4m")


def fill(directory) -> str:
    """Fill the file system of ``directory`` with ``fill-disk.bin`` (as the run's fault does)."""
    path = os.path.join(directory, "fill-disk.bin")
    with open(path, "ab", buffering=0) as fh:
        try:
            while True:
                fh.write(bytes(1 << 16))
        except OSError:
            pass
    return path


def one_line_on_every_rank(proc, nranks=NRANKS) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fourd-mpi: error: ")]
    assert len(errors) == nranks and len(set(errors)) == 1, proc.stderr
    return errors[0]


def leftovers(root) -> list:
    """Temporary files anywhere under ``root`` (``.tmp-`` in the name)."""
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if ".tmp-" in f]


def recover_cli(spool, *args):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", "trace", "recover", str(spool), *args],
                          capture_output=True, text=True, timeout=120, env=mpi_env(), cwd=REPO)


def whole_steps_only(spool):
    """No torn record: every .events file holds whole records, all of steps with a step record."""
    for rank in range(NRANKS):
        raw = (spool / f"rank{rank:06d}.events").read_bytes()
        steps = (spool / f"rank{rank:06d}.steps").read_bytes()
        assert len(raw) % EVENT_DTYPE.itemsize == 0 and len(steps) % RANK_STEP_DTYPE.itemsize == 0
        events = np.frombuffer(raw, EVENT_DTYPE)
        recorded = set(np.frombuffer(steps, RANK_STEP_DTYPE)["step"].tolist())
        assert set(events["step"].tolist()) <= recorded


@pytest.mark.mpi
def test_disk_full_during_the_steps(run_mpi, tmpfs):
    proc = run_mpi(NRANKS, RUN + ["--results-dir", tmpfs, "--run-id", "full", "--inject-fault", "1:3:fill-disk"],
                   timeout=180)
    line = one_line_on_every_rank(proc)
    assert "No space left on device (ENOSPC)" in line and "the run stops after step 4" in line
    spool = tmpfs / "full.ranks"
    assert "fourd-mpi trace recover" in line and str(spool) in line
    assert leftovers(tmpfs) == [] and not (tmpfs / "full.h5").exists()
    whole_steps_only(spool)
    reports = [json.loads(p.read_text()) for p in sorted(spool.glob("*.failed.json"))]
    assert reports and all("ENOSPC" in r["error"] for r in reports)  # recorded although the disk was full
    os.remove(tmpfs / "fill-disk.bin")
    rec = recover_cli(spool)
    assert rec.returncode == 0, rec.stderr
    trace = load_trace(str(tmpfs / "full.h5"))
    assert trace.status == "failed" and list(trace.steps["step"]) == [0, 1, 2]
    assert "ENOSPC" in trace.metadata["failures"][0]["error"] and check_invariants(trace) == []
    assert f"{spool} can now be removed" in rec.stdout


@pytest.mark.mpi
def test_disk_full_at_the_merge_and_during_recover(run_mpi, tmpfs):
    proc = run_mpi(NRANKS, RUN + ["--results-dir", tmpfs, "--run-id", "merge", "--inject-fault", "2:6:fill-disk"],
                   timeout=180)
    line = one_line_on_every_rank(proc)  # rank 0 wrote the trace: exit 2, no segfault (was rc 139)
    assert line.startswith(f"fourd-mpi: error: writing {tmpfs / 'merge.h5'} failed: No space left on device")
    spool = tmpfs / "merge.ranks"
    assert leftovers(tmpfs) == [] and not [f for f in os.listdir(tmpfs) if f.startswith(".")]
    whole_steps_only(spool)
    assert "merge: writing" in json.loads((spool / "rank000000.failed.json").read_text())["error"]
    # recover into the full disk: one line, no hidden temporary file (refused before the work)
    rec = recover_cli(spool)
    assert rec.returncode == 2 and "Traceback" not in rec.stderr, rec.stderr
    assert rec.stderr.strip() == (f"fourd-mpi: error: cannot write the trace {tmpfs / 'merge.h5'}: "
                                  f"no space left on the file system of {tmpfs} (0 bytes free)")
    assert sorted(os.listdir(tmpfs)) == ["fill-disk.bin", "merge.ranks"]
    os.remove(tmpfs / "fill-disk.bin")
    rec = recover_cli(spool)
    assert rec.returncode == 0, rec.stderr
    trace = load_trace(str(tmpfs / "merge.h5"))
    assert trace.status == "failed" and list(trace.steps["step"]) == list(range(6))
    assert check_invariants(trace) == []


@pytest.mark.mpi
@pytest.mark.parametrize("step", [2, 6])
def test_a_spool_deleted_mid_run_keeps_every_step(run_mpi, tmp_path, step):
    proc = run_mpi(NRANKS, RUN + ["--results-dir", tmp_path, "--run-id", "gone",
                                  "--inject-fault", f"1:{step}:remove-spool"], timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("fourd-mpi: warning: ")]
    assert len(warnings) == NRANKS and len(set(warnings)) == 1 and "no step was lost" in warnings[0], proc.stderr
    assert f"{NRANKS} of {NRANKS} rank(s) re-created" in warnings[0]
    trace = load_trace(str(tmp_path / "gone.h5"))
    assert trace.status == "complete" and list(trace.steps["step"]) == list(range(6))
    assert sorted(set(trace.rank_steps["rank"].tolist())) == list(range(NRANKS)) and check_invariants(trace) == []
    assert trace.metadata["summary"]["steps"] == 5
    assert len(trace.metadata["spool_recreated"]) == NRANKS
    # the re-created spool was removed after the merge
    assert sorted(os.listdir(tmp_path)) == ["gone.h5", "index.jsonl"]


# ---------------------------------------------------------------------------
# one process: liveness, writer, failure reports
# ---------------------------------------------------------------------------

HOLDER = """
import os, socket, sys
from fourd_mpi.trace.spool import RankSpool
from fourd_mpi.trace.events import EVENT_DTYPE, RANK_STEP_DTYPE
import numpy as np
spool = RankSpool(sys.argv[1], int(sys.argv[2]), {"rank": int(sys.argv[2]), "pid": os.getpid(),
                                           "hostname": socket.gethostname()})
from fourd_mpi.trace.events import LANE_STEP
record = np.zeros(1, RANK_STEP_DTYPE)
record["rank"], record["events"], record["end_ns"] = int(sys.argv[2]), 1, 10
span = np.zeros(1, EVENT_DTYPE)  # the step span: one per rank-step, as a real run records
span["rank"], span["lane"], span["end_ns"] = int(sys.argv[2]), LANE_STEP, 10
spool.append(span, record)
print("ready", flush=True)
sys.stdin.read()  # holds the spool (and its lock) until the test closes stdin
"""


def test_recover_refuses_a_live_run_unless_forced(tmp_path):
    spool = tmp_path / "live.ranks"
    spool.mkdir()
    (spool / "run.json").write_text(json.dumps({"run_id": "live", "world_size": 2, "layers": ["block0.qkv"]}))
    ended = RankSpool(str(spool), 0, {"rank": 0})  # rank 0 ended; rank 1 is alive
    record, span = np.zeros(1, RANK_STEP_DTYPE), np.zeros(1, EVENT_DTYPE)  # step 0: one step span
    record["events"], record["end_ns"] = 1, 10
    span["lane"], span["end_ns"] = LANE_STEP, 10
    ended.append(span, record)
    ended.close()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(spool), "1"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=mpi_env(), cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert live_ranks(str(spool), 2) == [f"rank 1 (pid {holder.pid} on {socket.gethostname()})"]
        with pytest.raises(TraceError, match="is still running: rank 1"):
            recover(str(spool))
        assert not (tmp_path / "live.h5").exists()
        forced = recover(str(spool), force=True)
        assert forced["live"] and forced["removable"].startswith("the run was still running")
        rec = recover_cli(spool, "--force", "-o", tmp_path / "again.h5")
        assert rec.returncode == 0 and "keep the per-rank files" in rec.stdout
        assert "can now be removed" not in rec.stdout
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    # the holder exited: its lock is gone
    done = recover(str(spool), force=True)
    assert done["live"] == [] and done["removable"] is None and done["steps"] == [0]


def test_failure_report_fits_on_a_full_disk(tmpfs):
    spool = RankSpool(str(tmpfs), 3, {"rank": 3})
    fill(tmpfs)
    record = np.zeros(1, RANK_STEP_DTYPE)
    spool.append(np.zeros(10, EVENT_DTYPE), record)  # fails: cut back, kept in .error
    assert "No space left on device (ENOSPC)" in spool.error
    assert os.path.getsize(spool.events_path) == 0 and os.path.getsize(spool.steps_path) == 0
    assert spool.mark_failed(spool.error)
    assert json.loads((tmpfs / "rank000003.failed.json").read_text())["error"] == spool.error
    with pytest.raises(OSError):
        write_json_atomic(str(tmpfs / "x.json"), {"a": "b" * 100000})
    assert leftovers(tmpfs) == []
    spool.remove()
    assert sorted(os.listdir(tmpfs)) == ["fill-disk.bin"]


WRITER = """
import sys
import numpy as np
from fourd_mpi.errors import TraceError
from fourd_mpi.trace.events import EVENT_DTYPE
from fourd_mpi.trace.writer import TraceFileWriter
events = np.frombuffer(np.random.default_rng(0).bytes(20000 * EVENT_DTYPE.itemsize), EVENT_DTYPE)
writer = TraceFileWriter(sys.argv[1])
try:
    for _ in range(100):
        writer.append_events(0, events)
except TraceError as exc:
    writer.abort()
    print(exc)
"""


def test_trace_writer_on_a_full_disk_exits_cleanly(tmpfs):
    """HDF5 2.0 / h5py 3.16 segfaulted after a failed write (the merge's rc 139): the writer's file object
    keeps every I/O error from HDF5, so the process ends normally with one line and no file."""
    proc = subprocess.run([sys.executable, "-c", WRITER, str(tmpfs / "t.h5")], capture_output=True, text=True,
                          timeout=120, env=mpi_env(), cwd=REPO)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert proc.stdout.strip() == f"writing {tmpfs / 't.h5'} failed: No space left on device (ENOSPC)"
    assert proc.stderr == "" and os.listdir(tmpfs) == []


def test_trace_writer_round_trip_through_the_guarded_file(tmp_path):
    from fourd_mpi.trace.files import RANK_DTYPE

    events = np.zeros(10000, EVENT_DTYPE)
    events["start_ns"] = np.arange(10000)
    events["end_ns"] = events["start_ns"] + 1
    writer = TraceFileWriter(str(tmp_path / "r.h5"))
    writer.append_events(0, events)
    ranks = np.zeros(1, RANK_DTYPE)
    path = writer.finish({"run_id": "r"}, ranks, np.zeros(0, RANK_STEP_DTYPE), [], "complete")
    import h5py

    with h5py.File(path, "r") as h5:
        assert np.array_equal(h5["events"][:], events) and h5.attrs["status"] == "complete"
    assert os.listdir(tmp_path) == ["r.h5"]


def test_a_deleted_spool_is_re_created_from_the_open_files(tmp_path):
    import shutil

    spool_dir = tmp_path / "r.ranks"
    spool_dir.mkdir()
    (spool_dir / "run.json").write_text('{"world_size": 1}')
    spool = RankSpool(str(spool_dir), 0, {"rank": 0})
    events = np.zeros(7, EVENT_DTYPE)
    events["start_ns"] = np.arange(7)
    record = np.zeros(1, RANK_STEP_DTYPE)
    spool.append(events, record)
    shutil.rmtree(spool_dir)
    assert spool.lost() and np.array_equal(spool.read_events(), events)  # read through the descriptor
    record["step"] = 1
    spool.append(events, record)
    assert spool.error is None and len(spool.recreated) == 1 and not spool.lost()
    assert json.loads((spool_dir / "run.json").read_text()) == {"world_size": 1}
    assert (spool_dir / "rank000000.steps").stat().st_size == 2 * RANK_STEP_DTYPE.itemsize
    assert read_records(str(spool_dir / "rank000000.events"), EVENT_DTYPE).tolist() == \
        np.concatenate([events, events]).tolist()
    assert live_ranks(str(spool_dir), 1) == []  # same process: its own lock never conflicts
    spool.close()


def test_the_summary_of_no_step_does_not_crash():
    from fourd_mpi.trace.summary import summarize

    summary = summarize(np.zeros(0, RANK_STEP_DTYPE), 4, 1e9, 128, 1.0, "--peak-tflops")
    assert summary.steps == 0 and np.isnan(summary.median_s)
    assert summary.lines()[0].startswith("step time: median - s over 0 step(s)")


def test_guarded_file_reads_back_what_was_written_after_a_failure(tmpfs):
    """After the first failing write, the pieces live in memory; reads see disk and memory, newest last."""
    from fourd_mpi.trace.guarded import GuardedFile

    fill(tmpfs)
    os.remove(tmpfs / "fill-disk.bin")
    fill(tmpfs)  # full again, nothing free
    raw = GuardedFile(str(tmpfs / "g"))
    assert raw.write(b"a" * 10) == 10 and raw.error is not None  # failed: kept in memory
    raw.seek(5)
    raw.write(b"b" * 10)
    raw.seek(0)
    raw.write(b"c" * 3)
    raw.seek(0)
    buffer = bytearray(20)
    assert raw.readinto(buffer) == 15 and bytes(buffer[:15]) == b"cccaabbbbbbbbbb"
    raw.close()
