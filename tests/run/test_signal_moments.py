"""Hardening: SIGINT, SIGTERM and SIGHUP to ``mpiexec`` at random moments of ``fourd-mpi run`` (2 ranks, two part
files). Each moment is drawn from a seeded RNG after one of three states (the ranks' handlers in place, every
rank past its first step, every rank past its last step), up to a little after the measured run would end.
Never a traceback or a crash, never a hidden temporary file; the results directory holds a complete indexed
trace, or per-rank files that ``trace recover`` turns into an ``interrupted`` trace, or nothing of the run.
SIGHUP kills Hydra's mpiexec, whose proxy then kills the ranks (SIGKILL): the run's sentinel records it."""

from __future__ import annotations

import json
import signal
import random
import subprocess
import sys

import pytest

from conftest import REPO, find_mpiexec, mpi_env, mpi_flavor
from fourd_mpi.trace.events import RANK_STEP_DTYPE
from moments import (SIGNALS, crashed, default_signals, hidden, ranks_ready, signal_at, steps_done, timeline,
                     wait_for)

TRIALS = 15
STEPS = 6
RUN = ["run", "--gx", "2", "--steps", str(STEPS), "--display", "quiet", "--peak-tflops", "1",
       "--trace-group-size", "1", "--run-id", "r"]


def start(results):
    cmd = [find_mpiexec(), "-n", "2", sys.executable, "-m", "fourd_mpi", *RUN, "--results-dir", str(results)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(), cwd=REPO,
                            preexec_fn=default_signals)


def fourd(*args):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          env=mpi_env(), cwd=REPO, timeout=300)


def states(results):
    spool = results / "r.ranks"
    return {"ready": lambda: True, "stepping": steps_done(spool, 2, 1, RANK_STEP_DTYPE.itemsize),
            "merging": steps_done(spool, 2, STEPS, RANK_STEP_DTYPE.itemsize)}


def outcome_of(results, why) -> str:
    """What the run left, checked (``why``: shown on a failure); ``complete``, ``recovered STATUS`` or
    ``nothing``. A spool left is recovered (``trace recover``), which also removes what a killed merge left."""
    trace, spool, index = results / "r.h5", results / "r.ranks", results / "index.jsonl"
    if spool.is_dir():
        rec = fourd("trace", "recover", spool)
        assert rec.returncode == 0 and crashed(rec.stderr) is None, (why, rec.stdout, rec.stderr)
        assert hidden(results) == [], (why, hidden(results))
        status = rec.stdout.split("status ", 1)[1].split(",")[0]
        assert status == "interrupted", (why, rec.stdout)
        return f"recovered {status}"
    assert hidden(results) == [], (why, hidden(results))
    if trace.exists():
        show = fourd("trace", "show", trace)
        assert show.returncode == 0 and "status complete" in show.stdout, (why, show.stdout, show.stderr)
        lines = [json.loads(line) for line in index.read_text().splitlines()] if index.exists() else []
        assert [(e["run_id"], e["status"]) for e in lines] == [("r", "complete")], (why, lines)
        return "complete"
    assert not (results / "r.parts").exists() and not index.exists(), (why, sorted(p.name for p in results.iterdir()))
    return "nothing"


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
        try:
            if ranks_ready(proc, 2) and wait_for(states(results)[anchor], proc):
                signal_at(proc, proc.pid, sig, moment)
            _, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        why += f"; exit {proc.returncode}: {err}"
        assert crashed(err) is None, why
        outcome = outcome_of(results, why)
        # 128 + signal: every rank ended by its handler; -SIGHUP: mpiexec itself (Hydra has no handler for it)
        expected = {0, -sig} if sig == signal.SIGHUP else {0, 128 + sig}
        if outcome != "complete":
            expected.discard(0)
        assert proc.returncode in expected, why
        seen[(sig.name, proc.returncode, outcome)] = seen.get((sig.name, proc.returncode, outcome), 0) + 1
    assert any(outcome.startswith("recovered") for _, _, outcome in seen), seen
