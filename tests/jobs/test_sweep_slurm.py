"""End to end against a real Slurm on localhost: render, sbatch, poll, collect, scaling table.

Needs root and Debian's Slurm (``.ci/run`` installs it); elsewhere it skips with the reason,
except under ``CI=true``, where a missing Slurm is a failure.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import mpi_env
from localslurm import LocalSlurm, missing_programs

IN_CI = os.environ.get("CI", "").lower() == "true"


def _why_not() -> str:
    if os.geteuid() != 0:
        return "the local Slurm runs its daemons as root (SlurmUser=root); not root here"
    missing = missing_programs()
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurmctld slurmd slurm-client"
    return ""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = _why_not()
    if why:
        if IN_CI:
            pytest.fail(f"CI=true but no Slurm: {why}")
        pytest.skip(why)
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    yield cluster
    cluster.stop()


SPEC = """\
name: weak-slurm
study: weak
ranks: [1, 2, 4, 8]
grids: {1: [1x1x1x1], 2: [2x1x1x1], 4: [1x1x2x2], 8: [2x1x2x2]}
model: {preset: gpt-tiny, batch: 4}
weak: {grow: batch}
options: {steps: 4, warmup: 1, trace_level: layer}
job: {time: "00:05:00"}
"""


def fourd(args, cwd, env, timeout=120):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_weak_scaling_sweep_through_sbatch(slurm, tmp_path):
    env = {**mpi_env(), **{"SLURM_CONF": str(slurm.conf)}}
    (tmp_path / "spec.yaml").write_text(SPEC)
    sweep_dir = "jobscripts/weak-slurm"
    done = fourd(["sweep", "render", "spec.yaml", "--site", "slurm", "--python", sys.executable], tmp_path, env)
    assert done.returncode == 0, done.stderr
    done = fourd(["sweep", "submit", sweep_dir], tmp_path, env)
    assert done.returncode == 0, done.stderr + slurm.logs()
    assert done.stdout.count("submitted weak-slurm-") == 4
    jobs = json.loads((tmp_path / sweep_dir / "jobs.json").read_text())
    assert sorted(len(j["job_id"]) > 0 for j in jobs.values()) == [True] * 4

    # a second submit while jobs are queued or running, or done, submits nothing
    again = fourd(["sweep", "submit", sweep_dir], tmp_path, env)
    assert again.returncode == 0 and "0 submitted" in again.stdout, again.stdout

    deadline = time.monotonic() + 600
    while True:
        status = fourd(["sweep", "status", sweep_dir], tmp_path, env)
        assert status.returncode == 0, status.stdout + status.stderr + "".join(p.read_text() for p in (tmp_path / sweep_dir / "logs").glob("*.out"))
        # a job's trace is complete a moment before Slurm marks the job COMPLETED: wait for both
        if "4/4 traces complete" in status.stdout and status.stdout.count("COMPLETED") == 4:
            break
        assert "FAILED" not in status.stdout and "CANCELLED" not in status.stdout, (
            status.stdout + "".join(p.read_text() for p in (tmp_path / sweep_dir / "logs").glob("*.out")))
        assert time.monotonic() < deadline, status.stdout + slurm.logs()
        time.sleep(2)
    assert status.stdout.count("COMPLETED") == 4

    # the jobs really ran under Slurm: srun started every rank and the log names the job
    for run_id, job in jobs.items():
        log = (tmp_path / sweep_dir / "logs" / f"{run_id}.out").read_text()
        assert f"run {run_id} on" in log and "trace: results/weak-slurm/" in log, log

    again = fourd(["sweep", "submit", sweep_dir], tmp_path, env)
    assert "0 submitted" in again.stdout and again.stdout.count("trace complete") == 4

    collected = fourd(["sweep", "collect", sweep_dir, "--format", "csv"], tmp_path, env)
    assert collected.returncode == 0, collected.stderr
    import io

    import pandas as pd

    text = collected.stdout
    scaling_csv = text.split("\n\n")[1]
    table = pd.read_csv(io.StringIO(scaling_csv))
    assert list(table["world_size"]) == [1, 2, 4, 8]
    assert list(table["tokens_per_step"]) == [64, 128, 256, 512]  # 4 sequences x 16 tokens per rank
    assert table["efficiency"].iloc[0] == pytest.approx(1.0)
    assert (table["efficiency"] > 0).all() and table["step_median_s"].notna().all()
    expected = table["step_median_s"].iloc[0] / table["step_median_s"]
    assert table["efficiency"].to_numpy() == pytest.approx(expected.to_numpy(), rel=1e-3)


TWO = """\
name: {name}
study: strong
ranks: [1, 2]
grids: {{1: [1x1x1x1], 2: [1x1x1x2]}}
model: {{preset: gpt-tiny, batch: 4}}
options: {{steps: 2, warmup: 0, trace_level: step}}
job: {{time: "00:05:00"}}
"""


def test_concurrent_submits_through_sbatch_submit_each_job_once(slurm, tmp_path):
    """Issue 19 item 9 on a real Slurm: two ``sweep submit`` at once. Before, both ran sbatch for every
    run (4 jobs for 2 runs) and each rewrote jobs.json; now each run is claimed under the lock first."""
    env = {**mpi_env(), **{"SLURM_CONF": str(slurm.conf)}}
    (tmp_path / "spec.yaml").write_text(TWO.format(name="twice"))
    sweep_dir = "jobscripts/twice"
    done = fourd(["sweep", "render", "spec.yaml", "--site", "slurm", "--python", sys.executable], tmp_path, env)
    assert done.returncode == 0, done.stderr
    cmd = [sys.executable, "-m", "fourd_mpi", "sweep", "submit", sweep_dir]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    jobs = json.loads((tmp_path / sweep_dir / "jobs.json").read_text())
    ids = [j["job_id"] for j in jobs.values()]
    try:
        assert [p.returncode for p in procs] == [0, 0], outs
        assert "".join(o for o, _ in outs).count("submitted twice-") == 2, outs
        assert len(ids) == 2 and all(ids) and all(j["state"] == "PENDING" for j in jobs.values()), jobs
        known = subprocess.run(["scontrol", "show", "job", "-o"], env=env, capture_output=True, text=True).stdout
        names = re.findall(r"\bJobName=(twice-\S+)", known)
        assert sorted(names) == sorted(jobs), known  # one Slurm job per run, no duplicate
    finally:
        subprocess.run(["scancel", *[i for i in ids if i]], env=env, capture_output=True)


def test_a_failed_sbatch_is_recorded_failed_with_exit_1(slurm, tmp_path):
    """sbatch refuses the job (an unknown partition): before, the first refusal stopped the submit with
    its message and nothing was recorded; now every run is tried, recorded FAILED with sbatch's words,
    submit exits 1 and status exits 1."""
    env = {**mpi_env(), **{"SLURM_CONF": str(slurm.conf)}}
    (tmp_path / "spec.yaml").write_text(TWO.format(name="refused"))
    sweep_dir = "jobscripts/refused"
    done = fourd(["sweep", "render", "spec.yaml", "--site", "slurm", "--partition", "nosuchpartition"], tmp_path, env)
    assert done.returncode == 0, done.stderr
    done = fourd(["sweep", "submit", sweep_dir], tmp_path, env)
    assert done.returncode == 1 and "0 submitted, 2 failed" in done.stdout, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("fourd-mpi: error: sweep refused: ")]
    assert len(errors) == 2 and all("Invalid partition" in e for e in errors), done.stderr
    jobs = json.loads((tmp_path / sweep_dir / "jobs.json").read_text())
    assert sorted(j["state"] for j in jobs.values()) == ["FAILED", "FAILED"]
    assert all("partition" in j["error"].lower() for j in jobs.values()), jobs
    status = fourd(["sweep", "status", sweep_dir], tmp_path, env)
    assert status.returncode == 1 and "2 jobs failed" in status.stdout, status.stdout
