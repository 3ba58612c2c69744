"""Tables across runs: scaling lines and the comparison of runs of one configuration."""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
import pandas as pd

from fourd_mpi.algorithms.registry import DEFAULT_ALGORITHM
from fourd_mpi.analysis.tables.runs import as_runs

SCALING_COLUMNS = ["config_key", "algorithm", "world_size", "grid", "step_median_s", "speedup", "efficiency",
                   "ideal_step_s", "group", "run_id", "tokens_per_step", "step_q1_s", "step_q3_s"]
COMPARE_COLUMNS = [
    "model", "world_size", "tokens_per_step", "algorithm", "grid", "overlap", "progress", "label", "run_id",
    "step_median_s", "step_q1_s", "step_q3_s", "compute_share", "wait_share", "harness_share", "other_share",
    "imbalance", "tflops_per_rank", "mfu_pct", "gemm_pct", "vs_best",
]


def scaling(runs, mode: str = "weak") -> pd.DataFrame:
    """Scaling lines from :func:`runs_table` rows (or a list of traces): columns :data:`SCALING_COLUMNS`.

    Runs are grouped by ``config_key`` (model, algorithm, overlap, progress, label); in ``strong`` mode also by
    the total work (``tokens_per_step``; the model is part of the key). Within a group, rows are
    sorted by ``world_size`` (then step time); every run is a row (several grids of one size may
    appear). Base = the smallest world size of the group; ``T(base)`` its fastest median step time.
    ``step_median_s``, ``step_q1_s``, ``step_q3_s``: the runs' step time and quartiles (:data:`STEP_FORMULA`).

    - ``weak`` (fixed work per rank): requires ``tokens_per_step / world_size`` to be the same for
      every run of the group, else the group is dropped. ``efficiency = T(base) / T(N)``,
      ``speedup = efficiency * N / base`` (scaled speedup: the throughput ratio),
      ``ideal_step_s = T(base)``.
    - ``strong`` (fixed total work): ``speedup = T(base) / T(N)``,
      ``efficiency = speedup * base / N``, ``ideal_step_s = T(base) * base / N``.

    ``group`` is the line's identifier (``config_key``; strong: ``config_key/tokens=T``).
    Groups with a single rank count are no line and are dropped. Runs without a step time are left out.
    Dropped groups and left-out runs are listed in ``df.attrs["dropped"]`` as ``(group, reason)``.
    """
    if mode not in ("weak", "strong"):
        raise ValueError(f"scaling mode must be 'weak' or 'strong', got {mode!r}")
    df = as_runs(runs)
    dropped: List[Tuple[str, str]] = []
    bad = df[~np.isfinite(df["step_median_s"].astype(float))]
    for _, row in bad.iterrows():
        dropped.append((row["config_key"], f"run {row['run_id']} has no measured step time"))
    df = df[np.isfinite(df["step_median_s"].astype(float))]
    keys = ["config_key"] if mode == "weak" else ["config_key", "tokens_per_step"]
    pieces = []
    for key, group in df.groupby(keys, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        name = key[0] if mode == "weak" else f"{key[0]}/tokens={key[1]}"
        group = group.sort_values(["world_size", "step_median_s"], kind="stable")
        if group["world_size"].nunique() < 2:
            dropped.append((name, f"one rank count only ({int(group['world_size'].iloc[0])})"))
            continue
        world = group["world_size"].to_numpy(dtype=np.float64)
        times = group["step_median_s"].to_numpy(dtype=np.float64)
        if mode == "weak":
            per_rank = group["tokens_per_step"].to_numpy(dtype=np.float64) / world
            if not np.allclose(per_rank, per_rank[0], rtol=1e-9, atol=0):
                values = ", ".join(f"{v:g}" for v in sorted(set(per_rank.tolist())))
                dropped.append((name, f"weak scaling needs the same tokens per rank in every run; got {values}"))
                continue
        base = world[0]
        t_base = times[world == base].min()
        if mode == "weak":
            efficiency = t_base / times
            speedup = efficiency * world / base
            ideal = np.full(len(times), t_base)
        else:
            speedup = t_base / times
            efficiency = speedup * base / world
            ideal = t_base * base / world
        pieces.append(pd.DataFrame({
            "config_key": group["config_key"].to_numpy(),
            "algorithm": (group["algorithm"].to_numpy() if "algorithm" in group.columns else DEFAULT_ALGORITHM),
            "world_size": group["world_size"].to_numpy(),
            "grid": group["grid"].to_numpy(), "step_median_s": times, "speedup": speedup,
            "efficiency": efficiency, "ideal_step_s": ideal, "group": name,
            "run_id": group["run_id"].to_numpy(), "tokens_per_step": group["tokens_per_step"].to_numpy(),
            "step_q1_s": group["step_q1_s"].to_numpy(dtype=np.float64),
            "step_q3_s": group["step_q3_s"].to_numpy(dtype=np.float64)}))
    out = (pd.concat(pieces, ignore_index=True) if pieces else pd.DataFrame(columns=SCALING_COLUMNS))
    out = out[SCALING_COLUMNS]
    out.attrs["dropped"] = dropped
    out.attrs["mode"] = mode
    return out


def compare(runs) -> pd.DataFrame:
    """Algorithms, grid shapes and overlap modes side by side: columns :data:`COMPARE_COLUMNS`.

    Runs of the same model, world size and total work (``tokens_per_step``) form a group, whatever
    their algorithm (``megatron1d`` against the best ``axonn4d`` grid is the comparison asked for),
    sorted by ``step_median_s``; ``vs_best`` = step_median_s / the group's smallest (1.0 = best,
    1.25 = 25 % slower). Groups are ordered by model, world size, tokens. Runs without a step time
    are left out.
    """
    df = as_runs(runs)
    df = df[np.isfinite(df["step_median_s"].astype(float))].copy()
    if not len(df):
        return pd.DataFrame(columns=COMPARE_COLUMNS)
    keys = ["model", "world_size", "tokens_per_step"]
    df["vs_best"] = df["step_median_s"] / df.groupby(keys)["step_median_s"].transform("min")
    df = df.sort_values(keys + ["step_median_s", "run_id"], kind="stable").reset_index(drop=True)
    return df[COMPARE_COLUMNS]
