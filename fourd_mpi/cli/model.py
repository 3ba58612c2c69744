"""``fourd-mpi model calibrate | validate | compare-axonn | paper | predict | published``: the
performance model, held against traces and published results (one process, no MPI; ``predict`` and
``published`` in :mod:`~fourd_mpi.cli.model_predict`)."""

from __future__ import annotations

import logging

from fourd_mpi.cli.args import (
    FORMATS,
    add_format,
    add_output,
    add_site,
    add_trace_paths,
    parse_list,
    write_output,
    wrote,
)
from fourd_mpi.cli.jsonout import JsonDoc, add_json_format, emit_json
from fourd_mpi.util.files import named_inputs, refuse_output, replacing
from fourd_mpi.util.units import GIB
from fourd_mpi.util.values import axis_size, batch_size, int_list_of, memory_limit, rank_count, repeat_count, seq_length

log = logging.getLogger(__name__)


def register(sub) -> None:
    from fourd_mpi.analysis.model_check import DEFAULT_FIT_TERMS

    p = sub.add_parser("model", help="the performance model: predict a forced configuration, hold it against "
                                     "published results, calibrate and validate it against traces (one process)")
    msub = p.add_subparsers(dest="model_command", required=True, parser_class=type(p))
    c = msub.add_parser("calibrate", help="fit the model's term weights (GEMM, attention, element-wise, per-call, "
                                          "alpha-beta, synchronization) to measured runs without overlap")
    add_trace_paths(c)
    c.add_argument("--profile", required=True, metavar="P", help="the machine profile to calibrate (built-in "
                                                                 "name or file, e.g. from bench collectives)")
    add_output(c, required=True, help="the calibrated profile (YAML)")
    c.add_argument("--terms", default=",".join(DEFAULT_FIT_TERMS), metavar="LIST",
                   help="terms the fit may use, the others get weight 0 (default %(default)s; all: "
                        "gemm,attention,elementwise,calls,comm,sync)")
    add_json_format(c, CALIBRATE_JSON, help="the fit's report on standard output: table (default) or json")
    v = msub.add_parser("validate", help="measured vs predicted step time and exposed communication of traces")
    add_trace_paths(v)
    v.add_argument("--profile", default=None, metavar="P", help="machine profile (built-in name or file; "
                   "default: this host's calibrated results/profiles/<host>.yaml, else laptop)")
    v.add_argument("--fallback-profile", default=None, metavar="P", help="profile for levels the profile lacks")
    add_format(v, FORMATS, help="table (default), csv (the two tables), json (one document: tables, summary, "
                                "goals) or markdown")
    add_output(v, help="write the report to FILE instead of standard output")
    v.add_argument("--require", action="store_true", help="exit 1 unless every goal is met (median |error| <= "
                   "20%%, Spearman >= 0.8 per group, measured best in the predicted top 3)")
    a = msub.add_parser("compare-axonn", help="communication only: our step's volumes and AxoNN's published "
                        "model, both costed with AxoNN's bandwidth table; the two top-K rankings and why they differ")
    a.add_argument("--model", default="gpt-80b", help="preset (default gpt-80b)")
    a.add_argument("--ranks", type=rank_count, default=1024, metavar="N", help="GPUs (default 1024)")
    a.add_argument("--batch", type=int_list_of(batch_size, "global batches"), default="1024,2048", metavar="LIST",
                   help="global batches in sequences, comma list (default 1024,2048)")
    a.add_argument("--seq", type=seq_length, default=2048, metavar="S", help="sequence length (default 2048)")
    a.add_argument("--min-tp", type=axis_size, default=64, metavar="T",
                   help="minimum G_x G_y G_z (AxoNN's minimum tensor-parallel degree; default 64)")
    a.add_argument("--profile", default="perlmutter", metavar="P", help="profile whose network.placement_gbs is "
                   "the table (default perlmutter; frontier has AxoNN's Frontier table)")
    a.add_argument("--top", type=repeat_count, default=8, metavar="K", help="grids per list (default 8)")
    a.add_argument("--explain", action="append", default=[], metavar="DxZxYxX",
                   help="grid to explain term by term (repeatable; default: AxoNN's best, ours, and AxoNN's best "
                        "with G_x, G_y > 1)")
    add_json_format(a, COMPARE_AXONN_JSON, help="table (default) or json")
    pp = msub.add_parser("paper", help="the model's prediction for the AxoNN SC'24 settings (gpt-80b on 1,024 "
                                       "Perlmutter A100s, bf16, full recompute, all overlaps) and the weak-scaling "
                                       "series, next to the published numbers (offline)")
    add_site(pp, default="perlmutter", help="use the machine profile the site names (its machine_profile: key)")
    pp.add_argument("--profile", default=None, metavar="P", help="machine profile (built-in name or file; overrides "
                                                                  "--site)")
    pp.add_argument("--memory-limit", type=memory_limit, default="80GiB", metavar="SIZE",
                    help="memory per GPU, run's grammar (80GiB, 80G or 80 GiB; default 80: the A100-80GB nodes; "
                         "40 for the others; none)")
    pp.add_argument("--batch", type=batch_size, default=None, metavar="N",
                    help="global batch in sequences of 2,048 tokens at 1,024 GPUs (default 2048, our assumption; the "
                         "weak-scaling cases scale it with their GPU count)")
    pp.add_argument("--series", default="all", metavar="LIST",
                    help="weak-scaling cases: all (5B/64 ... 80B/1,024), none, or a comma list of presets "
                         "(gpt-5b,gpt-10b,...)")
    add_output(pp, help="write the weak-scaling plot there (PNG; needs matplotlib, the analysis extra)")
    add_json_format(pp, PAPER_JSON, help="the report on standard output: table (default) or json")

    from fourd_mpi.cli.model_predict import register as register_predict

    register_predict(msub)
    p.set_defaults(handler=cmd_model, serial=True)


