"""Fuzz the command line itself: random options and values for every command, drawn
from the parser (run by tests/cli/test_command_line_fuzz.py in a subprocess under a timeout and an address-space limit).

    python tests/helpers/fuzz_cli.py EXAMPLES WORKDIR

Every command of :func:`fourd_mpi.cli.main.build_parser` is a target, its options and values drawn
from its argparse actions (choices, the option table's types: edge numbers, junk text, selections) and
file arguments from a scratch directory holding a real trace, an index, a spool, a spec and a profile.
The offline commands run whole, in this process (``main(argv)``, standard output and error captured
at the file-descriptor level); the commands that run under MPI (``run``, ``verify``, ``info``,
``bench``) are parsed and resolved as every rank does before any collective (starting MPI and running
steps per example would not fit the time). Left out: ``testbed`` (root: network namespaces) and
``sweep submit`` (it starts jobs).

Each example must end with status 0, 1, 2 or 3, no traceback on standard error, within
:data:`EXAMPLE_CPU_S` of CPU time and :data:`EXAMPLE_TIMEOUT_S` of wall time, and touch no file outside
WORKDIR (the repository's tree is compared before and after). The last line is JSON:
``{"examples", "statuses", "tracebacks", "hangs", "bad_status", "commands"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import traceback

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from fourd_mpi.cli.args import walk_parsers  # noqa: E402
from fourd_mpi.cli.main import build_parser, main, parse  # noqa: E402
from fourd_mpi.errors import ConfigError  # noqa: E402

#: one example may use this much CPU time (a plot of a sample trace takes about 1 CPU-s): more is a hang;
#: and this much wall time (a blocked one, on a machine whose load may be 8 per core)
EXAMPLE_CPU_S = 15
EXAMPLE_TIMEOUT_S = 120
#: commands run under MPI: parsed and resolved, not run
MPI_COMMANDS = ("run", "verify", "info", "bench")
#: commands never fuzzed: root network set-up; starting jobs; two reports of many seconds each at their defaults
#: (gpt-80b on 1,024 GPUs and its weak-scaling series: their options are bounded and tested in tests/perf)
LEFT_OUT = (("testbed",), ("sweep", "submit"), ("model", "paper"), ("model", "compare-axonn"))
#: options whose value is a file or directory the command writes
OUTPUTS = {"-o", "--output", "--out", "--emit-sweep", "--json", "--report", "--table", "--into", "--results-dir"}

COUNTS = {"examples": 0, "statuses": {}, "tracebacks": 0, "hangs": 0, "bad_status": 0, "commands": {}}
FAILURES = []


class Hang(BaseException):  # not an Exception: main() must not catch it
    pass


def _alarm(signum, frame):
    raise Hang()


def leaves():
    """``(words, parser)`` of every command that takes arguments (no subcommands), minus :data:`LEFT_OUT`."""
    out = []
    for words, parser in walk_parsers(build_parser()):
        if not words or any(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)):
            continue
        if any(words[:len(skip)] == skip for skip in LEFT_OUT):
            continue
        out.append((words, parser))
    return out


NUMBERS = ["0", "1", "2", "3", "8", "-1", "64", "1024", str(2 ** 31), str(2 ** 63), "1e308", "nan", "inf", "0.5",
           "4G", "64K", "", " ", "x", "1,2", "0-3", "3-1", "1-", "0-999999999999", "2^63"]
TEXT = ["", "   ", "a", "gpt-tiny", "none", "all", "oag,ors", "1x1x1x1", "1x2x2x2", "caf\u00e9", "-x", "--steps",
        "a" * 300, "0:1", "0:1:kill", "local", "laptop", "perlmutter", "KEY=VALUE", "model=gpt-tiny"]


def scratch_files(work: str) -> dict:
    """Real inputs in ``work``: a trace, its index, a spool, a sweep spec, a profile, a config file."""
    results = os.path.join(work, "results")
    os.makedirs(results)
    shutil.copy(os.path.join(REPO, "results", "samples", "weak-1.h5"), os.path.join(results, "t.h5"))
    shutil.copy(os.path.join(REPO, "results", "samples", "weak-2.h5"), os.path.join(results, "u.h5"))
    spool = os.path.join(work, "run.ranks")
    os.makedirs(spool)
    with open(os.path.join(spool, "run.json"), "w") as fh:
        fh.write('{"run_id": "run", "world_size": 1}')
    shutil.copy(os.path.join(REPO, "jobscripts", "weak-gpt-tiny.yaml"), os.path.join(work, "spec.yaml"))
    shutil.copy(os.path.join(REPO, "fourd_mpi", "perf", "profiles", "laptop.yaml"), os.path.join(work, "prof.yaml"))
    with open(os.path.join(work, "c.toml"), "w") as fh:
        fh.write("steps = 2\n")
    return {"trace": "results/t.h5", "trace2": "results/u.h5", "dir": "results", "index": "results/index.jsonl",
            "spool": "run.ranks", "spec": "spec.yaml", "profile": "prof.yaml", "config": "c.toml"}


def file_values(files: dict):
    return list(files.values()) + ["missing.h5", "out.txt", "out.png", "out.json", "new-dir", "results/*.h5", ".",
                                   "results/t.h5", "sub/missing/x.txt"]


def value_strategy(action, files):
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        return st.one_of(st.sampled_from(list(action.choices)), st.sampled_from(TEXT))
    option = action.option_strings[0] if action.option_strings else action.dest
    if option in OUTPUTS or action.dest in ("paths", "trace", "file", "directory", "spec", "sweep_dir", "new",
                                            "baseline", "config", "index", "profile", "fallback", "site"):
        return st.one_of(st.sampled_from(file_values(files)), st.sampled_from(TEXT))
    if action.type is not None and action.type is not str:
        return st.one_of(st.sampled_from(NUMBERS), st.integers(-3, 2 ** 64).map(str))
    return st.one_of(st.sampled_from(TEXT), st.sampled_from(NUMBERS), st.sampled_from(file_values(files)))


@st.composite
def command_lines(draw, targets, files):
    words, parser = draw(st.sampled_from(targets))
    argv = list(words)
    for action in parser._actions:
        if action.option_strings or action.dest == "help" or isinstance(action, argparse._SubParsersAction):
            continue
        count = 1 if action.nargs in (None, 1) else draw(st.integers(1, 2))
        argv += [draw(value_strategy(action, files)) for _ in range(count)]
    optional = [a for a in parser._actions if a.option_strings and "--help" not in a.option_strings
                and "--version" not in a.option_strings and a.help is not argparse.SUPPRESS]
    for action in draw(st.lists(st.sampled_from(optional), max_size=4, unique_by=id)) if optional else []:
        name = draw(st.sampled_from(action.option_strings))
        if action.nargs == 0:
            argv.append(name)
        else:
            argv += [name, draw(value_strategy(action, files))]
    if draw(st.integers(0, 9)) == 0:  # now and then an unknown option or a stray word
        argv.insert(draw(st.integers(1, len(argv))), draw(st.sampled_from(["--bogus", "stray", "-"])))
    return argv


def run_one(argv, work: str):
    """Status and standard error of ``main(argv)`` (MPI commands: parse and resolve only)."""
    out_fd, err_fd = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            status = _call(argv)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(out_fd, 1)
            os.dup2(err_fd, 2)
            os.close(out_fd)
            os.close(err_fd)
        err.seek(0)
        return status, err.read().decode("utf-8", "replace")


def _call(argv) -> int:
    import io

    if argv[0] in MPI_COMMANDS:
        captured = io.StringIO()
        try:
            args = parse(argv)
            if argv[0] in ("run", "verify", "info"):
                from fourd_mpi.cli.run import run_options

                run_options(args, 1)
            return 0
        except ConfigError:
            return 2
        except SystemExit as exc:  # --help, --version
            return exc.code if isinstance(exc.code, int) else 2
        except Exception:  # noqa: BLE001 - a traceback is what the fuzz looks for
            traceback.print_exc(file=captured)
            sys.stderr.write(captured.getvalue())
            return 1
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


def tree(root: str) -> dict:
    """Files under ``root`` (not under .git, .venv, build outputs) and their size and mtime."""
    out = {}
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in (".git", ".venv", "build", "__pycache__", ".pytest_cache",
                                                ".hypothesis", "fourd_mpi.egg-info")]
        for name in files:
            path = os.path.join(directory, name)
            try:
                st_ = os.lstat(path)
            except OSError:
                continue
            out[path] = (st_.st_size, st_.st_mtime_ns)
    return out


def main_fuzz(examples: int, work: str) -> int:
    limit = int(os.environ.get("FUZZ_MEMORY_LIMIT", str(3 << 30)))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.environ["MPLBACKEND"] = "Agg"
    os.chdir(work)
    files = scratch_files(work)
    main(["results", "reindex", "results"])  # an index of the traces
    targets = leaves()
    before = tree(REPO)
    signal.signal(signal.SIGALRM, _alarm)
    signal.signal(signal.SIGPROF, _alarm)
    import time

    # CPU seconds of this process, not wall seconds: the same examples run on a quiet and on a loaded machine
    # (a wall budget drew 4 times fewer on 2 cores shared with 8 busy processes); examples beyond it are skipped
    budget = float(os.environ.get("FUZZ_BUDGET_S", "0")) or None
    started = time.process_time()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(command_lines(targets, files))
    def example(argv):
        if budget is not None and time.process_time() - started > budget:
            COUNTS["skipped_over_budget"] = COUNTS.get("skipped_over_budget", 0) + 1
            return
        COUNTS["examples"] += 1
        name = " ".join(w for w in argv[:2] if not w.startswith("-"))
        COUNTS["commands"][name] = COUNTS["commands"].get(name, 0) + 1
        signal.alarm(EXAMPLE_TIMEOUT_S)
        signal.setitimer(signal.ITIMER_PROF, EXAMPLE_CPU_S)
        try:
            status, err = run_one(argv, work)
        except Hang:
            COUNTS["hangs"] += 1
            FAILURES.append(f"--- hang (> {EXAMPLE_CPU_S} CPU-s or {EXAMPLE_TIMEOUT_S} s): {argv}")
            return
        finally:
            signal.alarm(0)
            signal.setitimer(signal.ITIMER_PROF, 0)
        COUNTS["statuses"][str(status)] = COUNTS["statuses"].get(str(status), 0) + 1
        if "Traceback" in err:
            COUNTS["tracebacks"] += 1
            if len(FAILURES) < 8:
                FAILURES.append(f"--- traceback: {argv}\n{err[-3000:]}")
        elif status not in (0, 1, 2, 3):
            COUNTS["bad_status"] += 1
            if len(FAILURES) < 8:
                FAILURES.append(f"--- status {status}: {argv}\n{err[-1000:]}")

    example()
    after = tree(REPO)
    touched = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    for failure in FAILURES:
        print(failure)
    if touched:
        print(f"--- files outside the scratch directory changed: {touched[:10]}")
    COUNTS["touched_outside"] = len(touched)
    print(json.dumps(COUNTS, sort_keys=True))
    bad = COUNTS["tracebacks"] or COUNTS["hangs"] or COUNTS["bad_status"] or touched
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main_fuzz(int(sys.argv[1]), sys.argv[2]))
