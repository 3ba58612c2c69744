"""``fourd-mpi model published``: the model against a shipped, versioned set of published results (pure).

Datasets are the YAML files of this folder (``dataset``, ``version``, ``source``, ``metric``,
``machine``, ``defaults``, ``points``); each point holds its configuration, its published result and
where it comes from. Claims (``claims.yaml``) pair two configurations with a published margin.

Nothing here adjusts the model: every point is predicted by
:func:`~fourd_mpi.perf.prediction.predict_scenario` with the machine profile's data-sheet and
published-collective constants. Per point: ``ratio = predicted / published`` of the dataset's metric
(TFLOP/s per GPU or % of peak, Megatron's ``96 B s l h^2 (1 + s/6h + V/16lh)`` convention);
``error = |ratio - 1|``. Summary: the median of the errors, the worst point, and Spearman's rank
correlation ``rho = 1 - 6 sum d_i^2 / (n (n^2 - 1))`` of published against predicted (ranks with ties
averaged, then Pearson's correlation of the ranks, which equals that formula without ties).
"""

from __future__ import annotations

import copy
import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from fourd_mpi.core.grid import GridShape, grid_factorizations
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.machine import MachineProfile, load_profile
from fourd_mpi.perf.prediction import ScenarioResult, predict_scenario
from fourd_mpi.perf.scenario import Scenario
from fourd_mpi.perf.step_terms import fits_memory, scenario_memory
from fourd_mpi.step.presets import ModelConfig, model_problems
from fourd_mpi.util.table import render
from fourd_mpi.util.units import GIB

HERE = os.path.dirname(os.path.abspath(__file__))
DATASETS = ("narayanan_sc21", "axonn_sc24", "narayanan_sc21_table2", "megatron_readme_2020", "llama3_405b",
            "megascale_megatron")
#: the set the accuracy targets apply to (Table 1 and AxoNN's flagship); the other datasets are reported
#: beside it with their own summaries
TARGET_SET = ("narayanan_sc21", "axonn_sc24")
#: the accuracy targets for TARGET_SET: median |error| and Spearman's rho of % of peak
TARGET_MEDIAN_ERROR = 0.10
TARGET_SPEARMAN = 0.8
#: AxoNN's minimum tensor-parallel degree G_x G_y G_z for gpt-80b (REFERENCES.md section 2, run scripts)
AXONN_MIN_TP = {"gpt-80b": 64}


def load(name: str) -> Dict[str, Any]:
    """The dataset ``name`` (a file of this folder without ``.yaml``) as a mapping (a copy: the caller may
    change it; each file is read and parsed once per process)."""
    return copy.deepcopy(_read(name))


@functools.lru_cache(maxsize=None)
def _read(name: str) -> Dict[str, Any]:
    import yaml

    path = os.path.join(HERE, name + ".yaml")
    if not os.path.exists(path):
        raise ConfigError(f"unknown published dataset {name!r}: choose {', '.join(DATASETS)}")
    with open(path) as fh:
        return yaml.safe_load(fh)


def _model(point: Dict[str, Any], seq: int) -> ModelConfig:
    """The model of a point: GPT sizes, with ``ffn`` (default ``4h``), ``kv_heads`` and ``mlp`` where given."""
    h = int(point["hidden"])
    kv = point.get("kv_heads")
    return ModelConfig(point.get("name", "gpt"), "gpt", int(point["layers"]), h, int(point["heads"]),
                       int(point.get("ffn", 4 * h)), seq, int(point["batch"]), kv_heads=None if kv is None else int(kv),
                       mlp=point.get("mlp", "gelu"))


def dataset_file(dataset_id: str) -> str:
    """The file name (without ``.yaml``) of the dataset whose ``dataset:`` is ``dataset_id``."""
    for name in DATASETS:
        if load(name)["dataset"] == dataset_id:
            return name
    raise ConfigError(f"no published dataset {dataset_id!r}")


