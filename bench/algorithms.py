"""Algorithm comparison: every parallel algorithm on the same model and rank count, alternating repeats.

Cases (default, 8 ranks): ``optimus3d`` on a 2x2x2 cube; ``pipeline`` with 2 and 4 stages; the best
``axonn4d`` grid (``--best-grid``, else the performance model's fastest, :mod:`fourd_mpi.perf.algorithms`);
``megatron1d``; ``fsdp``; ``dp``. A case whose algorithm (or option) this installation lacks is skipped
with the reason (its command line is checked against ``fourd-mpi run``'s option table and resolution
first, without MPI), so the script runs today on the 4D family and picks up the others when they land.

**How it measures.** This driver never starts MPI. It launches one ``mpiexec -n N python -m fourd_mpi
run ...`` per (case, repeat), **round-robin**: repeat 1 of every case, then repeat 2 of every case, ...
(``--repeats R``), each writing an op-level trace. Launching a fresh job per measurement is what makes
the alternation honest: every case gets a fresh process layout and the same share of whatever else the
machine does at each point of the run, a drift in load hits all cases alike, and no case inherits
another's heap, buffer pools or page cache. Launch and set-up time are outside the measured steps
(``--warmup`` untimed steps first, then ``--steps`` measured ones). Numbers, per case, from the traces
(:mod:`fourd_mpi.analysis.tables`):

- ``grid``: the 4D grid (a pipeline's ``2st:4x1x1x1``: 2 stages, each a 4x1x1x1 grid);
- ``step ms``: the per-step series of every repeat pooled (a step's time = max over ranks of its span,
  :func:`fourd_mpi.trace.summary.step_stats`), its median and quartiles ``q1``/``q3``; ``rep min..max``:
  the range of the repeats' own medians (the run-to-run noise);
- ``vs best``: median over repeat rounds of ``case median / reference median`` **of the same round** (the
  ratio the alternation makes fair), the reference being the case with the smallest pooled median; with
  its range over rounds (a ratio below 1 happens when the rounds disagree with the pooled medians);
- ``compute``, ``bubble``, ``other``: per rank and step, mean over ranks = the category's share of all
  ranks' measured time x the mean rank step span (:func:`~fourd_mpi.analysis.tables.breakdown`; bubble:
  the pipeline's idle time waiting for a stage's message, categories named ``bubble``);
- ``exp <op>``: exposed communication per collective kind, per rank and step: host time inside MPI for
  it, its own ``I*`` call plus tests and waits (:data:`~fourd_mpi.analysis.tables.EXPOSED_FORMULA`); for
  a pipeline's ``send``/``recv`` that MPI time includes the bubbles in their windows (so the figure stacks
  compute, the collectives, the bubble and the rest of the mean rank step, p2p time in the rest);
- ``wire MB``: bytes a rank sends per step (ring model, :func:`~fourd_mpi.analysis.tables.comm_table`);
- ``act MiB``: activations kept from forward for backward, max over ranks, measured from the arrays held
  (trace metadata ``activations``); ``state MiB``: weights + gradients + optimizer state per rank from the
  memory model (not traced);
- ``model ms``: the performance model's step time for the case (``--profile``; ``-`` where the model has
  no predictor for the algorithm).

Launch with ``OMP_NUM_THREADS=1`` (exported to the jobs)::

    OMP_NUM_THREADS=1 python -m bench.algorithms                       # 8 ranks, gpt-small (4 layers, seq 64)
    python -m bench.algorithms --ranks 8 --repeats 5 --steps 6 --plot results/benchmarks/algorithms.png
    python -m bench.algorithms --cases megatron1d,fsdp --model gpt-tiny --json algos.json

The header prints the 1-min load average at start and end: anything else on the node skews every number.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

# Run from a checkout without installing the package.
REPO = Path(__file__).resolve().parents[1]

import numpy as np

from bench import command_line
from fourd_mpi import __version__
from fourd_mpi.algorithms.registry import ALGORITHMS, display_name
from fourd_mpi.errors import ConfigError
from fourd_mpi.step.presets import PRESETS
from fourd_mpi.util.values import nonnegative_int, positive_int

#: gpt-small with 4 layers (pipelines of 2 and 4 stages) and sequence 64 (about 0.5-2 s a step on 8 ranks, 2 cores)
DEFAULT_MODEL = "gpt-small"
DEFAULT_OVERRIDES = {"layers": 4, "seq": 64}
DEFAULT_CASES = ("optimus3d", "pipeline2", "pipeline4", "best4d", "megatron1d", "fsdp", "dp")
GIB, MIB = 2.0 ** 30, 2.0 ** 20
#: point-to-point ops (pipeline): their exposed time is MPI time in their windows, the bubbles included
P2P_OPS = ("send", "recv")


@dataclass
class Case:
    """One configuration: a name, its algorithm and the ``fourd-mpi run`` arguments that select it."""

    name: str
    algorithm: str
    args: List[str]
    note: str = ""
    skip: Optional[str] = None
    grid: str = ""
    traces: List[Optional[str]] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)


def case_table(ranks: int, microbatches: int, best_grid: Optional[str]) -> Dict[str, Case]:
    """The known cases (``--cases`` picks among them)."""
    best = ["--gdata", "--gz", "--gy", "--gx"]
    best_args = ([a for flag, v in zip(best, best_grid.split("x")) for a in (flag, v)] if best_grid else [])
    return {
        "optimus3d": Case("optimus3d", "optimus3d", ["--gx", "2", "--gy", "2", "--gz", "2"], "a 2x2x2 cube"),
        "pipeline2": Case("pipeline2", "pipeline", ["--ginter", "2", "--microbatches", str(microbatches)],
                          f"2 stages, {microbatches} micro-batches"),
        "pipeline4": Case("pipeline4", "pipeline", ["--ginter", "4", "--microbatches", str(microbatches)],
                          f"4 stages, {microbatches} micro-batches"),
        "best4d": Case("best4d", "axonn4d", best_args, "the best 4D grid"),
        "megatron1d": Case("megatron1d", "megatron1d", [], "all ranks tensor-parallel over Y"),
        "fsdp": Case("fsdp", "fsdp", [], "all ranks sharding over Z"),
        "dp": Case("dp", "dp", [], "all ranks data-parallel"),
    }


# --------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="algorithms.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=positive_int, default=8, help="MPI ranks of every case (default 8)")
    p.add_argument("--cases", default=",".join(DEFAULT_CASES),
                   help=f"comma list of {', '.join(DEFAULT_CASES)} (default all)")
    p.add_argument("--model", default=None, help=f"preset: {', '.join(PRESETS)} (default {DEFAULT_MODEL} with "
                   + ", ".join(f"--{k} {v}" for k, v in DEFAULT_OVERRIDES.items()) + " unless given)")
    for size in ("layers", "hidden", "heads", "ffn-hidden", "seq", "batch"):
        p.add_argument(f"--{size}", type=positive_int, default=None, help="model size override")
    p.add_argument("--best-grid", default=None, metavar="DxZxYxX",
                   help="the best4d case's grid (default: the performance model's fastest axonn4d grid)")
    p.add_argument("--microbatches", type=positive_int, default=2,
                   help="pipeline cases (default 2: divides the batch shard of both default pipelines)")
    p.add_argument("--steps", type=positive_int, default=5, help="measured steps per launch (default 5)")
    p.add_argument("--warmup", type=nonnegative_int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--repeats", type=positive_int, default=3, help="launches per case, round-robin (default 3)")
    p.add_argument("--overlap", default="none", help="--overlap of every case (default none)")
    p.add_argument("--dtype", default="float32", help="--dtype of every case (default float32)")
    p.add_argument("--profile", default=None, help="machine profile of the model column (default: this host's "
                   "calibrated results/profiles/<host>.yaml, else laptop)")
    p.add_argument("--out", default=None, help="directory for the traces (default: a temporary one, removed)")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the comparison figure there")
    p.add_argument("--json", default=None, metavar="FILE", help="also write every number as JSON")
    p.add_argument("--mpiexec", default=None, help="launcher (default: the mpiexec next to this Python)")
    p.add_argument("--timeout", type=positive_int, default=600, help="seconds per launch (default 600)")
    p.add_argument("--dry-run", action="store_true", help="print the cases, their grids and the skipped ones; "
                   "launch nothing")
    return p


def default_model(args) -> None:
    """No ``--model``: :data:`DEFAULT_MODEL` with :data:`DEFAULT_OVERRIDES` for the sizes not given."""
    if args.model is None:
        args.model = DEFAULT_MODEL
        for key, value in DEFAULT_OVERRIDES.items():
            if getattr(args, key) is None:
                setattr(args, key, value)


def model_args(args) -> List[str]:
    sizes = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "ffn-hidden": args.ffn_hidden,
             "seq": args.seq, "batch": args.batch}
    return ["--model", args.model] + [a for k, v in sizes.items() if v is not None for a in (f"--{k}", str(v))]


def common_args(args) -> List[str]:
    return model_args(args) + ["--steps", str(args.steps + args.warmup), "--warmup", str(args.warmup),
                               "--overlap", args.overlap, "--dtype", args.dtype, "--trace-level", "op",
                               "--display", "quiet"]


def check_case(case: Case, args, world: int) -> Optional[str]:
    """Why ``case`` cannot run here (None: it can), from ``fourd-mpi run``'s own parser and resolution."""
    from fourd_mpi.cli.run import run_parser
    from fourd_mpi.run.options import resolve_values

    if case.algorithm not in ALGORITHMS:
        return f"algorithm {case.algorithm} is not registered in this installation yet"
    try:
        ns = run_parser().parse_args(common_args(args) + ["--algorithm", case.algorithm] + case.args)
        options = resolve_values(vars(ns), world)
    except ConfigError as exc:
        return " ".join(str(exc).split())
    stages = int(getattr(options, "ginter", 1) or 1)  # pipeline: each stage's 4D grid
    case.grid = f"{stages}st:{options.grid}" if stages > 1 else str(options.grid)
    return None


