"""Test-only fault injection (``--inject-fault RANK:STEP[:MODE]``) as hooks of a run.

:class:`Fault` is the parsed option; :class:`Faults` the hooks a run calls at its fixed points: before each step
(:meth:`Faults.before_step`), inside the final merge once the trace's temporary files exist
(:attr:`Faults.in_merge`, :func:`fourd_mpi.trace.merge.merge_run`'s ``after_open``) and on rank 0 right after
the trace is published and indexed (:meth:`Faults.after_published`). Built once per run by :meth:`Faults.of`;
without ``--inject-fault`` (production) every hook does nothing and the merge gets no hook (so no barrier of
its own). The tests that use them: ``tests/run/test_interrupt.py``, ``tests/trace/test_io_faults.py``,
``tests/trace/test_spool_faults.py``, ``tests/trace/test_merge_signals.py``.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from typing import Callable, Optional

from fourd_mpi.errors import ConfigError

FAULT_MODES = ("kill", "raise", "remove-spool", "fill-disk", "touch", "sigterm", "stop", "sigterm-merge",
               "kill-merge", "sigterm-published", "kill-published")
#: modes that act during the final merge, once the trace's temporary files exist, or (``*-published``, rank 0
#: only) right after its publication and index line (STEP must be --steps)
MERGE_FAULTS = ("sigterm-merge", "kill-merge", "sigterm-published", "kill-published")
PUBLISHED_FAULTS = ("sigterm-published", "kill-published")
#: the file ``touch`` creates in the results directory
TOUCH_NAME = "inject-fault.touch"
#: ``fill-disk`` fills only a file system smaller than this (a tmpfs made for the test), never a real disk
FILL_DISK_MAX_BYTES = 1 << 30


@dataclass(frozen=True)
class Fault:
    """Testing aid: at the start of step ``step`` (``step`` = the number of steps: after the last step,
    before the final merge) rank ``rank`` fails (``kill``: SIGKILL; ``raise``: exception), deletes the
    spool directory (``remove-spool``) or fills the file system of the results directory with
    ``<results-dir>/fill-disk.bin`` (``fill-disk``; only on one smaller than
    :data:`FILL_DISK_MAX_BYTES`, see :meth:`check`) or creates the empty file
    ``<results-dir>/inject-fault.touch`` (``touch``: a signal to a fault-injecting test file system,
    ``tests/helpers/faultfs.py``, which starts failing I/O when it sees that file created), or sends
    itself SIGTERM (``sigterm``: what ``scancel``, a time limit or ``kill`` does) or SIGSTOP (``stop``: the
    run stays live, its spool locked, until the test sends SIGCONT). The modes of
    :data:`MERGE_FAULTS` act inside the final merge instead (``step`` must be the number of steps),
    once every rank knows that the trace's temporary files exist: ``sigterm-merge`` (SIGTERM) and
    ``kill-merge`` (SIGKILL: the temporary files stay behind, as after a node failure); or, on rank 0, right
    after the trace is published and indexed, before the spool is removed: ``sigterm-published`` (held back
    until the end of the merge, then raised) and ``kill-published`` (the spool stays, left over).

    Every rank meets in a barrier first, so all steps before ``step`` are on disk on every rank.
    """

    rank: int
    step: int
    mode: str = "kill"

    @classmethod
    def parse(cls, text: str) -> "Fault":
        parts = text.split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            rank, step = int(parts[0]), int(parts[1])
            mode = parts[2] if len(parts) == 3 else "kill"
        except ValueError:
            raise ConfigError(f"--inject-fault expects RANK:STEP[:MODE], got {text!r}") from None
        if mode not in FAULT_MODES or rank < 0 or step < 0:
            raise ConfigError(f"--inject-fault {text!r}: rank and step >= 0, mode one of {', '.join(FAULT_MODES)}")
        return cls(rank, step, mode)

    def check(self, results_dir: str, steps: int) -> "Fault":
        """``fill-disk`` refuses a file system of :data:`FILL_DISK_MAX_BYTES` or more, a merge mode a step
        other than ``steps`` (same answer on every rank)."""
        if self.mode in MERGE_FAULTS and self.step != steps:
            raise ConfigError(f"--inject-fault {self.rank}:{self.step}:{self.mode} acts in the final merge: "
                              f"give STEP = --steps ({steps})")
        if self.mode in PUBLISHED_FAULTS and self.rank != 0:
            raise ConfigError(f"--inject-fault {self.rank}:{self.step}:{self.mode} acts where rank 0 publishes the "
                              "trace: give RANK 0")
        if self.mode == "fill-disk":
            where = os.path.abspath(results_dir)
            while not os.path.exists(where):
                where = os.path.dirname(where)
            st = os.statvfs(where)
            if st.f_blocks * st.f_frsize >= FILL_DISK_MAX_BYTES:
                raise ConfigError(f"--inject-fault {self.rank}:{self.step}:fill-disk fills the file system of "
                                  f"--results-dir; allowed only below {FILL_DISK_MAX_BYTES >> 20} MiB (a tmpfs "
                                  f"made for the test), {where} has {st.f_blocks * st.f_frsize >> 20} MiB")
        return self

    def trigger(self, spool_dir: str, results_dir: str) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        if self.mode in ("kill", "kill-merge", "kill-published"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        if self.mode in ("sigterm", "sigterm-merge", "sigterm-published"):
            signal.raise_signal(signal.SIGTERM)  # to this thread: the handler runs before the next line
            return
        if self.mode == "remove-spool":
            import shutil

            shutil.rmtree(spool_dir)
            return
        if self.mode == "fill-disk":
            block = bytes(1 << 16)
            with open(os.path.join(results_dir, "fill-disk.bin"), "ab", buffering=0) as fh:
                try:
                    while True:
                        fh.write(block)
                except OSError:
                    pass
            return
        if self.mode == "touch":
            os.close(os.open(os.path.join(results_dir, TOUCH_NAME), os.O_WRONLY | os.O_CREAT, 0o644))
            return
        raise RuntimeError(f"injected fault (--inject-fault {self.rank}:{self.step}:{self.mode})")


#: modes that act on the spool or the disk: every rank waits in a second barrier until the fault acted
SHARED_FAULTS = ("remove-spool", "fill-disk", "touch")


class Faults:
    """The hooks of a run without an injected fault (production): each does nothing.

    :attr:`in_merge` is None, so :func:`~fourd_mpi.trace.merge.merge_run` adds no barrier for it."""

    in_merge: Optional[Callable[[], None]] = None

    @staticmethod
    def of(fault: Optional[Fault], world, spool_dir: str, results_dir: str) -> "Faults":
        """The run's hooks: :class:`Faults` when ``fault`` is None, else :class:`InjectedFault` over ``world``."""
        return Faults() if fault is None else InjectedFault(fault, world, spool_dir, results_dir)

    def before_step(self, step: int) -> None:
        """At the start of step ``step`` (``step`` = the number of steps: after the last, before the merge)."""

    def after_published(self) -> None:
        """Rank 0, right after the trace is published and indexed, before the spool is removed."""


