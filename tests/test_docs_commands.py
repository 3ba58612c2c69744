"""Every command of README.md and docs/, run as typed, from a shell where the environment is not activated.

The commands are read from the pages: every line of a ``bash`` (``sh``, ``shell``) code block and every ``$ ``
line of a ``console`` block (a line continued with ``\\`` and a ``for ... done`` loop are one command). Each one
is either a step of a :data:`SCENARIOS` entry, run here with its exit status and a check of its output, or in
:data:`ALREADY` (run as typed by another part of CI, which is checked to contain it), or in :data:`NOT_RUN` with
the reason; a command in none of them (a new or edited line of a page) fails
:func:`test_every_documented_command_is_run_or_listed`, and so does a table entry no page shows any more.

How a scenario runs: in a fresh directory laid out like a clone (``.venv`` is the environment running the tests,
as README command 1 makes it; the committed inputs ``results/samples``, ``results/baselines``, ``jobscripts``,
``bench``, ``docs`` beside it), one ``bash`` session that types the commands in the page's order, as a user
does (what ``eval`` exports and ``E=...`` sets is there for the lines after it), with ``PATH`` holding no
``bin/`` of the environment (``VIRTUAL_ENV`` unset, ``HOME`` a directory of its own): what a user who
followed the README types. A step marked ``activated`` comes from a page that activates an environment
first (``source .../bin/activate``): the session then has the environment's ``bin/`` on ``PATH``. Each step's
output is checked for its result lines and key words, not for headers or spacing. The scenarios of the test bed
(root, network namespaces, Debian's Slurm) use a bed and a state directory of their own.

Sizes are the pages' own; where a page's command ran for minutes it was changed on the page to a bounded form
(fewer steps, sizes, repeats) that still shows what the command does, and the page says what the committed
tables used. Nothing here runs two scenarios at once: on 2 cores one 8-rank run already takes both, so running
side by side would only stretch each (and a test bed's jobs) without saving time.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
from conftest import REPO

IN_CI = os.environ.get("CI", "").lower() == "true"
VENV_BIN = Path(sys.executable).parent

# -- reading the commands from the pages ------------------------------------------------------------------------

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
SHELL = {"bash", "sh", "shell"}
_OPEN = re.compile(r"^(for|while|until|if|case)\b")
_CLOSE = re.compile(r"^(done|fi|esac)\b")
_ENDS = re.compile(r";\s*(done|fi|esac)\s*(#.*)?$")


def pages() -> List[str]:
    """README.md and every Markdown page of docs/ (paths relative to the repository)."""
    return ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").rglob("*.md"))]


def logical_lines(body: str) -> List[str]:
    """The commands of a shell block: comment and blank lines dropped, ``\\`` continuations joined with a space,
    a compound command (``for``/``while``/``if`` ... ``done``/``fi``) kept whole, its lines joined by newlines."""
    out, buf, depth = [], [], 0
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1].rstrip() + " " + lines[i].strip()
        i += 1
        s = line.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        buf.append(line if buf else s)
        if not (_OPEN.match(s) and _ENDS.search(s)):  # a one-line loop (for ...; do ...; done) opens nothing
            depth += 1 if _OPEN.match(s) else -1 if _CLOSE.match(s) else 0
        if depth <= 0:
            out.append("\n".join(buf))
            buf, depth = [], 0
    if buf:
        out.append("\n".join(buf))
    return out


def commands_of(text: str) -> List[str]:
    found = []
    for m in _FENCE.finditer(text):
        indent, lang = m.group("indent"), m.group("lang")
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line
                         for line in m.group("body").splitlines())
        if lang == "console":
            found += [line[2:] for line in body.splitlines() if line.startswith("$ ")]
        elif lang in SHELL:
            found += logical_lines(body)
    return found


def documented() -> Dict[str, List[str]]:
    """Every documented command and the pages that show it."""
    where: Dict[str, List[str]] = {}
    for page in pages():
        for command in commands_of((REPO / page).read_text()):
            where.setdefault(command, [])
            if page not in where[command]:
                where[command].append(page)
    return where


# -- what runs, and what does not ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    command: str  #: exactly as the page shows it
    expect: str  #: a regular expression the output (stdout and stderr) must match
    status: Tuple[int, ...] = (0,)  #: the exit statuses that are right
    activated: bool = False  #: the page activated the environment before this line
    timeout: float = 600
    page: bool = True  #: a page's command (False: the test's own step, e.g. a wait for submitted jobs)


BED_UP = '.venv/bin/fourd-mpi testbed up --nodes 2 --rate 200mbit        # bed "fourd": nodes fourd-n1, fourd-n2'
#: every verification of a line passed (a loop's exit status is its last command's)
ALL_PASSED = r"(?s)\A(?!.*\b[1-9]\d* failed).*\b[1-9]\d* passed, 0 failed"
#: docs/placement.md's verification matrix, bounded
MATRIX = [
    "for A in megatron1d fsdp dp optimus3d; do $E fourd-mpi verify --dtype float64 --steps 2 --algorithm $A "
    "--all-grids --model mlp-tiny $OV; done",
    "$E fourd-mpi verify --dtype float64 --steps 2 --algorithm axonn4d --grid 1x2x2x2 --grid 2x1x1x4 "
    "--model mlp-tiny $OV",
    "$E fourd-mpi verify --dtype float64 --steps 2 --algorithm axonn4d --grid 1x2x2x2 --model gpt-tiny --overlap none "
    "--overlap all,cache --recompute none --recompute full",
    "$E fourd-mpi verify --dtype float64 --steps 2 --algorithm optimus3d --all-grids --model gpt-tiny --overlap none "
    "--overlap all",
    "for S in axonn 1f1b; do $E fourd-mpi verify --dtype float64 --steps 2 --algorithm pipeline --pipeline-schedule $S "
    "--ginter 2 --grid 1x2x1x2 --model gpt-tiny --batch 16 --microbatches 2 $OV; done",
    "$E fourd-mpi verify --dtype float64 --steps 2 --algorithm pipeline --ginter 4 --grid 1x1x1x2 --model gpt-tiny "
    "--layers 4 --batch 16 --microbatches 2 $OV",
]
#: the test's wait for the jobs of the bed's Slurm (squeue of the Slurm that eval pointed SLURM_CONF at), then the
#: run header of the sweep's 8-rank job
SLURM_WAIT = ('for i in $(seq 150); do [ -z "$(squeue -h 2>&1)" ] && break; sleep 2; done; '
              'grep -h "8 ranks" results/weak-gpt-tiny/emulated-slurm/jobs/logs/*n8*')
TOUR_RUN = ("OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 .venv/bin/fourd-mpi run --gx 2 --gy 2 --gz 2 "
            "--model gpt-tiny --steps 10")
LATEST = '"$(ls -t results/*.h5 | head -n 1)"'

#: name -> the steps, run in order in one directory; ``mpi``: launches mpiexec with several ranks
SCENARIOS: Dict[str, Tuple[bool, List[Step]]] = {
    # README's tour, then what the guide does with the runs it leaves in results/
    "tour": (True, [
        # docs/guide/runs.md: the tour's run with its full configuration; the run itself (README) is .ci/run's
        Step(TOUR_RUN + " --show-config", r"(?s)^resolved configuration \(reusable as --config FILE\.toml\):\n"
                                          r".*1x2x2x2.*step time: median .*trace: results/\S+\.h5"),
        Step("OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 .venv/bin/fourd-mpi verify "
             "--gx 2 --gy 2 --gz 2 --model gpt-tiny", r"1x2x2x2 .* ok\n1 passed, 0 failed"),
        Step(f".venv/bin/fourd-mpi trace show {LATEST}", r"status complete.*\n(?s:.*)median step \S+ s"),
        Step(".venv/bin/fourd-mpi analyze results/samples/grid-*.h5 --what compare --format markdown",
             r"\| grid +\| overlap +\|.*\n(?s:.*)\| 8x1x1x1 +\| none +\|"),
        Step(".venv/bin/fourd-mpi tune --ranks 64 --model gpt-5b --batch 64 --site perlmutter --top 3",
             r"top 3 of \d+ valid grids"),
        Step(".venv/bin/fourd-mpi sweep plan jobscripts/weak-gpt-tiny.yaml --site perlmutter --account m1234",
             r"sweep weak-gpt-tiny: weak scaling, 4 runs on site perlmutter"),
        # docs/guide/regressions.md: the index the run appended to
        Step(".venv/bin/fourd-mpi results list --model gpt-tiny --since 2026-11-01 dtype=float32   "
             "# also --grid --status --algorithm; --format table|json|csv", r"gpt-tiny +1x2x2x2 .*\n1 run\(s\)"),
        Step(".venv/bin/fourd-mpi results show baseline-gpt-tiny-np2 --index results/baselines   "
             "# one run (RUN_ID) of an index (default: results)", r"baseline-gpt-tiny-np2"),
        Step(".venv/bin/fourd-mpi results reindex results                "
             "# rebuild index.jsonl from the traces (offline)", r"results/index.jsonl: 1 run\(s\) indexed"),
        Step(".venv/bin/fourd-mpi compare results/baselines/slower-gpt-tiny-np2.h5 --baseline "
             "results/baselines/baseline-gpt-tiny-np2.h5 --threshold 5%   "
             "# NEW... --baseline OLD...; --format table|markdown|json|junit -o FILE", r"gpt-tiny", (0, 1)),
        Step(".venv/bin/fourd-mpi compare results/baselines/slower-gpt-tiny-np2.h5 --baseline "
             "results/baselines/baseline-gpt-tiny-np2.h5 --unit step", r"(?i)slower|regression", (1,)),
    ]),
    # docs/guide/regressions.md: is this machine quiet enough for compare? (12 pairs of identical 1-rank runs)
    "quiet-machine": (False, [
        Step('for i in $(seq 0 11); do\n  [ $((i % 2)) = 0 ] && order="a b" || order="b a"\n  for side in $order; do\n'
             "    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 1 -bind-to core .venv/bin/fourd-mpi run --model gpt-tiny "
             "--hidden 128 --seq 64 --batch 8 --steps 22 --results-dir quiet --run-id $side$i --display quiet\n"
             "  done\ndone", r"trace: quiet/b11\.h5"),
        # identical runs: same on a quiet machine, slower or faster (exit 1 or 0) on a busy one; always paired
        Step(".venv/bin/fourd-mpi compare 'quiet/b*.h5' --baseline 'quiet/a*.h5'   # quiet enough: same",
             r"12 pairs", (0, 1)),
    ]),
    # docs/guide/algorithms.md
    "algorithms": (True, [
        Step("OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 .venv/bin/fourd-mpi run --algorithm megatron1d "
             "--model gpt-tiny   # 1x1x8x1", r"grid 1x1x8x1 \(DxZxYxX\), 8 ranks(?s:.*)step time: median"),
        Step("OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 .venv/bin/fourd-mpi verify --algorithm fsdp --all-grids   "
             "# the grids fsdp allows", r"(\d+) passed, 0 failed"),
        Step(".venv/bin/fourd-mpi tune --ranks 8 --model gpt-small --algorithm all   "
             "# one ranking, all algorithms", r"megatron1d(?s:.*)fsdp"),
        Step(".venv/bin/fourd-mpi model validate results/*.h5   # errors per algorithm", r"megatron1d"),
        # the guide's recipe, bounded: round-robin (R outer), so the traces come out in that order
        Step("for R in 1 2; do for A in megatron1d fsdp; do OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 "
             ".venv/bin/fourd-mpi run --algorithm $A --model gpt-tiny --steps 2 --warmup 1 --results-dir algorithms "
             "--run-id $A-$R --display quiet; done; done",
             r"(?s)trace: algorithms/megatron1d-1\.h5.*fsdp-1\.h5.*megatron1d-2\.h5.*fsdp-2\.h5"),
        Step(".venv/bin/fourd-mpi analyze algorithms --what compare   "
             "# fastest first: algorithm, grid, step time and quartiles, shares",
             r"(?s)megatron1d.*fsdp|fsdp.*megatron1d"),
    ]),
    # docs/guide/analysis.md, docs/model.md, docs/guide/model-and-tuning.md (the offline part)
    "offline": (False, [
        Step(".venv/bin/fourd-mpi analyze results/samples --what runs,compare,scaling --scaling weak "
             "--format markdown", r"## weak scaling"),
        Step(".venv/bin/fourd-mpi analyze results/samples/grid-2x2x1x2.h5 results/samples/grid-1x2x2x2-overlap.h5 "
             "--what comm --format markdown", r"overlap_pct"),
        Step(".venv/bin/fourd-mpi plot overlap results/samples/grid-1x2x2x2-overlap.h5 --baseline "
             "results/samples/weak-8.h5 -o hidden.png", r"wrote hidden\.png"),
        Step(".venv/bin/fourd-mpi model predict --profile dgx-a100 --model gpt-80b --batch 1536 --algorithm "
             "megatron1d --grid 16x1x8x1 --ginter 6 --pipeline-schedule interleaved --chunks-per-stage 7 "
             "--microbatch-size 1 --dtype float16 --attention unfused --overlap none", r"MFU \d"),
        Step(".venv/bin/fourd-mpi model published --dataset all   # or narayanan_sc21, axonn_sc24, "
             "narayanan_sc21_table2, megatron_readme_2020, llama3_405b, megascale_megatron", r"Narayanan"),
        Step(".venv/bin/fourd-mpi tune --ranks 64 --model gpt-5b --batch 64 --site perlmutter --top 5 "
             "--memory-limit 40 --emit-sweep tune.yaml", r"tune\.yaml"),
        # docs/multinode.md: the model's side of the committed ranking, again
        Step(".venv/bin/python bench/multinode.py --from-results "
             "results/benchmarks/multinode-ranking/multinode-ranking.txt  # offline",
             r"Spearman rank correlation \(measured vs model, 20 grids\)"),
    ]),
    # docs/guide/sweeps.md: rendered for Perlmutter here; submitted only there (NOT_RUN)
    "sweeps": (False, [
        Step(".venv/bin/fourd-mpi sweep plan   jobscripts/weak-gpt-tiny.yaml --site perlmutter --account m1234",
             r"4 runs on site perlmutter"),
        Step(".venv/bin/fourd-mpi sweep render jobscripts/weak-gpt-tiny.yaml --site perlmutter --account m1234",
             r"manifest\.json to results/weak-gpt-tiny/perlmutter/jobs/"),
        Step(".venv/bin/fourd-mpi sweep status results/weak-gpt-tiny/perlmutter/jobs    "
             "# scheduler state and trace of every run", r"0/4 traces complete, 0 jobs failed"),
        # before the jobs ran on Perlmutter: one line per missing trace, exit 2
        Step(".venv/bin/fourd-mpi sweep collect results/weak-gpt-tiny/perlmutter/jobs   "
             "# check the traces, runs + scaling tables", r"no traces yet \(4 missing\)", (2,)),
    ]),
    # docs/guide/commands.md: shell completion, into this scenario's own HOME
    "completion": (False, [
        Step("mkdir -p ~/.local/share/bash-completion/completions", r"^$"),
        Step(".venv/bin/fourd-mpi completion bash > ~/.local/share/bash-completion/completions/fourd-mpi", r"^$"),
        Step("mkdir -p ~/.zfunc && .venv/bin/fourd-mpi completion zsh > ~/.zfunc/_fourd-mpi   "
             "# with fpath+=(~/.zfunc) in ~/.zshrc", r"^$"),
        Step(".venv/bin/fourd-mpi completion tcsh > ~/.fourd-mpi.completion.csh && echo 'source "
             "~/.fourd-mpi.completion.csh' >> ~/.tcshrc", r"^$"),
    ]),
    # README.md, docs/contributing.md: the site
    "site": (False, [
        Step(".venv/bin/mkdocs build --strict   # the site in build/site, as CI builds it", r"^$|Documentation built"),
    ]),
    # docs/guide/benchmarks.md: each script's bounded form
    "benchmarks": (True, [
        Step("OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 .venv/bin/python -m bench.step_bench --model gpt-tiny "
             "--grids 1x2x2x2,8x1x1x1 --steps 2 --warmup 1 --repeats 1", r"1x2x2x2(?s:.*)8x1x1x1"),
        Step("OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 .venv/bin/python -m bench.recompute_bench --gx 2 --gy 2 --gz 2 "
             "--model gpt-tiny --steps 1 --repeats 1", r"selective(?s:.*)full"),
        Step("OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 .venv/bin/python bench/overlap_bench.py --configs comm-heavy "
             "--steps 2 --warmup 1 --probe-mib 1 --overlaps none,all", r"(?s)progress probe.*comm-heavy +all +poll"),
        Step("OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 .venv/bin/python -m bench.trace_overhead --repeats 4 "
             "--merge-events 10000 --merge-repeats 1", r"(?s)op.*step.*events per second|events/s"),
        Step("OMP_NUM_THREADS=1 .venv/bin/python -m bench.algorithms --cases best4d,megatron1d --repeats 1 "
             "--steps 2 --warmup 1 --plot results/benchmarks/algorithms.png   # measured side by side",
             r"wrote results/benchmarks/algorithms\.png|algorithms\.png"),
    ]),
    # docs/guide/model-and-tuning.md: measure, calibrate against traces, validate
    "model-and-tuning": (True, [
        Step("OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 .venv/bin/fourd-mpi bench collectives --ops "
             "iallgather,ireduce_scatter,iallreduce --max-size 64K --iters 3 --min-time 0 --overlap-sizes 0 "
             "--no-in-place --accept-poor-fit -o results/profiles/$(hostname).yaml",
             r"(?s)# Avg bus bandwidth.*machine profile"),
        Step(".venv/bin/fourd-mpi model calibrate results/samples/*.h5 --profile results/profiles/$(hostname).yaml "
             "-o calibrated.yaml   # TRACES: files, directories, globs", r"wrote calibrated\.yaml"),
        Step(".venv/bin/fourd-mpi model validate results/samples/*.h5 --profile calibrated.yaml",
             r"1x2x2x2"),
    ]),
    # docs/sites.md: the job scripts of each centre, rendered from the environment the page activated
    "sites": (False, [
        Step(f"fourd-mpi sweep render jobscripts/weak-gpt-tiny.yaml --site {site} --account {account} --out jobs/{out}",
             rf"manifest\.json to jobs/{out}/", activated=True)
        for site, account, out in (("perlmutter", "m1234", "pm"), ("frontier", "abc123", "frontier"),
                                   ("polaris", "MyProj", "polaris"), ("alps", "g123", "alps"))
    ]),
    # docs/guide/benchmarks.md: the peer benchmark (the peer extra: torch, AxoNN)
    "peer": (False, [
        Step("OMP_NUM_THREADS=1 .venv/bin/python -m bench.peer_axonn --ranks 4 --grids 2x2x1 --hidden 128 --seq 32 "
             "--batch 4 --steps 2 --warmup 1 --rounds 1", r"ratio"),
    ]),
    # docs/placement.md: an environment called by its full path, never activated
    "full-path": (True, [
        Step("~/venvs/fourd/bin/fourd-mpi sweep render jobscripts/weak-gpt-tiny.yaml     "
             "# --site local is the default", r"manifest\.json to results/weak-gpt-tiny/local/jobs/"),
        Step("~/venvs/fourd/bin/fourd-mpi sweep submit results/weak-gpt-tiny/local/jobs", r"4 submitted"),
    ]),
    # docs/multinode.md, docs/placement.md: the emulated cluster (root, network namespaces), a bed of the test's own
    "testbed": (True, [
        Step(BED_UP, r"test bed \w+ up"),
        Step(".venv/bin/fourd-mpi testbed status                              "
             "# nodes, addresses, link rates, bytes on each link", r"200mbit"),
        Step(".venv/bin/fourd-mpi testbed mpiexec -n 8 --ppn 4 -- fourd-mpi run --gx 2 --gy 2 --gz 2 --steps 4",
             r"(?s)2 node\(s\).*step time: median"),
        Step(".venv/bin/fourd-mpi testbed mpiexec -n 4 --ppn 2 -- fourd-mpi verify --grid 1x2x1x2 --grid 2x1x1x2 "
             "--steps 2", r"(?s)1x2x1x2.*\bz\b.*\bok\b.*2x1x1x2.*\bdata\b.*\bok\b.*2 passed, 0 failed"),
        Step(".venv/bin/fourd-mpi testbed mpiexec -n 8 --ppn 4 -- fourd-mpi bench collectives --ops "
             "iallgather,ireduce_scatter,iallreduce --min-size 2K --factor 4 --max-size 32K --iters 3 --min-time 0 "
             "--overlap-sizes 0 --no-in-place --accept-poor-fit -o bed-2x4.yaml --fallback laptop   "
             "# the tbf-shaped link: fits miss by 40-80 % rms", r"(?s)inter-node.*machine profile bed-2x4\.yaml"),
        Step(".venv/bin/fourd-mpi tune --ranks 8 --profile bed-2x4.yaml --ranks-per-node 4 --model gpt-tiny "
             "--hidden 256 --seq 64 --batch 8", r"valid grids"),
        Step(".venv/bin/fourd-mpi testbed down", r"removed .*namespace"),
    ]),
    # docs/multinode.md: the bed's own Slurm, and a sweep rendered for it
    "testbed-slurm": (True, [
        Step(".venv/bin/fourd-mpi testbed up --nodes 2 --slurm", r"Slurm started"),
        Step('eval "$(.venv/bin/fourd-mpi testbed env)"          # SLURM_CONF, UCX_TLS=tcp,self, FOURD_TESTBED', r"^$"),
        Step(".venv/bin/fourd-mpi sweep render jobscripts/weak-gpt-tiny.yaml --site emulated-slurm",
             r"manifest\.json to results/weak-gpt-tiny/emulated-slurm/jobs/"),
        Step(".venv/bin/fourd-mpi sweep submit results/weak-gpt-tiny/emulated-slurm/jobs   "
             "# sbatch --nodes=2 ...: ranks on both nodes", r"4 submitted"),
        Step(".venv/bin/fourd-mpi tune --ranks 8 --site emulated", r"valid grids"),
        # the test's own step, no page's: "half a minute later", until Slurm's queue is empty (at most 5 minutes)
        Step(SLURM_WAIT, r"(?s)8 ranks.*2 node\(s\)", page=False),
        Step(".venv/bin/fourd-mpi sweep status results/weak-gpt-tiny/emulated-slurm/jobs    "
             "# half a minute later: 4/4 traces complete", r"4/4 traces complete, 0 jobs failed"),
        Step(".venv/bin/fourd-mpi sweep collect results/weak-gpt-tiny/emulated-slurm/jobs   "
             "# the runs and the weak scaling, 1-8 ranks", r"(?s)weak-gpt-tiny-003-n8.*weak scaling"),
        Step(".venv/bin/fourd-mpi testbed down                                             # the Slurm daemons too",
             r"removed .*process"),
    ]),
    # docs/placement.md section 4: the bounded cross-node verification matrix, in one shell (E and OV)
    "verify-matrix": (True, [
        Step(BED_UP, r"test bed \w+ up"),
        Step('E=".venv/bin/fourd-mpi testbed mpiexec -n 8 --ppn 4 --"        '
             "# 4 nodes x 2: testbed up --nodes 4, then --ppn 2", r"^$"),
        Step('OV="--overlap none --overlap all,cache"', r"^$"),
        *(Step(command, ALL_PASSED) for command in MATRIX),
        Step(".venv/bin/fourd-mpi testbed down", r"removed .*namespace"),
    ]),
    # docs/multinode.md: bench/multinode.py's bounded form (it brings up and takes down a bed of its own)
    "multinode-bench": (True, [
        Step('OMP_NUM_THREADS=1 .venv/bin/python bench/multinode.py --repeats 1 --steps 2 --hidden 64 '
             '--overlap-repeats 1 --overlap-axis z --overlap-hidden 64 --overlap-batch 8 --launch-repeats 0 '
             '--calibration "--ops iallgather,ireduce_scatter,iallreduce --max-size 32K --iters 3 --min-time 0 '
             '--overlap-sizes 0 --no-in-place"',
             r"(?s)## 0\. calibration.*## 1\. placement.*^block +intra-node +inter-node +\d.*"
             r"^cyclic +inter-node +intra-node +\d.*## 2\. overlap.*^none +\d"),
    ]),
}

#: scenarios on the test bed (root, network namespaces), and those with its Slurm
BED_SCENARIOS = {"testbed", "testbed-slurm", "verify-matrix", "multinode-bench"}
SLURM_SCENARIOS = {"testbed-slurm"}

#: documented commands that another part of CI runs as typed, so they are not run again here:
#: command -> (the file that runs it, where and how); :func:`test_what_runs_elsewhere_is_there_as_typed` checks that
#: the file holds the command (its comment left out)
ALREADY: Dict[str, Tuple[str, str]] = {
    TOUR_RUN: (".ci/run", "the last part of README command 1, run in .ci/run's install stage "
                          "(tests/test_docs.py::test_ci_runs_the_readme_commands checks that it is the README's); "
                          "the tour scenario runs it with --show-config (docs/guide/runs.md)"),
}

#: documented commands that are not run here, and why
NOT_RUN: Dict[str, str] = {}

_CI_RUNS = ".ci/run runs this line as typed (tests/test_docs.py checks that it is .ci/run's)"
_SUITE = "the test suite itself, which this test is part of (.ci/run runs it: README command 2)"
_INSTALL = "installs into the environment the tests run in (.ci/run runs the installs of the extras)"
_CLUSTER = "a centre's modules, scheduler and MPI (Perlmutter, Frontier, Polaris, Alps): not on a CI machine"
_SPACK = "needs Spack, which CI has not (packaging/ci_check.sh builds the sdist and runs make_repo.py on it)"
_CUDA_MPI = ("builds and runs a CUDA-aware Open MPI (about 20 minutes; .ci/run's Open MPI stage runs the build and "
             "tests/openmpi.txt on it)")
_GPU = "needs a GPU"
for _command, _why in {
    # README.md, docs/index.md, docs/install.md, docs/contributing.md
    'python3 -m venv .venv && .venv/bin/pip install -q -e ".[mpich]" && ' + TOUR_RUN: _CI_RUNS,
    'python3 -m venv .venv && .venv/bin/pip install -q -e ".[mpich,test]" && .venv/bin/python -m pytest -q': _CI_RUNS,
    'python3 -m venv .venv && .venv/bin/pip install -e ".[mpich]"':
        "creates the environment: tests/packaging/test_base_install.py builds a fresh one with this command (CI)",
    '.venv/bin/pip install -q -e ".[docs]"': _INSTALL,
    ".venv/bin/mkdocs serve            # or browse it at http://127.0.0.1:8000, rebuilt on every save":
        "a server that runs until it is stopped; the line before builds what it serves",
    "OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_docs.py tests/trace": _SUITE,
    "FOURD_MPI_SLOW_TESTS=1 .venv/bin/python -m pytest -q tests/packaging/test_base_install.py": _SUITE,
    "yes >/dev/null & yes >/dev/null & OMP_NUM_THREADS=1 CI=true .venv/bin/python -m pytest -q; kill %1 %2": _SUITE,
    "FOURD_CI_HOGS=2 bash .ci/run               # the test stage with two CPU hogs beside it":
        "the whole of CI (up to 90 minutes), of which this test is a part",
    "FOURD_CI_DEPS=newest bash .ci/run          # the whole of CI against the newest releases (the drift check)":
        "the whole of CI (up to 90 minutes), of which this test is a part",
    "bash packaging/update_constraints.sh       # then regenerate constraints.txt, review the diff, commit it":
        "rewrites constraints.txt from the newest releases (a maintainer's step, reviewed by hand)",
    "P=$(bash packaging/cuda-mpi/build.sh openmpi | tail -n 1)": _CUDA_MPI,
    'python3 -m venv .venv-ompi && .venv-ompi/bin/pip install -q -e ".[test]" && .venv-ompi/bin/pip install -q '
    '--no-deps --force-reinstall "$P"/wheels/mpi4py-*.whl': _CUDA_MPI,
    "(source \"$P/env.sh\" && OMP_NUM_THREADS=1 .venv-ompi/bin/python -m pytest -q $(grep -v '^#' tests/openmpi.txt))":
        _CUDA_MPI,
    # docs/guide/gpu-mpi.md
    "bash packaging/cuda-mpi/build.sh openmpi   # Open MPI 4.1 --with-cuda: smcuda (CUDA IPC on one node)": _CUDA_MPI,
    "bash packaging/cuda-mpi/build.sh mpich     # MPICH 4.0 --with-cuda: yaksa GPU kernels for sm_90": _CUDA_MPI,
    "P=$(bash packaging/cuda-mpi/build.sh openmpi)": _CUDA_MPI,
    'source "$P/env.sh"': _CUDA_MPI,
    'python3 -m venv .venv-ompi && .venv-ompi/bin/pip install -q "$P"/wheels/mpi4py-*.whl -e ".[test]"': _CUDA_MPI,
    "mpiexec --oversubscribe -n 4 .venv-ompi/bin/fourd-mpi verify --all-grids   # as root: --allow-run-as-root":
        _CUDA_MPI,
    # docs/guide/benchmarks.md
    '.venv/bin/pip install -e ".[mpich,peer]"    # CPU: torch==2.13.0 is the CPU wheel in pip\'s find-links here':
        _INSTALL,
    "OMP_NUM_THREADS=1 mpiexec -n 4 python bench/gpu_bench.py --json gpu.json": _GPU,
    # docs/guide/commands.md
    '.venv/bin/pip install -e ".[completion]"': _INSTALL,
    # docs/guide/clusters.md, docs/sites.md: at a centre
    "module load PrgEnv-gnu cray-mpich            # or your site's MPI module": _CLUSTER,
    'MPICC="$(which mpicc)" python -m pip install --no-cache-dir --no-binary=mpi4py mpi4py': _CLUSTER,
    'python -m pip install -e ".[gpu]"            # add the CuPy extra on GPU nodes': _CLUSTER,
    "srun -n 16 --ntasks-per-node=4 --gpus-per-node=4 bash -c 'CUDA_VISIBLE_DEVICES=$SLURM_LOCALID exec fourd-mpi run "
    "--gx 2 --gy 2 --gz 2 --gdata 2 --model gpt-5b --batch 32'": _CLUSTER + "; GPUs",
    "srun -n 8 nsys profile --trace=cuda,nvtx,mpi -o prof-%q{SLURM_PROCID} fourd-mpi run --nvtx --steps 5 ...":
        _CLUSTER + "; GPUs and Nsight Systems",
    "python -m build --sdist --outdir dist .": _SPACK,
    "python packaging/spack/make_repo.py ~/spack-fourd --sdist dist/fourd_mpi-0.1.0.tar.gz": _SPACK,
    "spack repo add ~/spack-fourd/spack_repo/fourd_mpi && spack install py-fourd-mpi+analysis": _SPACK,
    "spack repo add ~/spack-fourd/spack_repo/fourd_mpi": _SPACK,
    "spack install py-fourd-mpi+analysis          # the MPI from packages.yaml (an external: cray-mpich, ...)": _SPACK,
    "ldd \"$(python -c 'import mpi4py.MPI as m; print(m.__file__)')\" | grep gtl   # libmpi_gtl_cuda or libmpi_gtl_hsa":
        _CLUSTER + " (Cray MPICH's GPU transport library)",
    "module load PrgEnv-gnu cudatoolkit craype-accel-nvidia80 cray-mpich python": _CLUSTER,
    "python -m venv ~/venvs/fourd && source ~/venvs/fourd/bin/activate": _CLUSTER,
    'MPICC="cc -target-accel=nvidia80 -shared" pip install --force-reinstall --no-cache-dir --no-binary=mpi4py mpi4py':
        _CLUSTER,
    'pip install "fourd_mpi[gpu]"           # from a checkout: pip install ".[gpu]"': _CLUSTER,
    "module load PrgEnv-gnu/8.7.0 cpe/26.03 miniforge3/23.11.0-0 rocm/7.0.2 craype-accel-amd-gfx90a": _CLUSTER,
    'export LD_LIBRARY_PATH="$CRAY_LD_LIBRARY_PATH:$LD_LIBRARY_PATH" ROCM_HOME="$ROCM_PATH"': _CLUSTER,
    ('module unload rocm; MPICC="cc -shared" pip install --no-cache-dir --no-binary=mpi4py mpi4py; '
     'module load rocm/7.0.2'): _CLUSTER,
    'pip install "fourd_mpi[rocm]"          # CuPy for ROCm 7.0 (cupy-rocm-7-0); or OLCF\'s amd-cupy, below': _CLUSTER,
    "module use /soft/modulefiles; module load craype-accel-nvidia80 conda; conda activate base": _CLUSTER,
    "python -m venv --system-site-packages ~/venvs/fourd && source ~/venvs/fourd/bin/activate": _CLUSTER,
    "pip install .                          # mpi4py (Cray MPICH + GTL) and CuPy come from ALCF's conda": _CLUSTER,
    "uenv start --view=default prgenv-gnu/25.6:v2": _CLUSTER,
    'unset PYTHONPATH; export PYTHONUSERBASE="$(dirname "$(dirname "$(which python)")")"': _CLUSTER,
    "MPICC=mpicc pip install --no-cache-dir --no-binary=mpi4py mpi4py   # the uenv's cray-mpich, GTL linked": _CLUSTER,
    'pip install "fourd_mpi[gpu]"                                       # cupy-cuda12x has aarch64 wheels': _CLUSTER,
    "for i in 1 2 3 4 5; do reframe -C YOUR_CONFIG.py -c packaging/reframe/fourd_mpi_check.py -n "
    "'FourdMpiRunCheck%site=perlmutter%grid=1x2x2x4' -r; done":
        _CLUSTER + "; ReFrame with the centre's configuration (.ci/run runs the check with "
                   "packaging/reframe/config_local.py on the local scheduler)",
    "python packaging/reframe/fourd_reference.py --system perlmutter:gpu --site perlmutter --grid 1x2x2x4 "
    "'output/perlmutter/gpu/*/FourdMpiRunCheck_*/index.jsonl'":
        "reads the ReFrame runs of the line before it, at a centre; tests/packaging/test_recipes.py runs "
        "fourd_reference.py on an index of runs",
    # docs/guide/regressions.md
    "for i in $(seq 0 11); do\n  [ $((i % 2)) = 0 ] && order=\"old new\" || order=\"new old\"\n  for side in $order; "
    "do\n    mpiexec -n 8 $side/.venv/bin/fourd-mpi run --gx 8 --model gpt-tiny --results-dir results --label "
    "$side\n  done\ndone":
        "needs two installs of different versions (old/ and new/, e.g. two worktrees with their .venv); "
        "the quiet-machine scenario runs the same loop with one install (docs/guide/regressions.md)",
    "fourd-mpi compare label=new --baseline label=old   # auto: 12 pairs": "compares the runs of the loop before it",
    # docs/guide/sweeps.md
    ".venv/bin/fourd-mpi sweep submit results/weak-gpt-tiny/perlmutter/jobs    # sbatch / qsub / bsub; records job ids":
        "submits to Perlmutter's Slurm (sbatch of a real site); tests/jobs/test_readme_sweep.py submits the same "
        "sweep rendered for the local site, and tests/testbed to the emulated cluster's Slurm",
}.items():
    NOT_RUN[_command] = _why


def scenario_commands() -> List[str]:
    return [step.command for _, steps in SCENARIOS.values() for step in steps if step.page]


def test_every_documented_command_is_run_or_listed():
    docs = documented()
    covered = set(scenario_commands()) | set(ALREADY) | set(NOT_RUN)
    missing = {c: p for c, p in docs.items() if c not in covered}
    assert missing == {}, ("documented commands neither run by a scenario nor listed in ALREADY or NOT_RUN "
                           f"(tests/test_docs_commands.py): {missing}")
    stale = sorted(c for c in covered if c not in docs)
    assert stale == [], f"commands of tests/test_docs_commands.py that no page shows any more: {stale}"
    run, elsewhere, listed = set(scenario_commands()), set(ALREADY), set(NOT_RUN)
    assert not (run & elsewhere or run & listed or elsewhere & listed), "a command in two of the tables"


def test_what_runs_elsewhere_is_there_as_typed():
    for command, (path, _) in ALREADY.items():
        typed = re.sub(r"\s+#.*$", "", command)
        assert typed in (REPO / path).read_text(), f"{path} does not run {typed!r} (ALREADY)"


def test_the_reader_sees_continued_lines_and_loops_as_one_command():
    body = "# a comment\nfourd-mpi run \\\n    --steps 2   # two\n\nfor i in 1 2; do\n  echo $i\ndone\n"
    assert logical_lines(body) == ["fourd-mpi run --steps 2   # two", "for i in 1 2; do\n  echo $i\ndone"]
    one_line = "for A in a b; do echo $A; done   # both"
    assert logical_lines(f"{one_line}\nE=x\n") == [one_line, "E=x"]
    text = "```console\n$ fourd-mpi tune\nout\n```\n\n  ```bash\n  fourd-mpi trace show T.h5\n  ```\n```text\nx\n```\n"
    assert commands_of(text) == ["fourd-mpi tune", "fourd-mpi trace show T.h5"]


# -- running them ---------------------------------------------------------------------------------------------------

def checkout(root: Path) -> Path:
    """A directory laid out like a clone after README command 1: ``.venv`` (the running environment), the
    committed inputs the commands read, and an empty ``results/`` (but the committed results the pages read)."""
    root.mkdir(parents=True, exist_ok=True)
    os.symlink(sys.prefix, root / ".venv")
    for name in ("bench", "docs", "packaging", "mkdocs.yml"):
        os.symlink(REPO / name, root / name)
    (root / "results" / "benchmarks").mkdir(parents=True)
    for name in ("samples", "baselines"):
        os.symlink(REPO / "results" / name, root / "results" / name)
    for name in ("multinode-ranking",):  # a committed report the pages read (a copy: nothing writes into the repo)
        shutil.copytree(REPO / "results" / "benchmarks" / name, root / "results" / "benchmarks" / name)
    shutil.copytree(REPO / "jobscripts", root / "jobscripts", ignore=shutil.ignore_patterns("weak-gpt-tiny"))
    (root / "home" / "venvs").mkdir(parents=True)
    os.symlink(sys.prefix, root / "home" / "venvs" / "fourd")  # docs/placement.md's environment by full path
    return root


def login_path() -> str:
    """``PATH`` of a login shell: this one's without the running environment's ``bin/``."""
    return os.pathsep.join(d for d in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                           if d and Path(d).resolve() != VENV_BIN.resolve())


def user_env(root: Path) -> Dict[str, str]:
    """A login shell's environment: no environment's bin/ on PATH, no environment activated, HOME here."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = login_path()
    env["HOME"] = str(root / "home")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