#: ``model calibrate --format json``
CALIBRATE_JSON = JsonDoc("model calibrate", {
    "profile": "the profile calibrated", "output": "the calibrated profile written (-o)", "terms": "the terms fitted",
    "runs": "per run: run_id, measured_ms, fitted_ms, err_%", "weights": "term -> weight",
    "median_abs_rel_error": "of the fit over the runs", "left_out": "traces left out, each with why"})
#: ``model compare-axonn --format json``
COMPARE_AXONN_JSON = JsonDoc("model compare-axonn", {
    "machine_profile": "the profile whose placement table costs both", "model": "the preset", "ranks": "GPUs",
    "min_tp": "minimum G_x G_y G_z", "formula": "the time of a grid",
    "cases": "per --batch: batch, candidates, dropped [grid, why], axonn / ours / ours_cache (the --top [grid, "
             "s/step]), explained (per grid its term rows)"})
#: ``model paper --format json``
PAPER_JSON = JsonDoc("model paper", {
    "machine_profile": "name and description", "settings": "model, GPUs, batch, dtype, recompute, attention, "
    "precision, optimizer, overlap, memory_limit_gib", "published": "the paper's figures and their source",
    "best": "the predicted best grid of the flagship: grid, step_s, compute_s, exposed_s, exposed_by_axis, "
            "required_gib, hfu_pct, pflops, considered, dropped_memory, notes (null: none fits)",
    "megatron": "the Megatron-LM-like grid, as best, or null (megatron_problem says why)",
    "megatron_problem": "why the Megatron-LM-like grid cannot run (or null)",
    "speedup": "t_Megatron-like / t_4D (or null)",
    "ptdp": "the fastest Megatron-LM PTD-P configuration: tp, pp, dp, schedule, microbatch_size, microbatches, "
            "step_s, hfu_pct, required_gib (or null)",
    "series": "the weak-scaling cases: model, gpus, grid, pct_peak, megatron_pct_peak, pflops"})


def _paper_prediction(case, pred, profile) -> dict:
    """One predicted grid of ``model paper --format json``."""
    from fourd_mpi.perf.tune import memory_reserve

    if pred is None:
        return None
    return {"grid": str(pred.grid), "step_s": pred.step_s, "compute_s": pred.compute_s,
            "exposed_s": pred.exposed_total_s, "exposed_by_axis": pred.exposed_by_axis(),
            "required_gib": pred.memory.required(memory_reserve(profile)) / GIB, "hfu_pct": case.pct_peak(pred),
            "pflops": case.pflops(pred)}


