"""The "examples:" section at the end of every ``--help``: one to three command lines per command, as typed.

One table, :data:`EXAMPLES` (command words -> lines), put on every parser by :func:`add_examples` when
:func:`fourd_mpi.cli.main.build_parser` has registered the commands. ``tests/cli/test_help_examples.py`` walks every
parser: each has examples, and every example line parses with :func:`~fourd_mpi.cli.main.build_parser` (the
words after ``fourd-mpi``; a launcher and its options before it, ``VAR=value`` settings, and a redirection or
comment after it are not the command's), the command after ``testbed mpiexec ... --`` too.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Dict, List, Tuple

#: command words (``()`` the top level) -> example command lines
EXAMPLES: Dict[Tuple[str, ...], Tuple[str, ...]] = {
    (): ("OMP_NUM_THREADS=1 mpiexec -n 8 fourd-mpi run --gx 2 --gy 2 --gz 2 --model gpt-tiny --steps 10",
         "fourd-mpi trace show results/baselines/baseline-gpt-tiny-np2.h5",
         "fourd-mpi tune --ranks 64 --model gpt-5b --batch 64 --site perlmutter --top 3"),
    ("run",): ("OMP_NUM_THREADS=1 mpiexec -n 8 fourd-mpi run --gx 2 --gy 2 --gz 2 --model gpt-tiny --steps 10",
               "mpiexec -n 4 fourd-mpi run --model gpt-tiny --overlap all --trace-level op --label nightly",
               "mpiexec -n 8 fourd-mpi run --config run.toml --steps 20"),
    ("verify",): ("OMP_NUM_THREADS=1 mpiexec -n 8 fourd-mpi verify --gx 2 --gy 2 --gz 2 --model gpt-tiny",
                  "mpiexec -n 4 fourd-mpi verify --all-grids --overlap none --overlap all",
                  "mpiexec -n 4 fourd-mpi verify --grid 1x2x1x2 --format json"),
    ("info",): ("mpiexec -n 8 fourd-mpi info --gx 2 --gy 2 --gz 2 --model gpt-tiny",
                "mpiexec -n 4 fourd-mpi info --format json"),
    ("presets",): ("fourd-mpi presets",
                   "fourd-mpi presets --format csv"),
    ("trace",): ("fourd-mpi trace show results/baselines/baseline-gpt-tiny-np2.h5",
                 "fourd-mpi trace check results/baselines/baseline-gpt-tiny-np2.h5",
                 "fourd-mpi trace recover results/RUN_ID.ranks"),
    ("trace", "show"): ("fourd-mpi trace show results/baselines/baseline-gpt-tiny-np2.h5",
                        "fourd-mpi trace show results/baselines/baseline-gpt-tiny-np2.h5 --format json"),
    ("trace", "check"): ("fourd-mpi trace check results/baselines/baseline-gpt-tiny-np2.h5",
                         "fourd-mpi trace check results/baselines/baseline-gpt-tiny-np2.h5 --format json"),
    ("trace", "recover"): ("fourd-mpi trace recover results/RUN_ID.ranks",
                           "fourd-mpi trace recover results/RUN_ID.ranks -o recovered.h5 --check full"),
    ("analyze",): ("fourd-mpi analyze results/samples/grid-*.h5 --what compare --format markdown",
                   "fourd-mpi analyze results/overlap.h5 --what comm --baseline results/no-overlap.h5",
                   "fourd-mpi analyze results/*.h5 --format json -o tables.json"),
    ("plot",): ("fourd-mpi plot scaling results/weak/*.h5 -o scaling.png",
                "fourd-mpi plot timeline results/run.h5 --select-steps 3 --select-ranks 0-3 -o timeline.svg",
                "fourd-mpi plot overlap results/overlap.h5 --baseline results/no-overlap.h5 -o overlap.png"),
    ("export",): ("fourd-mpi export perfetto results/run.h5 -o run.json.gz",
                  "fourd-mpi export perfetto results/run.h5 --select-steps 2 -o run.pftrace",
                  "fourd-mpi export thicket results/run.h5 -o run.cali.json"),
    ("results",): ("fourd-mpi results list --model gpt-tiny",
                   "fourd-mpi results show RUN_ID",
                   "fourd-mpi results reindex results"),
    ("results", "list"): ("fourd-mpi results list --model gpt-tiny --since 2026-11-01 dtype=float32",
                          "fourd-mpi results list --index results/baselines --format json"),
    ("results", "show"): ("fourd-mpi results show RUN_ID",
                          "fourd-mpi results show RUN_ID --index results/baselines --format json"),
    ("results", "reindex"): ("fourd-mpi results reindex results",
                             "fourd-mpi results reindex results/baselines --format json"),
    ("compare",): ("fourd-mpi compare label=new --baseline label=old",
                   "fourd-mpi compare results/baselines/slower-gpt-tiny-np2.h5 --baseline "
                   "results/baselines/baseline-gpt-tiny-np2.h5 --unit step",
                   "fourd-mpi compare new/*.h5 --baseline old/*.h5 --format junit -o compare.xml"),
    ("sweep",): ("fourd-mpi sweep plan jobscripts/weak-gpt-tiny.yaml --site perlmutter --account m1234",
                 "fourd-mpi sweep render jobscripts/weak-gpt-tiny.yaml --site perlmutter --account m1234",
                 "fourd-mpi sweep submit jobscripts/weak-gpt-tiny"),
    ("sweep", "plan"): ("fourd-mpi sweep plan jobscripts/weak-gpt-tiny.yaml --site perlmutter --account m1234",
                        "fourd-mpi sweep plan jobscripts/weak-gpt-tiny.yaml --format json"),
    ("sweep", "render"): ("fourd-mpi sweep render jobscripts/weak-gpt-tiny.yaml --site perlmutter --account m1234",
                          "fourd-mpi sweep render jobscripts/weak-gpt-tiny.yaml --site local --out jobs/local"),
    ("sweep", "submit"): ("fourd-mpi sweep submit jobscripts/weak-gpt-tiny",
                          "fourd-mpi sweep submit jobscripts/weak-gpt-tiny --resubmit-failed --dry-run",
                          "fourd-mpi sweep submit jobscripts/weak-gpt-tiny --format json"),
    ("sweep", "status"): ("fourd-mpi sweep status jobscripts/weak-gpt-tiny",
                          "fourd-mpi sweep status jobscripts/weak-gpt-tiny --format json"),
    ("sweep", "collect"): ("fourd-mpi sweep collect jobscripts/weak-gpt-tiny",
                           "fourd-mpi sweep collect jobscripts/weak-gpt-tiny --into results/weak --format markdown"),
    ("tune",): ("fourd-mpi tune --ranks 64 --model gpt-5b --batch 64 --site perlmutter --top 5 --memory-limit 40 "
                "--emit-sweep tune.yaml",
                "fourd-mpi tune --ranks 8 --model gpt-small --algorithm all",
                "fourd-mpi tune --ranks 8 --model gpt-tiny --format json"),
    ("model",): ("fourd-mpi model predict --profile dgx-a100 --model gpt-80b --batch 1536 --grid 16x1x8x1",
                 "fourd-mpi model validate results/*.h5 --profile calibrated.yaml",
                 "fourd-mpi model published --dataset axonn_sc24"),
    ("model", "calibrate"): ("fourd-mpi model calibrate results/*.h5 --profile results/profiles/HOST.yaml "
                             "-o calibrated.yaml",
                             "fourd-mpi model calibrate results/*.h5 --profile laptop --terms gemm,comm "
                             "-o calibrated.yaml --format json"),
    ("model", "validate"): ("fourd-mpi model validate results/*.h5 --profile calibrated.yaml",
                            "fourd-mpi model validate results/*.h5 --require --format json"),
    ("model", "compare-axonn"): ("fourd-mpi model compare-axonn",
                                 "fourd-mpi model compare-axonn --ranks 512 --batch 1024 --profile frontier",
                                 "fourd-mpi model compare-axonn --format json"),
    ("model", "paper"): ("fourd-mpi model paper",
                         "fourd-mpi model paper --series gpt-5b,gpt-10b --memory-limit 40 -o weak.png",
                         "fourd-mpi model paper --series none --format json"),
    ("model", "predict"): ("fourd-mpi model predict --profile dgx-a100 --model gpt-80b --batch 1536 "
                           "--algorithm megatron1d --grid 16x1x8x1 --ginter 6 --pipeline-schedule interleaved "
                           "--chunks-per-stage 7 --microbatch-size 1 --dtype float16 --attention unfused "
                           "--overlap none",
                           "fourd-mpi model predict --config predict.yaml --format json"),
    ("model", "published"): ("fourd-mpi model published",
                             "fourd-mpi model published --dataset axonn_sc24 --no-claims --format json"),
    ("bench",): ("OMP_NUM_THREADS=1 mpiexec -n 8 fourd-mpi bench collectives -o results/profiles/HOST.yaml",),
    ("bench", "collectives"): (
        "OMP_NUM_THREADS=1 mpiexec -n 8 fourd-mpi bench collectives -o results/profiles/HOST.yaml",
        "mpiexec -n 4 fourd-mpi bench collectives --ops iallreduce --max-size 4M --time-limit 60 --format csv",
        "fourd-mpi testbed mpiexec -n 8 --ppn 4 -- fourd-mpi bench collectives --min-size 2K --factor 4 "
        "--max-size 2M -o bed-2x4.yaml --fallback laptop"),
    ("testbed",): ("fourd-mpi testbed up --nodes 2 --rate 200mbit",
                   "fourd-mpi testbed mpiexec -n 8 --ppn 4 -- fourd-mpi run --gx 2 --gy 2 --gz 2",
                   "fourd-mpi testbed down"),
    ("testbed", "up"): ("fourd-mpi testbed up --nodes 2 --rate 200mbit",
                        "fourd-mpi testbed up --nodes 2 --slurm --format json"),
    ("testbed", "down"): ("fourd-mpi testbed down",
                          "fourd-mpi testbed down --all"),
    ("testbed", "status"): ("fourd-mpi testbed status",
                            "fourd-mpi testbed status --name bed2 --format json"),
    ("testbed", "mpiexec"): ("fourd-mpi testbed mpiexec -n 8 --ppn 4 -- fourd-mpi run --gx 2 --gy 2 --gz 2",
                             "fourd-mpi testbed mpiexec -n 4 --order cyclic --dry-run -- fourd-mpi verify --all-grids"),
    ("testbed", "env"): ("fourd-mpi testbed env",
                         "fourd-mpi testbed env --name bed2"),
    ("completion",): ("fourd-mpi completion bash > ~/.local/share/bash-completion/completions/fourd-mpi",
                      "fourd-mpi completion zsh > ~/.zfunc/_fourd-mpi"),
}

HEADING = "examples:"


class ExamplesFormatter(argparse.HelpFormatter):
    """argparse's help layout, but the examples section keeps its lines as written (a command line is not
    re-wrapped); the description is wrapped as before."""

    def _fill_text(self, text, width, indent):
        if text.startswith(HEADING):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def add_examples(parser: argparse.ArgumentParser, lines) -> None:
    """End ``parser``'s ``--help`` with ``examples:`` and ``lines``, one command line each."""
    parser.epilog = HEADING + "\n" + "\n".join("  " + line for line in lines)
    parser.formatter_class = ExamplesFormatter


