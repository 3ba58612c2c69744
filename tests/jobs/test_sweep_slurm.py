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
    done = fourd(["sweep", "render", "spec.yaml", "--site", "slurm", "--python", sys.executable, "--out", sweep_dir],
                 tmp_path, env)
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
        assert status.returncode == 0, status.stdout + status.stderr + "".join(
            p.read_text() for p in (tmp_path / sweep_dir / "logs").glob("*.out"))
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
    """Transactional submission on a real Slurm: two ``sweep submit`` at once. Before, both ran sbatch for every
    run (4 jobs for 2 runs) and each rewrote jobs.json; now each run is claimed under the lock first."""
    env = {**mpi_env(), **{"SLURM_CONF": str(slurm.conf)}}
    (tmp_path / "spec.yaml").write_text(TWO.format(name="twice"))
    sweep_dir = "jobscripts/twice"
    done = fourd(["sweep", "render", "spec.yaml", "--site", "slurm", "--python", sys.executable, "--out", sweep_dir],
                 tmp_path, env)
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
    done = fourd(["sweep", "render", "spec.yaml", "--site", "slurm", "--partition", "nosuchpartition", "--out",
                  sweep_dir], tmp_path, env)
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


# -- job packing -------------------------------------------------------------

#: four runs (1, 1, 2, 2 ranks); the second of each rank count fails at start: its memory limit
#: (1 KiB) is below any model's estimate, a value the spec accepts and `fourd-mpi run` refuses
PACKED = """\
name: {name}
study: strong
ranks: [1, 2]
grids: {{1: [1x1x1x1], 2: [1x1x1x2]}}
model: {{preset: gpt-tiny, batch: 4}}
options: {{steps: 2, warmup: 0, trace_level: step}}
matrix: {{memory_limit: [0, 1KiB]}}
job: {{time: "00:05:00"}}
"""
GOOD, BAD = ("000-n1-1x1x1x1", "002-n2-1x1x1x2"), ("001-n1-1x1x1x1", "003-n2-1x1x1x2")


def _wait_for_queue(slurm, env, timeout=300):
    deadline = time.monotonic() + timeout
    while subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, slurm.logs()
        time.sleep(1)


