"""Fuzzing of everything that reads user files: mutated real traces, generated
sweep specs / site profiles (YAML, aliases included) and ``--config`` files (TOML, YAML, JSON).

Each target runs ``tests/helpers/fuzz_readers.py`` in a subprocess under an address-space limit
(``RLIMIT_AS``: a runaway allocation fails there instead of swapping the machine) and a timeout
(a hang fails the test); every generated file must be read or refused with the project's error
types (``ConfigError``/``TraceError``), never a traceback. ``FOURD_FUZZ_SCALE`` multiplies the
counts (e.g. 10 for a long local run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import HELPERS, REPO, mpi_env

SCALE = float(os.environ.get("FOURD_FUZZ_SCALE", "1"))
#: generated files per target (4,500 in all; about 45 s on a loaded 2-core machine)
EXAMPLES = {"trace": 500, "spec": 2000, "config": 2000}


@pytest.mark.parametrize("target", sorted(EXAMPLES))
def test_fuzzed_inputs_give_no_traceback_no_hang_bounded_memory(tmp_path, target):
    examples = max(1, int(EXAMPLES[target] * SCALE))
    env = dict(mpi_env(), FUZZ_MEMORY_LIMIT=str(3 << 30))
    proc = subprocess.run([sys.executable, str(HELPERS / "fuzz_readers.py"), target, str(examples), str(tmp_path)],
                          capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    print(counts)  # the fuzz counts, shown with pytest -s
    assert counts["files"] == examples and counts["tracebacks"] == 0
    assert counts["refused"] > 0  # the generators do reach the error paths