def best_grid(args, world: int, profile) -> Tuple[Optional[str], str]:
    """``(grid, how it was chosen)`` of the best4d case."""
    if args.best_grid:
        return args.best_grid, "given (--best-grid)"
    from fourd_mpi.perf.algorithms import rank_algorithms
    from fourd_mpi.step.overlap import OverlapConfig
    from fourd_mpi.step.presets import resolve_model

    sizes = {k: v for k, v in (("layers", args.layers), ("hidden", args.hidden), ("heads", args.heads),
                               ("ffn_hidden", args.ffn_hidden), ("seq", args.seq), ("batch", args.batch))
             if v is not None}
    cfg = resolve_model(args.model, **sizes)
    try:
        ranking = rank_algorithms(["axonn4d"], cfg, world, profile, OverlapConfig.parse(args.overlap), args.dtype)
    except ConfigError as exc:
        return None, str(exc)
    top = ranking.every[0]
    return str(top.grid), (f"the model's fastest axonn4d grid on profile {profile.name} "
                           f"({top.prediction.step_s * 1e3:.1f} ms predicted)")


# --------------------------------------------------------------------------- running
def find_mpiexec(given: Optional[str]) -> str:
    if given:
        return given
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        raise ConfigError("no mpiexec next to this Python or on PATH: give --mpiexec")
    return found