_BEGIN = "\x1ebegin"
_END = "\x1eend"


def shell_script(steps: List[Step], root: Path) -> str:
    """The steps as one shell session types them: each command as the page shows it, between two marker lines
    (step number, exit status, ``$EPOCHREALTIME``); the session stops at a status the step does not allow. A
    step marked ``activated`` runs with the environment's ``bin/`` first on ``PATH``, as ``activate`` puts it."""
    venv = shlex.quote(str(root / ".venv"))
    lines, activated = [], False
    for i, step in enumerate(steps):
        if step.activated != activated:
            lines.append(f"export VIRTUAL_ENV={venv} PATH={venv}/bin:\"$PATH\"" if step.activated else
                         f"export PATH={shlex.quote(login_path())}; unset VIRTUAL_ENV")
            activated = step.activated
        lines += [f"printf '\\n{_BEGIN} {i} %s\\n' \"$EPOCHREALTIME\"",
                  step.command,
                  f"__rc=$?; printf '\\n{_END} {i} %s %s\\n' \"$__rc\" \"$EPOCHREALTIME\"",
                  f"case $__rc in {'|'.join(map(str, step.status))}) ;; *) exit 90 ;; esac"]
    return "\n".join(lines) + "\n"


@dataclass
class Ran:
    command: str
    out: str
    status: Optional[int]  #: None: the session ended (or was stopped) before the command did
    seconds: float


