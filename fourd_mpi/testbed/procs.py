"""Processes of a test bed (Linux /proc, no state): a process's identity by PID and start time
(:func:`proc_start`, :func:`daemon_record`), the processes inside a network namespace, stopping verified
processes only, through a pidfd where there is one (:func:`_kill`), and the MPI shared-memory segments no process
holds (:func:`stale_shm_segments`). :mod:`fourd_mpi.testbed.bed` decides
which processes are its own and imports these."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import List, Optional, Sequence, Tuple


def proc_start(pid: int) -> Optional[int]:
    """A process's start time (clock ticks after boot, /proc/PID/stat field 22); None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def daemon_record(pid: int) -> dict:
    return {"pid": pid, "start": proc_start(pid) or 0}


def _in_netns(pid: int, inode: Sequence[int]) -> bool:
    try:
        st = os.stat(f"/proc/{pid}/ns/net")
    except OSError:
        return False
    return [st.st_dev, st.st_ino] == list(inode)


def _netns_members(inode: Sequence[int]) -> List[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid() and _in_netns(int(p), inode)]


def _signal(pid: int, check, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if ``check(pid)`` holds, through a pidfd where there is one (so a PID that is
    reused between the check and the signal is never hit)."""
    fd = None
    with contextlib.suppress(AttributeError, OSError):
        fd = os.pidfd_open(pid)
    try:
        if not check(pid):
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
        return True
    except OSError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


def _kill(targets: Sequence[Tuple[int, object]], grace: float = 5.0) -> int:
    """Stop the verified processes: ``(pid, check)`` pairs, TERM then KILL; how many were signalled."""
    hit = set()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [(p, c) for p, c in targets if _signal(p, c, sig)]
        hit |= {p for p, _ in live}
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(pid_alive(p) and c(p) for p, c in live):
            time.sleep(0.05)
        if not any(pid_alive(p) and c(p) for p, c in live):
            break
    return len(hit)


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    return proc_start(pid) is not None


# -- leftovers of a killed run --------------------------------------------------------------------

#: the shared-memory segments of MPICH (``mpich_shm_*``), Open MPI 4's vader BTL (``vader_segment.*``) and
#: Open MPI 5's sm BTL (``sm_segment.*``); a tuple for ``str.startswith``
SHM_DIR, SHM_PREFIX = "/dev/shm", ("mpich_shm_", "vader_segment.", "sm_segment.")


def stale_shm_segments(min_age_s: float = 60.0) -> List[str]:
    """MPI segments (:data:`SHM_PREFIX`) in this machine's ``/dev/shm`` that no process maps or holds open, older
    than ``min_age_s`` (a run killed outside a bed leaves them; a bed's nodes have their own ``/dev/shm``)."""
    try:
        names = [os.path.join(SHM_DIR, n) for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)]
    except OSError:
        return []
    now = time.time()
    old = []
    for path in names:
        with contextlib.suppress(OSError):
            if now - os.stat(path).st_mtime > min_age_s:
                old.append(path)
    if not old:
        return []
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as fh:
                held.update(line.split(None, 5)[-1].strip().removesuffix(" (deleted)") for line in fh
                            if SHM_DIR in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return [p for p in old if p not in held]