def launch(case: Case, repeat: int, args, out: str, mpiexec: str) -> Tuple[Optional[str], str]:
    """One ``mpiexec`` job of ``case``; ``(trace path or None, error line)``."""
    run_id = f"{case.name}-r{repeat}"
    cmd = [mpiexec, "-n", str(args.ranks), sys.executable, "-m", "fourd_mpi", "run", *common_args(args),
           "--algorithm", case.algorithm, *case.args, "--results-dir", out, "--run-id", run_id, "--force"]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {args.timeout} s"
    path = os.path.join(out, run_id + ".h5")
    if proc.returncode != 0 or not os.path.exists(path):
        last = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        return None, f"exit {proc.returncode}: {last[-1] if last else 'no output'}"
    return path, ""


# --------------------------------------------------------------------------- measuring
def measure(path: str, profile) -> Dict:
    """The numbers of one repeat (module docstring), from its trace."""
    from fourd_mpi.analysis.tables import breakdown, comm_table
    from fourd_mpi.trace.events import COMPUTE_OPS
    from fourd_mpi.trace.read import load_trace
    from fourd_mpi.trace.summary import measured_records, step_stats

    trace = load_trace(path)
    stats = step_stats(trace)
    rs = measured_records(trace.rank_steps)
    mean_span = float((rs["end_ns"] - rs["start_ns"]).astype(np.float64).mean()) * 1e-9
    bd = breakdown(trace)
    share = bd.groupby("category")["share"].sum()
    compute = float(share[[c for c in share.index if c in COMPUTE_OPS]].sum())
    bubble = float(share[[c for c in share.index if "bubble" in str(c)]].sum())
    exposed_all = float(share.get("exposed_comm", 0.0))
    comm = comm_table(trace)
    exposed = {str(op): float(v) for op, v in comm.groupby("op")["exposed_s_per_step"].sum().items()
               if np.isfinite(v)}
    act = trace.metadata.get("activations") or {}
    return {"path": path, "per_step_s": [float(v) for v in stats.per_step_s], "median_s": stats.median_s,
            "compute_s": compute * mean_span, "bubble_s": bubble * mean_span, "waits_s": exposed_all * mean_span,
            "other_s": max(0.0, 1.0 - compute - bubble - exposed_all) * mean_span, "mean_span_s": mean_span,
            "exposed_s": exposed, "wire_bytes": float(comm["wire_bytes_per_step"].sum()) if len(comm) else 0.0,
            "activation_bytes": act.get("saved_bytes_max"), "activation_peak_bytes": act.get("peak_bytes_max"),
            **model_numbers(trace, profile)}