def split_session(steps: List[Step], transcript: str) -> List[Ran]:
    """Each step's output, exit status and duration, read back between the markers of :func:`shell_script`."""
    ran = []
    for i, step in enumerate(steps):
        begin = re.search(rf"^{_BEGIN} {i} ([0-9.]+)\n", transcript, re.M)
        if not begin:
            break
        end = re.compile(rf"\n{_END} {i} (\d+) ([0-9.]+)$", re.M).search(transcript, begin.end() - 1)
        text = transcript[begin.end():end.start() if end else len(transcript)]
        ran.append(Ran(step.command, text, int(end.group(1)) if end else None,
                       float(end.group(2)) - float(begin.group(1)) if end else float("nan")))
    return ran


#: a scenario's shell is stopped after this long, before pytest's own timeout (600 s) would cut its transcript
SESSION_LIMIT = 570


def run_session(steps: List[Step], root: Path, env: Dict[str, str]) -> Tuple[List[Ran], str]:
    """One ``bash`` for all the steps, in ``root``; what each step printed, and a note when the shell was stopped
    (its process group, after the steps' timeouts together or :data:`SESSION_LIMIT`)."""
    script, log = root / ".session.sh", root / ".session.log"
    script.write_text(shell_script(steps, root))
    limit = min(sum(step.timeout for step in steps), SESSION_LIMIT)
    note = ""
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", str(script)], cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            note = f"\n[the shell was stopped after {limit:.0f} s]"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # and whatever it left running
            proc.wait()
    return split_session(steps, log.read_bytes().decode(errors="replace")), note


