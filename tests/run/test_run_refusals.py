"""Faults of a run found before the steps, or at the step they happen, in one line per rank.

Before: ``--inject-fault 0:99`` with ``--steps 3`` was accepted and never fired; ``--run-id dup --force``
with ``RESULTS/dup.h5`` a directory ran every step and failed at publish; ``--lr 1e30`` made the losses
nan, leaked numpy ``RuntimeWarning: overflow encountered in matmul`` lines, and the trace was "complete".
Real ``mpiexec``, real files.
"""

import contextlib
import json
import subprocess
import sys

import pytest
from conftest import REPO, mpi_env, rank_stderr

pytestmark = pytest.mark.mpi


def errors_of(proc, nranks):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
    # rank 0's notes (e.g. "ranks not pinned") go to stderr with the run's header: not errors, not counted
    lines = [line for line in rank_stderr(proc.stderr).splitlines()
             if line.strip() and not line.startswith("fourd-mpi: note: ")]
    errors = [line for line in lines if line.startswith("fourd-mpi: error: ")]
    assert len(errors) == nranks and len(set(errors)) == 1 and len(lines) == nranks, proc.stderr
    return errors[0]


def test_a_fault_step_beyond_the_run_is_refused(run_mpi, tmp_path):
    proc = run_mpi(8, ["run", "--steps", "3", "--inject-fault", "0:99", "--results-dir", tmp_path], timeout=120)
    line = errors_of(proc, 8)
    assert "--inject-fault 0:99: step 99 is beyond the run: STEP must be <= --steps 3" in line
    assert list(tmp_path.iterdir()) == []


def test_a_directory_in_the_way_of_the_trace_is_refused_before_the_steps(run_mpi, tmp_path):
    (tmp_path / "dup.h5").mkdir()
    proc = run_mpi(2, ["run", "--steps", "3", "--run-id", "dup", "--force", "--results-dir", tmp_path,
                       "--display", "quiet"], timeout=120)
    line = errors_of(proc, 2)
    assert line == f"fourd-mpi: error: {tmp_path / 'dup.h5'} is a directory, not a trace file: remove it or choose " \
                   "another --run-id"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dup.h5"]  # no spool: no step ran


def test_a_non_finite_loss_stops_every_rank_and_keeps_the_steps(run_mpi, tmp_path):
    proc = run_mpi(4, ["run", "--gdata", "2", "--gx", "2", "--steps", "4", "--lr", "1e30", "--run-id", "big",
                       "--results-dir", tmp_path, "--display", "quiet"], timeout=180)
    line = errors_of(proc, 4)
    spool = tmp_path / "big.ranks"
    assert line.startswith("fourd-mpi: error: the loss became non-finite (nan) at step "), line
    assert f"the learning rate (--lr 1e+30) is too large or the model diverged; the steps so far are kept in {spool}" \
        in line
    step = int(line.split(" at step ")[1].split(":")[0])
    assert step < 3
    for rank in range(4):  # recorded as a run failure, like the others
        report = json.loads((spool / f"rank{rank:06d}.failed.json").read_text())
        assert report["error"].startswith(f"the loss became non-finite (nan) at step {step}: ")
    rec = subprocess.run([sys.executable, "-m", "fourd_mpi", "trace", "recover", str(spool)], capture_output=True,
                         text=True, timeout=120, env=mpi_env(), cwd=REPO)
    assert rec.returncode == 0, rec.stderr
    steps = "step 0" if step == 0 else f"steps 0-{step}"
    assert f"status failed, {steps} completed by every rank ({step + 1})" in rec.stdout, rec.stdout


# --- a watchdog abort, long run ids, verify of one step -------------------------------------------------

def test_a_watchdog_abort_publishes_no_trace_and_no_index_entry(tmp_path):
    """Before: a watchdog that fired (--step-timeout 0.001: "aborting the job", exit 3) on a wait that then
    ended still published a complete trace and its index line, and the message said "waited 0 s".

    Deterministic on a quiet or a loaded machine: rank 1 stops itself (SIGSTOP) at the start of step 1, so
    rank 0's first collective of that step outlasts --step-timeout 1 whatever the load; once rank 0's line
    is out, rank 1 is continued, so the wait ends and the ranks could go on to the merge while the
    watchdog aborts. Either way: exit 3, no trace, no index line."""
    import os
    import signal

    from conftest import find_mpiexec

    cmd = [find_mpiexec(), "-n", "2", sys.executable, "-m", "fourd_mpi", "run", "--model", "gpt-tiny", "--steps",
           "3", "--step-timeout", "1", "--inject-fault", "1:1:stop", "--run-id", "wd", "--results-dir",
           str(tmp_path), "--display", "quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(), cwd=REPO)
    meta, pid, err = tmp_path / "wd.ranks" / "rank000001.json", None, []
    try:
        for line in proc.stderr:  # until rank 0's watchdog has said it, or the job ended
            err.append(line)
            if pid is None and meta.exists() and meta.stat().st_size:
                pid = json.loads(meta.read_text())["pid"]  # written before the first step
            if "longer than --step-timeout" in line:
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
                break
        out, rest = proc.communicate(timeout=180)
        err.append(rest)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if pid is not None:  # never leave a stopped rank behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    stderr = "".join(err)
    assert proc.returncode == 3, (proc.returncode, stderr)
    assert "Traceback" not in stderr
    assert not (tmp_path / "wd.h5").exists() and not (tmp_path / "index.jsonl").exists()
    fired = [line for line in stderr.splitlines() if "longer than --step-timeout 1 s" in line]
    assert fired and all(line.startswith("fourd-mpi: error: rank ") for line in fired), fired
    assert not any(" waited 0 s " in line for line in fired), fired


@pytest.mark.parametrize("option, length, most", [("--run-id", 240, 226), ("--label", 220, 203)])
def test_a_run_id_longer_than_the_file_system_allows_is_refused_before_the_steps(run_mpi, tmp_path, option, length,
                                                                                 most):
    """Before: a run id of 240+ characters failed only at the merge, after every step (and so did the
    suggested trace recover)."""
    proc = run_mpi(2, ["run", "--steps", "2", option, "a" * length, "--results-dir", tmp_path], timeout=120)
    line = errors_of(proc, 2)
    assert line == (f"fourd-mpi: error: {option} of {length} characters is too long: "
                    "the file names made of it must fit "
                    f"the file system's limit of 255 (NAME_MAX): give at most {most} characters")
    assert list(tmp_path.iterdir()) == []


def test_verify_of_one_step_does_not_ask_for_a_warmup_it_lacks(run_mpi):
    """Before: verify --steps 1 said "give --warmup smaller than --steps"; verify has no --warmup."""
    proc = run_mpi(1, ["verify", "--steps", "1", "--model", "gpt-tiny"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "1 passed, 0 failed" in proc.stdout and "--warmup" not in proc.stderr
