"""The suite's benchmarks: each module measures one part of fourd_mpi and prints a table that names its formula,
the command that produced it and the machine's load; the committed outputs are in ``results/benchmarks/``
(``results/benchmarks/README.md`` is the index: file, command, date, machine class).

Run a benchmark as a module from the repository root, with the environment's Python (``fourd_mpi`` installed
in it, editable or not; no ``sys.path`` changes)::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.timeline_formats --ranks 64 --steps 2 --repeats 1
    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 8 .venv/bin/python -m bench.step_bench --model gpt-tiny

``bench`` is a package of the checkout only: ``setup.py`` installs ``fourd_mpi`` and nothing else
(``packaging/check_dist.py`` fails a wheel with any other top-level file). The GPU stage
(``gpu_validate.sh`` with ``gpu_bench.py``, ``gpu_coll.py``, ``gpu_copy.py``) and ``multinode.py`` and
``overlap_bench.py`` also run as ``python bench/NAME.py``, as their docstrings show. Runbooks and probes that
measure no part of the suite are in ``tools/`` (docs/design.md section 7).
"""

import os
import shlex
import sys


def command_line() -> str:
    """The command that runs this benchmark, as a reader would type it from the repository root: ``python -m
    bench.NAME ARGS`` (or ``python bench/NAME.py ARGS`` relative to the current directory); never a machine's
    absolute path to the checkout."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.startswith("bench."):
        head = ["python", "-m", spec.name]
    else:
        path = os.path.relpath(sys.argv[0]) if os.path.isabs(sys.argv[0]) else sys.argv[0]
        head = ["python", path]
    return " ".join(shlex.quote(a) for a in head + sys.argv[1:])
