"""packaging/cuda-mpi/cuda_stub.py: the link-time libcuda stub that lets MPICH's MPL link -lcuda (its GPU layer)."""

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "packaging", "cuda-mpi", "cuda_stub.py")

# a cuda.h in miniature: a versioned rename, a declaration, a function-pointer typedef (not a function)
CUDA_H = """
typedef int CUresult; typedef unsigned long long CUdeviceptr; typedef unsigned long size_t;
#define CUDAAPI
#define cuMemGetAddressRange cuMemGetAddressRange_v2
CUresult CUDAAPI cuMemGetAddressRange(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr);
CUresult CUDAAPI cuInit(unsigned int Flags);
typedef CUresult (CUDAAPI *cuHostFn)(void *userData);
"""


@pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("readelf") is None, reason="needs gcc and readelf")
def test_the_stub_defines_the_plain_and_renamed_functions_under_the_drivers_soname(tmp_path):
    header = tmp_path / "cuda.h"
    header.write_text(CUDA_H)
    done = subprocess.run([sys.executable, SCRIPT, str(header), str(tmp_path / "stubs")], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert "3 functions of cuda.h, soname libcuda.so.1" in done.stdout
    lib = tmp_path / "stubs" / "libcuda.so"
    dynamic = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    assert "Library soname: [libcuda.so.1]" in dynamic
    symbols = subprocess.run(["readelf", "--dyn-syms", "-W", str(lib)], capture_output=True, text=True).stdout
    names = {line.split()[-1] for line in symbols.splitlines() if " FUNC " in line and " GLOBAL " in line}
    # the versioned name (code compiled with cuda.h) and the plain one (autoconf's AC_CHECK_LIB links it)
    assert names >= {"cuMemGetAddressRange_v2", "cuMemGetAddressRange", "cuInit"}
    assert "cuHostFn" not in names


def test_a_header_without_the_function_mpl_links_is_refused(tmp_path):
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    header = tmp_path / "cuda.h"
    header.write_text("typedef int CUresult;\nCUresult cuInit(unsigned int Flags);\n")
    done = subprocess.run([sys.executable, SCRIPT, str(header), str(tmp_path / "stubs")], capture_output=True,
                          text=True)
    assert done.returncode == 1 and "no cuMemGetAddressRange_v2 among the 1 functions" in done.stderr