class InjectedFault(Faults):
    """The hooks of ``--inject-fault``: :class:`Fault` ``fault`` acts on its rank at its moment.

    Before a step it acts after a barrier of every rank of ``world`` (so every step before it is on disk on every
    rank), and the modes of :data:`SHARED_FAULTS` are followed by a second barrier (every rank goes on after the
    spool or the disk is gone). Collective over ``world`` at step ``fault.step``."""

    def __init__(self, fault: Fault, world, spool_dir: str, results_dir: str):
        self.fault, self.world, self.spool_dir, self.results_dir = fault, world, spool_dir, results_dir
        if fault.mode in MERGE_FAULTS and fault.mode not in PUBLISHED_FAULTS:
            self.in_merge = self._on_my_rank

    def _on_my_rank(self) -> None:
        if self.fault.rank == self.world.Get_rank():
            self.fault.trigger(self.spool_dir, self.results_dir)

    def before_step(self, step: int) -> None:
        if self.fault.step != step or self.fault.mode in MERGE_FAULTS:
            return
        self.world.Barrier()  # every rank has spooled the steps before: the test knows what survives
        self._on_my_rank()
        if self.fault.mode in SHARED_FAULTS:
            self.world.Barrier()  # every rank goes on after the spool or the disk is gone

    def after_published(self) -> None:
        if self.fault.mode in PUBLISHED_FAULTS:
            self.fault.trigger(self.spool_dir, self.results_dir)
