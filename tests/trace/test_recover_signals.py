"""SIGINT, SIGTERM and SIGHUP at many moments of ``trace recover`` (its HDF5 writes
included: the writer holds them back around each HDF5 call, then exits with one line and status 128 +
signal, its temporary file removed); never a crash, a traceback or a hidden temporary file; a recovery
that ends adds its run to the index."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, caught_signals, mpi_env

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)




@pytest.fixture(scope="module")
def spool(tmp_path_factory):
    """The per-rank files of a run killed (SIGKILL) at step 60: a recovery of a few hundred KiB of events."""
    where = tmp_path_factory.mktemp("killed")
    proc = subprocess.run([sys.executable, "-m", "fourd_mpi", "run", "--steps", "80", "--results-dir", str(where),
                           "--run-id", "k", "--display", "quiet", "--inject-fault", "0:60:kill"],
                          capture_output=True, text=True, env=mpi_env(), cwd=REPO, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return where / "k.ranks"


def test_recover_adds_the_run_to_the_index(tmp_path, spool):
    """Before: the recovered run was in no index (results/index.jsonl)."""
    shutil.copytree(spool, tmp_path / "k.ranks")
    done = subprocess.run([sys.executable, "-m", "fourd_mpi", "trace", "recover", str(tmp_path / "k.ranks")],
                          capture_output=True, text=True, env=mpi_env(), cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in (tmp_path / "index.jsonl").read_text().splitlines()]
    assert [(e["run_id"], e["status"]) for e in lines] == [("k", "partial")], lines


def default_signals() -> None:
    """In the child: the handled signals at their default disposition, whatever this test runner inherited (a
    shell's background job ignores SIGINT, nohup SIGHUP, and an ignored signal stays ignored in the command)."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def test_a_signal_at_any_moment_of_recover(tmp_path, spool):
    """30 tries: each signal of the three, at a random moment between the child's handlers being in place
    (it catches SIGTERM, see tests/cli/test_messages.py) and a little after a whole recovery would end.
    Before: SIGSEGV 3 times in about 110 Ctrl-C."""
    rng = random.Random(7)
    start = time.monotonic()
    trial = tmp_path / "measure"
    shutil.copytree(spool, trial / "k.ranks")
    subprocess.run([sys.executable, "-m", "fourd_mpi", "trace", "recover", str(trial / "k.ranks")], env=mpi_env(),
                   cwd=REPO, capture_output=True, timeout=300, check=True)
    whole = time.monotonic() - start
    seen = {}
    for i in range(30):
        work = tmp_path / f"w{i}"
        shutil.copytree(spool, work / "k.ranks")
        sig = SIGNALS[i % 3]
        proc = subprocess.Popen([sys.executable, "-m", "fourd_mpi", "trace", "recover", str(work / "k.ranks")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(), cwd=REPO,
                                preexec_fn=default_signals)
        while proc.poll() is None and not caught_signals(proc.pid) & (1 << (signal.SIGTERM - 1)):
            time.sleep(0.001)
        ready = time.monotonic()
        moment = rng.uniform(0, whole * 1.1)
        while proc.poll() is None and time.monotonic() - ready < moment:
            time.sleep(0.002)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
        seen[(sig.name, proc.returncode)] = seen.get((sig.name, proc.returncode), 0) + 1
        # 128 + signal from the command's own handling, never -signal: a Ctrl-C that came while a lazy import
        # built a dataclass or namedtuple (code run from a string) made CPython end the process by SIGINT after
        # the one line (tests/cli/test_interrupt_exit.py); the entry point clears that note now
        assert proc.returncode in (0, 128 + sig), (sig.name, moment, proc.returncode, err)
        assert "Traceback" not in err and "Exception ignored" not in err, err
        assert len(err.strip().splitlines()) <= 1, err
        hidden = sorted(p.name for p in work.iterdir() if p.name.startswith("."))
        assert hidden == [], (sig.name, moment, hidden)
        if proc.returncode == 0:
            assert (work / "k.h5").exists() and (work / "index.jsonl").exists()
        else:
            assert f"interrupted ({'Ctrl-C' if sig == signal.SIGINT else sig.name})" in err, err
            assert (work / "k.ranks").is_dir()  # the per-rank files stay for another try
        shutil.rmtree(work)
    assert any(code != 0 for _, code in seen), seen  # some signals came while it worked
