"""The analyses registry that ``analyze --what`` iterates: words, order, and every named function found."""

import subprocess
import sys

from fourd_mpi.analysis.registry import ANALYSES, AUTO, NAMES, PER_RUNS, PER_TRACE


def test_words_in_output_order_and_auto_leaves_out_steps():
    assert NAMES == ("runs", "breakdown", "comm", "compare", "scaling", "steps")
    assert AUTO == ("runs", "breakdown", "comm", "compare", "scaling")


def test_every_named_function_and_formula_is_found():
    for entry in ANALYSES:
        assert entry.scope in (PER_TRACE, PER_RUNS)
        assert callable(entry.get("table"))
        assert isinstance(entry.get("formulas"), dict)
        for name in ("wide", "need", "against"):
            assert getattr(entry, name) is None or callable(entry.get(name))
        if entry.companion:
            title, function, formulas = entry.get("companion")
            assert title == "comm by placement" and callable(function) and formulas


def test_the_comm_formulas_are_the_tables_own():
    from fourd_mpi.analysis.tables import COMM_FORMULAS, COMM_PLACEMENT_FORMULAS

    comm = next(a for a in ANALYSES if a.name == "comm")
    assert comm.get("formulas") is COMM_FORMULAS and comm.get("companion")[2] is COMM_PLACEMENT_FORMULAS


def test_the_registry_loads_no_pandas():
    code = "import sys, fourd_mpi.analysis.registry; assert 'pandas' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