@pytest.mark.parametrize("mode,pack", [("sequential", 4), ("concurrent", 4), ("array", 2)])
def test_packed_runs_in_one_allocation_are_tracked_one_by_one(slurm, tmp_path, mode, pack):
    """4 runs in one Slurm job (array: 2 arrays of 2 tasks, one per shape), one run of each shape failing:
    every run has its own log and exit-status file, status reports the failed runs FAILED and the others
    COMPLETED, the pack job fails; concurrent steps run side by side (srun never waits for a busy node);
    --resubmit-failed submits the failed runs only, inside their pack (script arguments, or --array=K)."""
    env = {**mpi_env(), **{"SLURM_CONF": str(slurm.conf)}}
    name = f"pk-{mode}"
    (tmp_path / "spec.yaml").write_text(PACKED.format(name=name))
    sweep_dir = f"jobscripts/{name}"
    done = fourd(["sweep", "render", "spec.yaml", "--site", "slurm", "--python", sys.executable, "--pack", str(pack),
                  "--pack-mode", mode, "--out", sweep_dir], tmp_path, env)
    assert done.returncode == 0, done.stderr
    done = fourd(["sweep", "submit", sweep_dir], tmp_path, env)
    assert done.returncode == 0 and "4 submitted" in done.stdout, done.stdout + done.stderr + slurm.logs()
    jobs = json.loads((tmp_path / sweep_dir / "jobs.json").read_text())
    ids = {run_id[len(name) + 1:]: job["job_id"] for run_id, job in jobs.items()}
    if mode == "array":  # two arrays (one per shape), task K = run K of its pack
        assert re.fullmatch(r"\d+_0", ids[GOOD[0]]) and ids[BAD[0]] == ids[GOOD[0]][:-1] + "1", ids
        assert ids[GOOD[1]] != ids[GOOD[0]] and ids[BAD[1]] == ids[GOOD[1]][:-1] + "1", ids
    else:
        assert len(set(ids.values())) == 1, ids  # one job
    _wait_for_queue(slurm, env)
    logs = tmp_path / sweep_dir / "logs"
    everything = "".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(logs.iterdir()))
    status = fourd(["sweep", "status", sweep_dir], tmp_path, env)
    rows = {line.split()[0][len(name) + 1:]: line.split() for line in status.stdout.splitlines()
            if line.startswith(name + "-")}
    assert status.returncode == 1 and "2/4 traces complete, 2 jobs failed" in status.stdout, status.stdout + everything
    for run in GOOD:
        assert rows[run][-2:] == ["COMPLETED", "complete"], status.stdout
        assert f"trace: results/{name}/slurm/{name}-{run}.h5" in (logs / f"{name}-{run}.out").read_text()
        assert (logs / f"{name}-{run}.status").read_text().split() == ["0", ids[run]]
    for run in BAD:
        assert rows[run][-2:] == ["FAILED", "missing"], status.stdout
        assert "--memory-limit" in (logs / f"{name}-{run}.out").read_text()
        assert (logs / f"{name}-{run}.status").read_text().split() == ["2", ids[run]]
    assert "step creation temporarily disabled" not in everything  # steps of a concurrent pack never wait
    if mode != "array":
        pack_log = (logs / "pack-000.out").read_text()
        assert "2 of 4 runs failed" in pack_log, everything
        state = subprocess.run(["scontrol", "show", "job", "-o", ids[GOOD[0]]], env=env, capture_output=True,
                               text=True).stdout
        assert "JobState=FAILED" in state and "ExitCode=1:0" in state, state  # the pack job reports the failure
    if mode == "concurrent":  # all four started before any ended
        events = [line.split()[4] for line in pack_log.splitlines() if " started at " in line or " ended " in line]
        assert events[:4] == ["started"] * 4, pack_log
    if mode == "sequential":  # one after another, the failed ones in the middle did not stop the rest
        order = [line.split()[3][len(name) + 1:] for line in pack_log.splitlines() if " started at " in line]
        assert order == [GOOD[0], BAD[0], GOOD[1], BAD[1]], pack_log

    if mode == "concurrent":  # selects the runs to retry as sequential does (the pack script's arguments)
        return
    again = fourd(["sweep", "submit", sweep_dir, "--resubmit-failed"], tmp_path, env)
    assert again.returncode == 0 and "2 submitted" in again.stdout and again.stdout.count("skip ") == 2, again.stdout
    _wait_for_queue(slurm, env)
    retried = json.loads((tmp_path / sweep_dir / "jobs.json").read_text())
    for run in GOOD:  # untouched: same job, same status file
        assert retried[f"{name}-{run}"]["job_id"] == ids[run]
        assert (logs / f"{name}-{run}.status").read_text().split() == ["0", ids[run]]
    for run in BAD:  # run again (and failed again) in a new job of its pack
        new = retried[f"{name}-{run}"]["job_id"]
        assert new != ids[run] and (logs / f"{name}-{run}.status").read_text().split() == ["2", new]
    status = fourd(["sweep", "status", sweep_dir], tmp_path, env)
    assert "2/4 traces complete, 2 jobs failed" in status.stdout, status.stdout


