"""The default install does the whole user journey (docs/install.md).

After README command 1 (``pip install -e ".[mpich]"``, no other extra) every command of the journey
either works or says in exactly one line which extra to install (exit 2), never a traceback.

- :func:`test_the_base_install_does_the_journey` builds a fresh venv of that install (pip's cache is
  reused) and runs the journey from it: a 2-rank run, analyze, plot, export, model, tune, sweep
  plan/render, trace show/check, compare, results list. It takes minutes, so it runs where ``CI=true``
  (``.ci/run``) or ``FOURD_MPI_SLOW_TESTS=1`` and is skipped elsewhere with that reason.
- :func:`test_a_missing_package_is_one_line` runs in this environment with the analysis packages
  hidden from the interpreter (as after ``pip install --no-deps``): the commands that need one name
  it and what installs it in one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "results" / "samples"
SAMPLE = SAMPLES / "grid-1x2x2x2-overlap.h5"
BASELINES = REPO / "results" / "baselines"
IN_CI = os.environ.get("CI", "").lower() == "true"
SLOW = IN_CI or os.environ.get("FOURD_MPI_SLOW_TESTS") == "1"
#: the line a command prints when it needs the analysis extra (scipy: compare, model calibrate)
ANALYSIS_EXTRA = "pip install 'fourd_mpi[analysis]'"


def clean_env(bin_dir: Path = None) -> dict:
    """This environment without Python paths of the test's own venv; ``bin_dir`` first on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    if bin_dir is not None:
        env["PATH"] = str(bin_dir) + os.pathsep + env.get("PATH", "")
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", MPLBACKEND="Agg")
    return env