def scenario_of(point: Dict[str, Any], defaults: Dict[str, Any], machine: str) -> Scenario:
    """The :class:`Scenario` of a point with an explicit configuration (``tp``, ``pp``, ``gpus``, ``mbs``,
    ``chunks``, ``ddp``, optionally ``cp``, ``first_stage_layers``, ``last_stage_layers``): Megatron's 1D tensor
    parallelism is the grid ``DP x 1 x TP x 1`` with ``DP = GPUs / (TP PP CP)``; or ``grid``
    (``G_data x G_z x G_y x G_x``, e.g. ZeRO-3's ``1 x N x 1 x 1``) with ``algorithm``, ``overlap`` and
    ``implementation``."""
    d = dict(defaults, **point)
    cfg = _model(d, int(d["seq"]))
    tp, pp, cp = int(d.get("tp", 1)), int(d.get("pp", 1)), int(d.get("cp", 1))
    dp = int(d["gpus"]) // (tp * pp * cp)
    grid = GridShape.parse(d["grid"]) if d.get("grid") else GridShape(dp, 1, tp, 1)
    chunks = int(d.get("chunks", 1))
    overlap = d.get("overlap") or ("dp" if d.get("ddp") == "torch" else "none")
    return Scenario(cfg, grid, machine, algorithm=d["algorithm"], stages=pp,
                    implementation=d.get("implementation", "fourd"),
                    schedule="interleaved" if chunks > 1 else "1f1b", chunks=chunks,
                    microbatch_size=int(d["mbs"]), vocab=int(d["vocab"]),
                    sequence_parallel=bool(d["sequence_parallel"]), recompute=d["recompute"], dtype=d["dtype"],
                    attention=d["attention"], precision=d["precision"], shard_optimizer=d["shard_optimizer"],
                    optimizer=d["optimizer"], overlap=overlap, memory_limit_gib=d.get("memory_limit_gib"),
                    context_parallel=cp, context_parallel_comm=d.get("cp_comm", "ring"),
                    first_stage_layers=d.get("first_stage_layers"),
                    last_stage_layers=d.get("last_stage_layers"))


def tuned_4d(point: Dict[str, Any], defaults: Dict[str, Any], profile: MachineProfile) -> ScenarioResult:
    """``grid: tuned``: the fastest 4D grid of ``gpus`` (with at least AxoNN's minimum tensor-parallel
    degree where the run scripts state one) whose predicted memory fits; one micro-batch."""
    d = dict(defaults, **point)
    cfg = _model(d, int(d["seq"]))
    min_tp = AXONN_MIN_TP.get(d.get("name"), 1)
    best: Optional[ScenarioResult] = None
    for grid in grid_factorizations(int(d["gpus"])):
        if grid.x * grid.y * grid.z < min_tp or model_problems(cfg, grid) or (d["vocab"] % (grid.x * grid.y)):
            continue
        sc = Scenario(cfg, grid, profile.name, algorithm="axonn4d", vocab=int(d["vocab"]), recompute=d["recompute"],
                      dtype=d["dtype"], attention=d["attention"], precision=d["precision"],
                      shard_optimizer=d["shard_optimizer"], optimizer=d["optimizer"], overlap=d.get("overlap", "all"),
                      memory_limit_gib=d.get("memory_limit_gib"))
        if not fits_memory(sc, profile):
            continue
        r = predict_scenario(sc, profile)
        if best is None or r.step_s < best.step_s:
            best = r
    if best is None:
        raise ConfigError(f"no 4D grid of {d['gpus']} GPUs fits {cfg.name} in {d.get('memory_limit_gib')} GiB")
    return best


