"""Small MPI helpers that keep failures from turning into hangs."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

from fourd_mpi.errors import BackendError, ConfigError

T = TypeVar("T")


def agree(comm, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if it raises a user error on any rank, raise it on all.

    For checks whose outcome may differ between ranks (a GPU missing on one node).
    Collective over ``comm``.
    """
    error = None
    result = None
    try:
        result = fn()
    except (ConfigError, BackendError) as exc:
        error = (type(exc).__name__, str(exc))
    errors = comm.allgather(error)
    for rank, err in enumerate(errors):
        if err is not None:
            cls = BackendError if err[0] == "BackendError" else ConfigError
            suffix = "" if all(e == err for e in errors) else f" (on rank {rank})"
            raise cls(err[1] + suffix)
    return result


def on_root(comm, fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 and give its result to every rank; a user error it raises is raised on all.

    For decisions only one rank may take (a run id, creating a directory). Collective over ``comm``.
    """
    outcome = None
    if comm.Get_rank() == 0:
        try:
            outcome = (None, fn())
        except (ConfigError, BackendError) as exc:
            outcome = ((type(exc), str(exc)), None)
    error, result = comm.bcast(outcome, root=0)
    if error is not None:
        raise error[0](error[1])
    return result


def idle_barrier(comm, poll_seconds: float = 1e-3) -> None:
    """A barrier that sleeps between polls, so waiting ranks leave the cores to working ones.

    MPICH's blocking Barrier spins; on an oversubscribed node that steals cycles
    from the ranks still computing (standalone benchmarks, serial references).
    """
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(poll_seconds)