def check_session(name: str, steps: List[Step], ran: List[Ran], note: str = "") -> None:
    """Every step ran, with an allowed exit status, no 'command not found', and its expected output."""
    timings = "\n".join(f"  {r.seconds:7.1f} s  {r.command.splitlines()[0][:100]}" for r in ran)
    print(f"scenario {name}:\n{timings}")
    for step, r in zip(steps, ran):
        where = f"{step.command!r} (scenario {name}):\n{r.out[-4000:]}{note}"
        assert r.status is not None, f"did not finish: {where}"
        assert r.status in step.status, f"exited {r.status} (expected {step.status}): {where}"
        assert "command not found" not in r.out and "execvp error" not in r.out, where
        assert re.search(step.expect, r.out, re.M), f"no match for {step.expect!r}: {where}"
    assert len(ran) == len(steps), f"scenario {name} stopped before {steps[len(ran)].command!r}{note}"


def _unavailable(why: str):
    if IN_CI:
        pytest.fail(why)
    pytest.skip(why)


def _needs(name: str, mpi: bool):
    if mpi and not (VENV_BIN / "mpiexec").exists():
        _unavailable(f"no mpiexec in {VENV_BIN} (the mpich extra): the pages launch .venv/bin/mpiexec")
    for module, extra in {"site": [("mkdocs", "test")], "peer": [("torch", "peer"), ("axonn", "peer")]}.get(name, []):
        try:
            __import__(module)
        except ImportError:
            _unavailable(f"{module} is not installed: .venv/bin/pip install -e '.[mpich,{extra}]'")
    if name in BED_SCENARIOS:
        from fourd_mpi.testbed import bed, slurm

        why = bed.why_unavailable()
        if not why and name in SLURM_SCENARIOS and slurm.missing_programs():
            why = f"Slurm is not installed ({', '.join(slurm.missing_programs())} missing)"
        if why:
            _unavailable(f"the test bed: {why}")


