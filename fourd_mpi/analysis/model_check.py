"""``fourd-mpi model validate TRACES...`` and ``model calibrate``: the performance model (:mod:`fourd_mpi.perf`,
pure) checked against, and its term weights fitted to, measured runs (traces read by :mod:`fourd_mpi.trace`,
measured by :mod:`fourd_mpi.analysis.tables`): a check of the model, so it sits above both.

For every trace the configuration (model, grid, overlap options, progress, dtype) comes from its
metadata (``run_options``), the measurement from :func:`fourd_mpi.analysis.tables.runs_table` (median step
time) and :func:`fourd_mpi.analysis.tables.breakdown` (exposed communication per step: time blocked in
``Wait``, mean over ranks). Reported per configuration: measured and predicted step time and
exposed communication and their relative errors ``(predicted - measured) / measured``; per group
of runs of one model, rank count and global batch: Spearman's rank correlation of predicted and
measured step times, and whether the measured best is the predicted best (top 1) or among the
predicted three best (top 3); per algorithm (metadata ``algorithm``; traces without it ran ``axonn4d``):
the runs and the median absolute relative errors of the step time and of the exposed communication;
overall: the median absolute relative error of the step time. Each run is predicted by its algorithm
family's predictor (:mod:`fourd_mpi.perf.algorithms`); a run of an algorithm the model does not cover
yet keeps NaN predictions and is named in the summary.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.machine import MachineProfile
from fourd_mpi.perf.predict import Prediction
from fourd_mpi.run.options import overlap_of

GOALS = {"median_abs_rel_error": 0.20, "spearman": 0.8, "best_in_top": 3}


def average_ranks(values) -> np.ndarray:
    """Ranks 1..n, ties get the mean of their ranks (as ``scipy.stats.rankdata``)."""
    v = np.asarray(values, dtype=float)
    order = np.argsort(v, kind="stable")
    ranks = np.empty(len(v))
    ranks[order] = np.arange(1, len(v) + 1)
    for value in np.unique(v):
        tie = v == value
        if tie.sum() > 1:
            ranks[tie] = ranks[tie].mean()
    return ranks


def spearman(a, b) -> float:
    """Spearman's rho: Pearson correlation of the average ranks (NaN for fewer than 3 points or no spread)."""
    if len(a) < 3:
        return float("nan")
    ra, rb = average_ranks(a), average_ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def config_of(trace) -> Dict:
    """Model, grid and options of a trace, from its metadata."""
    from fourd_mpi.step.presets import ModelConfig

    ro = trace.metadata.get("run_options")
    if not isinstance(ro, dict) or "model" not in ro or "grid" not in ro:
        raise ConfigError(f"{trace.path}: the trace has no run_options metadata to predict from")
    model = ModelConfig(**{k: ro["model"][k] for k in ModelConfig.__dataclass_fields__ if k in ro["model"]})
    grid = GridShape(**{k: int(ro["grid"][k]) for k in ("data", "z", "y", "x")})
    overlap = overlap_of({k: ro[k] for k in ("overlap", "cache_weights", "prefetch_depth", "chunks") if k in ro})
    rpn = trace.metadata.get("ranks_per_node")
    rpn = int(max(rpn)) if isinstance(rpn, (list, tuple)) and rpn else None
    from fourd_mpi.algorithms.registry import of_metadata

    return {"model": model, "grid": grid, "overlap": overlap, "progress": str(ro.get("progress", "poll")),
            "dtype": str(ro.get("dtype", "float32")), "optimizer": str(ro.get("optimizer", "adam")),
            "ranks_per_node": rpn, "algorithm": of_metadata(trace.metadata), "run_options": ro}