def _cmd_compare_axonn(args) -> int:
    from fourd_mpi.core.grid import GridShape
    from fourd_mpi.errors import ConfigError
    from fourd_mpi.perf.axonn_commmodel import (
        compare,
        default_explained,
        explain_grid,
        format_comparison,
        format_explanation,
    )
    from fourd_mpi.perf.machine import load_profile
    from fourd_mpi.step.presets import resolve_model

    batches = args.batch  # parsed and bounded by int_list_of(batch_size)
    explain = [GridShape.parse(g) for g in args.explain]
    for text, g in zip(args.explain, explain):  # AxoNN's candidates: product --ranks, G_data*G_z | batch
        if g.size != args.ranks:
            raise ConfigError(f"--explain {text}: {g.size:,} ranks, not the --ranks {args.ranks:,} compared "
                              f"(G_data*G_z*G_y*G_x must equal --ranks)")
        bad = [b for b in batches if b % (g.data * g.z)]
        if bad:
            raise ConfigError(f"--explain {text}: G_data*G_z = {g.data * g.z:,} does not divide --batch {bad[0]:,} "
                              f"(every grid compared splits the batch over G_data*G_z)")
    profile = load_profile(args.profile)
    if profile.placement_gbs(1, 2) is None:
        raise ConfigError(f"machine profile {profile.name} has no network.placement_gbs (AxoNN's get_bw table): "
                          f"use --profile perlmutter or frontier")
    cases = []
    for i, batch in enumerate(batches):
        cfg = resolve_model(args.model, batch=batch, seq=args.seq)
        comp = compare(cfg, args.ranks, args.min_tp, profile.placement_gbs)
        grids = explain or default_explained(comp)
        if args.format == "json":
            cases.append({"batch": batch, "candidates": len(comp.axonn),
                          "dropped": [[str(g), why] for g, why in comp.dropped],
                          **{key: [[str(g), t] for g, t in getattr(comp, key)[: args.top]]
                             for key in ("axonn", "ours", "ours_cache")},
                          "explained": [{"grid": str(g), "rows": explain_grid(cfg, g, profile.placement_gbs)}
                                        for g in grids]})
            continue
        print(("\n" if i else "") + format_comparison(cfg, args.ranks, args.min_tp, comp, args.top, profile.name))
        for g in grids:
            print(format_explanation(explain_grid(cfg, g, profile.placement_gbs), g))
    if args.format == "json":
        from fourd_mpi.perf.axonn_commmodel import TIME_FORMULA

        emit_json(COMPARE_AXONN_JSON, {"machine_profile": profile.name, "model": args.model, "ranks": args.ranks,
                                       "min_tp": args.min_tp, "formula": TIME_FORMULA, "cases": cases})
    return 0