def model_numbers(trace, profile) -> Dict:
    """The performance model's step time and per-rank state memory for the traced configuration."""
    from fourd_mpi.algorithms.registry import get
    from fourd_mpi.analysis.model_check import config_of
    from fourd_mpi.perf.algorithms import predict_one, predictor, run_predict_options

    try:
        c = config_of(trace)
        algorithm = get(c["algorithm"])
        if predictor(algorithm.family) is None:
            return {"model_s": None, "state_bytes": None}
        p = predict_one(algorithm, c["model"], c["grid"], profile, c["overlap"], c["dtype"], c["progress"],
                        c["optimizer"], c["ranks_per_node"], **run_predict_options(algorithm, c["run_options"]))
    except ConfigError:
        return {"model_s": None, "state_bytes": None}
    m = p.memory
    return {"model_s": p.step_s, "state_bytes": m.weights + m.gradients + m.optimizer + m.master}


def aggregate(case: Case, reps: List[Optional[Dict]]) -> Dict:
    ok = [r for r in reps if r is not None]
    pooled = np.concatenate([r["per_step_s"] for r in ok]) if ok else np.zeros(0)
    med = lambda key: float(np.median([r[key] for r in ok])) if ok else float("nan")  # noqa: E731
    kinds = sorted({k for r in ok for k in r["exposed_s"]})
    optional = lambda key: (float(np.median([r[key] for r in ok if r[key] is not None]))  # noqa: E731
                            if any(r[key] is not None for r in ok) else None)
    return {"case": case.name, "algorithm": case.algorithm, "grid": case.grid, "note": case.note,
            "repeats": len(ok), "errors": case.errors,
            "step_median_s": float(np.median(pooled)) if len(pooled) else float("nan"),
            "step_q1_s": float(np.percentile(pooled, 25)) if len(pooled) else float("nan"),
            "step_q3_s": float(np.percentile(pooled, 75)) if len(pooled) else float("nan"),
            "repeat_medians_s": [r["median_s"] for r in ok],
            "compute_s": med("compute_s"), "bubble_s": med("bubble_s"), "other_s": med("other_s"),
            "waits_s": med("waits_s"), "span_s": med("mean_span_s"),
            "exposed_s": {k: float(np.median([r["exposed_s"].get(k, 0.0) for r in ok])) for k in kinds},
            "wire_bytes": med("wire_bytes"), "activation_bytes": optional("activation_bytes"),
            "activation_peak_bytes": optional("activation_peak_bytes"), "state_bytes": optional("state_bytes"),
            "model_s": optional("model_s")}


