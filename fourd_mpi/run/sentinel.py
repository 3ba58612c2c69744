"""The record of a run whose launcher ended first: SIGHUP to Hydra's ``mpiexec`` (the terminal or the ssh
session of the run closed) or ``mpiexec`` killed.

Hydra's ``mpiexec`` forwards SIGINT and SIGTERM to every rank, which record ``interrupted`` in the spool
(:mod:`fourd_mpi.run.session`), but it has no handler for SIGHUP: it dies, and each ``hydra_pmi_proxy``,
seeing its control connection close, kills its ranks with SIGKILL at once (MPICH 5.0.2, ``pmip.c``). No
handler of a rank runs, so the spool would say nothing and ``trace recover`` would call the trace
``partial``.

So the first rank of a node that runs under a Hydra proxy whose parent is an ``mpiexec`` on this node that
SIGHUP would end starts a *sentinel* (:func:`start`): a small process in a session of its own (the proxy's
SIGKILL goes to the rank's process group only), which holds a pipe from the rank and a copy of the rank's
standard output and error. When the pipe closes, the sentinel knows whether the rank ended in order (it said
so, :data:`DONE`, as the last thing of every run: nothing to add) or was ended (the pipe closed with the rank);
then it looks at ``mpiexec``, waiting up to :data:`LAUNCHER_GRACE_S` for it to end (a dying ``mpiexec`` closes its
connections, so its proxy kills the ranks, before the kernel reports it gone):

- alive: the rank ended otherwise (it finished, failed, or was killed while the launcher lived: the
  OOM killer, ``kill -9``, ``MPI_Abort``); nothing to add. ``mpiexec`` cannot have ended in between: it
  waits for every proxy, and the proxy waits for the rank's output to close, which the sentinel still
  holds;
- gone: the launcher ended, and its proxy killed the ranks. That is also how Hydra ends a job one of whose
  ranks called ``MPI_Abort`` (it closes its connections to the proxies and exits): but a rank of this run
  aborts the job only after recording why in the spool. So unless some rank recorded a reason or the run's
  trace was published (its spool left over or removed), the sentinel writes the rank's
  ``rankNNNNNN.failed.json``: ``interrupted: SIGHUP to mpiexec ...``, and ``trace recover`` calls the trace
  ``interrupted``. (A rank killed on another node of a multi-node launch, by the OOM killer say, also makes
  ``mpiexec`` end the job without a report; its record then names a hang-up that was none.)

Then it exits. The rank tells it when the final merge starts, for the wording of the record, and the names of
the temporary file and staged parts directory that rank 0 created for the merge: when the launcher's end killed
the ranks in the merge, the sentinel removes them (a published trace has neither name any more).
Ranks on the other nodes of a multi-node launch start none: their proxy's parent is no ``mpiexec``, and the
record of the first node's ranks is the run's. Without Hydra, under ``nohup`` (SIGHUP ignored), or where
``mpiexec`` handles SIGHUP itself, nothing is started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Optional

#: names (``/proc/PID/comm``) of Hydra's proxy and of the launchers that start it
PROXY_NAMES = ("hydra_pmi_proxy",)
LAUNCHER_NAMES = ("mpiexec", "mpiexec.hydra", "mpirun")
#: what the rank writes into the pipe, one line each: its final merge starts; the names of the merge's
#: temporary file and staged parts directory (``t`` TMP ``\0`` STAGED, empty where none)
MERGING = b"m\n"
TEMPORARIES = b"t"
#: the rank's last line: the run ended on it in order (its spool closed, its communicators freed)
DONE = b"d\n"
#: how long a sentinel whose rank was ended waits for ``mpiexec`` to be reported gone: a dying process closes its
#: files (the proxy then kills the ranks at once) before the kernel marks it exited, and on a loaded machine that
#: gap was long enough for the sentinel to see a live ``mpiexec`` and record nothing (the trace said ``partial``)
LAUNCHER_GRACE_S = 5.0


def _stat_fields(pid: int):
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as fh:
        return fh.read().strip()


def _hangs_up(pid: int) -> bool:
    """True if SIGHUP would end ``pid`` (neither ignored nor caught: ``/proc/PID/status``)."""
    bit = 1 << (signal.SIGHUP - 1)
    with open(f"/proc/{pid}/status") as fh:
        masks = {line.split(":")[0]: int(line.split()[1], 16) for line in fh if line.startswith(("SigIgn", "SigCgt"))}
    return not (masks.get("SigIgn", 0) | masks.get("SigCgt", 0)) & bit


def hydra_launcher() -> Optional[int]:
    """The pid of the ``mpiexec`` on this node whose Hydra proxy is this process's parent, if SIGHUP would end
    it; else None (no Hydra, ``mpiexec`` on another node, SIGHUP ignored or handled)."""
    try:
        proxy = os.getppid()
        if _comm(proxy) not in PROXY_NAMES:
            return None
        launcher = int(_stat_fields(proxy)[1])
        if launcher <= 1 or _comm(launcher) not in LAUNCHER_NAMES or not _hangs_up(launcher):
            return None
        return launcher
    except (OSError, ValueError, IndexError):
        return None


class Sentinel:
    """The rank's end of the pipe to its sentinel process (:func:`start`)."""

    def __init__(self, fd: int, process: subprocess.Popen):
        self.fd, self.process = fd, process

    def merging(self) -> None:
        """The final merge starts (the record then says so)."""
        self._tell(MERGING)

    def temporaries(self, tmp_path: Optional[str], staged_dir: Optional[str]) -> None:
        """The names of the merge's temporary file and staged parts directory (created by rank 0 for this merge):
        the sentinel removes them if the launcher's end kills the ranks before the merge publishes or removes
        them itself."""
        self._tell(TEMPORARIES + os.fsencode(tmp_path or "") + b"\0" + os.fsencode(staged_dir or "") + b"\n")

    def _tell(self, line: bytes) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, line)
        except OSError:  # the sentinel is gone (killed): nothing to tell
            pass

    def close(self) -> None:
        """The run ended on this rank in an orderly way: the sentinel is told so (:data:`DONE`) and exits."""
        if self.fd is not None:
            self._tell(DONE)
            os.close(self.fd)
            self.fd = None


