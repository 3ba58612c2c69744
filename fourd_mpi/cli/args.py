"""Shared pieces of the command line: the parser class, option groups from the run-option table,
trace-path arguments and the error line.

The options of ``fourd-mpi run`` are declared once, in :data:`fourd_mpi.run.options.RUN_OPTIONS`;
:func:`add_options` turns any subset of them into argparse arguments, so ``run``, ``verify``,
``info``, ``tune`` and ``bench`` offer the same names, types, choices and help.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Iterable, Sequence

from fourd_mpi.errors import ConfigError
from fourd_mpi.run.options import GROUPS, OPTIONS, Option, options_in

PROG = "fourd-mpi"


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is a one-line :class:`ConfigError` (same on every rank),
    ``--help`` prints once (rank 0), not once per rank, and long options are never abbreviated
    (``--step 3`` is an error, not ``--steps 3``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise ConfigError(f"{message} (see {self.prog} --help)")

    def _print_message(self, message, file=None):
        if "mpi4py.MPI" not in sys.modules or sys.modules["mpi4py.MPI"].COMM_WORLD.Get_rank() == 0:
            super()._print_message(message, file)


def add_option(parser, option: Option, many: bool = False, **override) -> None:
    """One table option as an argparse argument (``many``: repeatable, values collected in a list)."""
    kwargs = dict(dest=option.dest, help=option.help)
    if option.flag:
        kwargs.update(action="store_true", default=option.default)
    else:
        kwargs.update(type=option.type, metavar=option.metavar, choices=option.choices,
                      action="append" if many else "store", default=None if many else option.default)
        if option.choices is not None:
            kwargs.pop("metavar")
    kwargs.update(override)
    parser.add_argument(f"--{option.name}", **kwargs)


def add_options(parser: argparse.ArgumentParser, groups: Sequence[str] = (), names: Iterable[str] = (),
                many: Sequence[str] = (), **overrides) -> None:
    """Add the table's options of ``groups`` (each under its titled group) and the single options
    ``names`` (under "run options"). ``many``: names that become repeatable (verify checks each);
    ``overrides``: ``{dest: {argparse keyword: value}}`` for a command whose default differs."""
    for group in groups:
        g = parser.add_argument_group(GROUPS[group])
        for option in options_in(group):
            add_option(g, option, option.name in many, **overrides.get(option.dest, {}))
    names = list(names)
    if names:
        g = parser.add_argument_group("run options (as in fourd-mpi run)")
        for name in names:
            option = OPTIONS[name]
            add_option(g, option, option.name in many, **overrides.get(option.dest, {}))


def add_trace_paths(parser: argparse.ArgumentParser, what: str = "") -> None:
    """``TRACE...``: trace files, directories of them, or globs."""
    parser.add_argument("paths", nargs="+", metavar="TRACE",
                        help="trace files, directories of them, or globs" + what)


def add_allow_damaged(parser: argparse.ArgumentParser) -> None:
    """``--allow-damaged``: read traces with NaN or negative times or missing events (see
    :func:`fourd_mpi.trace.read.damage`) instead of skipping them."""
    parser.add_argument("--allow-damaged", action="store_true",
                        help="also read damaged traces (NaN or negative times, events missing for the trace level); "
                             "by default they are skipped with the reason")


def add_output(parser: argparse.ArgumentParser, required: bool = False, help: str = "",
               force_help: str = "replace an existing output file") -> None:
    """``-o/--output FILE`` and ``--force`` (an existing file is never replaced without it)."""
    parser.add_argument("-o", "--output", metavar="FILE", required=required, help=help or None)
    parser.add_argument("--force", action="store_true", help=force_help)


def error_line(exc: Exception) -> None:
    """One line, one write: mpiexec interleaves the ranks' stderr at write granularity."""
    text = " ".join(str(exc).split())
    sys.stderr.flush()
    os.write(2, f"{PROG}: error: {text}\n".encode())


def say(world, text: str = "") -> None:
    """Print on rank 0 only (``world`` None: one process)."""
    if world is None or world.Get_rank() == 0:
        print(text, flush=True)


def parse_list(text: str, choices: Sequence[str], flag: str) -> list:
    """A comma list whose items must be among ``choices`` (``--what``, ``--terms``, ``--ops``)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in items if t not in choices]
    if unknown or not items:
        raise ConfigError(f"{flag}: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(choices)}")
    return items
