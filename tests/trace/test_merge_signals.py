"""Hardening: SIGINT, SIGTERM and SIGHUP at random moments of the final merge of a multi-part trace (3 ranks, one
part file each, staged in a hidden directory next to the trace until published), sent to ``mpiexec`` (which
forwards SIGINT and SIGTERM to every rank and dies of SIGHUP, its proxy then killing the ranks), to rank 0 (the
writer of the top-level file) or to rank 2 (the writer of a part). Each moment is drawn from a seeded RNG after
every rank has spooled its last step, up to a little after the measured merge would end. The merge publishes a
complete trace, indexed, with its spool removed, or leaves the spool for ``trace recover`` (an ``interrupted``
trace); never a traceback, a crash, or a hidden temporary file or parts directory once recovered."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys

import pytest

from conftest import REPO, find_mpiexec, mpi_env, mpi_flavor
from fourd_mpi.trace.events import RANK_STEP_DTYPE
from moments import SIGNALS, check_left, crashed, default_signals, signal_at, steps_done, timeline, wait_for

TRIALS = 12
STEPS = 4
RANKS = 3
RUN = ["run", "--gdata", str(RANKS), "--batch", "6", "--steps", str(STEPS), "--display", "quiet", "--peak-tflops",
       "1", "--trace-group-size", "1", "--run-id", "m"]


def start(results):
    cmd = [find_mpiexec(), "-n", str(RANKS), sys.executable, "-m", "fourd_mpi", *RUN, "--results-dir", str(results)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(), cwd=REPO,
                            preexec_fn=default_signals)


def merging(results):
    return steps_done(results / "m.ranks", RANKS, STEPS, RANK_STEP_DTYPE.itemsize)


def rank_pid(results, rank: int) -> int:
    return json.loads((results / "m.ranks" / f"rank{rank:06d}.json").read_text())["pid"]


@pytest.mark.mpi
def test_a_signal_at_any_moment_of_the_final_merge(tmp_path):
    if mpi_flavor() != "mpich":
        pytest.skip("the moments are drawn over Hydra's forwarding of signals to the ranks")
    rng = random.Random(5)
    proc = start(tmp_path / "measure")
    at = timeline(proc, {"merging": merging(tmp_path / "measure")})
    window = at["end"] - at["merging"]
    seen = {}
    for i in range(TRIALS):
        results = tmp_path / f"t{i}"
        sig = SIGNALS[i % 3]
        target = ("mpiexec", "rank 0", "rank 2")[i // 3 % 3]  # every pair of signal and target
        moment = rng.uniform(0, window * 1.2)
        why = f"trial {i}: {sig.name} to {target} {moment:.3f} s into the merge (measured {window:.3f} s)"
        proc = start(results)
        try:
            if wait_for(merging(results), proc):
                pid = proc.pid if target == "mpiexec" else rank_pid(results, int(target[-1]))
                signal_at(proc, pid, sig, moment)
            _, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        why += f"; exit {proc.returncode}: {err}"
        assert crashed(err) is None, why
        outcome = check_left(results, "m", why)
        if outcome != "complete":
            assert outcome == "recovered interrupted", why
        if sig == signal.SIGHUP and target == "mpiexec":
            expected = {-sig}  # Hydra has no handler for it
        else:
            expected = {128 + sig}
        if outcome == "complete":
            expected.add(0)
        assert proc.returncode in expected, why
        key = (sig.name, target, proc.returncode, outcome)
        seen[key] = seen.get(key, 0) + 1
        print(i, key, f"{moment:.3f}/{window:.3f}", flush=True)
    assert any(outcome.startswith("recovered") for *_, outcome in seen), seen
