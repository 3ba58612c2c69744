"""The examples of README.md and the documentation: every command, and its real output, in one place.

    python3 docs/examples.py                    # run every example, rewrite its blocks with the output
    python3 docs/examples.py --only tune,plan   # only these
    python3 docs/examples.py --check            # run nothing: every block's command is this table's (exit 1 if not)
    python3 docs/examples.py --list             # the examples and the files that show them

Run it from the repository root after README command 1 (the commands use ``.venv/bin``). A block in a
Markdown file is written between two markers; everything between them belongs to this script:

    <!-- example: NAME -->
    ```console
    $ COMMAND
    OUTPUT
    ```
    <!-- /example: NAME -->

``<!-- example: NAME elide-config -->`` shows the output with the resolved-configuration lines of ``fourd-mpi
run --show-config`` replaced by one line saying how many were left out.
Examples of format ``markdown`` print a Markdown table, which the block shows as a table under the command.
``stable`` examples read only committed files (``results/samples``, the built-in profiles, the example sweep
spec): their output must not change, and ``tests/test_docs.py`` runs them and compares.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Example:
    """One command and how its output is shown."""

    command: str  #: a bash command line, run in the repository root
    #: console: a code block with ``$ COMMAND`` and the output; markdown: the output as Markdown;
    #: note: the output as one line of text, without the command (the conditions the examples ran under)
    format: str = "console"
    stable: bool = False  #: reads only committed files: the output is the same on every run
    show_output: bool = True  #: False: the block shows the command only (an install step)
    columns: Tuple[str, ...] = ()  #: markdown tables: keep only these columns (the block says so)


RUN = ("OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 .venv/bin/fourd-mpi run --gx 2 --gy 2 --gz 2 "
       "--model gpt-tiny --steps 10")
EXAMPLES: Dict[str, Example] = {
    # the machine and its load when the examples ran (other jobs share the development machine)
    "conditions": Example("echo \"Measured outputs last regenerated on $(date -u +%Y-%m-%d) "
                          "on $(nproc --all) cores, load average "
                          "$(cut -d' ' -f1 /proc/loadavg) (1 min) as the examples started.\"", format="note"),
    # the same job with its full configuration (docs/guide/runs.md), first: trace-show shows the plain run's trace
    "run-config": Example(RUN + " --show-config"),
    # README command 1's job (the tour's first stop; docs/guide/runs.md too)
    "run": Example(RUN),
    "verify": Example("OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 .venv/bin/fourd-mpi verify --gx 2 --gy 2 --gz 2 "
                      "--model gpt-tiny"),
    "trace-show": Example('.venv/bin/fourd-mpi trace show "$(ls -t results/*.h5 | head -n 1)"'),
    "analyze-compare": Example(".venv/bin/fourd-mpi analyze results/samples/grid-*.h5 --what compare "
                               "--format markdown", format="markdown", stable=True,
                               columns=("grid", "overlap", "step_median_s", "step_q1_s", "step_q3_s",
                                        "compute_share", "wait_share", "tflops_per_rank", "vs_best")),
    "tune": Example(".venv/bin/fourd-mpi tune --ranks 64 --model gpt-5b --batch 64 --site perlmutter --top 3",
                    stable=True),
    "plan": Example(".venv/bin/fourd-mpi sweep plan jobscripts/weak-gpt-tiny.yaml --site perlmutter "
                    "--account m1234", stable=True),
    # docs/guide/analysis.md, "Sample data"
    "samples-weak": Example(".venv/bin/fourd-mpi analyze results/samples --what runs,compare,scaling "
                            "--scaling weak --format markdown", format="markdown", stable=True),
    "samples-comm": Example(".venv/bin/fourd-mpi analyze results/samples/grid-2x2x1x2.h5 "
                            "results/samples/grid-1x2x2x2-overlap.h5 --what comm --format markdown",
                            format="markdown", stable=True,
                            columns=("run_id", "op", "axis", "messages_per_step", "inflight_s_per_step",
                                     "wait_s_per_step", "mpi_s_per_step", "busbw_gbps", "overlap_pct",
                                     "outside_mpi_pct")),
}

_BLOCK = re.compile(r"^<!-- example: (?P<name>[\w-]+)(?P<opts>(?: [\w-]+)*) -->\n(?P<body>.*?)"
                    r"^<!-- /example: (?P=name) -->\n", re.M | re.S)
_CONFIG_HEAD = "resolved configuration (reusable as --config FILE.toml):"


def example_files() -> Tuple[str, ...]:
    """README.md and every page of docs/ with an example block (paths relative to the repository)."""
    pages = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").rglob("*.md")
                   if _BLOCK.search(p.read_text()))
    return ("README.md", *pages)


#: the files whose blocks this script owns
FILES = example_files()


def run(example: Example) -> str:
    """The example's output: stdout and stderr of ``bash -c COMMAND`` in the repository root."""
    proc = subprocess.run(["bash", "-c", example.command], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"examples: {example.command!r} exited {proc.returncode}:\n{proc.stdout}")
    return proc.stdout


def elide_config(output: str) -> str:
    """``fourd-mpi run``'s output with its resolved-configuration lines counted, not shown."""
    lines = output.splitlines()
    if not lines or lines[0] != _CONFIG_HEAD:
        return output
    n = 1
    while n < len(lines) and lines[n].startswith("  "):
        n += 1
    note = f"[{n - 1} lines of resolved configuration, reusable as --config FILE.toml: left out here]"
    return "\n".join([note] + lines[n:]) + "\n"