def validate(traces, profile: MachineProfile):
    """A pandas frame, one row per trace, and a summary dict (see the module docstring)."""
    import pandas as pd

    from fourd_mpi.algorithms.registry import ALGORITHMS
    from fourd_mpi.analysis.tables import breakdown, runs_table
    from fourd_mpi.perf.algorithms import predict_one, predictor, run_predict_options
    from fourd_mpi.trace.summary import measured_records

    runs = runs_table(traces)
    rows = []
    uncovered: Dict[str, int] = {}
    for trace, (_, run) in zip(traces, runs.iterrows()):
        c = config_of(trace)
        algorithm = ALGORITHMS.get(c["algorithm"])
        if algorithm is None or predictor(algorithm.family) is None:
            uncovered[c["algorithm"]] = uncovered.get(c["algorithm"], 0) + 1
            pred = None
        else:
            pred: Prediction = predict_one(algorithm, c["model"], c["grid"], profile, c["overlap"], c["dtype"],
                                           c["progress"], c["optimizer"], c["ranks_per_node"],
                                           **run_predict_options(algorithm, c["run_options"]))
        bd = breakdown(trace)
        # exposed communication per rank and step, mean over the measured records: the breakdown's share
        # of all ranks' time times the mean rank span (not of the median step time: the model predicts a mean)
        rs = measured_records(trace.rank_steps)
        mean_span = float((rs["end_ns"] - rs["start_ns"]).astype(np.float64).mean()) * 1e-9 if len(rs) else np.nan
        exposed = (float(bd.loc[bd["category"] == "exposed_comm", "share"].sum()) * mean_span if len(bd)
                   else float("nan"))
        measured = float(run["step_median_s"])
        nan = float("nan")
        p_step, p_exposed, p_compute = ((pred.step_s, pred.exposed_total_s, pred.compute_s) if pred is not None
                                        else (nan, nan, nan))
        rows.append({
            "group": f"{run['model']}/{run['world_size']}/b{c['model'].batch}", "algorithm": c["algorithm"],
            "run_id": run["run_id"], "grid": str(c["grid"]), "overlap": run["overlap"], "progress": run["progress"],
            "measured_s": measured, "predicted_s": p_step,
            "step_err": (p_step - measured) / measured if measured > 0 else nan,
            "measured_exposed_s": exposed, "predicted_exposed_s": p_exposed,
            "exposed_err": ((p_exposed - exposed) / exposed if exposed > 0 else nan),
            "predicted_compute_s": p_compute,
        })
    df = pd.DataFrame(rows)
    groups = []
    for name, g in df.groupby("group", sort=True):
        g = g[np.isfinite(g["measured_s"]) & np.isfinite(g["predicted_s"])]
        if not len(g):
            continue
        pred_order = list(g.sort_values("predicted_s", kind="stable")["run_id"])
        best = g.loc[g["measured_s"].idxmin(), "run_id"]
        position = pred_order.index(best) + 1
        groups.append({"group": name, "runs": len(g), "spearman": spearman(g["predicted_s"], g["measured_s"]),
                       "measured_best": _configuration(g.loc[g["measured_s"].idxmin()]),
                       "predicted_best": _configuration(g.loc[g["predicted_s"].idxmin()]),
                       "best_rank_in_prediction": position, "top1": position == 1, "top3": position <= 3})
    gdf = pd.DataFrame(groups)
    errs = np.abs(df["step_err"].to_numpy(dtype=float))
    errs = errs[np.isfinite(errs)]
    exp_errs = np.abs(df["exposed_err"].to_numpy(dtype=float))
    exp_errs = exp_errs[np.isfinite(exp_errs)]
    rhos = gdf["spearman"].to_numpy(dtype=float) if len(gdf) else np.array([])
    summary = {
        "runs": len(df),
        "median_abs_rel_error": float(np.median(errs)) if len(errs) else float("nan"),
        "median_abs_rel_error_exposed": float(np.median(exp_errs)) if len(exp_errs) else float("nan"),
        "spearman_min": float(np.nanmin(rhos)) if np.isfinite(rhos).any() else float("nan"),
        "spearman_pooled": spearman(df["predicted_s"], df["measured_s"]) if len(df) else float("nan"),
        "top1": int(gdf["top1"].sum()) if len(gdf) else 0,
        "top3": int(gdf["top3"].sum()) if len(gdf) else 0,
        "groups": len(gdf),
    }
    summary["by_algorithm"] = by_algorithm(df)
    summary["not_predicted"] = dict(uncovered)
    summary["goals_met"] = {
        "median_abs_rel_error <= 0.20": bool(summary["median_abs_rel_error"] <= GOALS["median_abs_rel_error"]),
        "spearman >= 0.8 in every group": bool(np.isfinite(rhos).any()
                                              and np.nanmin(rhos) >= GOALS["spearman"]),
        "measured best in predicted top 3 in every group": bool(len(gdf) and gdf["top3"].all()),
    }
    return df, gdf, summary


def _configuration(row) -> str:
    """``grid (overlap)``, with the algorithm when it is not the default: ``megatron1d 2x1x4x1 (none)``."""
    head = "" if row.get("algorithm", "axonn4d") == "axonn4d" else f"{row['algorithm']} "
    return f"{head}{row['grid']} ({row['overlap']})"


def by_algorithm(df) -> "list":
    """Per algorithm: runs, runs predicted, the median |relative error| of the step time and of the exposed
    communication (over the runs where both are finite), the median signed step error (a bias)."""
    out = []
    for name, g in df.groupby("algorithm", sort=True):
        step = g["step_err"].to_numpy(dtype=float)
        step = step[np.isfinite(step)]
        exp = g["exposed_err"].to_numpy(dtype=float)
        exp = exp[np.isfinite(exp)]
        out.append({"algorithm": name, "runs": int(len(g)), "predicted": int(np.isfinite(g["predicted_s"]).sum()),
                    "median_abs_step_err": float(np.median(np.abs(step))) if len(step) else float("nan"),
                    "median_step_err": float(np.median(step)) if len(step) else float("nan"),
                    "median_abs_exposed_err": float(np.median(np.abs(exp))) if len(exp) else float("nan")})
    return out


