"""Diagnostics through Python's :mod:`logging`: the ``fourd_mpi`` logger hierarchy (each module logs to
``logging.getLogger(__name__)``), configured once by the command line (:func:`configure`, from ``-v`` and
``-q``).

Standard output carries a command's result (its tables, summaries, reports); standard error carries
the diagnostics, one line each:

- ``fourd-mpi: debug: ...`` (DEBUG, shown with ``-v``): what a command did and how long it took;
- ``fourd-mpi: ...`` (INFO, hidden by ``-q``): progress, notes (``fourd-mpi: note: ...``) and the
  ``wrote FILE`` line of ``-o FILE``;
- ``fourd-mpi: warning: ...`` (WARNING): something the user should know, the command goes on.

An error that ends a command is not a log record: it is the one ``fourd-mpi: error: ...`` line of
:func:`fourd_mpi.cli.args.error_line`, printed whatever the verbosity.

Under MPI the ranks other than 0 log one step quieter (warnings only by default, INFO with ``-v``,
DEBUG with ``-vv``), so a job of many ranks says each thing once.
"""

from __future__ import annotations

import logging
import sys

#: the logger above every module's
ROOT = "fourd_mpi"
#: the name every diagnostic line starts with
PROG = "fourd-mpi"
#: level of the one process or rank 0, by verbosity (-v count minus -q count, clamped to -1..1)
LEVELS = {-1: logging.WARNING, 0: logging.INFO, 1: logging.DEBUG}


class LineFormatter(logging.Formatter):
    """``fourd-mpi: MESSAGE`` for INFO, ``fourd-mpi: LEVEL: MESSAGE`` for the others, the bare message
    for a record logged with ``extra={"bare": True}`` (``wrote FILE``)."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if getattr(record, "bare", False):
            return text
        if record.levelno == logging.INFO:
            return f"{PROG}: {text}"
        return f"{PROG}: {record.levelname.lower()}: {text}"


class StderrHandler(logging.StreamHandler):
    """Each record as one write of one line to the current ``sys.stderr`` (looked up at every record, so
    that a caller that replaces it, a test, gets the lines), standard output flushed first so that the
    two streams keep their order on a terminal."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler sets it in __init__: always the current sys.stderr instead
        pass

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            try:
                sys.stdout.flush()
            except (OSError, ValueError):  # stdout closed or gone (a pipe's reader ended): stderr still says it
                pass
            self.stream.write(text + "\n")
            self.flush()
        except RecursionError:
            raise
        except Exception:  # as logging does: a failing stream never stops the command
            self.handleError(record)


def level_of(verbosity: int, first_rank: bool = True) -> int:
    """The level of this process: :data:`LEVELS` for rank 0 (or the one process), one step quieter for
    the others."""
    shifted = verbosity if first_rank else verbosity - 1
    return LEVELS[max(-1, min(1, shifted))]


def configure(verbosity: int = 0, first_rank: bool = True) -> logging.Logger:
    """Set up the ``fourd_mpi`` logger once per command: one :class:`StderrHandler` (a previous one of this
    function replaced, so a process that runs several commands, a test, does not print twice), the level
    from ``verbosity`` (``-v`` count minus ``-q`` count) and the rank (:func:`level_of`)."""
    logger = logging.getLogger(ROOT)
    for handler in list(logger.handlers):
        if isinstance(handler, StderrHandler):
            logger.removeHandler(handler)
    handler = StderrHandler()
    handler.setFormatter(LineFormatter())
    logger.addHandler(handler)
    logger.setLevel(level_of(verbosity, first_rank))
    logger.propagate = False  # the lines are ours: an application's root handler does not print them again
    return logger


def ensure_configured() -> None:
    """:func:`configure` with the defaults unless it ran already: a caller that builds the parser without
    :func:`fourd_mpi.cli.main.main` (a test, a script) still gets the notes of parsing."""
    if not any(isinstance(h, StderrHandler) for h in logging.getLogger(ROOT).handlers):
        configure()


def verbosity_of(args) -> int:
    """``-v`` count minus ``-q`` count of a parsed command line (0 where it has neither)."""
    return int(getattr(args, "verbose", 0) or 0) - int(getattr(args, "quiet", 0) or 0)
