"""Every command of README.md and docs/, run as typed, from a shell where the environment is not activated.

The commands are read from the pages: every line of a ``bash`` (``sh``, ``shell``) code block and every ``$ ``
line of a ``console`` block (a line continued with ``\\`` and a ``for ... done`` loop are one command). Each one
is either a step of a :data:`SCENARIOS` entry, run here with its exit status and a check of its output, or in
:data:`NOT_RUN` with the reason; a command in neither (a new or edited line of a page) fails
:func:`test_every_documented_command_is_run_or_listed`, and so does a table entry no page shows any more.

How a scenario runs: in a fresh directory laid out like a clone (``.venv`` is the environment running the tests,
as README command 1 makes it; the committed inputs ``results/samples``, ``results/baselines``, ``jobscripts``,
``bench``, ``docs`` beside it), one ``bash -c`` per command in the page's order, with ``PATH`` holding no
``bin/`` of the environment (``VIRTUAL_ENV`` unset, ``HOME`` a directory of its own): what a user who
followed the README types. A step marked ``activated`` comes from a page that activates an environment
first (``source .../bin/activate``): its shell has the environment's ``bin/`` on ``PATH``, as the page says.

Sizes are the pages' own; where a page's command ran for minutes it was changed on the page to a bounded form
(fewer steps, sizes, repeats) that still shows what the command does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from conftest import REPO

IN_CI = os.environ.get("CI", "").lower() == "true"
VENV_BIN = Path(sys.executable).parent

# -- reading the commands from the pages ------------------------------------------------------------------------

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
SHELL = {"bash", "sh", "shell"}
_OPEN = re.compile(r"^(for|while|until|if|case)\b")
_CLOSE = re.compile(r"^(done|fi|esac)\b")


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


TOUR_RUN = ("OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 .venv/bin/fourd-mpi run --gx 2 --gy 2 --gz 2 "
            "--model gpt-tiny --steps 10")
LATEST = '"$(ls -t results/*.h5 | head -n 1)"'

#: name -> the steps, run in order in one directory; ``mpi``: launches mpiexec with several ranks
SCENARIOS: Dict[str, Tuple[bool, List[Step]]] = {
    # README's tour, then what the guide does with the runs it leaves in results/
    "tour": (True, [
        Step(TOUR_RUN, r"(?s)on grid 1x2x2x2 \(DxZxYxX\), 8 ranks on 1 node.*step time: median .*"
                       r"trace: results/\S+\.h5"),
        Step("OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 .venv/bin/fourd-mpi verify --gx 2 --gy 2 --gz 2 --model gpt-tiny",
             r"1x2x2x2 .* ok\n1 passed, 0 failed"),
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
        # docs/guide/runs.md: the tour's run with its full configuration (last: the steps above count one run)
        Step(TOUR_RUN + " --show-config", r"(?s)^resolved configuration \(reusable as --config FILE\.toml\):\n"
                                          r".*4D grid G_data x G_z x G_y x G_x = 1x2x2x2 on 8 ranks.*"
                                          r"step time: median .*trace: results/\S+\.h5"),
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
        Step("OMP_NUM_THREADS=1 .venv/bin/python bench/algorithms.py --cases best4d,megatron1d --repeats 1 "
             "--steps 2 --warmup 1 --plot results/benchmarks/algorithms.png   # measured side by side",
             r"wrote results/benchmarks/algorithms\.png|algorithms\.png"),
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
             "megatron1d --grid 16x1x8x1 --stages 6 --schedule interleaved --chunks-per-stage 7 --microbatch-size 1 "
             "--dtype float16 --attention unfused --overlap none", r"MFU \d"),
        Step(".venv/bin/fourd-mpi model published --dataset all   # or narayanan_sc21, axonn_sc24, "
             "narayanan_sc21_table2, megatron_readme_2020", r"Narayanan"),
        Step(".venv/bin/fourd-mpi tune --ranks 64 --model gpt-5b --batch 64 --site perlmutter --top 5 "
             "--memory-limit 40 --emit-sweep tune.yaml", r"tune\.yaml"),
    ]),
    # docs/guide/sweeps.md: rendered for Perlmutter here; submitted only there (NOT_RUN)
    "sweeps": (False, [
        Step(".venv/bin/fourd-mpi sweep plan   jobscripts/weak-gpt-tiny.yaml --site perlmutter --account m1234",
             r"4 runs on site perlmutter"),
        Step(".venv/bin/fourd-mpi sweep render jobscripts/weak-gpt-tiny.yaml --site perlmutter --account m1234",
             r"manifest\.json to jobscripts/weak-gpt-tiny/"),
        Step(".venv/bin/fourd-mpi sweep status jobscripts/weak-gpt-tiny      # scheduler state and trace of every run",
             r"0/4 traces complete, 0 jobs failed"),
        # before the jobs ran on Perlmutter: one line per missing trace, exit 2
        Step(".venv/bin/fourd-mpi sweep collect jobscripts/weak-gpt-tiny     # check the traces, runs + scaling tables",
             r"no traces yet \(4 missing\)", (2,)),
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
        Step("OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 .venv/bin/python bench/step_bench.py --model gpt-tiny "
             "--grids 1x2x2x2,8x1x1x1 --steps 2 --warmup 1 --repeats 1", r"1x2x2x2(?s:.*)8x1x1x1"),
        Step("OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 .venv/bin/python bench/recompute_bench.py --gx 2 --gy 2 --gz 2 "
             "--model gpt-tiny --steps 1 --repeats 1", r"selective(?s:.*)full"),
        Step("OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 .venv/bin/python bench/overlap_bench.py --configs comm-heavy "
             "--steps 2 --warmup 1", r"comm-heavy"),
        Step("OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 .venv/bin/python bench/trace_overhead.py --repeats 4 "
             "--merge-events 10000 --merge-repeats 1", r"(?s)op.*step.*events per second|events/s"),
    ]),
    # docs/guide/model-and-tuning.md: measure, calibrate against traces, validate
    "model-and-tuning": (True, [
        Step("OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 .venv/bin/fourd-mpi bench collectives --max-size 64K "
             "--min-time 0 --accept-poor-fit -o results/profiles/$(hostname).yaml", r"# Avg bus bandwidth"),
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
        Step("OMP_NUM_THREADS=1 .venv/bin/python bench/peer_axonn.py --ranks 8 --grids 2x2x2 --hidden 256 --rounds 1",
             r"ratio"),
    ]),
    # docs/placement.md: an environment called by its full path, never activated
    "full-path": (True, [
        Step("~/venvs/fourd/bin/fourd-mpi sweep render jobscripts/weak-gpt-tiny.yaml     "
             "# --site local is the default", r"manifest\.json to jobscripts/weak-gpt-tiny/"),
        Step("~/venvs/fourd/bin/fourd-mpi sweep submit jobscripts/weak-gpt-tiny", r"4 submitted"),
    ]),
    # docs/multinode.md, docs/placement.md: the emulated cluster (root, network namespaces)
    "testbed": (True, [
        Step('.venv/bin/fourd-mpi testbed up --nodes 2 --rate 200mbit        # bed "fourd": nodes fourd-n1, fourd-n2',
             r"up|already up"),
        Step(".venv/bin/fourd-mpi testbed status                              "
             "# nodes, addresses, link rates, bytes on each link", r"200mbit"),
        Step(".venv/bin/fourd-mpi testbed mpiexec -n 8 --ppn 4 -- fourd-mpi run --gx 2 --gy 2 --gz 2 --steps 4",
             r"8 ranks on 2 node\(s\), 4 per node(?s:.*)step time: median"),
        Step(".venv/bin/fourd-mpi testbed mpiexec -n 4 --ppn 2 -- fourd-mpi verify --grid 1x2x1x2 --grid 2x1x1x2 "
             "--steps 2", r"2 passed, 0 failed"),
        Step(".venv/bin/fourd-mpi testbed mpiexec -n 8 --ppn 4 -- fourd-mpi bench collectives --min-size 2K "
             "--factor 4 --max-size 2M --min-time 0 --accept-poor-fit -o bed-2x4.yaml --fallback laptop   "
             "# the tbf-shaped link: fits miss by 59-74 % rms", r"bed-2x4\.yaml"),
        Step(".venv/bin/fourd-mpi tune --ranks 8 --profile bed-2x4.yaml --ranks-per-node 4 --model gpt-tiny "
             "--hidden 256 --seq 64 --batch 8", r"valid grids"),
        Step(".venv/bin/fourd-mpi testbed down", r"removed|namespace"),
    ]),
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
# not run yet, though CI could (root, network namespaces and Debian's Slurm are there): each takes minutes to hours
_EMULATED_SLURM = ("the emulated cluster with its own Slurm: not run line by line yet; tests/testbed/test_testbed.py "
                   "renders and runs an emulated-slurm sweep on such a bed")
_MULTINODE_BENCH = ("regenerates a committed multi-node benchmark (hours on 2 cores); not run yet: a bounded form "
                    "for the page is still to be written")
_MATRIX = ("a template (PPN, A, S and $OV stand for the values the page lists) of the cross-node verification "
           "matrix, hours on 2 cores; the testbed scenario runs one cross-node verify as typed")
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
    "module load PrgEnv-gnu cpe miniforge3 rocm/7.0.2 craype-accel-amd-gfx90a": _CLUSTER,
    'export LD_LIBRARY_PATH="$CRAY_LD_LIBRARY_PATH:$LD_LIBRARY_PATH" ROCM_HOME="$ROCM_PATH"': _CLUSTER,
    'module unload rocm; MPICC="cc -shared" pip install --no-cache-dir --no-binary=mpi4py mpi4py; module load rocm/7.0.2':
        _CLUSTER,
    'pip install "fourd_mpi[rocm]"          # CuPy for ROCm 7.0 (cupy-rocm-7-0); or OLCF\'s amd-cupy, below': _CLUSTER,
    "module use /soft/modulefiles; module load craype-accel-nvidia80 conda; conda activate base": _CLUSTER,
    "python -m venv --system-site-packages ~/venvs/fourd && source ~/venvs/fourd/bin/activate": _CLUSTER,
    "pip install .                          # mpi4py (Cray MPICH + GTL) and CuPy come from ALCF's conda": _CLUSTER,
    "uenv start --view=default prgenv-gnu/25.6:v2": _CLUSTER,
    'unset PYTHONPATH; export PYTHONUSERBASE="$(dirname "$(dirname "$(which python)")")"': _CLUSTER,
    "MPICC=mpicc pip install --no-cache-dir --no-binary=mpi4py mpi4py   # the uenv's cray-mpich, GTL linked": _CLUSTER,
    'pip install "fourd_mpi[gpu]"                                       # cupy-cuda12x has aarch64 wheels': _CLUSTER,
    # docs/guide/regressions.md
    "for i in $(seq 0 11); do\n  [ $((i % 2)) = 0 ] && order=\"old new\" || order=\"new old\"\n  for side in $order; "
    "do\n    mpiexec -n 8 $side/.venv/bin/fourd-mpi run --gx 8 --model gpt-tiny --results-dir results --label "
    "$side\n  done\ndone":
        "needs two installs of different versions (old/ and new/, e.g. two worktrees with their .venv); "
        "bench/compare_calibration.py makes such interleaved runs of one install",
    "fourd-mpi compare label=new --baseline label=old   # auto: 12 pairs": "compares the runs of the loop before it",
    # docs/multinode.md, docs/placement.md
    ".venv/bin/fourd-mpi testbed up --nodes 2 --slurm": _EMULATED_SLURM,
    'eval "$(.venv/bin/fourd-mpi testbed env)"          # SLURM_CONF, UCX_TLS=tcp,self, FOURD_TESTBED': _EMULATED_SLURM,
    ".venv/bin/fourd-mpi sweep render jobscripts/weak-gpt-tiny.yaml --site emulated-slurm": _EMULATED_SLURM,
    ".venv/bin/fourd-mpi sweep submit jobscripts/weak-gpt-tiny     # sbatch --nodes=2 ...: ranks on both nodes":
        _EMULATED_SLURM,
    ".venv/bin/fourd-mpi tune --ranks 8 --site emulated": _EMULATED_SLURM,
    "OMP_NUM_THREADS=1 python bench/multinode.py --repeats 3 --overlap-repeats 3 --overlap-axis z --overlap-hidden 256 "
    "--overlap-batch 32 --rank-repeats 2 --rank-layouts 2x4,4x2 --algorithm-repeats 3 --launch-repeats 0 --output "
    "results/benchmarks/multinode.txt": _MULTINODE_BENCH,
    "OMP_NUM_THREADS=1 python bench/multinode.py --skip-placement --rank-repeats 2 --rank-layouts 2x4,4x2 "
    "--launch-repeats 0 --output results/benchmarks/multinode-ranking/multinode-ranking.txt": _MULTINODE_BENCH,
    "python bench/multinode.py --from-results results/benchmarks/multinode-ranking/multinode-ranking.txt  # offline":
        _MULTINODE_BENCH,
    "OMP_NUM_THREADS=1 python bench/multinode.py --skip-placement --overlap-repeats 3 --overlap-axis z "
    "--overlap-hidden 256 --overlap-layers 8 --overlap-batch 32,64,128 --overlap-poll-flops 1e7,1e9 --steps 3 "
    "--launch-repeats 0 --output results/benchmarks/multinode-overlap.txt": _MULTINODE_BENCH,
    'E="fourd-mpi testbed mpiexec -n 8 --ppn PPN --"   # after testbed up --nodes 8/PPN': _MATRIX,
    "$E fourd-mpi verify --dtype float64 --steps 2 --algorithm A --all-grids --model mlp-tiny $OV   "
    "# A = axonn4d, megatron1d, fsdp, dp, optimus3d": _MATRIX,
    "$E fourd-mpi verify --dtype float64 --steps 2 --algorithm axonn4d --all-grids --model gpt-tiny --overlap none "
    "--overlap all,cache --recompute none --recompute full": _MATRIX,
    "$E fourd-mpi verify --dtype float64 --steps 2 --algorithm optimus3d --all-grids --model gpt-tiny --overlap none "
    "--overlap all": _MATRIX,
    "$E fourd-mpi verify --dtype float64 --steps 2 --algorithm pipeline --pipeline-schedule S --ginter 2 --all-grids "
    "--model gpt-tiny --batch 16 --microbatches 2 $OV   # S = axonn, 1f1b": _MATRIX,
    "$E fourd-mpi verify --dtype float64 --steps 2 --algorithm pipeline --ginter 4 --all-grids --model gpt-tiny "
    "--layers 4 --batch 16 --microbatches 2 $OV": _MATRIX,
    # docs/guide/sweeps.md
    ".venv/bin/fourd-mpi sweep submit jobscripts/weak-gpt-tiny      # sbatch / qsub / bsub; records job ids":
        "submits to Perlmutter's Slurm (sbatch of a real site); tests/jobs/test_readme_sweep.py submits the same "
        "sweep rendered for the local site, and tests/testbed to the emulated cluster's Slurm",
}.items():
    NOT_RUN[_command] = _why


def scenario_commands() -> List[str]:
    return [step.command for _, steps in SCENARIOS.values() for step in steps]


def test_every_documented_command_is_run_or_listed():
    docs = documented()
    covered = set(scenario_commands()) | set(NOT_RUN)
    missing = {c: p for c, p in docs.items() if c not in covered}
    assert missing == {}, ("documented commands neither run by a scenario nor listed in NOT_RUN with a reason "
                           f"(tests/test_docs_commands.py): {missing}")
    stale = sorted(c for c in covered if c not in docs)
    assert stale == [], f"commands of tests/test_docs_commands.py that no page shows any more: {stale}"
    assert not set(scenario_commands()) & set(NOT_RUN)


def test_the_reader_sees_continued_lines_and_loops_as_one_command():
    body = "# a comment\nfourd-mpi run \\\n    --steps 2   # two\n\nfor i in 1 2; do\n  echo $i\ndone\n"
    assert logical_lines(body) == ["fourd-mpi run --steps 2   # two", "for i in 1 2; do\n  echo $i\ndone"]
    text = "```console\n$ fourd-mpi tune\nout\n```\n\n  ```bash\n  fourd-mpi trace show T.h5\n  ```\n```text\nx\n```\n"
    assert commands_of(text) == ["fourd-mpi tune", "fourd-mpi trace show T.h5"]


# -- running them ---------------------------------------------------------------------------------------------------

def checkout(root: Path) -> Path:
    """A directory laid out like a clone after README command 1: ``.venv`` (the running environment), the
    committed inputs the commands read, and an empty ``results/`` (but its committed subdirectories)."""
    root.mkdir(parents=True, exist_ok=True)
    os.symlink(sys.prefix, root / ".venv")
    for name in ("bench", "docs", "packaging", "mkdocs.yml"):
        os.symlink(REPO / name, root / name)
    (root / "results" / "benchmarks").mkdir(parents=True)
    for name in ("samples", "baselines"):
        os.symlink(REPO / "results" / name, root / "results" / name)
    shutil.copytree(REPO / "jobscripts", root / "jobscripts", ignore=shutil.ignore_patterns("weak-gpt-tiny"))
    (root / "home" / "venvs").mkdir(parents=True)
    os.symlink(sys.prefix, root / "home" / "venvs" / "fourd")  # docs/placement.md's environment by full path
    return root


def user_env(root: Path, activated: bool) -> Dict[str, str]:
    """A login shell's environment: no environment's bin/ on PATH (unless the page activated one), HOME here."""
    keep = [d for d in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
            if d and Path(d).resolve() != VENV_BIN.resolve()]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(([str(root / ".venv" / "bin")] if activated else []) + keep)
    if activated:
        env["VIRTUAL_ENV"] = str(root / ".venv")
    env["HOME"] = str(root / "home")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def _needs(mpi: bool):
    if mpi and not (VENV_BIN / "mpiexec").exists():
        why = f"no mpiexec in {VENV_BIN} (the mpich extra): the pages launch .venv/bin/mpiexec"
        if IN_CI:
            pytest.fail(why)
        pytest.skip(why)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_documented_commands_run_as_typed(name, tmp_path, request):
    mpi, steps = SCENARIOS[name]
    if mpi:
        request.applymarker(pytest.mark.mpi)
    _needs(mpi)
    for module, extra in {"site": [("mkdocs", "test")], "peer": [("torch", "peer"), ("axonn", "peer")]}.get(name, []):
        try:
            __import__(module)
        except ImportError:
            why = f"{module} is not installed: .venv/bin/pip install -e '.[mpich,{extra}]'"
            if IN_CI:
                pytest.fail(why)
            pytest.skip(why)
    root = checkout(tmp_path / "clone")
    for step in steps:
        done = subprocess.run(["bash", "-c", step.command], cwd=root, env=user_env(root, step.activated),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=step.timeout)
        out = done.stdout
        assert done.returncode in step.status, \
            f"{step.command!r} exited {done.returncode} (expected {step.status}):\n{out[-4000:]}"
        assert "command not found" not in out and "execvp error" not in out, f"{step.command!r}:\n{out[-4000:]}"
        assert re.search(step.expect, out, re.M), f"{step.command!r}: no match for {step.expect!r} in:\n{out[-4000:]}"
