"""bench/ is a package of the checkout, run as ``python -m bench.NAME``: no benchmark changes ``sys.path`` (it
imports ``fourd_mpi`` as installed), and the distribution installs ``fourd_mpi`` only (docs/design.md section 7)."""

import runpy
import subprocess
import sys

import setuptools
from conftest import REPO

#: run also as ``python bench/NAME.py`` by the GPU stage (``gpu_*.py``) and the multi-node runs, whose path line stays
PATH_RUN = {"multinode.py", "overlap_bench.py"}


def test_no_benchmark_changes_sys_path():
    bench = REPO / "bench"
    assert (bench / "__init__.py").is_file()
    mine = [p for p in bench.glob("*.py") if p.name not in PATH_RUN and not p.name.startswith("gpu_")]
    hacks = sorted(p.name for p in mine if any(f"sys.path.{f}" in p.read_text() for f in ("insert", "append")))
    assert hacks == []


def test_the_distribution_installs_fourd_mpi_only(monkeypatch):
    seen = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    monkeypatch.chdir(REPO)
    runpy.run_path(str(REPO / "setup.py"))
    packages = seen["packages"]
    assert "fourd_mpi" in packages and "fourd_mpi.cli" in packages
    assert [p for p in packages if p.split(".")[0] != "fourd_mpi"] == []


def test_a_benchmark_runs_as_a_module_from_the_repository_root():
    proc = subprocess.run([sys.executable, "-m", "bench.timeline_formats", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0 and "--ranks" in proc.stdout, proc.stderr


def test_a_benchmark_records_its_command_without_the_checkouts_path():
    """``bench.command_line``: what a results file's ``# command:`` line says (results/benchmarks holds no path of
    any machine): ``python -m bench.NAME ARGS`` under ``-m``, else the script relative to the current directory."""
    as_module = ("import importlib.util, sys; sys.modules['__main__'].__spec__ = importlib.util.find_spec("
                 "'bench.multinode'); sys.argv = ['/somewhere/bench/multinode.py', '--rate', '1 gbit']; "
                 "from bench import command_line; print(command_line())")
    as_path = (f"import sys; sys.argv = [{str(REPO / 'bench' / 'overlap_bench.py')!r}, '--x']; "
               "from bench import command_line; print(command_line())")
    out = [subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
           for code in (as_module, as_path)]
    assert out == ["python -m bench.multinode --rate '1 gbit'\n", "python bench/overlap_bench.py --x\n"]