def examples_of(parser: argparse.ArgumentParser) -> List[str]:
    """The example lines of ``parser``'s help (none: ``[]``)."""
    epilog = parser.epilog or ""
    if not epilog.startswith(HEADING):
        return []
    return [line.strip() for line in epilog.splitlines()[1:] if line.strip()]


#: launchers whose options come before the command
LAUNCHERS = ("mpiexec", "mpirun", "srun")
#: shell words that end a command
SHELL_ENDS = (">", ">>", "|", "||", "&&", ";", "2>", "&")


def command_words(line: str) -> List[List[str]]:
    """The ``fourd-mpi`` command lines in an example, as argv lists without ``fourd-mpi``: the outer one, and
    the command after ``--`` when it is ``fourd-mpi`` too (``testbed mpiexec ... -- fourd-mpi run``). Words
    before ``fourd-mpi`` (``VAR=value``, a launcher and its options) and after a redirection, pipe or comment
    are not the command's."""
    words = shlex.split(line, comments=True)
    for i, word in enumerate(words):
        if word in SHELL_ENDS:
            words = words[:i]
            break
    starts = [i for i, word in enumerate(words) if word == "fourd-mpi" or word.endswith("/fourd-mpi")]
    if not starts:
        return []
    outer = words[starts[0] + 1:]
    out = [outer]
    if "--" in outer:
        at = outer.index("--")
        inner = outer[at + 1:]
        if inner and (inner[0] == "fourd-mpi" or inner[0].endswith("/fourd-mpi")):
            out.append(inner[1:])
    return out