def keep_columns(output: str, columns: Iterable[str]) -> str:
    """A Markdown table (the lines starting with ``|``) with only ``columns``, in their table order. Another table
    of the same output that lacks some of them (another section, e.g. ``comm by placement``) is kept whole; at
    least one table must have them all."""
    columns = list(columns)
    out, keep, matched = [], None, False
    for line in output.splitlines():
        if not line.startswith("|"):
            out.append(line)
            keep = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if keep is None:
            keep = [i for i, c in enumerate(cells) if c in columns]
            if set(columns) - {cells[i] for i in keep}:
                keep = list(range(len(cells)))
            else:
                matched = True
        out.append("| " + " | ".join(cells[i] for i in keep) + " |")
    if not matched:
        raise SystemExit(f"examples: no table has all the column(s) {sorted(columns)}")
    return "\n".join(out) + "\n"


def render(name: str, opts: List[str], output: Optional[str]) -> str:
    """The text between the markers of block ``name``."""
    example = EXAMPLES[name]
    if output is None or not example.show_output:
        return f"```bash\n{example.command}\n```\n"
    if "elide-config" in opts:
        output = elide_config(output)
    if example.format == "note":
        return output.strip() + "\n"
    if example.columns:
        output = keep_columns(output, example.columns)
    if example.format == "markdown":
        # the output's own "## table" headings would become headings of the page: bold labels instead
        body = "\n".join(f"**{line[3:]}**" if line.startswith("## ") else line
                         for line in output.splitlines()).strip("\n")
        note = f"\n\n(columns abridged to {', '.join(example.columns)})" if example.columns else ""
        return f"```bash\n{example.command}\n```\n\n{body}{note}\n\n"
    return f"```console\n$ {example.command}\n{output.rstrip()}\n```\n"


def blocks(text: str):
    """``(name, options, match)`` of every example block in ``text``."""
    for m in _BLOCK.finditer(text):
        yield m.group("name"), m.group("opts").split(), m


def block_command(name: str, body: str) -> Optional[str]:
    """The command a block shows (the first line after its opening fence, without ``$``)."""
    m = re.search(r"^```(?:console|bash)\n(?:\$ )?(.*)$", body, re.M)
    return m.group(1) if m else None


def check(files: Iterable[str] = FILES) -> List[str]:
    """Problems: a block whose command is not its example's, an unknown name, an example no file shows."""
    problems, seen = [], set()
    for rel in files:
        text = (REPO / rel).read_text()
        if text.count("<!-- example:") != text.count("<!-- /example:"):
            problems.append(f"{rel}: unbalanced example markers")
        for name, opts, m in blocks(text):
            seen.add(name)
            if name not in EXAMPLES:
                problems.append(f"{rel}: unknown example {name!r}")
                continue
            shown = block_command(name, m.group("body"))
            if EXAMPLES[name].format != "note" and shown != EXAMPLES[name].command:
                problems.append(f"{rel}: example {name!r} shows {shown!r}, docs/examples.py runs "
                                f"{EXAMPLES[name].command!r} (run python3 docs/examples.py)")
    problems += [f"example {n!r} is shown in none of {', '.join(files)}" for n in EXAMPLES if n not in seen]
    return problems


def rewrite(outputs: Dict[str, str], files: Iterable[str] = FILES) -> List[str]:
    """Rewrite the blocks of the examples in ``outputs``; the files changed."""
    changed = []
    for rel in files:
        path = REPO / rel
        text = path.read_text()
        new = _BLOCK.sub(lambda m: m.group(0) if m.group("name") not in outputs else
                         f"<!-- example: {m.group('name')}{m.group('opts')} -->\n"
                         + render(m.group("name"), m.group("opts").split(), outputs[m.group("name")])
                         + f"<!-- /example: {m.group('name')} -->\n", text)
        if new != text:
            path.write_text(new)
            changed.append(rel)
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="run nothing; check that the files show these commands")
    ap.add_argument("--only", metavar="NAMES", help="comma list of examples to run (default: all, in order)")
    ap.add_argument("--list", action="store_true", help="list the examples")
    args = ap.parse_args(argv)
    if args.list:
        for name, ex in EXAMPLES.items():
            print(f"{name:18} {'stable ' if ex.stable else ''}{ex.command}")
        return 0
    if args.check:
        problems = check()
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        print(f"examples: {len(EXAMPLES)} commands checked in {', '.join(FILES)}"
              + ("" if not problems else f"; {len(problems)} problem(s)"))
        return 1 if problems else 0
    names = args.only.split(",") if args.only else list(EXAMPLES)
    unknown = [n for n in names if n not in EXAMPLES]
    if unknown:
        ap.error(f"unknown example(s) {unknown} (known: {', '.join(EXAMPLES)})")
    if "conditions" not in names and any(not EXAMPLES[n].stable for n in names):
        names.insert(0, "conditions")  # the machine and its load belong with every measured output
    outputs = {}
    for name in names:
        print(f"examples: {name}: {EXAMPLES[name].command}", file=sys.stderr)
        outputs[name] = run(EXAMPLES[name])
    for rel in rewrite(outputs):
        print(f"examples: rewrote {rel}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
