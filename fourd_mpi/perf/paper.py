"""``fourd-mpi model paper``: the model's prediction for the AxoNN SC'24 settings, next to the published
numbers (pure, no MPI).

Settings (docs and sources in ``shared/REFERENCES.md`` sections 1-2): GPT models of the run scripts
of axonn-ai/Megatron-AxoNN, sequence length 2,048, bf16 with fp32 master weights and Adam moments
(mixed precision), flash attention (``attention="fused"``), full activation recompute, every
overlap on (``oag,ors,oar,dp,od``). The paper does not state the global batch in its abstract and the
run scripts take it as an argument, so :data:`DEFAULT_BATCH` (2,048 sequences of 2,048 tokens,
4.2 M tokens per step) is our assumption; ``--batch`` changes it.

Metrics (every one printed with its formula):

- **HFU** (hardware FLOPs utilization; what AxoNN's and Megatron's "% of peak" is) =
  ``F_hw / (t_step * N * peak)``: ``F_hw`` the hardware FLOPs of a step with full recompute,
  ``96 B s l h^2 (1 + s/6h)``
  (:meth:`~fourd_mpi.step.presets.ModelConfig.hardware_flops_per_step`; the suite's models have no
  LM head, so AxoNN's ``V/(16 l h)`` term is 0), ``t_step`` the predicted step time, ``N`` GPUs,
  ``peak`` the dense bf16 data-sheet peak of the profile's device (312 TFLOP/s on an A100;
  :mod:`fourd_mpi.perf.peaks`). MFU (model FLOPs, recompute not counted) is ``72/96`` of it here;
- **PFLOP/s** = ``F_hw / t_step / 1e15`` (the paper's 182 PFLOP/s is the same quantity);
- **speedup over Megatron-like** = ``t_megatron / t_4d`` (the paper: 26 % faster, i.e. 1.26).

Megatron-LM-like configuration: 1D tensor parallelism of 4 inside a node (the grid
``G_x = G_z = 1, G_y = 4``: column- then row-parallel layers), the rest data parallel, the optimizer
state sharded over data as Megatron's distributed optimizer does (TP + DP, no pipeline). Megatron-LM
with its pipeline (PTD-P) is predicted too (:func:`ptdp_case`): the fastest PTD-P configuration the
model finds (:func:`fourd_mpi.perf.published.megatron_search`: TP 1/2/4, every pipeline depth, 1F1B or
interleaved, micro-batch 1/2/4) with the vocabulary included; ``fourd-mpi model published`` prints
it beside the published 26 %.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.machine import MachineProfile
from fourd_mpi.perf.predict import Prediction, predict
from fourd_mpi.perf.tune import memory_reserve, rank_grids
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import ModelConfig, model_problems, resolve_model
from fourd_mpi.util.table import render
from fourd_mpi.util.units import GIB

#: sequences of 2,048 tokens per step (our assumption, see the module docstring)
DEFAULT_BATCH = 2048
#: the settings of the paper's runs (REFERENCES.md section 2)
SETTINGS = dict(dtype="bfloat16", recompute="full", attention="fused", precision="mixed", optimizer="adam")
OVERLAP = "all"
#: published figures (REFERENCES.md section 1): Singh et al., arXiv 2305.13525v3 (SC'24), abstract
PUBLISHED = {"model": "gpt-80b", "gpus": 1024, "pct_peak": 57.0, "pflops": 182.0, "faster_than_megatron": 1.26,
             "source": "Singh et al., A 4D Hybrid Algorithm to Scale Parallel Training to Thousands of GPUs, "
                       "arXiv 2305.13525v3 (SC'24), abstract"}
#: weak-scaling series: model size doubles with the GPU count (5B on 64 ... 80B on 1,024; our pairing).
#: The 60B model of the run scripts (REFERENCES.md section 2) has no GPU count in this doubling and is
#: left out. The global batch scales with the GPUs (``batch * gpus / 1024``: 2 sequences per GPU at the
#: default), since the suite has no gradient accumulation to keep a fixed batch in memory on few GPUs.
WEAK_SERIES = [("gpt-5b", 64), ("gpt-10b", 128), ("gpt-20b", 256), ("gpt-40b", 512), ("gpt-80b", 1024)]


@dataclass
class Case:
    """The model's answer for one (model, GPU count)."""

    cfg: ModelConfig
    gpus: int
    best: Optional[Prediction]
    considered: int
    dropped_memory: int
    peak_tflops: float
    megatron: Optional[Prediction] = None
    megatron_problem: str = ""
    notes: List[str] = field(default_factory=list)

    def hw_flops(self) -> float:
        return self.cfg.hardware_flops_per_step("full")

    def pct_peak(self, pred: Optional[Prediction]) -> Optional[float]:
        """``100 * F_hw / (t_step * N * peak)`` (module docstring)."""
        if pred is None:
            return None
        return 100.0 * self.hw_flops() / (pred.step_s * self.gpus * self.peak_tflops * 1e12)

    def pflops(self, pred: Optional[Prediction]) -> Optional[float]:
        return None if pred is None else self.hw_flops() / pred.step_s / 1e15


