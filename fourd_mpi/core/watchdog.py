"""A watchdog for blocking MPI waits: a rank that waits too long says where and aborts the job.

A stopped or hung rank (a node that froze, a process stopped with SIGSTOP, ranks that run
different commands) leaves its partners waiting in a collective forever, and on a cluster the
whole allocation burns. Each rank runs one daemon thread; the main thread announces every
blocking wait it enters (:meth:`Watchdog.watch`: what it waits for, e.g. ``allreduce over x,
step 3, layer block0.fc2 (backward), collective #17 of the step``) and leaves it. When one wait
has lasted longer than ``timeout_s``, the thread prints one line on this rank (what, for how
long, the limit), calls ``on_hang`` (the run marks its spool ``hung``) and calls
``MPI_Abort``, so the launcher ends every rank and the scheduler frees the allocation.

Entering, leaving and judging a wait hold one lock, so a wait judged too long is marked
(:attr:`Watchdog.fired`) before the main thread can leave it: :meth:`Watchdog.hold_if_fired`, the
collective check before the final merge, sees every fire of every rank, and no wait is watched after
it (the merge's own collectives are not), so an aborted run never publishes a trace.

mpi4py releases the GIL inside blocking MPI calls, so the thread runs while the main thread
waits. The thread itself makes no MPI call but the final ``Abort`` (``MPI_THREAD_MULTIPLE``,
mpi4py's default; if the library gives less, the process exits right after).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Optional

#: seconds between a rank's last line and its MPI_Abort: the launcher kills every process at once, and a line
#: written just before is lost without a pause (about one in five 2-rank runs; the CLI's abort path uses it too)
ABORT_GRACE_S = 0.5


def check_timeout(value: float) -> float:
    """``--step-timeout``: zero (off) or a positive number of seconds; a :class:`ConfigError` otherwise."""
    from fourd_mpi.errors import ConfigError

    if not value >= 0:  # NaN too
        raise ConfigError(f"--step-timeout must be zero (off) or a positive number of seconds, got {value}")
    return float(value)


def seconds_text(value: float) -> str:
    """A wait in seconds, with the digits a short one needs ("0.0123 s", not "0 s")."""
    return f"{value:.0f} s" if value >= 10 else f"{value:.3g} s"


class Watchdog:
    """Per-rank watchdog of blocking waits (see the module doc); ``timeout_s <= 0`` disables it."""

    def __init__(self, timeout_s: float, rank: int, on_hang: Optional[Callable[[str], None]] = None,
                 abort: Optional[Callable[[int], None]] = None, poll_s: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.timeout_s = float(timeout_s)
        self._clock = clock  # seconds; a test passes its own to decide what "long" is without waiting
        self.rank = rank
        self.on_hang = on_hang
        self._abort = abort
        self._current = None  # (what, start) of the wait in progress, set and cleared by the main thread
        # held to enter or leave a wait and to decide that one lasted too long: a wait that the thread finds too
        # long is marked (``fired``) before the main thread can leave it, so :meth:`hold_if_fired`, reached only
        # after the wait, always sees the mark (before: a fire decided while the wait ended could be marked
        # after the ranks had agreed that none fired, and the merge published within the 0.5 s before Abort)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.fired: Optional[str] = None
        self._thread = None
        if self.timeout_s > 0:
            self._poll_s = poll_s if poll_s is not None else min(1.0, self.timeout_s / 10)
            self._thread = threading.Thread(target=self._run, name="fourd-mpi-watchdog", daemon=True)
            self._thread.start()

    @contextmanager
    def watch(self, what: str):
        """The main thread is about to block in MPI for ``what`` (a description, evaluated now)."""
        with self._lock:
            self._current = (what, self._clock())
        try:
            yield
        finally:
            with self._lock:
                self._current = None

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            with self._lock:  # the main thread cannot leave the wait while it is judged and marked
                current = self._current
                if current is None:
                    continue
                what, start = current
                waited = self._clock() - start
                if waited <= self.timeout_s:
                    continue
                self.fired = self._message(what, waited)
            self._fire()
            return

    def _message(self, what: str, waited: float) -> str:
        return (f"rank {self.rank} waited {seconds_text(waited)} in {what}, longer than --step-timeout "
                f"{self.timeout_s:g} s: a partner rank is stopped, hung or running another command; "
                "aborting the job")

    def _fire(self) -> None:
        """Say it (``fired``, marked already), record it (``on_hang``), abort the job."""
        message = self.fired
        sys.stderr.write(f"fourd-mpi: error: {message}\n")
        sys.stderr.flush()
        if self.on_hang is not None:
            try:
                self.on_hang(f"hung: {message}")
            except Exception:  # noqa: BLE001 - recording the hang must not stop the abort
                pass
        if self._abort is not None:
            self._abort(3)
            return
        time.sleep(ABORT_GRACE_S)
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(3)
        os._exit(3)  # pragma: no cover - Abort does not return

    def watching(self, what: str):
        """:meth:`watch` when enabled, else a context that does nothing (callers need not check)."""
        return self.watch(what) if self._thread is not None else contextlib.nullcontext()

    def hold_if_fired(self, world) -> None:
        """Collective over ``world``: when the watchdog of any rank has fired, never return (the firing rank
        aborts the job with status 3; this rank waits for that, then aborts itself), so that nothing of an
        aborted run is published as complete. Returns at once when no rank's watchdog fired (or none runs)."""
        if self._thread is None and self._abort is None:
            return
        if not world.allreduce(1 if self.fired else 0):
            return
        time.sleep(2.0)  # the firing rank's Abort normally ends this process first
        if self._abort is not None:
            self._abort(3)
            return
        world.Abort(3)
        os._exit(3)  # pragma: no cover - Abort does not return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