def start(spool_dir: str, rank: int, steps: int, record_size: int, local_rank: int) -> Optional[Sentinel]:
    """Start the sentinel of this rank when it is the first of its node (``local_rank`` 0) and runs under a Hydra
    ``mpiexec`` that SIGHUP would end (:func:`hydra_launcher`); None otherwise, or where it cannot start.
    ``steps``: the run's steps; ``record_size``: bytes of one step record (the step in progress is read from
    the size of ``rankNNNNNN.steps``)."""
    launcher = hydra_launcher() if local_rank == 0 else None
    if launcher is None:
        return None
    read, write = os.pipe()  # both ends close on exec: the sentinel gets the read end as its standard input
    try:
        process = subprocess.Popen([sys.executable, "-m", "fourd_mpi.run.sentinel", spool_dir, str(rank),
                                    str(launcher), str(steps), str(record_size)],
                                   stdin=read, start_new_session=True, close_fds=True)
    except OSError:
        os.close(write)
        return None
    finally:
        os.close(read)
    return Sentinel(write, process)


def _gone(pid: int) -> bool:
    """True if ``pid`` has exited (a zombie not yet reaped by its parent included)."""
    try:
        return _stat_fields(pid)[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def watch(spool_dir: str, rank: int, launcher: int, steps: int, record_size: int) -> int:
    """The sentinel: wait for the end of standard input (the rank's pipe), then record what :mod:`this module's
    <fourd_mpi.run.sentinel>` doc says. Returns the exit status (always 0)."""
    try:
        pidfd = os.pidfd_open(launcher)  # the launcher itself, whatever later takes its pid
    except (AttributeError, OSError):
        pidfd = None
    merging, done, temporaries, data = False, False, (None, None), b""
    while True:
        try:
            more = os.read(0, 4096)
        except InterruptedError:
            continue
        except OSError:
            break
        if not more:
            break
        data += more
        *lines, data = data.split(b"\n")
        for line in lines:
            merging = merging or line + b"\n" == MERGING
            done = done or line + b"\n" == DONE
            if line.startswith(TEMPORARIES):
                tmp, _, staged = line[len(TEMPORARIES):].partition(b"\0")
                temporaries = (os.fsdecode(tmp) or None, os.fsdecode(staged) or None)
    gone = False if done else _launcher_ends(launcher, pidfd, LAUNCHER_GRACE_S)
    devnull = os.open(os.devnull, os.O_WRONLY)  # let go of the rank's output: its proxy (and mpiexec) may end now
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    if not gone:
        return 0
    if any(temporaries):  # the merge's own (their names came from it): gone now, or kept by nobody
        from fourd_mpi.trace.merge import remove_merge_temporaries

        remove_merge_temporaries(*temporaries)
    from fourd_mpi.trace.files import PUBLISHED

    stem = os.path.join(spool_dir, f"rank{rank:06d}")
    if not os.path.exists(stem + ".steps") or os.path.exists(os.path.join(spool_dir, PUBLISHED)) or \
            _reported(spool_dir):
        return 0  # the trace is published (the spool left over or removed), or a rank said why the job ended
    try:
        done = os.stat(stem + ".steps").st_size // record_size
    except OSError:
        return 0
    if merging:
        when, kept = "during the final merge", "every step is"
    elif done >= steps:
        when, kept = "after the last step, before the final merge", "every step is"
    elif done == 0:
        when, kept = "before the first step or during it", "the steps before it are"
    else:
        when, kept = f"during step {done}", "the steps before it are"
    from fourd_mpi.trace.spool import write_failure

    write_failure(stem, rank, f"interrupted: {HANGUP_NAME} {when}; {kept} in {spool_dir} "
                              f"(fourd-mpi trace recover {spool_dir})")
    return 0


def _launcher_ends(launcher: int, pidfd: Optional[int], grace: float) -> bool:
    """Whether ``launcher`` is gone, or ends within ``grace`` seconds (its pidfd readable; without one, its state
    polled every 10 ms)."""
    if pidfd is not None:
        import select

        return bool(select.select([pidfd], [], [], grace)[0])
    import time

    deadline = time.monotonic() + grace
    while not _gone(launcher):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _reported(spool_dir: str) -> bool:
    """Whether any rank of the spool recorded why it stopped (``rankNNNNNN.failed.json``). ``mpiexec`` also ends
    first when a rank calls ``MPI_Abort``: it closes its connections to the proxies, which kill their ranks, and
    exits, maybe before the sentinel looks. A rank of this run aborts the job only after recording why (an
    interruption, an error, a hang), so a report anywhere means the launcher's end was no hang-up."""
    try:
        return any(name.endswith(".failed.json") for name in os.listdir(spool_dir))
    except OSError:
        return True


#: how the record names what happened
HANGUP_NAME = ("SIGHUP to mpiexec (the terminal or the ssh session of the run closed) or mpiexec killed: it ended "
               "first and its proxy killed the ranks (SIGKILL)")


def main(argv) -> int:
    for sig in (signal.SIGINT, signal.SIGHUP):  # it outlives the rank: only SIGTERM (a scheduler) ends it early
        signal.signal(sig, signal.SIG_IGN)
    spool_dir, rank, launcher, steps, record_size = argv
    return watch(spool_dir, int(rank), int(launcher), int(steps), int(record_size))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
