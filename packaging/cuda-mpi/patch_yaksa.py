"""CUDA 13 removed ``cudaDeviceProp::computeMode``: read the compute mode with ``cudaDeviceGetAttribute``.

Usage: python3 patch_yaksa.py modules/yaksa/src/backend/cuda/hooks/yaksuri_cuda_init_hooks.c

MPICH 4.0.2's yaksa reads ``prop.computeMode`` after ``cudaGetDeviceProperties(&prop, i)``; the patch
replaces each ``prop.computeMode`` read by a local filled by ``cudaDeviceGetAttribute(&mode,
cudaDevAttrComputeMode, i)`` (an API since CUDA 5). Refuses (exit 1) when the text is not as expected.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def patch(text: str) -> str:
    if "prop.computeMode" not in text:
        raise SystemExit("no prop.computeMode in the file: nothing to patch (already patched?)")
    pattern = re.compile(r"cudaGetDeviceProperties\(&prop,\s*(\w+)\);")
    match = pattern.search(text)
    if not match:
        raise SystemExit("no cudaGetDeviceProperties(&prop, i) call found: the yaksa source changed")
    index = match.group(1)
    call = match.group(0)
    text = text.replace(call, call + f"\n        int fourd_compute_mode = 0;\n"
                        f"        cudaDeviceGetAttribute(&fourd_compute_mode, cudaDevAttrComputeMode, {index});", 1)
    return text.replace("prop.computeMode", "fourd_compute_mode")


def main(path: str) -> int:
    file = Path(path)
    file.write_text(patch(file.read_text()))
    print(f"patched {file}: prop.computeMode -> cudaDeviceGetAttribute(cudaDevAttrComputeMode)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