@contextlib.contextmanager
def own_bed(name: str, env: Dict[str, str]):
    """The pages' test bed under a name and a state directory of this test's own (``$FOURD_TESTBED``,
    ``$FOURD_TESTBED_STATE``, both documented), so a bed ``fourd`` of the machine's user, another session's beds
    and a ``testbed down --all`` elsewhere are never touched. Every bed of that directory (also one that
    ``bench/multinode.py`` brought up) is taken down afterwards, also after a failure or a timeout.

    The directory is short (Slurm's job-step sockets live under it: at most 107 characters) and the name ends
    in a letter: the mpich wheel's hydra cannot read a Slurm node list like ``d2-n1`` (a name ending in a digit
    larger than the node's number: "node list format not recognized"), which a single-node job gets."""
    env["FOURD_TESTBED"] = f"d{os.getpid() % 10 ** 6}{'abcdefgh'[sorted(BED_SCENARIOS).index(name)]}"
    env["FOURD_TESTBED_STATE"] = tempfile.mkdtemp(prefix="fourd-docs-",
                                                  dir="/tmp" if os.path.isdir("/tmp") else None)
    try:
        yield env
    finally:
        done = subprocess.run([sys.executable, "-m", "fourd_mpi", "testbed", "down", "--all"], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"testbed down --all in {env['FOURD_TESTBED_STATE']}: {done.stderr}"
        shutil.rmtree(env["FOURD_TESTBED_STATE"], ignore_errors=True)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_documented_commands_run_as_typed(name, tmp_path, request):
    mpi, steps = SCENARIOS[name]
    if mpi:
        request.applymarker(pytest.mark.mpi)
    _needs(name, mpi)
    root = checkout(tmp_path / "clone")
    env = user_env(root)
    with own_bed(name, env) if name in BED_SCENARIOS else contextlib.nullcontext(env):
        ran, note = run_session(steps, root, env)
    check_session(name, steps, ran, note)
