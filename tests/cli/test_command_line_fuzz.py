"""Fuzzing of the command line itself: random options and values for every command,
drawn from the parser (``tests/helpers/fuzz_cli.py``, in a subprocess under an address-space limit).

Every example must end with status 0, 1, 2 or 3, no traceback, no hang (CPU and wall bounds per
example), and no file outside its scratch directory touched. The run stops drawing new examples after
``FUZZ_BUDGET_S`` CPU seconds of the fuzzing process (default 30; CPU, not wall, time: a loaded machine runs the
same examples, more slowly, instead of fewer); ``FOURD_FUZZ_SCALE``
multiplies the example count and the budget (e.g. 10 for a long local run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import HELPERS, REPO, mpi_env

SCALE = float(os.environ.get("FOURD_FUZZ_SCALE", "1"))
#: examples drawn (a quiet machine runs them in about 20 s; the CPU budget below stops a slower machine)
EXAMPLES = 200
BUDGET_S = 30


def test_fuzzed_command_lines_give_no_traceback_no_hang_and_touch_nothing_outside(tmp_path):
    env = dict(mpi_env(), FUZZ_MEMORY_LIMIT=str(3 << 30), FUZZ_BUDGET_S=str(BUDGET_S * SCALE), MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, str(HELPERS / "fuzz_cli.py"), str(int(EXAMPLES * SCALE)), str(tmp_path)],
                          capture_output=True, text=True, timeout=600 * max(1.0, SCALE), env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    print(counts)  # the fuzz counts, shown with pytest -s
    assert counts["tracebacks"] == 0 and counts["hangs"] == 0 and counts["bad_status"] == 0
    assert counts["touched_outside"] == 0
    assert counts["examples"] >= 20  # even on a loaded machine it reaches many commands
    assert set(counts["statuses"]) & {"2"} and set(counts["statuses"]) & {"0", "1"}  # refusals and successes
