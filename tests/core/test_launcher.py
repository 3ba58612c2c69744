"""``fourd_mpi.core.launcher``: telling MPICH's Hydra from Open MPI's mpiexec, the environment each needs here,
a site's Hydra options in Open MPI's spelling, and the test bed's command line for each (no MPI is started)."""

from __future__ import annotations

import os
import sys

import pytest

from fourd_mpi.core import launcher
from fourd_mpi.testbed import bed

VERSIONS = {  # the first lines of `mpiexec --version`, as printed by each
    "mpich": "HYDRA build details:\n    Version:                                 5.0.2\n",
    "openmpi4": "mpiexec (OpenRTE) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/\n",
    "openmpi5": "mpiexec (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/\n",
    "other": "some launcher 1.0\n",
}


@pytest.mark.parametrize("name, family", [("mpich", "mpich"), ("openmpi4", "openmpi"), ("openmpi5", "openmpi"),
                                          ("other", "unknown")])
def test_flavor_from_the_version_text(tmp_path, name, family):
    exe = tmp_path / name
    exe.write_text(f"#!/bin/sh\ncat <<'EOF'\n{VERSIONS[name]}EOF\n")
    exe.chmod(0o755)
    assert launcher.flavor(str(exe)) == family
    assert launcher.local_env(str(exe)) == (launcher.OPENMPI_LOCAL_ENV if family == "openmpi" else {})


def test_a_missing_mpiexec_is_unknown(tmp_path):
    assert launcher.flavor(str(tmp_path / "nothing")) == "unknown"


def test_hydra_site_options_in_open_mpis_spelling():
    args = ["-iface", "eth0", "-bind-to", "core", "-ppn", "4", "--other", "x"]
    assert launcher.hydra_args_for(args, "mpich") == args
    assert launcher.hydra_args_for(args, "openmpi") == [
        "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0", "--bind-to", "core",
        "--map-by", "ppr:4:node", "--other", "x"]


STATE = {"name": "tb", "bridge": "tb-br", "subnet": "10.9.8.0/24",
         "nodes": [{"name": f"tb-n{i}", "addr": f"10.9.8.{i}", "veth": f"tb-v{i}", "rate_bits": None,
                    "burst_bytes": None} for i in (1, 2)]}


@pytest.mark.parametrize("order, mapping, ppn", [("block", "slot", "2"), ("cyclic", "node", "1")])
def test_bed_command_lines_of_both_launchers(order, mapping, ppn):
    hydra = bed.mpiexec_argv(STATE, 4, 2, "mpiexec", order, "mpich")
    assert hydra == ["mpiexec", "-launcher", "ssh", "-launcher-exec", bed.shim_path("tb"), "-iface", "tb-br",
                     "-hosts", "tb-n1,tb-n2", "-ppn", ppn, "-n", "4"]
    ompi = bed.mpiexec_argv(STATE, 4, 2, "mpiexec", order, "openmpi")
    assert ompi[:4] == ["mpiexec", "--allow-run-as-root", "--mca", "plm_rsh_agent"]
    assert ompi[4] == bed.shim_path("tb")
    text = " ".join(ompi)
    assert "--host tb-n1:2,tb-n2:2" in text and f"--map-by {mapping}" in text and "--bind-to none" in text
    assert "btl_tcp_if_include 10.9.8.0/24" in text and "oob_tcp_if_include 10.9.8.0/24" in text
    assert ompi[-2:] == ["-n", "4"]


# -- the programs of this environment: testbed mpiexec and sweep render resolve them alike ----------------------

def _environment(tmp_path, *programs):
    """A directory laid out like a virtual environment's ``bin/``: ``python`` and executable ``programs``."""
    bin_dir = tmp_path / "env" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.symlink_to(sys.executable)
    for name in programs:
        (bin_dir / name).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir, str(python)


def test_fourd_mpi_and_python_resolve_beside_the_interpreter(tmp_path):
    bin_dir, python = _environment(tmp_path, "fourd-mpi", "mpiexec")
    resolve = launcher.resolve_program
    assert resolve(["fourd-mpi", "run", "--gx", "2"], python) == [str(bin_dir / "fourd-mpi"), "run", "--gx", "2"]
    assert resolve(["python", "-m", "fourd_mpi", "verify"], python) == [python, "-m", "fourd_mpi", "verify"]
    assert resolve(["python3", "bench/x.py"], python) == [python, "bench/x.py"]
    # other programs and paths are the user's: left as typed
    assert resolve(["sh", "-c", "exit 3"], python) == ["sh", "-c", "exit 3"]
    assert resolve(["./fourd-mpi", "run"], python) == ["./fourd-mpi", "run"]
    assert resolve(["/opt/x/bin/python", "-V"], python) == ["/opt/x/bin/python", "-V"]
    assert launcher.beside("mpiexec", python) == str(bin_dir / "mpiexec")


def test_no_console_script_beside_the_interpreter_leaves_the_name(tmp_path):
    bin_dir, python = _environment(tmp_path)
    (bin_dir / "mpiexec").write_text("not executable")
    assert launcher.resolve_program(["fourd-mpi", "run"], python) == ["fourd-mpi", "run"]
    assert launcher.beside("mpiexec", python) is None  # a file that is not executable is no program
    # a bare interpreter name (a site's python: the job's PATH) has no directory to look in
    assert launcher.beside("mpiexec", "python3") is None
    assert launcher.resolve_program(["fourd-mpi", "run"], "python3") == ["fourd-mpi", "run"]


def test_the_running_interpreter_is_the_default():
    """What ``.venv/bin/fourd-mpi testbed mpiexec -- fourd-mpi ...`` launches from a shell without the environment
    on PATH: the console script of the running interpreter's environment, by absolute path."""
    here = os.path.dirname(os.path.abspath(sys.executable))
    script = os.path.join(here, "fourd-mpi")
    expected = script if os.access(script, os.X_OK) else "fourd-mpi"
    assert launcher.resolve_program(["fourd-mpi", "--version"]) == [expected, "--version"]
    assert launcher.resolve_program(["python", "-c", "pass"]) == [os.path.abspath(sys.executable), "-c", "pass"]


def test_sweep_render_and_testbed_mpiexec_share_the_resolution(tmp_path, monkeypatch):
    """The job scripts' mpiexec (sweep render) and the bed's (testbed mpiexec) are the one beside the interpreter."""
    from fourd_mpi.cli import testbed as cli_testbed
    from fourd_mpi.jobs import launchers

    bin_dir, python = _environment(tmp_path, "mpiexec")
    assert launchers.mpiexec_for(None, python) == str(bin_dir / "mpiexec")
    assert launchers.mpiexec_for(None, "python3") == "mpiexec"
    monkeypatch.setattr(sys, "executable", python)
    assert cli_testbed.default_mpiexec() == str(bin_dir / "mpiexec")
    assert launcher.interpreter() == python