def _cmd_paper(args) -> int:
    from fourd_mpi.errors import ConfigError
    from fourd_mpi.jobs.sites import resolve_profile
    from fourd_mpi.perf.paper import DEFAULT_BATCH, PUBLISHED, WEAK_SERIES, model_case, plot, report

    refuse_output(args.output, args.force, inputs=[args.profile or "", args.site or ""])
    wanted = [t.strip() for t in args.series.split(",") if t.strip()]
    if wanted == ["all"]:
        cases = list(WEAK_SERIES)
    elif wanted == ["none"]:
        cases = []
    else:
        known = dict(WEAK_SERIES)
        unknown = [w for w in wanted if w not in known]
        if unknown:
            raise ConfigError(f"--series: unknown {', '.join(unknown)}: choose all, none or a comma list of "
                              f"{', '.join(known)}")
        cases = [(w, known[w]) for w in wanted]
    if args.output and not cases:
        raise ConfigError("-o writes the weak-scaling plot: give --series all or a list, not none")
    profile = resolve_profile(args.site, args.profile)
    limit = args.memory_limit / GIB or None  # GiB (0: none)
    batch = args.batch or DEFAULT_BATCH
    flagship = model_case(PUBLISHED["model"], PUBLISHED["gpus"], profile, limit, batch)
    series = [flagship if (m, g) == (PUBLISHED["model"], PUBLISHED["gpus"])
              else model_case(m, g, profile, limit, max(1, batch * g // PUBLISHED["gpus"])) for m, g in cases]
    from fourd_mpi.perf.paper import OVERLAP, SETTINGS, ptdp_case, series_data

    ptdp = ptdp_case(flagship.cfg, flagship.gpus, profile, limit)
    if args.format == "json":
        best, meg = flagship.best, flagship.megatron
        sc = ptdp.scenario if ptdp is not None else None
        doc = {"machine_profile": {"name": profile.name, "description": profile.describe()},
               "settings": dict(SETTINGS, model=flagship.cfg.name, gpus=flagship.gpus, batch=flagship.cfg.batch,
                                overlap=OVERLAP, memory_limit_gib=limit),
               "published": dict(PUBLISHED),
               "best": None if best is None else dict(_paper_prediction(flagship, best, profile),
                                                      considered=flagship.considered,
                                                      dropped_memory=flagship.dropped_memory, notes=flagship.notes),
               "megatron": _paper_prediction(flagship, meg, profile),
               "megatron_problem": flagship.megatron_problem or None,
               "speedup": meg.step_s / best.step_s if (meg is not None and best is not None) else None,
               "ptdp": None if sc is None else {
                   "tp": sc.grid.y, "pp": sc.stages, "dp": sc.grid.data,
                   "schedule": sc.schedule + (f" v={sc.chunks}" if sc.schedule == "interleaved" else ""),
                   "microbatch_size": sc.microbatch_size, "microbatches": sc.microbatches, "step_s": ptdp.step_s,
                   "hfu_pct": ptdp.pct_peak(), "required_gib": ptdp.memory["required"] / GIB},
               "series": series_data(series)}
    else:
        print(report(flagship, series, profile, limit, ptdp))
    if args.output:
        with replacing(args.output) as tmp:  # the figure under a temporary name, renamed when complete
            plot(series, tmp, profile, limit)
        wrote(args.output, "weak-scaling plot")
    if args.format == "json":
        emit_json(PAPER_JSON, doc)
    return 0


def _need_pandas(command: str) -> None:
    """One line naming the extra when pandas (the ``analysis`` extra) is missing."""
    try:
        import pandas  # noqa: F401
    except ImportError:
        from fourd_mpi.errors import ConfigError

        raise ConfigError(f"fourd-mpi model {command} reads traces with pandas: pip install 'fourd_mpi[analysis]' "
                          f"(model predict, published, paper and compare-axonn do not need it)") from None


def cmd_model(args, world=None) -> int:
    if args.model_command == "predict":
        from fourd_mpi.cli.model_predict import cmd_predict

        return cmd_predict(args)
    if args.model_command == "published":
        from fourd_mpi.cli.model_predict import cmd_published

        return cmd_published(args)
    if args.model_command == "paper":
        return _cmd_paper(args)
    if args.model_command == "compare-axonn":
        return _cmd_compare_axonn(args)
    _need_pandas(args.model_command)
    if args.model_command == "calibrate":
        return _cmd_calibrate(args)
    from fourd_mpi.analysis.model_check import report, validate
    from fourd_mpi.analysis.tables import collect_or_fail
    from fourd_mpi.jobs.sites import resolve_profile

    refuse_output(args.output, args.force, inputs=named_inputs(args.paths + [args.profile or ""]))
    profile = resolve_profile("local" if args.profile is None else None, args.profile, args.fallback_profile)
    traces, problems = collect_or_fail(args.paths)
    df, gdf, summary = validate(traces, profile)
    text = report(df, gdf, summary, profile, args.format)
    write_output(args.output, text + "\n", f"model validation, {args.format}")
    if args.require and not all(summary["goals_met"].values()):
        return 1
    return 1 if problems else 0


def _cmd_calibrate(args) -> int:
    import pandas as pd
    import yaml

    from fourd_mpi.analysis.model_check import calibrate
    from fourd_mpi.analysis.tables import collect_or_fail, format_table
    from fourd_mpi.perf.machine import TERMS, load_profile

    terms = parse_list(args.terms, TERMS, "--terms")  # checked before any trace is read
    refuse_output(args.output, args.force, inputs=named_inputs(args.paths + [args.profile or ""]))
    profile = load_profile(args.profile)
    traces, problems = collect_or_fail(args.paths)
    data, rows, skipped = calibrate(traces, profile, terms)
    for line in skipped:
        log.info("left out %s", line)
    fit = data["step_fit"]
    if args.format != "json":
        print(format_table(pd.DataFrame(rows), "table"))
        print("weights: " + ", ".join(f"{t} x{w:g}" for t, w in fit["weights"].items())
              + f"; median |error| of the fit {100 * fit['median_abs_rel_error']:.1f}% over {len(rows)} runs")
    with replacing(args.output) as tmp:
        with open(tmp, "w") as fh:
            yaml.safe_dump(data, fh, sort_keys=False)
        load_profile(tmp)  # what we write must load
    wrote(args.output, "calibrated machine profile")
    if args.format == "json":
        emit_json(CALIBRATE_JSON, {"profile": args.profile, "output": args.output, "terms": terms, "runs": rows,
                                   "weights": fit["weights"], "median_abs_rel_error": fit["median_abs_rel_error"],
                                   "left_out": list(skipped)})
    return 1 if problems else 0
