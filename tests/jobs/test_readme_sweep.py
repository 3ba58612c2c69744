"""The documented sweep commands (README.md, docs/guide/sweeps.md), run literally from a shell where the
environment is not activated.

The user's shell has ``fourd-mpi`` on its PATH (a console script, as ``pipx`` or ``~/.local/bin`` install it)
but not the virtual environment's ``bin/``: no ``mpiexec``, no ``python`` with fourd_mpi. The rendered job
scripts must name the interpreter and ``mpiexec`` of the environment they were rendered from.
The commands are read from README.md; the only change is the site: the README's example names a cluster
(``--site perlmutter --account m1234``), which is dropped so that the default site, ``local``, runs the jobs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


#: where the documentation shows the sweep commands: the README (before it became a door to the docs site), then
#: the sweeps page of the guide
DOCUMENTED = ("README.md", "docs/guide/sweeps.md")


def readme_commands():
    """The documented ``fourd-mpi sweep render|submit|status|collect`` lines (first of each; comments dropped)."""
    lines = {}
    text = "\n".join((REPO / f).read_text() for f in DOCUMENTED if (REPO / f).exists())
    for line in text.splitlines():
        m = re.match(r"^((?:\.venv/bin/)?fourd-mpi) sweep (render|submit|status|collect)\s+(.*?)\s*(#.*)?$", line)
        if m and m.group(2) not in lines:
            lines[m.group(2)] = f"{m.group(1)} sweep {m.group(2)} {m.group(3)}"
    return lines


def on_default_site(command: str) -> str:
    """``command`` without its ``--site X`` and ``--account Y`` options (the default site is local), and a rendered
    sweep's directory of another site (``results/SWEEP/SITE/jobs``, render's default) as the local site's."""
    words = [re.sub(r"^(results/[^/]+/)[^/]+(/jobs)$", r"\1local\2", word) for word in shlex.split(command)]
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in ("--site", "--account"):
            skip = True
        else:
            out.append(word)
    return shlex.join(out)


def user_shell(tmp_path: Path) -> dict:
    """An environment like a login shell with only the console script on PATH (no venv activated)."""
    bin_dir = tmp_path / "user-bin"
    bin_dir.mkdir()
    os.symlink(VENV_BIN / "fourd-mpi", bin_dir / "fourd-mpi")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join([str(bin_dir), "/usr/local/bin", "/usr/bin", "/bin"])
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = "1"
    return env


def shell(command: str, cwd: Path, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def checkout(tmp_path):
    """A directory holding the README's spec where the README has it, and ``.venv``: the environment of README
    command 1 (this one), which the pages name as ``.venv/bin/fourd-mpi``."""
    os.symlink(sys.prefix, tmp_path / ".venv")
    (tmp_path / "jobscripts").mkdir()
    shutil.copy(REPO / "jobscripts" / "weak-gpt-tiny.yaml", tmp_path / "jobscripts" / "weak-gpt-tiny.yaml")
    return tmp_path


def test_the_readme_has_the_commands():
    commands = readme_commands()
    assert set(commands) == {"render", "submit", "status", "collect"}, commands
    assert "jobscripts/weak-gpt-tiny.yaml" in commands["render"]


def test_shell_without_the_environment_has_no_mpiexec(tmp_path):
    env = user_shell(tmp_path)
    probe = shell("command -v mpiexec || echo none; command -v fourd-mpi", tmp_path, env)
    assert probe.stdout.split("\n")[0] == "none" or not probe.stdout.startswith(str(VENV_BIN)), probe.stdout
    assert probe.stdout.strip().endswith("user-bin/fourd-mpi")


@pytest.mark.mpi
def test_readme_sweep_runs_without_an_activated_environment(checkout):
    env = user_shell(checkout)
    commands = readme_commands()
    render = shell(on_default_site(commands["render"]), checkout, env)
    assert render.returncode == 0, render.stdout + render.stderr
    sweep_dir = checkout / "results" / "weak-gpt-tiny" / "local" / "jobs"  # render's default, beside the traces
    manifest = json.loads((sweep_dir / "manifest.json").read_text())
    assert manifest["site"] == "local" and manifest["results_dir"] == "results/weak-gpt-tiny/local"
    for run in manifest["runs"]:  # the environment's own interpreter and launcher, by absolute path
        argv = shlex.split(run["command"])
        assert argv[0] == str(VENV_BIN / "mpiexec") and Path(argv[3]).parent == VENV_BIN, argv
        assert Path(argv[3]).name.startswith("python"), argv

    submit = shell(on_default_site(commands["submit"]), checkout, env)
    assert submit.returncode == 0 and "4 submitted" in submit.stdout, (
        submit.stdout + submit.stderr + "".join(p.read_text() for p in (sweep_dir / "logs").glob("*.out")))
    assert "command not found" not in submit.stdout + submit.stderr
    status = shell(on_default_site(commands["status"]), checkout, env)
    assert status.returncode == 0 and "4/4 traces complete, 0 jobs failed" in status.stdout, status.stdout
    collect = shell(on_default_site(commands["collect"]), checkout, env)
    assert collect.returncode == 0, collect.stdout + collect.stderr
    assert sorted(p.name for p in (checkout / "results" / "weak-gpt-tiny" / "local").glob("*.h5")) == sorted(
        run["run_id"] + ".h5" for run in manifest["runs"])

    # the same spec for another site keeps its own results: nothing is skipped as "trace complete"
    other = shell(commands["render"].replace("--site perlmutter", "--site slurm").replace("--account m1234", "")
                  + " --out jobscripts/weak-gpt-tiny-slurm", checkout, env)
    assert other.returncode == 0, other.stderr
    slurm = json.loads((checkout / "jobscripts" / "weak-gpt-tiny-slurm" / "manifest.json").read_text())
    assert slurm["results_dir"] == "results/weak-gpt-tiny/slurm"
    dry = shell("fourd-mpi sweep submit jobscripts/weak-gpt-tiny-slurm --dry-run", checkout, env)
    assert dry.returncode == 0 and dry.stdout.count("would submit") == 4 and "trace complete" not in dry.stdout, \
        dry.stdout + dry.stderr


def test_job_script_names_a_missing_interpreter_in_one_line(checkout):
    env = user_shell(checkout)
    done = shell("fourd-mpi sweep render jobscripts/weak-gpt-tiny.yaml --python /nowhere/bin/python", checkout, env)
    assert done.returncode == 0, done.stderr
    script = sorted((checkout / "results" / "weak-gpt-tiny" / "local" / "jobs").glob("*.sh"))[0]
    run = shell(f"bash {shlex.quote(str(script))}", checkout, env)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 127 and len(lines) == 1, run.stderr
    assert lines[0].startswith("fourd-mpi job: /nowhere/bin/python not found on ") or \
        lines[0].startswith("fourd-mpi job: mpiexec not found on "), lines