def peak_tflops(profile: MachineProfile, dtype: str = "bfloat16") -> float:
    """The data-sheet dense peak of the profile's device for ``dtype`` (:meth:`MachineProfile.peak_tflops`: the
    one peak table, :mod:`fourd_mpi.perf.peaks`)."""
    peak = profile.peak_tflops(dtype)
    if peak is None:
        raise ConfigError(f"machine profile {profile.name} has no data-sheet peak for {dtype}: set compute.device "
                          f"(one of fourd_mpi/perf/peaks.py) or compute.peak_tflops")
    return peak


def megatron_grid(gpus: int, tp: int = 4) -> GridShape:
    """Megatron-LM's 1D tensor parallelism of ``tp`` inside a node, the rest data parallel."""
    if gpus % tp:
        raise ConfigError(f"{gpus} GPUs is not a multiple of the tensor-parallel degree {tp}")
    return GridShape(gpus // tp, 1, tp, 1)


def model_case(model: str, gpus: int, profile: MachineProfile, memory_limit_gib: Optional[float],
               batch: int = DEFAULT_BATCH, megatron: bool = True) -> Case:
    """Rank every grid of ``gpus`` for ``model`` with the paper's settings; predict the Megatron-like grid."""
    cfg = resolve_model(model, batch=batch)
    limit = None if memory_limit_gib is None else memory_limit_gib * GIB
    overlap = OverlapConfig.parse(OVERLAP)
    peak = peak_tflops(profile, SETTINGS["dtype"])
    kw = {k: SETTINGS[k] for k in ("recompute", "attention", "precision")}
    try:
        ranking = rank_grids(cfg, gpus, profile, overlap, SETTINGS["dtype"], "poll", SETTINGS["optimizer"], limit,
                             **kw)
        best, considered, dropped = ranking.predictions[0], ranking.considered, ranking.dropped_for("memory")
        notes = list(best.notes)
    except ConfigError as exc:  # nothing fits: say so in the table
        best, considered, dropped, notes = None, 0, 0, [str(exc)]
    case = Case(cfg, gpus, best, considered, dropped, peak, notes=notes)
    if megatron:
        grid = megatron_grid(gpus)
        problems = model_problems(cfg, grid)
        if problems:
            case.megatron_problem = "; ".join(problems)
        else:
            case.megatron = predict(cfg, grid, profile, overlap, SETTINGS["dtype"], "poll", SETTINGS["optimizer"],
                                    shard_optimizer="data", **kw)
    return case


def ptdp_case(cfg: ModelConfig, gpus: int, profile: MachineProfile, memory_limit_gib: Optional[float]):
    """The fastest Megatron-LM PTD-P configuration of ``gpus`` the model finds (a
    :class:`~fourd_mpi.perf.scenario.ScenarioResult`), the paper's settings, vocabulary 51,200; None when
    none fits."""
    from fourd_mpi.perf.published import megatron_search
    from fourd_mpi.perf.vocab import DEFAULT_VOCAB

    defaults = dict(vocab=DEFAULT_VOCAB, recompute=SETTINGS["recompute"], dtype=SETTINGS["dtype"],
                    attention=SETTINGS["attention"], precision=SETTINGS["precision"], optimizer=SETTINGS["optimizer"],
                    memory_limit_gib=memory_limit_gib)
    try:
        return megatron_search(cfg, gpus, profile, defaults)
    except ConfigError:
        return None


def fits(pred: Optional[Prediction], profile: MachineProfile, memory_limit_gib: Optional[float]) -> bool:
    return pred is not None and (memory_limit_gib is None
                                 or pred.memory.required(memory_reserve(profile)) <= memory_limit_gib * GIB)


def report(flagship: Case, series: List[Case], profile: MachineProfile, memory_limit_gib: Optional[float],
           ptdp=None) -> str:
    """The text of ``fourd-mpi model paper``: settings, the flagship against the paper, Megatron-like,
    the weak-scaling table."""
    reserve = memory_reserve(profile)
    lim = "none" if memory_limit_gib is None else f"{memory_limit_gib:g} GiB"
    c = flagship
    lines = [
        f"# fourd-mpi model paper: {profile.describe()}",
        f"# settings: {c.cfg.name} ({c.cfg.layers} layers, hidden {c.cfg.hidden}, heads {c.cfg.heads}, seq "
        f"{c.cfg.seq}), global batch {c.cfg.batch} sequences ({c.cfg.tokens:,} tokens; our assumption, the paper's "
        f"batch is not in its abstract or run scripts), {c.gpus} GPUs, bf16 mixed precision (fp32 master + Adam), "
        f"flash attention, full recompute, overlap {OVERLAP}; memory limit {lim} per GPU",
        "# HFU = 96 B s l h^2 (1 + s/6h) / (t_step * GPUs * peak) (hardware FLOPs with full recompute: the "
        f"paper's % of peak), peak = {c.peak_tflops:g} TFLOP/s bf16 dense (data sheet, fourd_mpi/perf/peaks.py); "
        "PFLOP/s = 96 B s l h^2 (1 + s/6h) / t_step / 1e15; "
        "speedup = t_Megatron-like / t_4D",
        f"# source of the published column: {PUBLISHED['source']}",
        "",
    ]
    best = c.best
    if best is None:
        lines.append(f"no grid of {c.gpus} GPUs fits: {c.notes[0] if c.notes else ''}")
    else:
        lines.append(f"predicted best grid (D x Z x Y x X): {best.grid}, {c.considered} grids considered, "
                     f"{c.dropped_memory} dropped for memory")
        lines.append(f"  step {best.step_s:.3f} s = compute {best.compute_s:.3f} s + exposed communication "
                     f"{best.exposed_total_s:.3f} s (of {best.comm_total_s:.3f} s in total); exposed by axis: "
                     + ", ".join(f"{a} {t:.3f} s" for a, t in sorted(best.exposed_by_axis().items())))
        lines.append(f"  memory per GPU: {best.memory.describe()}; with the allocator margin and GPU reserve "
                     f"{best.memory.required(reserve) / GIB:.3g} GiB")
    meg = c.megatron
    rows = [("", "ours (model)", "published")]
    rows.append(("HFU (96 convention, % of peak)", _pct(c.pct_peak(best)), f"{PUBLISHED['pct_peak']:g} %"))
    rows.append(("PFLOP/s in total", _num(c.pflops(best), "{:.1f}"), f"{PUBLISHED['pflops']:g}"))
    speed = meg.step_s / best.step_s if (meg is not None and best is not None) else None
    rows.append(("4D faster than Megatron-LM by", _num(None if speed is None else 100 * (speed - 1), "{:.0f} %")
                 + ("" if speed is None else " (TP-only+DP, no pipeline)"),
                 f"{100 * (PUBLISHED['faster_than_megatron'] - 1):.0f} % (Megatron with its pipeline)"))
    lines += ["", render(rows[1:], rows[0]), ""]
    if meg is not None:
        fit = fits(meg, profile, memory_limit_gib)
        lines.append(f"Megatron-LM-like grid {meg.grid} (1D tensor parallelism 4 inside a node, data parallel "
                     f"{meg.grid.data}, optimizer state sharded over data): step {meg.step_s:.3f} s "
                     f"(compute {meg.compute_s:.3f} s, exposed {meg.exposed_total_s:.3f} s), "
                     f"HFU {_pct(c.pct_peak(meg))}; memory {meg.memory.required(reserve) / GIB:.3g} GiB per GPU: "
                     + ("fits" if fit else f"does NOT fit in {lim}") + ".")
    elif c.megatron_problem:
        lines.append(f"Megatron-LM-like grid: cannot run {c.cfg.name}: {c.megatron_problem}")
    if ptdp is not None:
        sc = ptdp.scenario
        sched = sc.schedule + (f" v={sc.chunks}" if sc.schedule == "interleaved" else "")
        lines.append(f"Megatron-LM with its pipeline (PTD-P; the fastest configuration the model finds, vocabulary "
                     f"{sc.vocab} included): TP {sc.grid.y} x PP {sc.stages} x DP {sc.grid.data}, {sched}, micro-batch "
                     f"{sc.microbatch_size} x {sc.microbatches}: step {ptdp.step_s:.3f} s, HFU {ptdp.pct_peak():.1f} % "
                     "(96 B s l h^2 (1 + s/6h + V/16lh) convention, % of data-sheet peak), "
                     f"memory {ptdp.memory['required'] / GIB:.3g} GiB per "
                     f"GPU; fourd-mpi model published compares it with the 4D side and the published 26 %.")
    else:
        lines.append("Megatron-LM with its pipeline (PTD-P): no configuration fits (fourd-mpi model published)")
    if series:
        lines += ["", "weak scaling (model size and global batch double with the GPU count, batch = "
                      f"{c.cfg.batch} x GPUs / {c.gpus}; published: only the 80B point's 57 % is in the abstract)",
                  _series_table(series, profile, memory_limit_gib)]
    notes = []
    for case in [c] + series:
        for n in case.notes + (case.best.notes if case.best is not None else []):
            if n not in notes:
                notes.append(n)
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f} %"


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _series_table(series: List[Case], profile: MachineProfile, memory_limit_gib: Optional[float]) -> str:
    reserve = memory_reserve(profile)
    rows = [("model", "GPUs", "batch", "best grid", "step s", "HFU", "PFLOP/s", "mem GiB", "Megatron-like step s",
             "HFU", "mem GiB", "fits", "published HFU")]
    for c in series:
        b, m = c.best, c.megatron
        rows.append((c.cfg.name, c.gpus, c.cfg.batch, "-" if b is None else str(b.grid), _num(b and b.step_s, "{:.3f}"),
                     _pct(c.pct_peak(b)), _num(c.pflops(b), "{:.1f}"),
                     _num(b and b.memory.required(reserve) / GIB, "{:.1f}"),
                     _num(m and m.step_s, "{:.3f}"), _pct(c.pct_peak(m)),
                     _num(m and m.memory.required(reserve) / GIB, "{:.1f}"),
                     "-" if m is None else ("yes" if fits(m, profile, memory_limit_gib) else "no"),
                     f"{PUBLISHED['pct_peak']:g} %" if (c.cfg.name, c.gpus) == (PUBLISHED["model"], PUBLISHED["gpus"])
                     else "-"))
    return render(rows[1:], rows[0])


