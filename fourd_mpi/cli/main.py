"""``fourd-mpi``: the parser of every command and the entry point.

Commands, by module:

- :mod:`~fourd_mpi.cli.run` — ``run``, ``verify``, ``info`` (under mpiexec), ``presets``;
- :mod:`~fourd_mpi.cli.traces` — ``trace show | check | recover``;
- :mod:`~fourd_mpi.cli.analyze` — ``analyze``, ``plot``, ``export``;
- :mod:`~fourd_mpi.cli.results` — ``results list | show | reindex``, ``compare``;
- :mod:`~fourd_mpi.cli.sweep` — ``sweep plan | render | submit | status | collect``;
- :mod:`~fourd_mpi.cli.tune` — ``tune``;
- :mod:`~fourd_mpi.cli.model` — ``model calibrate | validate | compare-axonn | paper`` (``predict | published``:
  :mod:`~fourd_mpi.cli.model_predict`);
- :mod:`~fourd_mpi.cli.bench` — ``bench collectives`` (under mpiexec);
- :mod:`~fourd_mpi.cli.testbed` — ``testbed up | down | status | mpiexec | env`` (emulated nodes on this machine);
- this module — ``completion bash | zsh | tcsh`` (the shell completion script, from this parser);
- :mod:`~fourd_mpi.cli.examples` — the examples that end every ``--help``.

Every parser is a :class:`~fourd_mpi.cli.args.OneLineParser`: a module's ``register(sub)`` adds its
commands with ``sub.add_parser`` (nested ``add_subparsers`` inherit the class), so a new command
gets the shared rules (no abbreviations, one-line errors); ``tests/cli/test_vocabulary.py`` walks
every command of :func:`build_parser` for help text and the other rules of
:mod:`fourd_mpi.cli.args`.

Only this module touches ``COMM_WORLD``, and only for the commands that run under mpiexec:
building the parser and running the offline commands never imports ``mpi4py.MPI`` (a login
node's MPI may abort when initialized outside a launcher). Nothing outside ``fourd_mpi.cli``
imports this package.

Error policy, as in ``python -m mpi4py``: a user error (:class:`ConfigError`,
:class:`BackendError`) is raised on every rank by validation that runs before any collective,
and every rank prints the same one-line message (``bench``: rank 0 only) and exits with status 2;
any other exception prints its traceback and aborts the whole job, so no rank is left waiting.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
import traceback
from typing import Dict, List, Optional

from fourd_mpi import __version__
from fourd_mpi.cli import analyze, bench, model, results, run, sweep, testbed, traces, tune
from fourd_mpi.cli.args import (
    PROG,
    OneLineParser,
    add_verbosity,
    error_line,
    is_first_rank,
    refuse_empty_values,
    walk_parsers,
)
from fourd_mpi.cli.examples import EXAMPLES, add_examples
from fourd_mpi.errors import BackendError, ConfigError, Terminated

log = logging.getLogger(__name__)

#: command modules, in the order ``--help`` lists their commands
MODULES = (run, traces, analyze, results, sweep, tune, model, bench, testbed)


def build_parser() -> OneLineParser:
    from fourd_mpi.util.log import ensure_configured

    ensure_configured()  # the notes of parsing (a deprecated option) have their handler
    parser = OneLineParser(prog=PROG, description="MPI benchmark of 4D hybrid parallel training "
                           "(data x 3D tensor parallelism). Launch run, verify, info and bench under "
                           "mpiexec/srun; the other commands run in one process without MPI.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_verbosity(parser)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for module in MODULES:
        module.register(sub)
    comp = sub.add_parser("completion", help="print the shell completion script (needs shtab: pip install "
                          "'fourd_mpi[completion]'); e.g. fourd-mpi completion bash > "
                          "~/.local/share/bash-completion/completions/fourd-mpi")
    comp.add_argument("shell", choices=SHELLS, help="the shell whose script to print")
    comp.set_defaults(handler=cmd_completion, serial=True)
    for path, p in walk_parsers(parser):  # every --help ends with examples (fourd_mpi.cli.examples)
        if path in EXAMPLES:
            add_examples(p, EXAMPLES[path])
    refuse_empty_values(parser)  # every free-text value: '' refused in one line, in one place
    for path, command in walk_parsers(parser):
        if path:  # -v and -q also after the command words: fourd-mpi run ... -q
            add_verbosity(command, default=argparse.SUPPRESS)
    return parser


#: shells ``fourd-mpi completion`` writes a script for (shtab's)
SHELLS = ("bash", "zsh", "tcsh")


def cmd_completion(args, world=None) -> int:
    """The completion script of the whole command line (every command, option and choice)."""
    try:
        import shtab
    except ImportError:
        raise ConfigError("shell completion needs shtab: pip install 'fourd_mpi[completion]' (or pip install "
                          "shtab)") from None
    sys.stdout.write(shtab.complete(build_parser(), shell=args.shell) + "\n")
    return 0


def parse(argv: Optional[List[str]] = None):
    """Parse, with ``run --config FILE`` options inserted before the command line's own."""
    from fourd_mpi.run.configfile import config_tokens, load_config_file

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        tokens = config_tokens(load_config_file(args.config), args.config)
        at = argv.index(args.command) + 1
        args = parser.parse_args(argv[:at] + tokens + argv[at:])
    return args


