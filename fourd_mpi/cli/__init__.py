"""The command line (``fourd-mpi``): one module per command group, plus ``args`` (shared
parser pieces) and ``main`` (the parser and entry point). Nothing outside this package
imports it.
"""

import os as _os
import signal as _signal

from fourd_mpi.util.launch import launch_rank as _launch_rank

#: the first signal that came while the modules imported, in a rank of a launch with other ranks (None: none)
early_signal = None


def _interrupted_while_starting(signum, frame):  # noqa: ARG001 - a signal handler's signature
    """Ctrl-C, SIGTERM or SIGHUP while the command line's modules import (before
    :func:`fourd_mpi.cli.main.main` takes over): one line and status 128 + signal, not a traceback from
    inside an import (nothing was written yet). A rank of a launch with other ranks only notes it: the
    command raises it once MPI is up and can take the whole job down (:mod:`fourd_mpi.util.signals`)."""
    global early_signal
    if _launch_rank() is not None:
        if early_signal is None:
            early_signal = signum
        return
    name = "Ctrl-C" if signum == _signal.SIGINT else _signal.Signals(signum).name
    _os.write(2, f"fourd-mpi: interrupted ({name}) while starting; nothing was done\n".encode())
    _os._exit(128 + signum)


if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:  # a Python that chose otherwise is left alone
    _signal.signal(_signal.SIGINT, _interrupted_while_starting)
    for _sig in (_signal.SIGTERM, _signal.SIGHUP):
        if _signal.getsignal(_sig) is _signal.SIG_DFL:
            _signal.signal(_sig, _interrupted_while_starting)
