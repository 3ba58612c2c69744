"""``python -m interrupt_in_exec SIGNAL``: fourd-mpi's entry point as ``python -m fourd_mpi`` runs it
(``sys.exit(main())``), with a command that receives SIGNAL (a real one, sent to itself) while code run from a
string executes: what a command's lazy import does when it builds a dataclass (``exec``) or a namedtuple (``eval``),
about 45 times in a ``trace recover``. tests/cli/test_interrupt_exit.py runs it."""

import sys

from fourd_mpi.cli import main as cli


def command_interrupted_in_exec(argv=None, start=None):  # noqa: ARG001 - _main's signature
    exec(f"import os, signal\nos.kill(os.getpid(), signal.{sys.argv[1]})\nwhile True:\n    pass\n", {})


if __name__ == "__main__":
    cli._main = command_interrupted_in_exec
    sys.exit(cli.main())
