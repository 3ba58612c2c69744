"""packaging/cuda-mpi: the pieces of the CUDA-aware MPI build that run without building anything.

The build itself (Open MPI or MPICH from Debian's sources, about 17 and 30 minutes on 2 cores) is
exercised by .ci/run's Open MPI stage; here: the deb-src lines made from the system's apt entries,
the yaksa patch for CUDA 13, the script's refusal of an unknown implementation, and shellcheck.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[2] / "packaging" / "cuda-mpi"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_deb_src_lines_from_one_line_and_deb822_entries(tmp_path):
    debsrc = _load("debsrc")
    (tmp_path / "sources.list").write_text("deb http://deb.example/debian bookworm main contrib # note\n"
                                           "# deb http://commented/out bookworm main\n"
                                           "deb-src http://already/src bookworm main\n")
    parts = tmp_path / "sources.list.d"
    parts.mkdir()
    (parts / "debian.sources").write_text(
        "Types: deb\nURIs: http://deb.example/debian\nSuites: bookworm bookworm-updates\nComponents: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
        "Types: deb-src\nURIs: http://only/src\nSuites: bookworm\nComponents: main\n\n"
        "Types: deb\nURIs: http://disabled\nSuites: bookworm\nComponents: main\nEnabled: no\n")
    (parts / "off.list.disabled-by-farm").write_text("deb http://not/read bookworm main\n")
    lines = []
    for path in (tmp_path / "sources.list", parts):
        files = sorted(path.iterdir()) if path.is_dir() else [path]
        for f in files:
            if f.suffix == ".list" or f.name == "sources.list":
                lines += debsrc.one_line(f.read_text())
            elif f.suffix == ".sources":
                lines += debsrc.deb822(f.read_text())
    key = "[signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
    assert lines == ["deb-src http://deb.example/debian bookworm main contrib",
                     f"deb-src {key}http://deb.example/debian bookworm main",
                     f"deb-src {key}http://deb.example/debian bookworm-updates main"]


def test_yaksa_patch_replaces_the_removed_field():
    patch = _load("patch_yaksa")
    original = ("        for (int i = 0; i < n; i++) {\n            struct cudaDeviceProp prop;\n\n"
                "            cerr = cudaGetDeviceProperties(&prop, i);\n"
                "            if (prop.computeMode != cudaComputeModeDefault) {\n")
    out = patch.patch(original)
    assert "prop.computeMode" not in out
    assert "cudaDeviceGetAttribute(&fourd_compute_mode, cudaDevAttrComputeMode, i);" in out
    assert out.index("cudaDeviceGetAttribute") > out.index("cudaGetDeviceProperties")
    assert "if (fourd_compute_mode != cudaComputeModeDefault)" in out
    with pytest.raises(SystemExit, match="nothing to patch"):
        patch.patch(out)


def test_build_script_refuses_an_unknown_implementation():
    proc = subprocess.run(["bash", str(HERE / "build.sh"), "mvapich"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"usage: {HERE / 'build.sh'} openmpi|mpich"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_build_script_is_shellcheck_clean():
    proc = subprocess.run(["shellcheck", str(HERE / "build.sh")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


def test_helpers_are_runnable_as_scripts(tmp_path):
    out = subprocess.run([sys.executable, str(HERE / "debsrc.py"), str(tmp_path)], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == ""