#: terms ``model calibrate`` fits by default: ``sync`` (the benchmark's per-message wait after compute)
#: is left out (weight 0) because on held-out runs it made predictions worse, not better
#: (results/benchmarks/model_validation.txt); ``--terms`` chooses.
DEFAULT_FIT_TERMS = ("gemm", "attention", "elementwise", "calls", "comm")


def calibrate(traces, profile: MachineProfile, terms=DEFAULT_FIT_TERMS):
    """Fit the profile's term weights to the measured steps of ``traces`` (runs without overlap).

    Returns ``(profile data with step_fit, table rows, names of the traces left out)``.
    """
    from fourd_mpi.analysis.tables import runs_table
    from fourd_mpi.perf.machine import TERMS
    from fourd_mpi.perf.predict import fit_term_weights, term_features

    runs = runs_table(traces)
    features, measured, used, skipped = [], [], [], []
    for trace, (_, run) in zip(traces, runs.iterrows()):
        c = config_of(trace)
        if [o for o in c["overlap"].enabled if o != "cache"]:
            skipped.append(f"{run['run_id']} (overlap {run['overlap']}: the terms add up only without overlap)")
            continue
        features.append(term_features(c["model"], c["grid"], profile, c["overlap"], c["dtype"], c["optimizer"],
                                      c["ranks_per_node"]))
        measured.append(float(run["step_median_s"]))
        used.append(str(run["run_id"]))
    weights, predicted = fit_term_weights(features, measured, terms)
    errors = [abs(p - m) / m for p, m in zip(predicted, measured)]
    data = dict(profile.data)
    data["step_fit"] = {
        "description": "multipliers of the model's terms, fitted by fourd-mpi model calibrate to measured "
                       f"steps (relative least squares, non-negative; fitted terms: {', '.join(terms)})",
        "weights": {t: round(weights[t], 6) for t in TERMS},
        "traces": used, "median_abs_rel_error": round(float(np.median(errors)), 4)}
    rows = [{"run_id": u, "measured_ms": m * 1e3, "fitted_ms": p * 1e3, "err_%": 100 * (p - m) / m}
            for u, m, p in zip(used, measured, predicted)]
    return data, rows, skipped


def report(df, gdf, summary, profile: MachineProfile, fmt: str = "table") -> str:
    from fourd_mpi.analysis.tables import format_table

    shown = df.copy()
    for col in ("measured_s", "predicted_s", "measured_exposed_s", "predicted_exposed_s", "predicted_compute_s"):
        shown[col.replace("_s", "_ms")] = shown.pop(col) * 1e3
    for col in ("step_err", "exposed_err"):
        shown[col.replace("_err", "_err_%")] = shown.pop(col) * 100
    cols = ["group", "algorithm", "grid", "overlap", "progress", "measured_ms", "predicted_ms", "step_err_%",
            "measured_exposed_ms", "predicted_exposed_ms", "exposed_err_%", "predicted_compute_ms", "run_id"]
    shown = shown.sort_values(["group", "measured_ms"])[cols]
    if fmt == "json":  # one document: the profile, both tables (records), the summary
        import json

        def plain(value):  # numpy scalars of the summary
            return value.item() if hasattr(value, "item") else str(value)

        return json.dumps({"profile": profile.describe(),
                           "configurations": json.loads(format_table(shown, "json")),
                           "groups": json.loads(format_table(gdf, "json")), "summary": summary},
                          indent=1, default=plain)
    fmt_t = "markdown" if fmt == "markdown" else ("csv" if fmt == "csv" else "table")
    parts = [profile.describe(), "", "per configuration (errors = (predicted - measured) / measured):",
             format_table(shown, fmt_t), "", "per group (model/ranks/batch):", format_table(gdf, fmt_t), ""]
    s = summary
    if s.get("by_algorithm"):
        import pandas as pd

        per = pd.DataFrame(s["by_algorithm"])
        for col in ("median_abs_step_err", "median_step_err", "median_abs_exposed_err"):
            per[col.replace("_err", "_err_%")] = per.pop(col) * 100
        parts += ["per algorithm (metadata algorithm; older traces: axonn4d):", format_table(per, fmt_t), ""]
    for name, n in (s.get("not_predicted") or {}).items():
        parts.append(f"not predicted: {n} run(s) of {name} (the performance model has no predictor for it yet)")
    parts.append(f"{s['runs']} runs in {s['groups']} group(s): median |step error| "
                 f"{100 * s['median_abs_rel_error']:.1f}%, median |exposed-comm error| "
                 f"{100 * s['median_abs_rel_error_exposed']:.1f}%, Spearman min over groups {s['spearman_min']:.3f} "
                 f"(pooled {s['spearman_pooled']:.3f}), measured best = predicted best in {s['top1']}/{s['groups']}, "
                 f"in predicted top 3 in {s['top3']}/{s['groups']}")
    parts.append("goals: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in s["goals_met"].items()))
    return "\n".join(parts)
