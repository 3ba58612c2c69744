"""A link-time stub of the CUDA driver library (``libcuda.so``), as the CUDA toolkit's ``lib64/stubs``.

    python cuda_stub.py CUDA_H OUTDIR     # writes OUTDIR/libcuda.so (soname libcuda.so.1)

PyPI's CUDA wheels carry ``cuda.h`` but no driver library, and MPICH's MPL links ``-lcuda`` to enable its
GPU layer (``src/mpl/configure.ac``). The stub defines every function ``cuda.h`` declares, under the names
the preprocessor gives them (``cuMemGetAddressRange`` is ``cuMemGetAddressRange_v2``) and under their plain
names (which autoconf's link checks use), each an empty
function: enough to link, never run. Its soname is ``libcuda.so.1``, so what was linked against it loads
the driver's own ``libcuda.so.1`` at run time; the stub itself is not installed into the MPI's prefix.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile


def declared_functions(cuda_h: str) -> list:
    """Names of the functions ``cuda.h`` declares, before and after preprocessing (``CUresult CUDAAPI cuX(...)``):
    the versioned names (``cuMemGetAddressRange_v2``) that code compiled with the header calls, and the plain
    ones (``cuMemGetAddressRange``), which the driver exports too and which autoconf's ``AC_CHECK_LIB`` links
    against (it declares ``char cuMemGetAddressRange();`` without the header)."""
    raw = open(cuda_h).read()
    text = subprocess.run(["gcc", "-E", "-P", "-x", "c", "-I", os.path.dirname(cuda_h), cuda_h],
                          check=True, capture_output=True, text=True).stdout
    names = set()
    for source in (raw, text):
        pointers = set(re.findall(r"typedef[^;]*\(\s*(?:CUDAAPI\s*)?\*?\s*(cu\w+)", source))
        names |= set(re.findall(r"\b(cu[A-Z]\w*)\s*\(", source)) - pointers
    return sorted(names)


def main(argv) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    cuda_h, outdir = argv
    names = declared_functions(cuda_h)
    if "cuMemGetAddressRange_v2" not in names:  # what MPL's configure links against
        print(f"cuda_stub: no cuMemGetAddressRange_v2 among the {len(names)} functions of {cuda_h}", file=sys.stderr)
        return 1
    os.makedirs(outdir, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".c", delete=False) as src:
        src.write("".join(f"int {name}(void) {{ return 999; }}\n" for name in names))
    out = os.path.join(outdir, "libcuda.so")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", out, "-Wl,-soname,libcuda.so.1", src.name], check=True)
    os.unlink(src.name)
    print(f"cuda_stub: {out}: {len(names)} functions of {os.path.basename(cuda_h)}, soname libcuda.so.1")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
