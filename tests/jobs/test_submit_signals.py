"""SIGINT, SIGTERM and SIGHUP to ``fourd-mpi sweep submit`` of a local sweep (two runs, run one after
another under mpiexec) at random moments drawn from a seeded RNG over the measured life of a whole submit. The
submit passes the signal on to the job it runs and waits for it: no job outlives it. Never a traceback or a
crash, never a hidden temporary file; ``jobs.json`` holds no claim of a process that is gone, each run's record
agrees with what it left (a complete trace, per-rank files that ``trace recover`` turns into an
``interrupted`` trace, or nothing), and ``sweep status`` reads it."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import mpi_env, mpi_flavor
from moments import SIGNALS, check_left, crashed, default_signals, fourd, signal_at, timeline, wait_caught

TRIALS = 8
SPEC = """\
name: s1
study: weak
ranks: [1, 2]
grids: {1: [1x1x1x1], 2: [1x1x1x2]}
model: {preset: gpt-tiny, batch: 8}
options: {steps: 3}
"""
#: hidden files a sweep directory keeps: the submit lock and the marker of a directory fourd-mpi made
KEPT = (".submit.lock", ".fourd-mpi-dir.json")


def submit(where):
    return subprocess.Popen([sys.executable, "-m", "fourd_mpi", "sweep", "submit", "jobscripts/s1"], cwd=where,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(),
                            preexec_fn=default_signals)


def working_in(where) -> list:
    """The processes whose working directory is ``where`` or below (the jobs of a submit there)."""
    found, root = [], os.path.realpath(where)
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd")
            with open(f"/proc/{entry}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if (cwd == root or cwd.startswith(root + os.sep)) and state not in ("Z", "X"):
            found.append(int(entry))
    return found


def wait_no_process_in(where, timeout: float = 60) -> list:
    """Wait until no process works in ``where`` (a sentinel may outlive its job for a moment); the ones left."""
    deadline = time.monotonic() + timeout
    while working_in(where) and time.monotonic() < deadline:
        time.sleep(0.05)
    return working_in(where)


def sweep(base):
    base.mkdir()
    (base / "spec.yaml").write_text(textwrap.dedent(SPEC))
    done = fourd("sweep", "render", "spec.yaml", "--site", "local", "--python", sys.executable,
                 "--out", "jobscripts/s1", cwd=base)
    assert done.returncode == 0, done.stderr
    return json.loads((base / "jobscripts/s1/manifest.json").read_text())["runs"]


@pytest.mark.mpi
def test_a_signal_at_any_moment_of_sweep_submit(tmp_path):
    if mpi_flavor() != "mpich":
        pytest.skip("the moments are drawn over Hydra's forwarding of signals to the ranks")
    runs = sweep(tmp_path / "base")
    rng = random.Random(3)
    shutil.copytree(tmp_path / "base", tmp_path / "measure")
    proc = submit(tmp_path / "measure")
    assert wait_caught(proc.pid, proc), proc.communicate()
    whole = timeline(proc, {})["end"]
    seen = {}
    for i in range(TRIALS):
        where = tmp_path / f"t{i}"
        shutil.copytree(tmp_path / "base", where)
        sig = SIGNALS[i % 3]
        moment = rng.uniform(0, whole * 1.05)
        why = f"trial {i}: {sig.name} {moment:.2f} s into the submit (measured {whole:.2f} s)"
        proc = submit(where)
        try:
            if wait_caught(proc.pid, proc):
                signal_at(proc, proc.pid, sig, moment)
            out, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        why += f"; exit {proc.returncode}: {out} {err}"
        assert crashed(err) is None, why
        assert proc.returncode in (0, 128 + sig), why
        assert wait_no_process_in(where) == [], why  # no job outlives the submit
        jobs = json.loads((where / "jobscripts/s1/jobs.json").read_text()) \
            if (where / "jobscripts/s1/jobs.json").exists() else {}
        status = fourd("sweep", "status", "jobscripts/s1", cwd=where)
        assert status.returncode in (0, 1) and crashed(status.stderr) is None, (why, status.stdout, status.stderr)
        outcomes = []
        for run in runs:
            record = jobs.get(run["run_id"], {})
            assert record.get("state") in (None, "COMPLETED", "CANCELLED"), (why, jobs)
            left = check_left(where / os.path.dirname(run["trace"]), run["run_id"], why)
            if record.get("state") == "COMPLETED":
                assert left == "complete", (why, record, left)
            elif record.get("state") is None:
                assert left == "nothing", (why, record, left)
            else:
                assert left in ("complete", "recovered interrupted", "nothing"), (why, record, left)
            outcomes.append((record.get("state"), left))
        assert hidden_in(where) == [], why
        key = (sig.name, proc.returncode, tuple(outcomes))
        seen[key] = seen.get(key, 0) + 1
        print(i, key, f"{moment:.2f}/{whole:.2f}", flush=True)
    assert any(code != 0 for _, code, _ in seen), seen


def hidden_in(where) -> list:
    from moments import hidden

    return hidden(where / "jobscripts", KEPT) + hidden(where / "results", KEPT) if (where / "results").exists() \
        else hidden(where / "jobscripts", KEPT)


@pytest.mark.mpi
def test_an_interrupted_sequential_pack_starts_no_further_run(tmp_path):
    """Ctrl-C to ``sweep submit`` of a local sequential pack of two runs while the first one steps. Before: the
    submit died (its job killed, its mpiexec left running the run), and the pack would have gone on to the
    second run. Now the first run records the interruption, the pack starts no further run, the first run's
    record says CANCELLED and the second run's claim is given back (no record: a later submit runs it)."""
    if mpi_flavor() != "mpich":
        pytest.skip("Hydra forwards the signal to the ranks")
    from moments import steps_done, wait_for

    from fourd_mpi.trace.events import RANK_STEP_DTYPE

    # the SIGINT, not the end, stops it
    tmp_path.joinpath("spec.yaml").write_text(textwrap.dedent(SPEC).replace("steps: 3", "steps: 100000"))
    done = fourd("sweep", "render", "spec.yaml", "--site", "local", "--python", sys.executable, "--pack", "2",
                 "--out", "jobscripts/s1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    first, second = json.loads((tmp_path / "jobscripts/s1/manifest.json").read_text())["runs"]
    spool = tmp_path / (first["trace"][:-3] + ".ranks")
    proc = submit(tmp_path)
    try:
        assert wait_for(steps_done(spool, 1, 1, RANK_STEP_DTYPE.itemsize), proc), proc.communicate()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130 and crashed(err) is None, (out, err)
    assert wait_no_process_in(tmp_path) == []
    jobs = json.loads((tmp_path / "jobscripts/s1/jobs.json").read_text())
    assert list(jobs) == [first["run_id"]] and jobs[first["run_id"]]["state"] == "CANCELLED", jobs
    assert "interrupted: sweep submit got Ctrl-C while the job ran" in jobs[first["run_id"]]["error"]
    assert check_left(tmp_path / os.path.dirname(first["trace"]), first["run_id"], out) == "recovered interrupted"
    assert check_left(tmp_path / os.path.dirname(second["trace"]), second["run_id"], out) == "nothing"
    assert not (tmp_path / second["log"]).exists() or "started" not in (tmp_path / second["log"]).read_text()
