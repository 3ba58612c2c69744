"""SIGINT, SIGTERM and SIGHUP to ``mpiexec`` at random moments of ``fourd-mpi run`` (2 ranks, two part
files). Each moment is drawn from a seeded RNG after one of three states (the ranks' handlers in place, every
rank past its first step, every rank past its last step), up to a little after the measured run would end.
Never a traceback or a crash, never a hidden temporary file; the results directory holds a complete indexed
trace, or per-rank files that ``trace recover`` turns into an ``interrupted`` trace, or nothing of the run.
SIGHUP kills Hydra's mpiexec, whose proxy then kills the ranks (SIGKILL): the run's sentinel records it."""

from __future__ import annotations

import random
import signal
import subprocess
import sys

import pytest
from conftest import REPO, find_mpiexec, mpi_env, mpi_flavor
from moments import (
    SIGNALS,
    check_left,
    crashed,
    default_signals,
    ranks_ready,
    signal_at,
    signalled,
    steps_done,
    timeline,
    wait_for,
)

from fourd_mpi.trace.events import RANK_STEP_DTYPE

TRIALS = 12
STEPS = 6
RUN = ["run", "--gx", "2", "--steps", str(STEPS), "--display", "quiet", "--peak-tflops", "1",
       "--trace-group-size", "1", "--run-id", "r"]


def start(results):
    cmd = [find_mpiexec(), "-n", "2", sys.executable, "-m", "fourd_mpi", *RUN, "--results-dir", str(results)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(), cwd=REPO,
                            preexec_fn=default_signals)


def states(results):
    spool = results / "r.ranks"
    return {"ready": lambda: True, "stepping": steps_done(spool, 2, 1, RANK_STEP_DTYPE.itemsize),
            "merging": steps_done(spool, 2, STEPS, RANK_STEP_DTYPE.itemsize)}


@pytest.mark.mpi
def test_a_signal_at_any_moment_of_run(tmp_path):
    if mpi_flavor() != "mpich":
        pytest.skip("the moments are drawn over Hydra's forwarding of signals to the ranks")
    rng = random.Random(11)
    proc = start(tmp_path / "measure")
    assert ranks_ready(proc, 2), proc.communicate()
    at = timeline(proc, states(tmp_path / "measure"))
    seen = {}
    for i in range(TRIALS):
        results = tmp_path / f"t{i}"
        sig = SIGNALS[i % 3]
        anchor = rng.choice(("ready", "stepping", "merging"))
        moment = rng.uniform(0, (at["end"] - at[anchor]) * 1.1)
        why = f"trial {i}: {sig.name} {moment:.2f} s after {anchor} (measured {at})"
        proc = start(results)

        def fire():
            if ranks_ready(proc, 2) and wait_for(states(results)[anchor], proc):
                signal_at(proc, proc.pid, sig, moment)

        err = signalled(proc, fire)
        why += f"; exit {proc.returncode}: {err}"
        assert crashed(err) is None, why
        outcome = check_left(results, "r", why)
        if outcome.startswith("recovered"):
            assert outcome == "recovered interrupted", why
        # 128 + signal: every rank ended by its handler; -SIGHUP: mpiexec itself (Hydra has no handler for it)
        expected = {0, -sig} if sig == signal.SIGHUP else {0, 128 + sig}
        if outcome != "complete":
            expected.discard(0)
        assert proc.returncode in expected, why
        seen[(sig.name, proc.returncode, outcome)] = seen.get((sig.name, proc.returncode, outcome), 0) + 1
    assert any(outcome.startswith("recovered") for _, _, outcome in seen), seen
