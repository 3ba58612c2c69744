"""Small MPI helpers that keep failures from turning into hangs."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Callable, Dict, TypeVar

from fourd_mpi.errors import BackendError, ConfigError
from fourd_mpi.util.text import int_ranges

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


def check_same(comm, settings: Dict[str, str], what: str = "arguments",
               hint: str = "every rank must run the same command") -> None:
    """Raise the same :class:`ConfigError` on every rank unless every rank passed equal ``settings``.

    ``settings``: name -> canonical text of the value. Two reductions of a 63-bit hash of the
    sorted settings (MIN and MAX) decide; only on a mismatch are the settings gathered, to name
    the first differing one (in sorted order) and which ranks have which value; ``hint`` ends the
    message. Collective
    over ``comm``; call it before any other collective of the command (ranks that disagree on
    what to run would otherwise wait in different collectives forever).
    """
    text = json.dumps(sorted(settings.items()))
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1
    from mpi4py import MPI

    if comm.allreduce(digest, op=MPI.MIN) == comm.allreduce(digest, op=MPI.MAX):
        return
    everyone = comm.allgather(settings)
    names = sorted(set().union(*everyone))
    for name in names:
        values: Dict[str, list] = {}
        for rank, mine in enumerate(everyone):
            values.setdefault(mine.get(name, "(absent)"), []).append(rank)
        if len(values) > 1:
            shown = "; ".join(f"{value} on ranks {int_ranges(ranks)}" for value, ranks in
                              sorted(values.items(), key=lambda kv: kv[1][0]))
            raise ConfigError(f"the ranks were started with different {what}: {name} is {shown} ({hint})")
    raise ConfigError(f"the ranks were started with different {what} ({hint})")


def derived(parent, child):
    """``child`` (a communicator made from ``parent`` by ``Split``, ``Create_cart``, ``Sub``), adopted by
    ``parent.adopt_derived`` when ``parent`` has that method, else ``child`` itself.

    The test hook of the stream-order checker (``tests/helpers/streamcheck.py``): a checked communicator
    (a Python subclass of ``MPI.Intracomm`` that inspects every buffer handed to MPI) keeps checking the
    communicators derived from it, as mpi4py's own ``Dup`` keeps the caller's class. No-op in production.
    """
    adopt = getattr(parent, "adopt_derived", None)
    return adopt(child) if adopt is not None else child