#: parsed attributes that are not options of the command
_NOT_OPTIONS = {"handler", "serial"}


def command_fingerprint(args) -> Dict[str, str]:
    """What every rank of an MPI command must agree on: the package version and every parsed
    option (as ``--name``: its value's repr); a ``--config`` file also by the SHA-256 of its
    bytes, so that a stale copy on one node is caught."""
    import hashlib

    out = {"version": __version__}
    for name, value in sorted(vars(args).items()):
        if name in _NOT_OPTIONS or name.startswith("_"):
            continue
        out["--" + name.replace("_", "-")] = repr(value)
        if name == "config" and value and os.path.isfile(str(value)):
            with open(str(value), "rb") as fh:
                out["--config (file contents, sha256)"] = hashlib.sha256(fh.read()).hexdigest()[:16]
    return out


#: packages that commands import only when they need them, and what installs each: a command that meets one
#: missing says so in one line (exit 2) instead of a traceback (docs/install.md)
INSTALLS = {
    "pandas": "pip install 'pandas>=1.5' (a requirement of fourd_mpi: an install with --no-deps lacks it)",
    "matplotlib": "pip install 'matplotlib>=3.5' (a requirement of fourd_mpi: an install with --no-deps lacks it)",
    "scipy": "pip install 'fourd_mpi[analysis]' (or pip install scipy)",
    "shtab": "pip install 'fourd_mpi[completion]' (or pip install shtab)",
    "perfetto": "pip install 'fourd_mpi[perfetto]' (or pip install perfetto)",
}


def missing_package(exc: BaseException, command: str) -> Optional[str]:
    """The one line for a :data:`INSTALLS` package that ``command`` did not find installed, else None."""
    name = (getattr(exc, "name", None) or "").split(".")[0]
    if not isinstance(exc, ModuleNotFoundError) or name not in INSTALLS:
        return None
    return f"{command} needs {name}, which is not installed: {INSTALLS[name]}"


#: MPI commands whose errors are printed by rank 0 only (the others exit with the same status, silently)
ROOT_REPORTS = ("bench",)


def _not_root(argv: Optional[List[str]]) -> bool:
    """True on ranks other than 0 of a :data:`ROOT_REPORTS` command (MPI is initialized to ask)."""
    tokens = list(sys.argv[1:] if argv is None else argv)
    if not tokens or tokens[0] not in ROOT_REPORTS:
        return False
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank() != 0


#: the commands that run under mpiexec (their handlers take the world communicator)
MPI_COMMANDS = ("run", "verify", "info", "bench")


