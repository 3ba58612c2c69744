"""SIGINT, SIGTERM and SIGHUP as exceptions, held back while HDF5 writes.

:func:`install` (the command line, once) makes SIGINT raise ``KeyboardInterrupt`` and SIGTERM and
SIGHUP raise :class:`~fourd_mpi.errors.Terminated` in the main thread, for every command: a
``trace recover`` or a merge then aborts its writer (its temporary files removed) and exits with one
line and status 128 + signal, as ``run`` does.

:func:`deferred` holds them back: the trace writers write through a Python file object
(:class:`~fourd_mpi.trace.guarded.GuardedFile`), so HDF5 calls back into Python inside its own C
calls; an exception raised there (a signal handler runs between any two bytecodes) makes HDF5 fail
a write half way and crash later (SIGSEGV). Inside ``with deferred():`` a signal is only recorded;
it is raised when the outermost block ends, after the HDF5 call has returned. The handlers never
touch an HDF5 object, MPI, or the heap beyond setting a flag.

A handler's exception raised where Python cannot propagate it (a weakref callback, ``__del__``, the garbage
collector) is not lost: :func:`install` also sets ``sys.unraisablehook`` to deliver the signal again.

:func:`hold` and :func:`release` do the same across a stretch that is no block: a rank of a launch with
other ranks holds the signals from its start until MPI is up (``fourd_mpi.cli.main``). A rank that left
alone before then (its exit status 130, not a death by the signal) would leave the others waiting in
``MPI_Init`` or the first collective forever; once MPI is up, the interruption aborts the whole job.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
from typing import Iterator, Optional

#: the signals handled: Ctrl-C, a scheduler's time limit or ``kill``, the terminal or ssh session closed
HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_depth = 0  #: nesting of :func:`deferred` blocks in the main thread
_pending: Optional[int] = None  #: the first signal received inside them
_silenced: set = set()  #: the signals :func:`_raise` set to SIG_IGN (a second must not cut the report short)


def _raise(signum: int) -> None:
    if signum == signal.SIGINT:
        exc = KeyboardInterrupt()
    else:
        from fourd_mpi.errors import Terminated

        for sig in (signal.SIGTERM, signal.SIGHUP):  # one is enough: a second must not cut the report short
            if signal.getsignal(sig) is handler:
                signal.signal(sig, signal.SIG_IGN)
                _silenced.add(sig)
        exc = Terminated(f"signal {signum}")
    exc.signum = signum
    exc.from_signal_handler = True
    raise exc


def _unraisable(args) -> None:
    """``sys.unraisablehook`` while :func:`install`'s handlers are in place: an exception of :func:`handler` that
    Python could not propagate (the signal came while a weakref callback, a ``__del__`` or the garbage collector
    ran Python code: CPython prints "Exception ignored" and goes on) is not lost and not printed: the signal is
    delivered again a millisecond later, from a timer thread, so that the handler raises it in the main flow
    (delivered from inside this hook it would be raised here, and lost again). Anything else goes to the hook
    that was there before."""
    exc = args.exc_value
    if not getattr(exc, "from_signal_handler", False):
        _previous_unraisablehook(args)
        return
    for sig in _silenced:
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, handler)
    _silenced.clear()
    timer = threading.Timer(0.001, os.kill, (os.getpid(), exc.signum))
    timer.daemon = True
    timer.start()


_previous_unraisablehook = sys.unraisablehook


def handler(signum, frame) -> None:  # noqa: ARG001 - a signal handler's signature
    """The handler :func:`install` sets: raise now, or record for the end of :func:`deferred`."""
    global _pending
    if _depth > 0:
        if _pending is None:
            _pending = signum
        return
    _raise(signum)


def install() -> None:
    """Main thread: :func:`handler` for the signals not ignored (``nohup``: SIGHUP stays ignored)."""
    global _previous_unraisablehook
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in HANDLED:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, handler)
    if sys.unraisablehook is not _unraisable:
        _previous_unraisablehook, sys.unraisablehook = sys.unraisablehook, _unraisable


def hold(pending: Optional[int] = None) -> None:
    """Main thread: hold the signals back until the matching :func:`release` (as inside :func:`deferred`);
    ``pending``: a signal that came before (it is raised by the release, unless one came first)."""
    global _depth, _pending
    if threading.current_thread() is not threading.main_thread():
        return
    _depth += 1
    if _pending is None:
        _pending = pending


def release(raise_pending: bool = True) -> None:
    """End a :func:`hold`: at the outermost one, the first signal that came is raised (``raise_pending``), else
    dropped (an error already on its way out goes on)."""
    global _depth, _pending
    if threading.current_thread() is not threading.main_thread():
        return
    _depth -= 1
    if _depth == 0 and _pending is not None:
        signum, _pending = _pending, None
        if raise_pending:
            _raise(signum)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP back inside (re-entrant); the first one that came is raised at
    the end of the outermost block, unless an exception already leaves it (that one goes on)."""
    if threading.current_thread() is not threading.main_thread():  # handlers run in the main thread only
        yield
        return
    hold()
    leaving = False
    try:
        yield
        leaving = True
    finally:
        release(raise_pending=leaving)


def deferring(function):
    """Decorator: ``function`` runs inside :func:`deferred`."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with deferred():
            return function(*args, **kwargs)
    return wrapper