def test_slurm_sweep_after_a_local_one_without_an_activated_environment(slurm, tmp_path):
    """From a shell with only the ``fourd-mpi`` console script on PATH (no venv activated),
    a local sweep runs, then the same spec rendered for the slurm site (no --python) is submitted for real:
    its runs are not skipped as "trace complete" (each site keeps results/SWEEP/SITE), and its jobs run the
    rendering environment's interpreter under srun."""
    bin_dir = tmp_path / "user-bin"
    bin_dir.mkdir()
    os.symlink(os.path.join(os.path.dirname(sys.executable), "fourd-mpi"), bin_dir / "fourd-mpi")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=os.pathsep.join([str(bin_dir), "/usr/local/bin", "/usr/bin", "/bin"]), SLURM_CONF=str(slurm.conf),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    (tmp_path / "spec.yaml").write_text(SPEC.replace("ranks: [1, 2, 4, 8]", "ranks: [1, 2]").replace(
        "grids: {1: [1x1x1x1], 2: [2x1x1x1], 4: [1x1x2x2], 8: [2x1x2x2]}", "grids: {1: [1x1x1x1], 2: [2x1x1x1]}"))

    def sh(command):
        return subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)

    local = sh("fourd-mpi sweep render spec.yaml && fourd-mpi sweep submit results/weak-slurm/local/jobs")
    assert local.returncode == 0 and "2 submitted" in local.stdout, local.stdout + local.stderr
    assert len(list((tmp_path / "results/weak-slurm/local").glob("*.h5"))) == 2
    done = sh("fourd-mpi sweep render spec.yaml --site slurm --out jobscripts/weak-slurm-cluster && "
              "fourd-mpi sweep submit jobscripts/weak-slurm-cluster")
    assert done.returncode == 0 and done.stdout.count("submitted weak-slurm-") == 2, done.stdout + done.stderr
    assert "trace complete" not in done.stdout
    _wait_for_queue(slurm, env)
    status = sh("fourd-mpi sweep status jobscripts/weak-slurm-cluster")
    logs = "".join(p.read_text() for p in (tmp_path / "jobscripts/weak-slurm-cluster/logs").glob("*.out"))
    assert "2/2 traces complete, 0 jobs failed" in status.stdout, status.stdout + logs + slurm.logs()
    assert len(list((tmp_path / "results/weak-slurm/slurm").glob("*.h5"))) == 2
    assert f"{os.path.dirname(sys.executable)}/python" in \
        (tmp_path / "jobscripts/weak-slurm-cluster/manifest.json").read_text()


GPU_SPEC = """\
name: gpu-bind
study: weak
ranks: [4, 8]
grids: {4: [1x1x2x2], 8: [1x2x2x2]}
model: {preset: gpt-tiny, batch: 8}
options: {steps: 2}
"""
#: each GPU site's wrapper, by site: the GPU of node-local rank 0, 1, ... (the sources are in the site files)
CLOSEST_GPU = {"perlmutter": ("CUDA_VISIBLE_DEVICES", [3, 2, 1, 0]), "alps": ("CUDA_VISIBLE_DEVICES", [0, 1, 2, 3]),
               "frontier": ("ROCR_VISIBLE_DEVICES", [4, 5, 2, 3, 6, 7, 0, 1])}


@pytest.mark.parametrize("site_name", sorted(CLOSEST_GPU))
def test_gpu_affinity_wrapper_under_srun_gives_each_local_rank_its_gpu(slurm, tmp_path, site_name):
    """The rendered gpu_affinity.sh, started by a real srun (which sets SLURM_LOCALID), one task per GPU of a
    node: each local rank sees exactly the GPU the site file names, and srun is given no per-task GPU binding."""
    import shlex

    from fourd_mpi.jobs.sites import load_site
    from fourd_mpi.jobs.spec import load_spec
    from fourd_mpi.jobs.sweep import build_manifest, write_sweep

    (tmp_path / "spec.yaml").write_text(GPU_SPEC)
    spec, site = load_spec(str(tmp_path / "spec.yaml")), load_site(site_name)
    spec.job["account"] = "proj1"
    manifest = build_manifest(spec, site, "spec.yaml", f"jobs/{site_name}", python="python3")
    write_sweep(manifest, spec, site, str(tmp_path / "jobs" / site_name))
    run = manifest["runs"][-1]
    launch = shlex.split((tmp_path / run["script"]).read_text().strip().splitlines()[-1])
    wrapper = next(a for a in launch if a.endswith("/gpu_affinity.sh"))
    launcher = launch[:launch.index(wrapper)]
    assert launcher[0] == "srun" and not any(a.startswith(("--gpus-per-task", "--gpu-bind")) for a in launcher)

    variable, order = CLOSEST_GPU[site_name]
    ranks = len(order)  # one node's worth: local ranks 0 .. gpus_per_node - 1
    env = {**mpi_env(), "SLURM_CONF": str(slurm.conf)}
    done = subprocess.run(["srun", "-N", "1", "-n", str(ranks), f"--ntasks-per-node={ranks}", wrapper,
                           "sh", "-c", f'echo "$SLURM_LOCALID ${variable}"'],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr + slurm.logs()
    seen = dict(tuple(map(int, line.split())) for line in done.stdout.splitlines())
    assert seen == {r: order[r] for r in range(ranks)}, done.stdout