def _leave_together(argv: Optional[List[str]], exc: ConfigError) -> None:
    """After a rank of an MPI command launched with siblings said its parse error: wait until every rank has
    reached this point or its own first collective, so no rank exits before the others have printed.

    A launcher may end the whole job as soon as one rank exits with an error (Open MPI does; a rank still
    parsing a large config file then dies without its line). Every rank of a launch parses the same command
    line, so they all fail alike and meet in :func:`~fourd_mpi.core.mpiutil.check_same`; a rank that parsed
    (an MPMD launch with other arguments) meets this one in its own ``check_same`` of the command's
    fingerprint, which then fails on every rank with the line naming the difference, instead of waiting for a
    rank that is gone. Collective over ``COMM_WORLD``; nothing without a launcher or for the offline
    commands."""
    from fourd_mpi.util.launch import launch_rank

    tokens = list(sys.argv[1:] if argv is None else argv)
    if not tokens or tokens[0] not in MPI_COMMANDS or launch_rank() is None:
        return
    from mpi4py import MPI

    from fourd_mpi.core.mpiutil import check_same

    with contextlib.suppress(ConfigError):  # the settings differ from a rank that parsed: it says so
        check_same(MPI.COMM_WORLD, {"command line": f"refused ({str(exc).splitlines()[0] if str(exc) else exc})"})