def round_ratios(results: List[Dict], per_case: Dict[str, List[Optional[Dict]]], repeats: int) -> None:
    """``vs best`` per case: in every repeat round, case median / the fastest case's median of that round;
    the median and range over rounds (rounds where a case failed are left out for it)."""
    best = min((r for r in results if r["repeats"]), key=lambda r: r["step_median_s"], default=None)
    if best is None:
        return
    for r in results:
        ratios = []
        for k in range(repeats):
            mine, ref = per_case[r["case"]][k], per_case[best["case"]][k]
            if mine is not None and ref is not None and ref["median_s"] > 0:
                ratios.append(mine["median_s"] / ref["median_s"])
        r["vs_best"] = statistics.median(ratios) if ratios else float("nan")
        r["vs_best_range"] = (min(ratios), max(ratios)) if ratios else (float("nan"), float("nan"))
        r["best_case"] = best["case"]


# --------------------------------------------------------------------------- report
def _f(value, scale=1.0, fmt="{:.1f}") -> str:
    return "-" if value is None or (isinstance(value, float) and not np.isfinite(value)) else fmt.format(value * scale)


def format_table(results: List[Dict]) -> str:
    kinds = sorted({k for r in results for k in r["exposed_s"]})
    cols = (["case", "algorithm", "grid", "step ms", "q1", "q3", "rep min..max", "vs best", "(range)", "compute"]
            + [f"exp {k}" for k in kinds] + ["bubble", "other", "wire MB", "act MiB", "state MiB", "model ms"])
    rows = []
    for r in results:
        reps = r["repeat_medians_s"]
        rows.append([r["case"], r["algorithm"], r["grid"], _f(r["step_median_s"], 1e3), _f(r["step_q1_s"], 1e3),
                     _f(r["step_q3_s"], 1e3),
                     f"{min(reps) * 1e3:.0f}..{max(reps) * 1e3:.0f}" if reps else "-",
                     _f(r.get("vs_best"), fmt="{:.2f}"),
                     "{:.2f}..{:.2f}".format(*r["vs_best_range"]) if r.get("vs_best_range") else "-",
                     _f(r["compute_s"], 1e3)]
                    + [_f(r["exposed_s"].get(k, 0.0), 1e3) for k in kinds]
                    + [_f(r["bubble_s"], 1e3), _f(r["other_s"], 1e3), _f(r["wire_bytes"], 1e-6, "{:.2f}"),
                       _f(r["activation_bytes"], 1 / MIB, "{:.2f}"), _f(r["state_bytes"], 1 / MIB, "{:.2f}"),
                       _f(r["model_s"], 1e3)])
    from fourd_mpi.util.table import render

    return render(rows, cols, align=["left"] * 3 + ["right"] * (len(cols) - 3))