def megatron_search(cfg: ModelConfig, gpus: int, profile: MachineProfile, defaults: Dict[str, Any],
                    tps=(1, 2, 4), mbss=(1, 2, 4)) -> ScenarioResult:
    """The fastest Megatron-LM PTD-P configuration of ``gpus`` the model finds that fits: tensor
    parallelism ``tps`` inside a node, every pipeline depth dividing the layers, micro-batch sizes
    ``mbss``, 1F1B or interleaved (every ``v`` dividing the blocks per stage), the distributed optimizer
    (``shard_optimizer=data``), the gradient all-reduce after the last micro-batch."""
    best: Optional[ScenarioResult] = None
    for tp in tps:
        for pp in (p for p in range(1, cfg.layers + 1) if cfg.layers % p == 0):
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            grid = GridShape(dp, 1, tp, 1)
            if model_problems(cfg, grid):
                continue
            per_stage = cfg.layers // pp
            for mbs in mbss:
                if (cfg.batch // dp) % mbs:
                    continue
                m = cfg.batch // dp // mbs
                for v in [1] + [c for c in range(2, per_stage + 1) if per_stage % c == 0 and pp > 1 and m % pp == 0]:
                    sc = Scenario(cfg, grid, profile.name, algorithm="megatron1d", stages=pp,
                                  schedule="interleaved" if v > 1 else "1f1b", chunks=v, microbatch_size=mbs,
                                  vocab=int(defaults["vocab"]), recompute=defaults["recompute"],
                                  dtype=defaults["dtype"], attention=defaults["attention"],
                                  precision=defaults["precision"], shard_optimizer="data",
                                  optimizer=defaults["optimizer"], overlap="none",
                                  memory_limit_gib=defaults.get("memory_limit_gib"))
                    try:
                        if not fits_memory(sc, profile):
                            continue
                        r = predict_scenario(sc, profile)
                    except ConfigError:
                        continue
                    if best is None or r.step_s < best.step_s:
                        best = r
    if best is None:
        raise ConfigError(f"no Megatron-LM PTD-P configuration of {gpus} GPUs fits {cfg.name}")
    return best


@dataclass
class Row:
    """One published point next to its prediction."""

    dataset: str
    name: str
    gpus: int
    metric: str
    published: float
    predicted: float
    result: ScenarioResult
    source: str
    assumed: List[str] = field(default_factory=list)
    scheme: str = ""

    @property
    def ratio(self) -> float:
        return self.predicted / self.published

    @property
    def error(self) -> float:
        return abs(self.ratio - 1.0)

    def to_match(self) -> Dict[str, float]:
        """Which term would have to change, alone, for the prediction to equal the published result (a
        diagnosis, never applied): the published step ``t_pub = t_pred x ratio`` (both metrics are
        FLOPs / time, so ``ratio = t_pub / t_pred``); ``compute = (t_pub - (t_pred - c)) / c`` for the compute
        term ``c``; ``exposed = (t_pub - (t_pred - x)) / x`` for the exposed communication and bubble ``x``."""
        res = self.result
        t_pub = res.step_s * self.ratio
        c = res.compute_s
        x = sum(res.exposed_s.values()) + res.bubble_s
        return {"compute": (t_pub - (res.step_s - c)) / c if c else float("nan"),
                "exposed": (t_pub - (res.step_s - x)) / x if x else float("nan")}


#: a dataset's ``metric`` -> (the result's method, its FLOP convention): Megatron's ``96 B s l h^2 (...)`` % of peak
#: or TFLOP/s per GPU, or MFU (model FLOPs, PaLM's ``6N + 12 l h s`` per token, Chowdhery et al. 2023, appendix B)
METRICS = {"pct_peak": ("pct_peak", "megatron"), "tflops_per_gpu": ("tflops_per_gpu", "megatron"),
           "mfu_pct": ("pct_peak", "model")}


def metric_of(r: ScenarioResult, metric: str) -> float:
    """The prediction of ``r`` in a dataset's ``metric`` (:data:`METRICS`)."""
    method, convention = METRICS[metric]
    return getattr(r, method)(convention)


def predict_point(ds: Dict[str, Any], point: Dict[str, Any], profile: MachineProfile) -> ScenarioResult:
    """The model's prediction of one point of the dataset ``ds``."""
    if point.get("grid") == "tuned":
        return tuned_4d(point, ds["defaults"], profile)
    return predict_scenario(scenario_of(point, ds["defaults"], ds["machine"]), profile)


def evaluate(names=DATASETS) -> List[Row]:
    """Every point of the datasets ``names``, predicted."""
    rows: List[Row] = []
    for name in names:
        ds = load(name)
        profile = load_profile(ds["machine"])
        for point in ds["points"]:
            r = predict_point(ds, point, profile)
            rows.append(Row(ds["dataset"], point["name"], int(point["gpus"]), ds["metric"], float(point[ds["metric"]]),
                            metric_of(r, ds["metric"]), r, ds["source"], list(point.get("assumed", [])),
                            str(point.get("scheme", ""))))
    return rows


def _ranks(values: List[float]) -> List[float]:
    """Ranks 1..n, ties averaged."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(a: List[float], b: List[float]) -> float:
    """Spearman's rho: Pearson's correlation of the (tie-averaged) ranks. Known answers: identical order
    1, reversed -1."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError("spearman needs two lists of the same length, at least 2")
    ra, rb = _ranks(a), _ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else 0.0


def summary(rows: List[Row]) -> Dict[str, Any]:
    """Median absolute relative error, worst point, Spearman of published vs predicted (per dataset metric
    expressed as % of peak so datasets combine), and whether every point fits its GPU's memory."""
    errors = sorted(r.error for r in rows)
    n = len(errors)
    median = errors[n // 2] if n % 2 else 0.5 * (errors[n // 2 - 1] + errors[n // 2])
    worst = max(rows, key=lambda r: r.error)
    pub = [r.result.pct_peak() * r.published / r.predicted for r in rows]  # published % of peak
    pred = [r.result.pct_peak() for r in rows]
    return {"points": n, "median_abs_error": median, "worst": worst.name, "worst_error": worst.error,
            "spearman": spearman(pub, pred) if n > 1 else None,
            "all_fit": all(r.result.fits() is not False for r in rows),
            "targets": {"median_abs_error": TARGET_MEDIAN_ERROR, "spearman": TARGET_SPEARMAN}}


def evaluate_claims() -> List[Dict[str, Any]]:
    """Each published ranking claim: the two predictions and the published and predicted margins."""
    import yaml

    with open(os.path.join(HERE, "claims.yaml")) as fh:
        doc = yaml.safe_load(fh)
    out = []
    for claim in doc["claims"]:
        sides = {}
        for key in ("a", "b"):
            spec = claim[key]
            if "dataset" in spec:
                ds = load(dataset_file(spec["dataset"]))
                point = next(p for p in ds["points"] if p["name"] == spec["point"])
                sides[key] = predict_point(ds, point, load_profile(ds["machine"]))
            else:  # search: megatron-ptdp
                other = sides["a"].scenario
                ds = load("axonn_sc24")
                sides[key] = megatron_search(other.model, other.world, load_profile(spec["machine"]), ds["defaults"])
        a, b = sides["a"], sides["b"]
        predicted = a.tflops_per_gpu() / b.tflops_per_gpu() - 1.0
        out.append({"name": claim["name"], "source": claim["source"], "published_margin": float(claim["margin"]),
                    "predicted_margin": predicted, "a": a, "b": b,
                    "same_winner": (predicted > 0) == (float(claim["margin"]) > 0), "note": claim["b"].get("note", ""),
                    "published_tflops": claim.get("published_tflops", {})})
    return out


def evaluate_memory_claims(names=DATASETS) -> List[Dict[str, Any]]:
    """Each published statement that a configuration did or did not fit its GPUs (a dataset's
    ``memory_claims``: a point, optionally with other ``gpus``, ``batch`` and ``grid``), against the
    model's ``required`` bytes per GPU and the dataset's memory limit."""
    out = []
    for name in names:
        ds = load(name)
        for claim in ds.get("memory_claims", []):
            point = dict(next(p for p in ds["points"] if p["name"] == claim["point"]))
            point.update({k: claim[k] for k in ("gpus", "batch", "grid", "mbs") if k in claim})
            sc = scenario_of(point, ds["defaults"], ds["machine"])
            required = scenario_memory(sc, load_profile(ds["machine"]))["required"]
            limit = sc.memory_limit_gib * GIB
            out.append({"dataset": ds["dataset"], "name": claim["name"], "published_fits": bool(claim["fits"]),
                        "predicted_fits": required <= limit, "required_gib": required / GIB,
                        "limit_gib": sc.memory_limit_gib, "source": claim["source"],
                        "agree": (required <= limit) == bool(claim["fits"])})
    return out


def describe_config(r: ScenarioResult) -> str:
    sc = r.scenario
    sched = f"{sc.schedule}{'' if sc.chunks == 1 else f' v={sc.chunks}'}" if sc.stages > 1 else "-"
    impl = "" if sc.implementation == "fourd" else f" ({sc.implementation})"
    return f"{sc.algorithm}{impl} {sc.grid} p={sc.stages} {sched} b={sc.microbatch_size} m={sc.microbatches}"


def split(r: ScenarioResult) -> str:
    """The compute of the step by kind, % of the step: GEMMs, attention, memory-bound work and launches,
    LM head, optimizer update (the rest is exposed communication and bubble)."""
    t = r.terms
    parts = [t.get("step_gemm", 0.0), t.get("step_attention", 0.0), t.get("step_elementwise", 0.0),
             t.get("step_head", 0.0), t.get("optimizer", 0.0)]
    return "/".join(f"{100 * v / r.step_s:.0f}" for v in parts)


def _factor(x: float) -> str:
    """A to-match factor; ``-`` where the term is zero (no communication or bubble to change); ``none`` where no
    factor can match (at or below 0: the other terms alone take longer than the published step)."""
    return "-" if math.isnan(x) else "none" if x <= 0 else f"{x:.2f}"


def _target_rows(rows: List[Row]) -> List[Row]:
    """The rows of :data:`TARGET_SET`, the datasets the accuracy targets apply to."""
    target_ids = {load(name)["dataset"] for name in TARGET_SET}
    return [r for r in rows if r.dataset in target_ids]


def _rho(s: Dict[str, Any]) -> str:
    return "-" if s["spearman"] is None else format(s["spearman"], ".2f")


def report(rows: List[Row], claims: Optional[List[Dict[str, Any]]] = None,
           memory: Optional[List[Dict[str, Any]]] = None) -> str:
    """The text of ``model published``."""
    lines = ["# fourd-mpi model published: the model against published end-to-end results (nothing fitted to them)",
             "# metric: Megatron's 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs / (t_step x GPUs) [/ peak for % of peak]; "
             "mfu_pct: model FLOPs 6 B s l x block GEMM weights + 12 B s^2 l h + 6 B s h V / (t_step x GPUs x peak); "
             "ratio = predicted / published; error = |ratio - 1|",
             ""]
    table = [("dataset", "point", "GPUs", "configuration", "metric", "published", "predicted", "ratio", "mem GiB",
              "fits", "step % gemm/attn/elt/head/opt", "bubble %", "exposed comm % (largest axis)",
              "to match: compute x", "or comm+bubble x")]
    for r in rows:
        res = r.result
        exp = max(res.exposed_s.items(), key=lambda kv: kv[1]) if res.exposed_s else ("-", 0.0)
        table.append((r.dataset, r.name, r.gpus, describe_config(res), r.metric, f"{r.published:g}",
                      f"{r.predicted:.1f}", f"{r.ratio:.3f}", f"{res.memory['required'] / GIB:.1f}",
                      {True: "yes", False: "NO", None: "-"}[res.fits()], split(res),
                      f"{100 * res.bubble_s / res.step_s:.1f}",
                      f"{100 * sum(res.exposed_s.values()) / res.step_s:.1f} ({exp[0]})",
                      _factor(r.to_match()["compute"]), _factor(r.to_match()["exposed"])))
    lines.append(render(table[1:], table[0]))
    target_rows = _target_rows(rows)
    lines.append("")
    if target_rows:
        t = summary(target_rows)
        present = sorted({r.dataset for r in target_rows})
        lines.append(f"summary over {t['points']} points (the targets' set: {', '.join(present)}): median "
                     f"|error| {100 * t['median_abs_error']:.1f} % (target <= {100 * TARGET_MEDIAN_ERROR:g} %), worst "
                     f"{t['worst']} {100 * t['worst_error']:.1f} %, Spearman {_rho(t)} "
                     f"(target >= {TARGET_SPEARMAN}; of % of peak, published vs predicted), "
                     "every configuration fits its GPU's memory: "
                     f"{'yes' if t['all_fit'] else 'NO'}")
    groups = [(d, [r for r in rows if r.dataset == d]) for d in dict.fromkeys(r.dataset for r in rows)]
    groups += [(f"scheme {k}", [r for r in rows if r.scheme == k])
               for k in dict.fromkeys(r.scheme for r in rows if r.scheme)]
    if len(groups) > 1 or not target_rows:
        if len(groups) > 1:
            groups.append(("all", rows))
        st = [("set", "points", "median |error|", "worst", "Spearman", "all fit")]
        for name, rs in groups:
            g = summary(rs)
            st.append((name, g["points"], f"{100 * g['median_abs_error']:.1f} %",
                       f"{g['worst']} {100 * g['worst_error']:.1f} %", _rho(g), "yes" if g["all_fit"] else "NO"))
        lines += ["by dataset (and by scheme where a dataset compares several):", render(st[1:], st[0])]
    lines.append("to match: the factor by which that term alone would have to change for predicted = published "
                 "(a diagnosis of which term is wrong; never applied to the model; none: the other terms alone take "
                 "longer than the published step); step %: the step's compute "
                 "by kind (GEMMs, attention, memory-bound work and launches, LM head, optimizer update)")
    assumed = [f"{r.name}: {', '.join(r.assumed)}" for r in rows if r.assumed]
    if assumed:
        lines.append("assumed (not in the source): " + "; ".join(assumed))
    lines += [f"source: {src}" for src in dict.fromkeys(r.source for r in rows)]
    if memory:
        lines += ["", "memory claims (the model's required bytes per GPU = its memory x 1.10 allocator margin "
                  "+ the GPU runtime's reserve, against the limit):"]
        mt = [("dataset", "configuration", "published", "model: required GiB / limit", "model", "agree")]
        for m in memory:
            mt.append((m["dataset"], m["name"], "fits" if m["published_fits"] else "did not fit",
                       f"{m['required_gib']:.2f} / {m['limit_gib']:g}",
                       "fits" if m["predicted_fits"] else "does not fit", "yes" if m["agree"] else "NO"))
        lines.append(render(mt[1:], mt[0]))
        lines += [f"  {m['name']}: {m['source']}" for m in memory]
    if claims:
        lines += ["", "ranking claims (margin = speed of a / speed of b - 1, TFLOP/s per GPU):"]
        ct = [("claim", "a (predicted)", "b (predicted)", "published margin", "predicted margin", "same winner")]
        for c in claims:
            ct.append((c["name"], describe_config(c["a"]), describe_config(c["b"]),
                       f"{100 * c['published_margin']:+.1f} %", f"{100 * c['predicted_margin']:+.1f} %",
                       "yes" if c["same_winner"] else "NO"))
        lines.append(render(ct[1:], ct[0]))
        for c in claims:
            pub = c["published_tflops"]
            sides = "; ".join(f"{k} predicted {c[k].tflops_per_gpu():.1f} TFLOP/s per GPU"
                              + (f" vs published {pub[k]:g} (ratio {c[k].tflops_per_gpu() / pub[k]:.2f})"
                                 if k in pub else "")
                              for k in ("a", "b"))
            lines.append(f"  {c['name']}: {sides}")
            lines.append(f"    source {c['source']}" + (f"; b: {c['note']}" if c["note"] else ""))
    return "\n".join(lines)


def as_dict(rows: List[Row], claims: Optional[List[Dict[str, Any]]] = None,
            memory: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
    target_rows = _target_rows(rows)
    out = {"summary": summary(rows),
           "summary_by_dataset": {d: summary([r for r in rows if r.dataset == d])
                                  for d in dict.fromkeys(r.dataset for r in rows)},
           "summary_target_set": summary(target_rows) if target_rows else None,
           "points": [{"dataset": r.dataset, "name": r.name, "gpus": r.gpus, "metric": r.metric,
                       "published": r.published, "predicted": r.predicted, "ratio": r.ratio, "error": r.error,
                       "to_match": r.to_match(),
                       "assumed": r.assumed, "source": r.source, "scheme": r.scheme,
                       "prediction": r.result.as_dict(), "command": r.result.scenario.predict_command()}
                      for r in rows]}
    if memory is not None:
        out["memory_claims"] = memory
    if claims is not None:
        out["claims"] = [{"name": c["name"], "source": c["source"], "published_margin": c["published_margin"],
                          "predicted_margin": c["predicted_margin"], "same_winner": c["same_winner"],
                          "a": describe_config(c["a"]), "b": describe_config(c["b"])} for c in claims]
    return out