def check_outcome(args, proc, expect: str) -> None:
    """``expect`` "works": exit 0; "extra": exit 2 and exactly one line on stderr naming the analysis extra.
    Never a traceback."""
    where = (args, proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, where
    if expect == "works":
        assert proc.returncode == 0, where
    else:
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, where
        assert lines[0].startswith("fourd-mpi: error: ") and ANALYSIS_EXTRA in lines[0], where


# -- the base install, in a venv of its own ---------------------------------------------------

@pytest.fixture(scope="module")
def base_venv(tmp_path_factory):
    if not SLOW:
        pytest.skip("builds a venv of the base install (minutes): runs where CI=true or FOURD_MPI_SLOW_TESTS=1")
    venv = tmp_path_factory.mktemp("base") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    # README command 1, literally (pip's cache is kept: no --no-cache-dir), through the constraints file that
    # .ci/run names in FOURD_PIP_CONSTRAINTS (pinned CI; empty or unset: the newest releases)
    constraints = os.environ.get("FOURD_PIP_CONSTRAINTS")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *(["-c", constraints] if constraints else []),
           "-e", ".[mpich]"]
    proc = subprocess.run(pip, cwd=REPO, capture_output=True, text=True, timeout=1800, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return venv


JOURNEY = [  # (arguments, expected outcome); {trace} is the trace of the run, {out} the working directory
    (["analyze", "results"], "works"),
    (["analyze", str(SAMPLES), "--what", "runs,breakdown,comm"], "works"),
    (["plot", "breakdown", "results", "-o", "{out}/breakdown.png"], "works"),
    (["plot", "timeline", "{trace}", "-o", "{out}/timeline.svg"], "works"),
    (["export", "perfetto", "{trace}", "-o", "{out}/trace.json"], "works"),
    (["export", "thicket", "{trace}", "-o", "{out}/trace.cali.json"], "works"),
    (["model", "validate", str(SAMPLES)], "works"),
    (["model", "paper"], "works"),
    (["model", "calibrate", str(SAMPLES), "--profile", "laptop", "-o", "{out}/calibrated.yaml"], "extra"),
    (["tune", "--ranks", "8", "--top", "3"], "works"),
    (["tune", "--ranks", "64", "--model", "gpt-small", "--site", "perlmutter", "--top", "2"], "works"),
    (["sweep", "plan", str(REPO / "jobscripts" / "weak-gpt-tiny.yaml")], "works"),
    (["sweep", "render", str(REPO / "jobscripts" / "weak-gpt-tiny.yaml"), "--site", "perlmutter",
      "--account", "m0000", "--out", "{out}/sweep"], "works"),
    (["trace", "show", "{trace}"], "works"),
    (["trace", "check", "{trace}"], "works"),
    (["results", "list", "--index", "results"], "works"),
    (["compare", str(BASELINES / "slower-gpt-tiny-np2.h5"), "--baseline",
      str(BASELINES / "baseline-gpt-tiny-np2.h5")], "extra"),
]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # a venv install and 18 commands, on a loaded 2-core CI machine
def test_the_base_install_does_the_journey(base_venv, tmp_path):
    bin_dir = base_venv / "bin"
    env = clean_env(bin_dir)
    # it is the base install: fourd_mpi from this checkout, no scipy (the analysis extra), no pytest
    probe = subprocess.run([str(bin_dir / "python"), "-c", "import importlib.util as u, fourd_mpi; "
                            "print(fourd_mpi.__file__, u.find_spec('scipy') is None, u.find_spec('pytest') is None)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert probe.stdout.split() == [str(REPO / "fourd_mpi" / "__init__.py"), "True", "True"], probe

    run = subprocess.run([str(bin_dir / "mpiexec"), "-n", "2", str(bin_dir / "fourd-mpi"), "run", "--gx", "2",
                          "--model", "gpt-tiny", "--steps", "3", "--results-dir", "results"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    check_outcome(["run"], run, "works")
    traces = sorted((tmp_path / "results").glob("*.h5"))
    assert len(traces) == 1, run.stdout[-2000:]
    for args, expect in JOURNEY:
        args = [a.format(trace=traces[0], out=tmp_path) for a in args]
        proc = subprocess.run([str(bin_dir / "fourd-mpi"), *args], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=600)
        check_outcome(args, proc, expect)
    assert (tmp_path / "breakdown.png").stat().st_size > 0 and (tmp_path / "timeline.svg").stat().st_size > 0
    assert (tmp_path / "trace.json").stat().st_size > 0 and (tmp_path / "sweep" / "manifest.json").exists()
    assert not (tmp_path / "calibrated.yaml").exists()


# -- a package missing from an install (pip install --no-deps, a site module without it) -----------

SHIM = '''
import importlib.abc, sys

HIDDEN = set(__import__("os").environ.get("HIDE_PACKAGES", "").split(",")) - {""}


class _Hidden(importlib.abc.MetaPathFinder):
    """As if the package were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Hidden())
'''


@pytest.mark.parametrize("hidden, args, needs", [
    ("pandas", ["analyze", str(SAMPLES)], "pandas"),
    ("pandas", ["model", "validate", str(SAMPLES)], "pandas"),
    ("matplotlib", ["plot", "timeline", str(SAMPLE), "-o", "{out}/t.svg"], "matplotlib"),
    ("scipy", ["compare", str(BASELINES / "slower-gpt-tiny-np2.h5"), "--baseline",
               str(BASELINES / "baseline-gpt-tiny-np2.h5")], "fourd_mpi[analysis]"),
    ("perfetto", ["export", "perfetto", str(SAMPLE), "-o", "{out}/t.pftrace"], "fourd_mpi[perfetto]"),
    ("google", ["export", "perfetto", str(SAMPLE), "-o", "{out}/t.pftrace"], "protobuf"),  # perfetto --no-deps
])
def test_a_missing_package_is_one_line(tmp_path, hidden, args, needs):
    (tmp_path / "sitecustomize.py").write_text(SHIM)
    env = clean_env()
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]), HIDE_PACKAGES=hidden)
    check = subprocess.run([sys.executable, "-c", f"import {hidden}"], capture_output=True, text=True, env=env)
    assert check.returncode != 0 and "ModuleNotFoundError" in check.stderr  # the shim hides it
    args = [a.format(out=tmp_path) for a in args]
    proc = subprocess.run([sys.executable, "-m", "fourd_mpi", *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith("fourd-mpi: error: ") and needs in lines[0] and "pip install" in lines[0], lines


def test_a_package_that_is_there_is_not_reported(tmp_path):
    """Known answer for the shim: hiding an unrelated package leaves export working."""
    (tmp_path / "sitecustomize.py").write_text(SHIM)
    env = clean_env()
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]), HIDE_PACKAGES="scipy")
    proc = subprocess.run([sys.executable, "-m", "fourd_mpi", "export", "perfetto", str(SAMPLE), "-o",
                           str(tmp_path / "t.json")], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0 and (tmp_path / "t.json").stat().st_size > 0, proc.stderr


RUN_AND_LIST = '''
import sys
from fourd_mpi.cli.main import main

rc = main(sys.argv[1:])
print("analysis packages imported:", sorted(m for m in ("pandas", "matplotlib", "scipy") if m in sys.modules))
sys.exit(rc)
'''


def test_a_run_does_not_import_the_analysis_packages(tmp_path, run_mpi):
    """pandas and matplotlib are requirements, but only the commands that use them import them: the ranks of
    a run never pay for them."""
    script = tmp_path / "run_and_list.py"
    script.write_text(RUN_AND_LIST)
    proc = run_mpi(2, ["run", "--gx", "2", "--model", "gpt-tiny", "--steps", "2", "--warmup", "0",
                       "--results-dir", str(tmp_path / "results")], script=str(script))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("analysis packages imported: []") == 2, proc.stdout[-2000:]
