"""The command line (``fourd-mpi``): one module per command group, plus ``args`` (shared
parser pieces) and ``main`` (the parser and entry point). Nothing outside this package
imports it.
"""

import os as _os
import signal as _signal


def _interrupted_while_starting(signum, frame):  # noqa: ARG001 - a signal handler's signature
    """Ctrl-C while the command line's modules import (before :func:`fourd_mpi.cli.main.main` takes over):
    one line and status 130, not a traceback from inside an import."""
    _os.write(2, b"fourd-mpi: interrupted (Ctrl-C) while starting; nothing was done\n")
    _os._exit(130)


if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:  # a Python that chose otherwise is left alone
    _signal.signal(_signal.SIGINT, _interrupted_while_starting)
