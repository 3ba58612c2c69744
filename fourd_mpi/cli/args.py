"""Shared pieces of the command line: the parser class, option groups from the run-option table,
trace-path arguments and the error line, and the vocabulary every command shares.

The options of ``fourd-mpi run`` are declared once, in :data:`fourd_mpi.run.options.RUN_OPTIONS`;
:func:`add_options` turns any subset of them into argparse arguments, so ``run``, ``verify``,
``info``, ``tune`` and ``bench`` offer the same names, types, choices and help.

The vocabulary (docs/guide/commands.md, "Command-line conventions"; ``tests/cli/test_vocabulary.py`` walks every
command to check it):

- every parser is a :class:`OneLineParser` (``sub.add_parser`` and nested ``add_subparsers``
  inherit the class): long options are never abbreviated, errors are one line;
- counts and selections differ by name: ``--ranks N`` / ``--steps N`` are counts,
  ``--select-ranks LIST`` / ``--select-steps LIST`` choose among existing ranks and steps
  (:func:`add_selection`);
- ``-o/--output FILE`` writes the command's product to FILE, never also to standard output,
  and says ``wrote FILE`` on standard error (:func:`add_output`, :func:`write_output`);
- ``--format`` takes names from :data:`FORMATS` (:func:`add_format`);
- ``--site`` takes a built-in site of :mod:`fourd_mpi.jobs.sites` or a site FILE.yaml
  (:func:`add_site`); the same list for sweeps and the performance model;
- every argument has help text; an old spelling stays one release as a hidden
  :func:`add_deprecated` alias that says ``note: --old is deprecated, use --new``.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
from typing import Iterable, List, Optional, Sequence

from fourd_mpi.errors import ConfigError
from fourd_mpi.run.options import GROUPS, OPTIONS, Option, options_in

PROG = "fourd-mpi"
log = logging.getLogger(__name__)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is a one-line :class:`ConfigError` (same on every rank),
    ``--help`` prints once (rank 0), not once per rank, and long options are never abbreviated
    (``--step 3`` is an error, not ``--steps 3``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise ConfigError(f"{message} (see {self.prog} --help)")

    def parse_args(self, args=None, namespace=None):
        """As argparse, but an unrecognized option names the command it was given to and the
        options it resembles (``run --step 3``: did you mean --steps?)."""
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            command = chosen_parser(self, namespace)
            hints = []
            for token in extras:
                if token.startswith("--"):
                    known = [o for a in command._actions for o in a.option_strings
                             if o.startswith("--") and a.help is not argparse.SUPPRESS]
                    close = difflib.get_close_matches(token.split("=", 1)[0], known, n=2, cutoff=0.6)
                    if close:
                        hints.append(f"{token.split('=', 1)[0]}: did you mean {' or '.join(close)}?")
            hint = ("; " + "; ".join(hints) + " (options are never abbreviated)") if hints else ""
            raise ConfigError(f"unrecognized arguments: {' '.join(extras)}{hint} (see {command.prog} --help)")
        return namespace

    def _print_message(self, message, file=None):
        if is_first_rank():
            super()._print_message(message, file)


def subparser_actions(parser: argparse.ArgumentParser) -> List[argparse._SubParsersAction]:
    """The subcommand actions of ``parser`` (none, or one)."""
    return [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]


def chosen_parser(parser: argparse.ArgumentParser, namespace) -> argparse.ArgumentParser:
    """The innermost (sub)command parser that ``namespace`` was parsed by."""
    for action in subparser_actions(parser):
        name = getattr(namespace, action.dest, None)
        if name in action.choices:
            return chosen_parser(action.choices[name], namespace)
    return parser


def walk_parsers(parser: argparse.ArgumentParser, path: tuple = ()):
    """``(command words, parser)`` of ``parser`` and every subcommand below it (aliases once)."""
    yield path, parser
    for action in subparser_actions(parser):
        seen = set()
        for name, child in action.choices.items():
            if id(child) not in seen:
                seen.add(id(child))
                yield from walk_parsers(child, path + (name,))


def is_first_rank() -> bool:
    """True in one process of a launch: rank 0 of an initialized MPI, else the launcher's rank 0
    (the command line is parsed before MPI starts, :func:`fourd_mpi.util.launch.launch_rank`), else a
    process without a launcher."""
    if "mpi4py.MPI" in sys.modules:
        return sys.modules["mpi4py.MPI"].COMM_WORLD.Get_rank() == 0
    from fourd_mpi.util.launch import launch_rank

    return launch_rank() in (None, 0)


def add_option(parser, option: Option, many: bool = False, **override) -> None:
    """One table option as an argparse argument (``many``: repeatable, values collected in a list;
    an old spelling (:attr:`Option.old`) is hidden from ``--help``)."""
    kwargs = dict(dest=option.dest, help=option.help)
    if option.flag and option.old:
        kwargs.pop("help")  # DeprecatedAlias hides it
        kwargs.update(action=DeprecatedAlias, new=option.old, nargs=0, const=True, default=option.default)
    elif option.flag:
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


#: shell completion of a file name (shtab's FILE, without importing the optional shtab)
COMPLETE_FILE = {"bash": "_shtab_compgen_files", "zsh": "_files", "tcsh": "f"}


def complete_files(action: argparse.Action) -> argparse.Action:
    """Mark an argument as a file name for ``fourd-mpi completion``."""
    action.complete = COMPLETE_FILE
    return action


def add_trace_paths(parser: argparse.ArgumentParser, what: str = "") -> None:
    """``TRACE...``: trace files, directories of them, or globs."""
    complete_files(parser.add_argument("paths", nargs="+", metavar="TRACE",
                                       help="trace files, directories of them, or globs" + what))


def add_allow_damaged(parser: argparse.ArgumentParser) -> None:
    """``--allow-damaged``: read traces with NaN or negative times or missing events (see
    :func:`fourd_mpi.trace.damage.damage`) instead of skipping them."""
    parser.add_argument("--allow-damaged", action="store_true",
                        help="also read damaged traces (NaN or negative times, events missing for the trace level); "
                             "by default they are skipped with the reason")


#: values that may be empty: a program's own arguments (``testbed mpiexec -- prog ""``)
EMPTY_ALLOWED = frozenset({"program"})


def refuse_empty_values(parser: argparse.ArgumentParser) -> None:
    """Every option and positional of every command that takes a text value (paths: ``-o``, ``--index``,
    ``--profile``, ``--baseline``, ``--results-dir``...; names, lists, words of a choice, an old spelling of an
    option) refuses an empty or blank value in one line (``argument -o/--output: expected a value, got ''``),
    instead of taking it as "not given" or as the current directory. One place: each such action whose type is
    none or ``str`` gets :func:`fourd_mpi.util.values.text` (:data:`EMPTY_ALLOWED` keeps its own); the typed
    ones (numbers, sizes, grids) refuse ``''`` in their own one line. ``tests/cli/test_empty_values.py`` walks
    them all."""
    from fourd_mpi.util.values import text

    def required_text(value: str) -> str:
        if not str(value).strip():
            raise argparse.ArgumentTypeError(f"expected a value, got {value!r}")
        return value

    for _, sub in walk_parsers(parser):
        for action in sub._actions:
            if (not isinstance(action, (argparse._StoreAction, argparse._AppendAction, DeprecatedAlias))
                    or action.nargs == 0 or action.type not in (None, str) or action.dest in EMPTY_ALLOWED
                    or action.nargs in (argparse.REMAINDER, argparse.PARSER)):
                continue
            action.type = required_text if (action.required or not action.option_strings) else text


def add_output(parser: argparse.ArgumentParser, required: bool = False, help: str = "",
               force_help: str = "replace an existing output file", metavar: str = "FILE",
               announce: bool = True) -> None:
    """``-o/--output FILE`` and ``--force`` (an existing file is never replaced without it).

    The convention: FILE receives the command's product (a report, a figure, an export, a
    profile, a trace), which then does not go to standard output; the command says
    ``wrote FILE`` on standard error (:func:`write_output`, :func:`wrote`); ``announce=False``:
    a command whose report on standard output already names the file (``trace recover``)."""
    text = help or "write it to FILE instead of standard output"
    complete_files(parser.add_argument("-o", "--output", metavar=metavar, required=required,
                                       help=text + ("; says 'wrote FILE' on standard error" if announce else "")))
    parser.add_argument("--force", action="store_true", help=force_help)


def wrote(path: str, what: str = "") -> None:
    """The one line an ``-o FILE`` command prints: ``wrote FILE`` (and what), on standard error (an INFO
    record of :mod:`fourd_mpi.util.log`: ``-q`` leaves it out)."""
    log.info("wrote %s%s", path, f" ({what})" if what else "", extra={"bare": True})


def write_output(path: Optional[str], text: str, what: str = "") -> None:
    """The command's report: to ``path`` when given (atomically: a temporary file renamed into
    place; then ``wrote PATH`` on stderr), else to standard output."""
    if not path:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    from fourd_mpi.util.files import write_text

    write_text(path, text)
    wrote(path, what)


#: the names ``--format`` takes, wherever a command prints a table (a command offers those it can write)
FORMATS = ("table", "csv", "json", "markdown")
#: formats that only make sense for one kind of output, allowed beside :data:`FORMATS`
SPECIAL_FORMATS = {"junit": "JUnit XML, a test report for CI (regression checks)",
                   "shell": "export lines for a shell's eval (testbed env)"}


def add_format(parser, supported: Sequence[str] = FORMATS, default: str = "table", help: str = "") -> None:
    """``--format`` with names from :data:`FORMATS` (or :data:`SPECIAL_FORMATS`); an unsupported
    one is refused with the list."""
    unknown = set(supported) - set(FORMATS) - set(SPECIAL_FORMATS)
    if unknown:
        raise ValueError(f"formats {sorted(unknown)} are not in the common set {FORMATS} "
                         f"(or {sorted(SPECIAL_FORMATS)})")
    parser.add_argument("--format", default=default, choices=tuple(supported),
                        help=help or f"output format: {', '.join(supported)} (default {default})")


def add_selection(parser, what: str, help: str, old: Sequence[str] = ()) -> None:
    """``--select-ranks LIST`` / ``--select-steps LIST``: a selection among existing ranks or steps
    (a count is ``--ranks N`` / ``--steps N``). ``old``: deprecated spellings kept as aliases."""
    from fourd_mpi.util.values import int_list

    dest = f"select_{what}"
    parser.add_argument(f"--select-{what}", dest=dest, type=int_list, metavar="LIST", help=help)
    for name in old:
        add_deprecated(parser, name, f"--select-{what}", dest=dest, type=int_list)


class DeprecatedAlias(argparse.Action):
    """An old spelling of an option: stores into the new option's ``dest``, says so on stderr
    (once per process, rank 0 of an MPI run), hidden from ``--help``."""

    def __init__(self, option_strings, dest, new: str = "", **kwargs):
        self.new = new
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if is_first_rank():
            log.info("note: %s is deprecated, use %s", option_string, self.new)
        setattr(namespace, self.dest, values if self.nargs != 0 else self.const)


def add_deprecated(parser, old: str, new: str, dest: str, **kwargs) -> None:
    """Keep ``old`` (e.g. ``--step``) working one release as an alias of ``new``."""
    parser.add_argument(old, dest=dest, action=DeprecatedAlias, new=new, default=argparse.SUPPRESS, **kwargs)


def add_site(parser, default: Optional[str] = None, help: str = "") -> None:
    """``--site NAME|FILE.yaml``: one site list for sweeps and the performance model
    (:func:`fourd_mpi.jobs.sites.builtin_sites`)."""
    from fourd_mpi.jobs.sites import builtin_sites

    text = f"built-in {', '.join(builtin_sites())}, or a site profile FILE.yaml"
    parser.add_argument("--site", default=default, metavar="SITE",
                        help=(help + "; " if help else "") + text + (f" (default {default})" if default else ""))


def add_verbosity(parser, default=0) -> None:
    """``-v/--verbose`` (repeatable) and ``-q/--quiet``: the level of the diagnostics on standard error
    (:mod:`fourd_mpi.util.log`). Every parser has them, so they go before or after the command words;
    below the top (``default`` SUPPRESS, so that one given before the command is kept) with a short help."""
    top = default != argparse.SUPPRESS
    parser.add_argument("-v", "--verbose", action="count", default=default,
                        help="more diagnostics on standard error: debug lines (what was done, how long it took); "
                             "run: also the full configuration; repeat (-vv) for debug lines of every MPI rank"
                        if top else "more diagnostics on standard error (repeatable; see fourd-mpi --help)")
    parser.add_argument("-q", "--quiet", action="count", default=default,
                        help="only results and warnings: no progress or notes on standard error; run: no header "
                             "and no per-step lines (as --display quiet), the summary only"
                        if top else "only results and warnings (see fourd-mpi --help)")


def error_line(exc: Exception) -> None:
    """One line, one write: mpiexec interleaves the ranks' stderr at write granularity."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())  # values keep their spaces
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