def plot(results: List[Dict], path: str, title: str) -> None:
    """Stacked bars per case (compute, exposed communication per kind, bubble, other; step median with
    q1-q3 bars) and the memory per rank."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    shown = [r for r in results if r["repeats"]]
    kinds = sorted({k for r in shown for k in r["exposed_s"]})
    labels = [f"{display_name(r['algorithm'])}\n{r['grid']}" + (f"\n{r['note']}" if r["case"].startswith("pipe")
                                                                   else "") for r in shown]
    fig, (ax, axm) = plt.subplots(1, 2, figsize=(13, 5.6), gridspec_kw={"width_ratios": [2.2, 1]})
    y = np.arange(len(shown))
    left = np.zeros(len(shown))
    parts = [("compute", [r["compute_s"] for r in shown], "#2b6cb0")]
    palette = {"allgather": "#7b4fb0", "reduce_scatter": "#8c564b", "allreduce": "#d4a017", "send": "#2f855a",
               "recv": "#68d391"}
    collectives = [k for k in kinds if k not in P2P_OPS]  # a p2p op's exposed time holds the bubbles: not stacked
    parts += [(f"exposed {k}", [r["exposed_s"].get(k, 0.0) for r in shown], palette.get(k, "#e53e3e"))
              for k in collectives]
    parts += [("bubble", [r["bubble_s"] for r in shown], "#f6ad55")]
    stacked = np.sum([np.array(v, dtype=float) for _, v, _ in parts], axis=0)
    rest = [max(0.0, r.get("span_s", 0.0) - t) for r, t in zip(shown, stacked)]
    parts += [("other (incl. p2p send/recv)" if any(k in P2P_OPS for k in kinds) else "other", rest, "#a0aec0")]
    for name, values, color in parts:
        v = np.array(values, dtype=float) * 1e3
        if not np.any(v > 0):
            continue
        ax.barh(y, v, left=left, color=color, label=name, edgecolor="white", linewidth=0.5)
        left += v
    med = np.array([r["step_median_s"] for r in shown]) * 1e3
    lo = med - np.array([r["step_q1_s"] for r in shown]) * 1e3
    hi = np.array([r["step_q3_s"] for r in shown]) * 1e3 - med
    ax.errorbar(med, y, xerr=[np.maximum(lo, 0), np.maximum(hi, 0)], fmt="D", color="black", ms=4, capsize=3,
                label="step time (median, q1-q3)")
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step: bars = mean over ranks per category (sum: the mean rank step); "
                  "marker = median of max over ranks")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)
    ax.grid(True, axis="x", color="0.9")
    act = np.array([(r["activation_bytes"] or 0) / MIB for r in shown])
    state = np.array([(r["state_bytes"] or 0) / MIB for r in shown])
    axm.barh(y, state, color="#4a5568", label="weights + grads + optimizer (model)")
    axm.barh(y, act, left=state, color="#ed8936", label="activations kept for backward (measured)")
    axm.set_yticks(y)
    axm.set_yticklabels([])
    axm.invert_yaxis()
    axm.set_xlabel("MiB per rank (max over ranks)")
    axm.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, frameon=False)
    axm.grid(True, axis="x", color="0.9")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- main
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from fourd_mpi.jobs.sites import resolve_profile

    try:
        default_model(args)
        profile = resolve_profile("local" if args.profile is None else None, args.profile)
        table = case_table(args.ranks, args.microbatches, None)
        wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
        unknown = [c for c in wanted if c not in table]
        if unknown:
            raise ConfigError(f"--cases: unknown {', '.join(unknown)}; choose from {', '.join(table)}")
        grid, how = best_grid(args, args.ranks, profile) if "best4d" in wanted else (None, "")
        table = case_table(args.ranks, args.microbatches, grid)
        cases = [table[c] for c in wanted]
        for case in cases:
            case.skip = check_case(case, args, args.ranks)
        runnable = [c for c in cases if c.skip is None]
        if not runnable:
            raise ConfigError("no case can run: " + "; ".join(f"{c.name}: {c.skip}" for c in cases))
        mpiexec = find_mpiexec(args.mpiexec)
    except ConfigError as exc:
        print(f"algorithms.py: error: {exc}", file=sys.stderr)
        return 2
    out = args.out or tempfile.mkdtemp(prefix="fourd-algorithms-")
    os.makedirs(out, exist_ok=True)
    load_start = os.getloadavg()[0]
    print(f"algorithms bench (fourd-mpi {__version__}): {args.ranks} ranks, model {' '.join(model_args(args)[1:])}, "
          f"{args.dtype}, overlap {args.overlap}; {args.warmup} warm-up + {args.steps} measured steps per launch, "
          f"{args.repeats} launches per case, round-robin over the cases (one mpiexec per case and repeat)")
    print(f"1-min load average at start {load_start:.1f}; OMP_NUM_THREADS=1 in every job; {os.cpu_count()} cores")
    if grid:
        print(f"best4d grid {grid}: {how}")
    elif "best4d" in wanted:
        print(f"best4d: no grid ({how})")
    for c in cases:
        print(f"skipped {c.name}: {c.skip}" if c.skip else
              f"case {c.name}: --algorithm {c.algorithm} {' '.join(c.args)} -> grid {c.grid} ({c.note})")
    if args.dry_run:
        return 0
    per_case: Dict[str, List[Optional[Dict]]] = {c.name: [] for c in runnable}
    t0 = time.perf_counter()
    for k in range(args.repeats):
        for case in runnable:  # round-robin: every case once per round
            path, error = launch(case, k, args, out, mpiexec)
            rep = measure(path, profile) if path else None
            if error:
                case.errors.append(f"repeat {k}: {error}")
            per_case[case.name].append(rep)
            print(f"  round {k + 1}/{args.repeats} {case.name:<11} "
                  + (f"median step {rep['median_s'] * 1e3:8.1f} ms" if rep else f"FAILED: {error}"), flush=True)
    results = [aggregate(c, per_case[c.name]) for c in runnable]
    round_ratios(results, per_case, args.repeats)
    load_end = os.getloadavg()[0]
    print()
    print(format_table(results))
    print()
    print("step ms: pooled per-step times of every repeat (a step = max over ranks), median and quartiles; rep "
          "min..max: the repeats' medians;")
    print("vs best: median over rounds of (case median / the median of the case with the smallest pooled median, "
          "same round), range over rounds; compute, exp <op>, bubble, other: ms per rank and step, mean over ranks; "
          "wire MB: bytes a rank sends per step;")
    if any(k in P2P_OPS for r in results for k in r["exposed_s"]):
        print("exp send/recv: MPI time while the pipeline's messages were in flight, the bubble (time blocked "
              "waiting for another stage's message) included: not additive with the bubble column;")
    print("act MiB: activations kept for backward, max over ranks (measured); state MiB: weights + gradients + "
          "optimizer per rank (memory model); model ms: performance model, profile " + profile.name)
    for r in results:
        for e in r["errors"]:
            print(f"error {r['case']}: {e}")
    print(f"1-min load average at end {load_end:.1f} (this job alone keeps it near {args.ranks}); "
          f"wall {time.perf_counter() - t0:.0f} s; traces in {out}")
    if args.plot:
        title = (f"{args.ranks} ranks, {' '.join(model_args(args)[1:])}, {args.steps} steps x {args.repeats} "
                 f"alternating launches; load {load_start:.1f}-{load_end:.1f}")
        plot(results, args.plot, title)
        print(f"wrote {args.plot}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"command": command_line(), "load_average": [load_start, load_end], "profile": profile.name,
                       "skipped": {c.name: c.skip for c in cases if c.skip},
                       "results": results,
                       "repeats": {name: reps for name, reps in per_case.items()}}, fh, indent=1, default=str)
        print(f"wrote {args.json}")
    if args.out is None:
        shutil.rmtree(out, ignore_errors=True)
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
