"""bench/gpu_validate.sh's CUDA-aware MPI stages on CPU: the stage list and its time budget, shellcheck, the
step's message sizes of bench/gpu_coll.py, and the set-up (unpack the packed MPI, env.sh, wheels without an
index) with a build of packaging/cuda-mpi/build.sh when one is cached here."""

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from types import SimpleNamespace

import pytest
from conftest import REPO

SCRIPT = os.path.join(REPO, "bench", "gpu_validate.sh")
CACHE = os.environ.get("FOURD_CUDA_MPI_CACHE") or "/var/cache/fourd-mpi/cuda-mpi"


def _run(args, tmp_path, **env):
    full = dict(os.environ, OUT=str(tmp_path / "out"), CUDAMPI_ROOT=str(tmp_path / "root"), **env)
    return subprocess.run(["bash", SCRIPT, *args], cwd=REPO, env=full, capture_output=True, text=True, timeout=120)


def test_stage_list_parses_and_fits_one_device_call(tmp_path):
    done = _run(["list"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if " x " in line]
    names = [r[0] for r in rows]
    assert names == ["cset", "cipc", "chost", "cverify2", "ccoll", "cstep", "cmfu", "cverify4", "summary", "pack"]
    total = sum(int(r[1]) * int(r[3]) for r in rows)
    assert f"total {total} s" in done.stdout and total <= 540  # 9 of a device call's 10 minutes
    text = open(SCRIPT).read()
    for name in names:  # every listed stage has its branch
        assert f"\n    {name})" in text or f"\n    {name}|" in text, name


def test_unknown_stage_is_refused(tmp_path):
    assert _run(["nosuchstage"], tmp_path).returncode == 2


def test_shellcheck(tmp_path):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    done = subprocess.run(["shellcheck", "-S", "warning", SCRIPT], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_gpu_coll_sizes_are_the_steps():
    spec = importlib.util.spec_from_file_location("gpu_coll", os.path.join(REPO, "bench", "gpu_coll.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = SimpleNamespace(model="gpt-small", layers=2, hidden=4096, heads=32, seq=2048, batch=16, gdata=1, gz=1,
                           gy=1, gx=2, overlap="all", dtype="bfloat16")
    sizes = dict(mod.step_sizes(args))
    # G_x = 2: all-reduces over x only. fc2's backward all-reduce: 16 x 2048 tokens x 16384 / 1 x 2 bytes = 1 GiB;
    # qkv's forward one in 2 chunks (od): 32768 x 12288 x 2 / 2
    assert sizes[("allreduce", "x", 1 << 30)] == 2 and sizes[("allreduce", "x", 402653184)] == 4
    assert {op for op, _, _ in sizes} == {"allreduce"} and {ax for _, ax, _ in sizes} == {"x"}


def _probe_wheel(folder):
    """A tiny pure wheel: the set-up installs whatever .whl the folder holds, without an index."""
    path = os.path.join(folder, "fourd_probe-0.0-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("fourd_probe.py", "OK = 1\n")
        z.writestr("fourd_probe-0.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: fourd-probe\nVersion: 0.0\n")
        z.writestr("fourd_probe-0.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                      "Tag: py3-none-any\n")
        z.writestr("fourd_probe-0.0.dist-info/RECORD", "")
    return path


def test_rehearsal_setup_unpacks_a_cached_build(tmp_path):
    archives = sorted(glob.glob(os.path.join(CACHE, "*.tar.zst")))
    if not archives or shutil.which("zstd") is None:
        pytest.skip(f"no packed CUDA-aware MPI in {CACHE} (bash packaging/cuda-mpi/build.sh openmpi) or no zstd")
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _probe_wheel(str(wheels))
    done = _run(["cunpack"], tmp_path, GPU_REHEARSAL="1", GPU_PYTHON=sys.executable, WHEELS=str(wheels),
                CUDAMPI_ARCHIVE=archives[-1])
    assert done.returncode == 0, done.stdout + done.stderr
    root = tmp_path / "root"
    assert (root / "site" / "fourd_probe.py").is_file()
    assert (root / "prefix" / "env.sh").is_file() and (root / "prefix" / "bin" / "mpiexec").exists()
    row = (tmp_path / "out" / "summary.tsv").read_text().split("\t")
    assert row[:2] == ["cset", "unpack, wheels"] and row[4] == "0", row
    line = [x for x in done.stdout.splitlines() if x.startswith("cunpack:")][0]
    assert f"MPI4PY_LIBMPI={root}/prefix/lib/libmpi.so." in line and f"mpiexec={root}/prefix/bin/mpiexec" in line