def series_data(series: List[Case]) -> List[Dict]:
    """One mapping per case (for JSON and the plot)."""
    out = []
    for c in series:
        out.append({"model": c.cfg.name, "gpus": c.gpus, "grid": None if c.best is None else str(c.best.grid),
                    "pct_peak": c.pct_peak(c.best), "megatron_pct_peak": c.pct_peak(c.megatron),
                    "pflops": c.pflops(c.best)})
    return out


def plot(series: List[Case], path: str, profile: MachineProfile, memory_limit_gib: Optional[float]) -> None:
    """Predicted % of peak of the weak-scaling series (4D best, Megatron-like) and the published point, as PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("the plot needs matplotlib: pip install fourd-mpi[analysis]") from None
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    gpus = [c.gpus for c in series]
    ax.plot(gpus, [c.pct_peak(c.best) for c in series], "o-", color="#0072B2",
            label="4D, predicted best grid")
    meg = [(c.gpus, c.pct_peak(c.megatron), fits(c.megatron, profile, memory_limit_gib)) for c in series
           if c.megatron is not None]
    if meg:
        ax.plot([g for g, _, _ in meg], [p for _, p, _ in meg], "s--", color="#E69F00",
                label="Megatron-like TP 4 + DP, predicted")
        over = [(g, p) for g, p, f in meg if not f]
        if over:
            ax.plot([g for g, _ in over], [p for _, p in over], "x", color="#D55E00", markersize=10,
                    label="does not fit in memory")
    ax.plot([PUBLISHED["gpus"]], [PUBLISHED["pct_peak"]], "*", markersize=14, color="black",
            label="AxoNN published (80B, 1,024 A100)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus)
    ax.set_xticklabels([f"{g}\n{c.cfg.name[4:]}" for g, c in zip(gpus, series)])
    ax.set_xlabel("GPUs (count, log\u2082 scale) / model")
    ax.set_ylabel("HFU (%): 96 B s l h^2 (1+s/6h) / (t N peak_bf16)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"weak scaling on {profile.name}: model vs published")
    fig.tight_layout()
    fig.savefig(path, dpi=150, bbox_inches="tight", pad_inches=0.08)
    plt.close(fig)
