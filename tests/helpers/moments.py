"""Signals at random moments of a command: what the randomized signal tests share.

A test measures how long its command takes once (:func:`measure`), then starts it again and again,
each time sending one of SIGINT, SIGTERM and SIGHUP at a moment drawn from a seeded
:class:`random.Random` over the command's whole life (from the moment the target catches the signal,
a state read from /proc, not a delay), and checks what every outcome must be: no traceback, no crash,
no hidden temporary file, and a trace or spool that is complete or recoverable.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from conftest import caught_signals

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: what a crash looks like on stderr (a rank's own message, Hydra's report of a rank's death)
CRASH_WORDS = ("Traceback", "Exception ignored", "Segmentation fault", "signal 11", "core dumped",
               "Fatal Python error", "SIGSEGV", "signal 6", "(Aborted)")


def default_signals() -> None:
    """In the child (``preexec_fn``): the handled signals at their default disposition, whatever this test runner
    inherited (a shell's background job ignores SIGINT, nohup SIGHUP, and an ignored signal stays ignored)."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def wait_caught(pid: int, proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 120) -> bool:
    """Wait until ``pid`` catches ``sig`` (its handlers are in place); False if ``proc`` ended first."""
    deadline = time.monotonic() + timeout
    while not caught_signals(pid) & (1 << (sig - 1)):
        if proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, f"pid {pid} did not catch {signal.Signals(sig).name}"
        time.sleep(0.002)
    return True


def signal_at(proc: subprocess.Popen, pid: int, sig: int, moment: float) -> None:
    """Send ``sig`` to ``pid`` ``moment`` seconds from now, unless ``proc`` ended before."""
    start = time.monotonic()
    while proc.poll() is None and time.monotonic() - start < moment:
        time.sleep(0.002)
    if proc.poll() is None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def signalled(proc: subprocess.Popen, fire: Callable[[], None], timeout: float = 300) -> str:
    """``fire()`` (which waits for a state and sends the signal), then the command's end: its stderr. The
    command is killed if it is still alive when anything here fails."""
    try:
        fire()
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return err


def hidden(directory: Path, allowed=()) -> List[str]:
    """Every name under ``directory`` (recursively) that starts with ``.`` or holds ``.tmp-`` (temporary files,
    staged part directories, set-aside old parts), except the names in ``allowed``."""
    found = []
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            if (name.startswith(".") or ".tmp-" in name) and name not in allowed:
                found.append(os.path.relpath(os.path.join(root, name), directory))
    return sorted(found)


def crashed(text: str) -> Optional[str]:
    """The first :data:`CRASH_WORDS` in ``text``, or None."""
    return next((word for word in CRASH_WORDS if word in text), None)


def timeline(proc: subprocess.Popen, states: Dict[str, Callable[[], bool]], timeout: float = 600) -> Dict[str, float]:
    """Seconds from now at which each of ``states`` (polled every few milliseconds) first held, and ``"end"``: when
    ``proc`` ended (it must succeed). A state never seen is absent."""
    began, seen = time.monotonic(), {}
    while proc.poll() is None:
        for name, holds in states.items():
            if name not in seen and holds():
                seen[name] = time.monotonic() - began
        assert time.monotonic() - began < timeout, "the measured command did not end"
        time.sleep(0.003)
    seen["end"] = time.monotonic() - began
    out, err = proc.communicate()
    assert proc.returncode == 0, (out, err)
    return seen


def wait_for(holds: Callable[[], bool], proc: subprocess.Popen, timeout: float = 300) -> bool:
    """Wait until ``holds()``; False if ``proc`` ended first."""
    deadline = time.monotonic() + timeout
    while not holds():
        if proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, "the state waited for did not come"
        time.sleep(0.003)
    return True


def steps_done(spool: Path, ranks: int, steps: int, record_size: int) -> Callable[[], bool]:
    """A state: every rank of ``spool`` has at least ``steps`` step records on disk."""
    def holds() -> bool:
        try:
            return all(os.stat(spool / f"rank{r:06d}.steps").st_size >= steps * record_size for r in range(ranks))
        except OSError:
            return False
    return holds


def children(pid: int) -> List[int]:
    """The pids whose parent is ``pid`` (/proc/PID/task/*/children)."""
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                found += [int(word) for word in fh.read().split()]
    except OSError:
        pass
    return found


def descendants(pid: int) -> List[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def ranks_ready(proc: subprocess.Popen, ranks: int, timeout: float = 120) -> bool:
    """Wait until ``ranks`` processes of ``python -m fourd_mpi`` under ``proc`` (an ``mpiexec``) catch SIGTERM (the
    command's handlers are in place: before that, Python's own start-up turns a Ctrl-C into its traceback);
    False if ``proc`` ended first."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            return False
        pids = [pid for pid in descendants(proc.pid) if "fourd_mpi" in cmdline(pid).split()]  # not its sentinel
        if len(pids) >= ranks and all(caught_signals(pid) & (1 << (signal.SIGTERM - 1)) for pid in pids):
            return True
        assert time.monotonic() < deadline, f"{ranks} ranks did not start under pid {proc.pid}"
        time.sleep(0.005)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def fourd(*args, cwd=None) -> subprocess.CompletedProcess:
    """``python -m fourd_mpi ARGS`` (one process)."""
    from conftest import REPO, mpi_env

    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          env=mpi_env(), cwd=cwd or REPO, timeout=300)


def check_left(results: Path, run_id: str, why: str, allowed=()) -> str:
    """What an interrupted run left in ``results``, checked (``why``: shown on a failure); returns ``complete`` (its
    trace complete and indexed), ``recovered STATUS`` (its per-rank files, which ``trace recover`` merges) or
    ``nothing`` (no file of the run). No hidden file is there (but ``allowed``), before or after the recovery."""
    trace, spool, index = results / f"{run_id}.h5", results / f"{run_id}.ranks", results / "index.jsonl"
    def indexed():
        lines = [json.loads(line) for line in index.read_text().splitlines()] if index.exists() else []
        return [(e["run_id"], e["status"]) for e in lines if e["run_id"] == run_id]

    entries = indexed()
    if spool.is_dir():
        sentinels_gone(spool)
    if results.exists():  # an interrupted merge removed its temporaries (a run ended by the launcher: its sentinel)
        assert hidden(results, allowed) == [], (why, hidden(results, allowed))
    if spool.is_dir():
        rec = fourd("trace", "recover", spool)
        assert rec.returncode == 0 and crashed(rec.stderr) is None, (why, rec.stdout, rec.stderr)
        if "are left over" in rec.stdout:  # the run published its trace, then was ended before removing them
            outcome = "complete"
            assert f"{trace}: status complete" in rec.stdout, (why, rec.stdout)
            entries = indexed()
        else:
            outcome = "recovered " + rec.stdout.split("status ", 1)[1].split(",")[0]
            assert indexed() == [(run_id, outcome.split()[1])], (why, indexed())
    elif trace.exists():
        outcome = "complete"
    else:
        outcome = "nothing"
        assert not (results / f"{run_id}.parts").exists() and not entries, \
            (why, sorted(os.listdir(results)) if results.exists() else None)
    if outcome == "complete":
        show = fourd("trace", "show", trace)
        assert show.returncode == 0 and "status complete" in show.stdout, (why, show.stdout, show.stderr)
        assert entries == [(run_id, "complete")], (why, entries)
    if results.exists():
        assert hidden(results, allowed) == [], (why, hidden(results, allowed))
    return outcome


def sentinels_gone(spool: Path, timeout: float = 60) -> None:
    """Wait until no sentinel of the run of ``spool`` (:mod:`fourd_mpi.run.sentinel`, which outlives the ranks to
    write their record when mpiexec ended first) runs any more: its record is then on disk."""
    deadline = time.monotonic() + timeout
    while True:
        running = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            words = cmdline(int(entry)).split()
            if "fourd_mpi.run.sentinel" in words:
                where = words[words.index("fourd_mpi.run.sentinel") + 1]
                try:
                    where = os.path.join(os.readlink(f"/proc/{entry}/cwd"), where)
                except OSError:
                    continue
                if os.path.realpath(where) == os.path.realpath(spool):
                    running.append(int(entry))
        if not running:
            return
        assert time.monotonic() < deadline, f"the sentinels {running} of {spool} did not end"
        time.sleep(0.01)