def _tolerant_streams() -> None:
    """Standard output and error write what their encoding cannot hold as escapes (``\\xe9``), once for
    every command: ``PYTHONIOENCODING=ascii fourd-mpi trace show`` of a non-ASCII path is no traceback."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError, OSError):  # replaced by a caller (tests), or closed
            pass


class _StartHold:
    """A launched rank's signals held from its start until MPI is up (:func:`fourd_mpi.util.signals.hold`), so
    that an interruption then aborts the whole job instead of leaving the other ranks waiting in ``MPI_Init``
    or the first collective; a signal that came while the modules imported (:data:`fourd_mpi.cli.early_signal`)
    is raised at the release too. Without a launch with other ranks, nothing is held."""

    def __init__(self):
        from fourd_mpi import cli
        from fourd_mpi.util import signals
        from fourd_mpi.util.launch import launch_rank

        self.held = launch_rank() is not None
        if self.held:
            signals.hold(cli.early_signal)
            cli.early_signal = None

    def release(self, raise_pending: bool = True) -> None:
        """End the hold (once); ``raise_pending``: raise the signal that came meanwhile, if any."""
        if self.held:
            from fourd_mpi.util import signals

            self.held = False
            signals.release(raise_pending)


def _interrupted_line(exc: BaseException) -> None:
    """The one line of an interruption, on the first rank, unless the command said where it stopped
    (``run``: :func:`fourd_mpi.run.session.traced_run` marks the exception ``reported``)."""
    if getattr(exc, "reported", False) or not is_first_rank():
        return
    signum = getattr(exc, "signum", signal.SIGINT)
    error_line("interrupted (Ctrl-C)" if signum == signal.SIGINT else f"interrupted ({signal.Signals(signum).name})")


def main(argv: Optional[List[str]] = None) -> int:
    from fourd_mpi.util import signals

    _tolerant_streams()
    # from here, Ctrl-C is KeyboardInterrupt, SIGTERM and SIGHUP Terminated, handled below (restored after: a
    # caller in the same process, a test, keeps its own)
    previous = {sig: signal.getsignal(sig) for sig in signals.HANDLED}
    signals.install()
    start = _StartHold()
    try:
        return _main(argv, start)
    except (KeyboardInterrupt, Terminated) as exc:  # outside a command's own handling (parsing, imports): one line
        _interrupted_line(exc)
        return 128 + getattr(exc, "signum", signal.SIGINT)
    finally:
        start.release(raise_pending=False)
        with contextlib.suppress(ValueError, TypeError):  # not the main thread; a handler set from C (None)
            for sig, handler in previous.items():
                if argv is None:  # this process's own command: done, a late signal must not kill it at exit
                    signal.signal(sig, signal.SIG_IGN)  # (Python resets its own handlers to SIG_DFL there)
                elif handler is not None:
                    signal.signal(sig, handler)
        _forget_handled_interrupt()


def _forget_handled_interrupt() -> None:
    """Clear CPython's record of a KeyboardInterrupt that left a string ``exec``/``eval``, once every Ctrl-C has
    been handled here (its one line said, the status 130 chosen).

    CPython notes "unhandled KeyboardInterrupt" whenever one leaves code it runs from a string (``PyRun_String``:
    ``exec("...")``, ``eval("...")``, which ``dataclasses`` and ``collections.namedtuple`` use to build classes,
    e.g. while a command imports a module lazily), even when a caller catches it later; under ``python -m``, the
    interpreter then ends the process by SIGINT itself after the command returned (status -2, after its one
    line). That was ``trace recover``'s rare -2 after Ctrl-C. Running a string is what clears the note: the
    empty one here does, after the handlers are set aside (a signal now cannot raise again). A KeyboardInterrupt
    that does leave :func:`main` is noted again by the interpreter, and ends the process by SIGINT as it
    should."""
    exec("pass", {})  # noqa: S102 - a constant string: clears the note (CPython's run_eval_code_obj resets it)


def _main(argv: Optional[List[str]] = None, start: Optional[_StartHold] = None) -> int:
    from fourd_mpi.util.log import configure, verbosity_of

    configure(0, is_first_rank())  # a note while parsing (a deprecated option) has its handler
    try:
        args = parse(argv)
    except ConfigError as exc:
        if not _not_root(argv):
            error_line(exc)
        _leave_together(argv, exc)
        return 2
    configure(verbosity_of(args), is_first_rank())
    log.debug("version %s, Python %s, command: %s", __version__, sys.version.split()[0],
              " ".join(sys.argv[1:] if argv is None else argv))
    world = None
    try:
        if args.serial:
            if start is not None:
                start.release()
            return args.handler(args, None)
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        if start is not None:
            start.release()  # MPI is up: a signal held since the start aborts the whole job from here
        from fourd_mpi.core.mpiutil import check_same

        check_same(world, command_fingerprint(args))  # before any other collective
        return args.handler(args, world)
    except (ConfigError, BackendError) as exc:
        if not (world is not None and args.command in ROOT_REPORTS and world.Get_rank() != 0):
            error_line(exc)
        return 2
    except BrokenPipeError:  # output piped into head & co.
        return 0
    except (KeyboardInterrupt, Terminated) as exc:  # Ctrl-C: 130; SIGTERM or SIGHUP: 128 + signal
        _interrupted_line(exc)
        _abort(world, 128 + getattr(exc, "signum", signal.SIGINT))
    except MemoryError as exc:  # during the steps (admission and allocation said the same on every rank)
        where = f" on rank {world.Get_rank()}" if world is not None else ""
        error_line(f"out of memory{where} ({exc or type(exc).__name__}): the memory model counts no temporaries; "
                   "give a smaller model or batch, more ranks, or a lower --memory-limit; aborting the job")
        _abort(world, 1)
    except Exception as exc:
        missing = missing_package(exc, args.command)
        if missing:
            error_line(missing)
            if world is not None and world.Get_size() > 1:
                _abort(world, 2)
            return 2
        if isinstance(exc, OSError) and exc.strerror:  # the environment failed (a disk filled, EIO): one line
            where = f"{exc.filename}: " if exc.filename else ""
            error_line(f"{args.command}: {where}{exc.strerror}" + (f" (rank {world.Get_rank()})" if world else ""))
            _abort(world, 1)
        traceback.print_exc()
        sys.stderr.flush()
        _abort(world, 1)
    return 1


def _abort(world, code: int) -> None:
    """Take the whole job down: a rank that raised must not leave the others in a collective. Its line goes out
    first (stderr flushed, then :data:`~fourd_mpi.core.watchdog.ABORT_GRACE_S` for the launcher to forward it)."""
    if world is not None and world.Get_size() > 1:
        from fourd_mpi.core.watchdog import ABORT_GRACE_S
        from fourd_mpi.util import signals

        signals.hold()  # the job goes down from here: a second signal must not cut it short (never released)
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_S)
        world.Abort(code)
    sys.exit(code)
