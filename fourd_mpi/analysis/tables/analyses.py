"""The pandas side of the analyses of :mod:`fourd_mpi.analysis.registry`: the functions, views and
formulas its entries name (the registry itself loads no pandas: the command line lists the analyses
without it)."""


from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple

import pandas as pd

# the tables, views and formulas the registry names (getattr); those marked F401 are only re-exported for it
from fourd_mpi.analysis.tables.across import compare, scaling
from fourd_mpi.analysis.tables.breakdown import (
    RECOMPUTE_SHARE_FORMULA,
    breakdown,  # noqa: F401 (the registry's name)
    breakdown_wide,  # noqa: F401 (the registry's name)
    steps_table,  # noqa: F401 (the registry's name)
)
from fourd_mpi.analysis.tables.comm import (
    COMM_FORMULAS,  # noqa: F401 (the registry's name)
    COMM_PLACEMENT_FORMULAS,  # noqa: F401 (the registry's name)
    comm_placement_table,  # noqa: F401 (the registry's name)
    comm_table,  # noqa: F401 (the registry's name)
    hidden_vs_baseline,  # noqa: F401 (the registry's name)
)
from fourd_mpi.analysis.tables.runs import RUNS_SHOWN
from fourd_mpi.perf.peaks import GEMM_PCT_FORMULA, HFU_FORMULA, MFU_FORMULA
from fourd_mpi.trace.summary import HARDWARE_FLOPS_FORMULA, MODEL_FLOPS_FORMULA, SHARE_FORMULA, STEP_FORMULA

log = logging.getLogger(__name__)

#: the utilization columns' formulas (runs and compare tables)
UTILIZATION_FORMULAS = {"mfu_pct": f"in %, {MFU_FORMULA} (NaN: no data-sheet peak, e.g. a CPU run)",
                        "hfu_pct": f"in %, {HFU_FORMULA}", "gemm_pct": f"in %, {GEMM_PCT_FORMULA}"}
#: the keys of a comparison group (compare table)
COMPARE_KEYS = ["model", "world_size", "tokens_per_step"]


def runs_sections(runs: pd.DataFrame, modes: Sequence[str]) -> List[Tuple[str, pd.DataFrame]]:
    return [("runs", runs)]


def compare_sections(runs: pd.DataFrame, modes: Sequence[str]) -> List[Tuple[str, pd.DataFrame]]:
    """Only configurations with something to compare against: groups of two runs or more."""
    table = compare(runs)
    sizes = table.groupby(COMPARE_KEYS)["run_id"].transform("size")
    return [("compare", table[sizes > 1])]


def scaling_sections(runs: pd.DataFrame, modes: Sequence[str]) -> List[Tuple[str, pd.DataFrame]]:
    """One table per mode (weak, strong); groups left out are noted, except single runs (no line)."""
    out = []
    for mode in modes:
        table = scaling(runs, mode)
        for group, why in table.attrs.get("dropped", []):
            if not why.startswith("one rank count"):  # a single run is no line: not worth a word
                log.info("%s scaling: left out %s: %s", mode, group, why)
        out.append((f"{mode} scaling", table))
    return out


def need_compare(runs: pd.DataFrame) -> Optional[str]:
    n = len(runs)
    if n < 2 or not runs.duplicated(COMPARE_KEYS, keep=False).any():
        return (f"--what compare needs at least 2 traces of one configuration (same model, rank count and tokens "
                f"per step) to rank their grids and options; got {n} trace(s)"
                + ("" if n < 2 else ", no two of them alike"))
    return None


def need_scaling(runs: pd.DataFrame) -> Optional[str]:
    n = len(runs)
    counts = runs["world_size"].nunique() if n else 0
    if counts < 2:
        return (f"--what scaling needs traces at 2 or more rank counts (a weak or strong scaling line); got {n} "
                f"trace(s) at {counts} rank count(s)")
    return None


RUNS_FORMULAS = {"step_median_s": STEP_FORMULA, "*_share": SHARE_FORMULA, "tflops_per_rank": MODEL_FLOPS_FORMULA,
                 "hardware_tflops_per_rank": HARDWARE_FLOPS_FORMULA, **UTILIZATION_FORMULAS}
BREAKDOWN_FORMULAS = {"step_s": STEP_FORMULA, "*_%": "100 * " + SHARE_FORMULA, "recompute_%": RECOMPUTE_SHARE_FORMULA}
COMPARE_FORMULAS = {"mfu_pct": UTILIZATION_FORMULAS["mfu_pct"], "gemm_pct": UTILIZATION_FORMULAS["gemm_pct"]}


def runs_wide(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[RUNS_SHOWN]


def comm_wide(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.drop(columns=["formula"])
