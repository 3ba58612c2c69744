"""``fourd-mpi tune | model | bench``: the performance model, its calibration, and the collective
micro-benchmark that measures a machine profile.

``tune`` and ``model`` run in one process without MPI; ``bench collectives`` runs under mpiexec.
``tune`` takes the model and run options from the run-option table, so it offers exactly the
choices of ``fourd-mpi run``.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from fourd_mpi.cli.jsonout import JsonDoc, add_json_format, emit_json
from fourd_mpi.cli.args import (FORMATS, add_deprecated, add_format, add_option, add_options, add_output, add_site,
                                add_trace_paths, parse_list, write_output, wrote)
from fourd_mpi.run.options import OPTIONS, options_in
from fourd_mpi.util.files import named_inputs, refuse_output, replacing, write_text
from fourd_mpi.util.values import (axis_size, batch_size, float_in, int_in, int_list_of, layer_count, memory_limit,
                                  positive_float, rank_count, repeat_count, seq_length)

log = logging.getLogger(__name__)

GIB = 2.0 ** 30


def register(sub) -> None:
    _register_tune(sub)
    _register_model(sub)
    _register_bench(sub)


# -- tune -----------------------------------------------------------------------------------

def _register_tune(sub) -> None:
    p = sub.add_parser("tune", help="rank every grid shape of a rank count by predicted step time "
                       "(performance model; one process, no mpiexec)")
    p.add_argument("--ranks", type=rank_count, required=True, metavar="N", help="the rank count to place (at most 4,096 candidate grids: every power of two up to 2^24 "
                        "qualifies; 720720 has 89,600 and is refused)")
    p.add_argument("--algorithm", default="axonn4d", metavar="NAME|LIST|all",
                   help="algorithm(s) to rank: a name of fourd-mpi run --algorithm, a comma list, or all (one table "
                        "across algorithms with an algorithm column; default axonn4d). pipeline tries every stage "
                        "count dividing the ranks and the layers, every 4D grid of a stage, and every micro-batch "
                        "size that divides the per-replica batch (at most 1024 micro-batches; at most 20,000 configurations, "
                        "else refused, or skipped with a line under a list); configurations whose "
                        "lower bound exceeds the --top K-th fastest of their algorithm are counted, not predicted")
    add_options(p, ("model",), names=("dtype", "optimizer", "overlap", "progress"))
    m = p.add_argument_group("machine")
    add_site(m, help="use the machine profile the site names (its machine_profile: key; local: the calibrated "
                     "results/profiles/<host>.yaml when it exists, else laptop; no --site: laptop)")
    m.add_argument("--profile", default=None, metavar="P", help="machine profile: a built-in name or a file "
                   "written by fourd-mpi bench collectives (overrides --site)")
    m.add_argument("--fallback-profile", default=None, metavar="P", help="profile for placement levels the "
                   "profile lacks (e.g. perlmutter for inter-node axes of a one-node calibration)")
    m.add_argument("--ranks-per-node", type=axis_size, default=None, metavar="R",
                   help="ranks per node of the run (default: the site's with --site, else the profile's)")
    m.add_argument("--memory-limit", type=memory_limit, default=None, metavar="SIZE",
                   help="drop grids needing more per rank (counted bytes + allocator margin + GPU runtime reserve): "
                        "run's grammar, e.g. 80GiB, 80G or 40 (GiB); default: the profile's device memory (e.g. 40 "
                        "GiB on perlmutter, 64 on frontier; none on CPU profiles); none (or 0) keeps every grid")
    _add_memory_model(p)
    p.add_argument("--dw-window", type=layer_count, default=None, metavar="N",
                   help="with ORS, at most N dW blocks in flight (memory; as FSDP/ZeRO-3 bound their buckets; "
                        "default: every layer's, as this suite's step keeps every handle until the optimizer; "
                        "--algorithm axonn4d only)")
    _add_search(p)
    o = p.add_argument_group("output")
    add_json_format(o, TUNE_JSON, help="table (default) or json")
    o.add_argument("--top", type=repeat_count, default=5, metavar="K", help="grids to show (default 5)")
    o.add_argument("--emit-sweep", metavar="FILE", help="write a sweep spec (YAML) that measures the top K")
    o.add_argument("--force", action="store_true", help="replace an existing --emit-sweep file")
    # --dtype: the run's choices; default the site's training dtype (bfloat16 on GPU sites, float32 on CPU)
    p.set_defaults(handler=cmd_tune, serial=True, dtype=None)


#: the options that pin an axis of ``tune --search`` (run's where run has one, else ``model predict``'s:
#: :data:`fourd_mpi.cli.model_predict.PREDICT_OPTIONS`); giving one searches scenarios
SEARCH_PINS = ("ginter", "pipeline-schedule", "chunks-per-stage", "microbatches", "microbatch-size", "context-parallel",
               "sequence-parallel", "shard-optimizer")


def _add_search(p) -> None:
    """``--search`` and the options that pin its axes (:mod:`fourd_mpi.perf.search`)."""
    from fourd_mpi.cli.model_predict import PREDICT_OPTIONS
    from fourd_mpi.perf.search import AXES, MAX_SCENARIOS

    g = p.add_argument_group("scenario search (what fourd-mpi model predict can express)")
    g.add_argument("--search", default="grid", metavar="AXES|all",
                   help=f"grid (default: rank the 4D grids, as before), all, or a comma list of {', '.join(AXES)}: "
                        f"search these axes too (--recompute, --sequence-parallel, --shard-optimizer and gradient "
                        f"accumulation as a memory-relief ladder); at most {MAX_SCENARIOS:,} scenarios, those whose "
                        f"lower bound exceeds the --top K-th fastest pruned; an option below pins its axis")
    for name in SEARCH_PINS:
        kind, _, what = PREDICT_OPTIONS[name]
        if kind is bool:
            g.add_argument(f"--{name}", action="store_const", const=True, default=None, help=what)
        else:
            g.add_argument(f"--{name}", type=kind, default=None, help=what)


#: ``tune --format json``
TUNE_JSON = JsonDoc("tune", {
    "machine_profile": "name and description of the profile the model used",
    "model": "name, layers, hidden, heads, ffn_hidden, seq, batch",
    "ranks": "the rank count placed", "algorithms": "the algorithms ranked",
    "options": "overlap, progress, dtype (and dtype_source), precision, recompute, attention, optimizer, dw_window, "
               "ranks_per_node",
    "memory_limit": "bytes per rank (null: none) and how it was chosen",
    "dropped": "configurations left out and why (one sentence)", "pruned": "configurations not predicted (or null)",
    "skipped": "algorithms left out: [algorithm, reason]", "valid": "configurations predicted",
    "top": "the --top fastest: rank, algorithm, grid, options, step_ms, compute_ms, exposed_ms, comm_ms per axis, "
           "bubble_ms, wire_mb, memory_gib, need_gib, placement per axis",
    "best": "per algorithm its fastest: algorithm, configuration, step_ms, vs_best",
    "why": "why the first wins (one sentence; null across algorithms)", "notes": "the model's notes",
    "emit_sweep": "the sweep spec written (or null)",
    "search": "with --search or a pinned axis: axes, pinned, not_searched, scenarios (enumerated), max_scenarios, "
              "predicted, pruned, memory_dropped, summary"}, optional=("search",))


def _prediction_json(rank: int, algorithm: str, grid, options, p, need_bytes: int) -> dict:
    """One configuration of ``tune --format json`` (the columns of the table, in ms, MB and GiB)."""
    comm: dict = {}
    bubble = 0.0
    for (axis, op), t in p.exposed_s.items():
        if op == "bubble":
            bubble += t
        else:
            comm[axis] = comm.get(axis, 0.0) + t * 1e3
    return {"rank": rank, "algorithm": algorithm, "grid": str(grid), "options": dict(options),
            "step_ms": p.step_s * 1e3, "compute_ms": p.compute_s * 1e3, "exposed_ms": p.exposed_total_s * 1e3,
            "comm_ms": comm, "bubble_ms": bubble * 1e3, "wire_mb": sum(p.wire_bytes.values()) / 1e6,
            "memory_gib": p.memory.total / GIB, "need_gib": need_bytes / GIB, "placement": dict(p.placement)}


def _tune_header(args, cfg, profile, overlap, recompute, attention, limit_text: str, dropped: str,
                 algorithms=None) -> None:
    """The text header of ``tune``: the profile, the model and options, the memory limit, what was dropped."""
    from fourd_mpi.perf.memory import default_precision

    across = f"; algorithms {', '.join(algorithms)}" if algorithms else ""
    print(profile.describe())
    print(f"model {cfg.name}: {cfg.layers} layers, hidden {cfg.hidden}, heads {cfg.heads}, ffn {cfg.ffn_hidden}, "
          f"seq {cfg.seq}, global batch {cfg.batch}; {args.ranks} ranks{across}; overlap {overlap}; progress "
          f"{args.progress}; {args.dtype} ({args.precision or default_precision(args.dtype)} precision); "
          f"recompute {recompute}; attention {attention}"
          + ("" if getattr(args, "dw_window", None) is None else f"; dW window {args.dw_window}"))
    print(limit_text)
    print(dropped)


def _tune_json(args, names, cfg, overlap, profile, limit, limit_text, recompute, attention, dtype_source, top, best,
               why, notes, dropped, pruned, skipped, valid) -> dict:
    from fourd_mpi.perf.memory import default_precision

    return {"machine_profile": {"name": profile.name, "description": profile.describe()},
            "model": {"name": cfg.name, "layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads,
                      "ffn_hidden": cfg.ffn_hidden, "seq": cfg.seq, "batch": cfg.batch},
            "ranks": args.ranks, "algorithms": list(names),
            "options": {"overlap": str(overlap), "progress": args.progress, "dtype": args.dtype,
                        "dtype_source": dtype_source, "precision": args.precision or default_precision(args.dtype),
                        "recompute": recompute, "attention": attention, "optimizer": args.optimizer,
                        "dw_window": args.dw_window, "ranks_per_node": args.ranks_per_node or profile.ranks_per_node},
            "memory_limit": {"bytes": limit, "how": limit_text}, "dropped": dropped, "pruned": pruned or None,
            "skipped": [list(s) for s in skipped], "valid": valid, "top": top, "best": best, "why": why,
            "notes": notes, "emit_sweep": args.emit_sweep}


def _add_memory_model(p) -> None:
    """What the run keeps in memory and computes again (model options of tune and model paper)."""
    from fourd_mpi.perf.memory import ATTENTION, PRECISIONS, RECOMPUTE

    g = p.add_argument_group("memory and recompute model")
    g.add_argument("--recompute", default=None, choices=RECOMPUTE,
                   help="activation recompute (none: keep every block's activations; selective: recompute the "
                        "attention core; full: keep block inputs only, recompute each block in backward)")
    g.add_argument("--attention", default=None, choices=ATTENTION,
                   help="unfused keeps the s x s attention probabilities (this suite's step); fused = flash "
                        "attention (keeps none)")
    g.add_argument("--precision", default=None, choices=PRECISIONS,
                   help="mixed: 16-bit weights/gradients + fp32 master copy and Adam moments (default for "
                        "float16/bfloat16); pure: everything in the run dtype (this suite's step; default otherwise)")


def _memory_limit_bytes(args, profile):
    """``(bytes or None, sentence saying where the limit comes from)``."""
    from fourd_mpi.perf.memory import ALLOCATOR_MARGIN, GPU_RUNTIME_RESERVE_BYTES
    from fourd_mpi.perf.tune import default_memory_limit, memory_reserve

    how = f"need = counted bytes x {1 + ALLOCATOR_MARGIN:.2f} (allocator margin)"
    if memory_reserve(profile):
        how += f" + {GPU_RUNTIME_RESERVE_BYTES / GIB:g} GiB (GPU runtime reserve)"
    if args.memory_limit == 0:
        return None, "memory limit: none (--memory-limit none)"
    if args.memory_limit is not None:
        return args.memory_limit, f"memory limit: {args.memory_limit / GIB:g} GiB per rank (--memory-limit); {how}"
    limit = default_memory_limit(profile)
    if limit is None:
        return None, (f"memory limit: none (profile {profile.name} states no device memory; give --memory-limit "
                      f"GiB to drop grids)")
    return limit, (f"memory limit: {limit / GIB:g} GiB per rank (profile {profile.name}'s device memory; "
                   f"--memory-limit GiB|none to change); {how}")


def _node_shape(args, profile):
    """``(ranks per node or None, what says it)``: ``--ranks-per-node``; else, with ``--site``, the site's node
    shape (its ``ranks_per_node``; a site without nodes of its own, ``local``, keeps the profile's); else the
    profile's (None: the model's default, the profile's ranks per node)."""
    if args.ranks_per_node is not None:
        return args.ranks_per_node, f"{args.ranks_per_node} ranks per node (--ranks-per-node)"
    if args.site:
        from fourd_mpi.jobs.sites import load_site

        site = load_site(args.site)
        if site.scheduler != "local" or site.launcher == "testbed":
            per_node = min(site.ranks_per_node, args.ranks)
            return per_node, f"{per_node} ranks per node (site {site.name}'s nodes; --ranks-per-node to change)"
    return None, f"{min(profile.ranks_per_node, args.ranks)} ranks per node (profile {profile.name}'s)"


def cmd_tune(args, world=None) -> int:
    from fourd_mpi.jobs.sites import resolve_profile
    from fourd_mpi.perf.tune import format_ranking, rank_grids, sweep_spec, why_best
    from fourd_mpi.step.overlap import OverlapConfig
    from fourd_mpi.step.presets import resolve_labelled

    from fourd_mpi.perf.tune import check_search_size

    cfg = resolve_labelled(args.model, layers=args.layers, hidden=args.hidden, heads=args.heads,
                        ffn_hidden=args.ffn_hidden, seq=args.seq, batch=args.batch)
    if cfg.batch is not None:  # a bounded search, refused at once (not after minutes of predictions)
        check_search_size(args.ranks, cfg=cfg)
    overlap = OverlapConfig.parse(args.overlap)
    refuse_output(args.emit_sweep, args.force, option="--emit-sweep", inputs=[args.profile or "", args.site or ""])
    profile = resolve_profile(args.site, args.profile, args.fallback_profile)
    dtype_source = "--dtype"
    if args.dtype is None:
        args.dtype = profile.training_dtype
        dtype_source = (f"the training dtype of machine profile {profile.name} "
                        f"({'bf16 on GPU sites' if profile.backend == 'cupy' else 'float32 on CPU sites'}; --dtype to "
                        f"choose)")
        if args.format != "json":
            print(f"dtype {args.dtype}: {dtype_source}")
    args.ranks_per_node, shape = _node_shape(args, profile)
    if args.format != "json":
        print(f"{profile.origin()}; {shape}")
    limit, limit_text = _memory_limit_bytes(args, profile)
    recompute, attention = args.recompute or "none", args.attention or "unfused"
    from fourd_mpi.perf.algorithms import algorithm_names

    names = algorithm_names(args.algorithm)
    from fourd_mpi.perf.search import parse_axes

    axes = parse_axes(args.search)
    if axes or any(getattr(args, n.replace("-", "_")) is not None for n in SEARCH_PINS):
        return _tune_search(args, names, cfg, overlap, profile, limit, limit_text, attention, dtype_source, axes)
    if names != ["axonn4d"]:
        if args.dw_window is not None:
            from fourd_mpi.errors import ConfigError

            raise ConfigError("--dw-window applies to --algorithm axonn4d (model predict takes it for every algorithm)")
        return _tune_across(args, names, cfg, overlap, profile, limit, limit_text, recompute, attention, dtype_source)
    ranking = rank_grids(cfg, args.ranks, profile, overlap, args.dtype, args.progress, args.optimizer, limit,
                         args.ranks_per_node, recompute=recompute, attention=attention, precision=args.precision,
                         dw_window=args.dw_window)
    from fourd_mpi.perf.memory import default_precision

    notes = []
    for p in ranking.predictions[: args.top]:
        for n in p.notes:
            if n not in notes:
                notes.append(n)
    if args.format == "json":
        top = [_prediction_json(i, "axonn4d", p.grid, {}, p, p.memory.required(ranking.reserve))
               for i, p in enumerate(ranking.predictions[: args.top], 1)]
        best = [{"algorithm": "axonn4d", "configuration": str(ranking.predictions[0].grid),
                 "step_ms": ranking.predictions[0].step_s * 1e3, "vs_best": 1.0}]
        doc = _tune_json(args, names, cfg, overlap, profile, limit, limit_text, recompute, attention, dtype_source,
                         top, best, why_best(ranking), notes, ranking.dropped_summary(), None, [],
                         len(ranking.predictions))
    else:
        _tune_header(args, cfg, profile, overlap, recompute, attention, limit_text, ranking.dropped_summary())
        print(f"top {min(args.top, len(ranking.predictions))} of {len(ranking.predictions)} valid grids by predicted "
              f"step time (ms per step; comm = exposed communication per axis):")
        print(format_ranking(ranking, args.top))
        print(why_best(ranking))
        for n in notes:
            print(f"note: {n}")
    if args.emit_sweep:
        import yaml

        grids = [p.grid for p in ranking.predictions[: args.top]]
        spec = sweep_spec(cfg, args.ranks, grids, args.overlap)
        write_text(args.emit_sweep, "# written by fourd-mpi tune: measure the predicted top grids\n"
                   + yaml.safe_dump(spec, sort_keys=False), "--emit-sweep")
        wrote(args.emit_sweep, f"sweep spec: {len(grids)} grid(s) at {args.ranks} ranks")
    if args.format == "json":
        emit_json(TUNE_JSON, doc)
    return 0


def _tune_across(args, names, cfg, overlap, profile, limit, limit_text, recompute, attention, dtype_source) -> int:
    """``tune --algorithm LIST|all``: one ranking across algorithms (:mod:`fourd_mpi.perf.algorithms`)."""
    from fourd_mpi.perf.algorithms import format_across, format_best, rank_algorithms, sweep_options
    from fourd_mpi.perf.memory import default_precision

    ranking = rank_algorithms(names, cfg, args.ranks, profile, overlap, args.dtype, args.progress, args.optimizer,
                              limit, args.ranks_per_node, recompute=recompute, attention=attention,
                              precision=args.precision, keep=args.top)
    notes = list(dict.fromkeys(n for e in ranking.entries[: args.top] for n in e.prediction.notes))
    if args.format == "json":
        top = [_prediction_json(i, e.algorithm, e.grid, e.options, e.prediction, e.need_bytes)
               for i, e in enumerate(ranking.entries[: args.top], 1)]
        fastest = ranking.entries[0].prediction.step_s if ranking.entries else None
        best = [{"algorithm": name, "configuration": e.label, "step_ms": e.prediction.step_s * 1e3,
                 "vs_best": e.prediction.step_s / fastest}
                for name, e in sorted(ranking.best_by_algorithm().items(), key=lambda kv: kv[1].prediction.step_s)]
        doc = _tune_json(args, names, cfg, overlap, profile, limit, limit_text, recompute, attention, dtype_source,
                         top, best, None, notes, ranking.dropped_summary(), ranking.pruned_summary(), ranking.skipped,
                         len(ranking.entries))
    else:
        _tune_header(args, cfg, profile, overlap, recompute, attention, limit_text, ranking.dropped_summary(), names)
        if ranking.pruned:
            print(ranking.pruned_summary())
        for name, why in ranking.skipped:
            print(f"skipped {name}: {why}")
        print(f"top {min(args.top, len(ranking.entries))} of {len(ranking.entries)} predicted valid configurations by "
              f"predicted step time (ms per step and rank; comm = exposed communication per axis):")
        print(format_across(ranking, args.top))
        print(format_best(ranking))
        for n in notes:
            print(f"note: {n}")
    if args.emit_sweep:
        import yaml

        from fourd_mpi.perf.tune import sweep_spec

        grids, algorithms = sweep_options(ranking, args.top)
        spec = sweep_spec(cfg, args.ranks, [], args.overlap)
        spec["grids"] = {args.ranks: grids}
        spec["description"] = f"the top {args.top} configurations of fourd-mpi tune --algorithm {args.algorithm}"
        spec["matrix"]["algorithm"] = algorithms  # each algorithm runs the listed grids it allows
        write_text(args.emit_sweep, "# written by fourd-mpi tune: measure the predicted top configurations\n"
                   + yaml.safe_dump(spec, sort_keys=False), "--emit-sweep")
        print(f"sweep spec {args.emit_sweep}: {len(grids)} grid(s) x {len(algorithms)} algorithm(s) at {args.ranks} ranks",
              file=sys.stderr if args.format == "json" else sys.stdout)
    if args.format == "json":
        emit_json(TUNE_JSON, doc)
    return 0


def _tune_search(args, names, cfg, overlap, profile, limit, limit_text, attention, dtype_source, axes) -> int:
    """``tune --search AXES`` (or a pinned axis): scenarios through ``model predict``'s model
    (:mod:`fourd_mpi.perf.search`)."""
    from fourd_mpi.errors import ConfigError
    from fourd_mpi.perf.scenario import Scenario
    from fourd_mpi.perf.search import MAX_SCENARIOS, format_search, options_of, search

    if names not in (["axonn4d"], ["pipeline"]):
        raise ConfigError("--search covers the 4D family with its pipeline (--algorithm axonn4d or pipeline)")
    if args.emit_sweep:
        raise ConfigError("--emit-sweep lists grids: not with --search (measure a scenario with fourd-mpi run)")
    given = {n: getattr(args, n.replace("-", "_")) for n in SEARCH_PINS + ("recompute",)}
    options = {"model": cfg, "grid": "1x1x1x1", "vocab": 0, "dw-window": args.dw_window or "none",
               "ginter": args.ginter or 1, "pipeline-schedule": args.pipeline_schedule or "axonn",
               "chunks-per-stage": args.chunks_per_stage or 1, "context-parallel": args.context_parallel or 1,
               "sequence-parallel": bool(args.sequence_parallel), "shard-optimizer": args.shard_optimizer or "none",
               "recompute": args.recompute or "none", "attention": attention, "precision": args.precision,
               "dtype": args.dtype, "optimizer": args.optimizer, "overlap": overlap, "progress": args.progress,
               "ranks-per-node": args.ranks_per_node, "memory-limit": 0 if limit is None else limit}
    base = Scenario.from_options(options, profile)
    found = search(base, args.ranks, profile, axes, given, keep=args.top)
    shown = found.results[: args.top]
    notes = list(dict.fromkeys(n for r in shown for n in r.notes))
    recompute = args.recompute or ("searched" if "recompute" in axes else "none")
    if args.format == "json":
        top = []
        for i, r in enumerate(shown, 1):
            comm = {a: t * 1e3 for a, t in r.exposed_s.items() if a != "pipeline"}
            top.append({"rank": i, "algorithm": r.scenario.algorithm, "grid": str(r.scenario.grid),
                        "options": options_of(r.scenario), "step_ms": r.step_s * 1e3, "compute_ms": r.compute_s * 1e3,
                        "exposed_ms": sum(r.exposed_s.values()) * 1e3, "comm_ms": comm, "bubble_ms": r.bubble_s * 1e3,
                        "wire_mb": None, "memory_gib": r.memory["total"] / GIB, "need_gib": r.memory["required"] / GIB,
                        "placement": None})
        first = shown[0]
        best = [{"algorithm": first.scenario.algorithm, "configuration": _search_label(first.scenario),
                 "step_ms": first.step_s * 1e3, "vs_best": 1.0}]
        doc = _tune_json(args, names, cfg, overlap, profile, limit, limit_text, recompute, attention, dtype_source,
                         top, best, None, notes, f"{found.memory_dropped} scenarios dropped by memory",
                         f"{found.pruned} scenarios pruned by the lower bound", [], found.predicted)
        doc["search"] = {"axes": ["grid", *found.axes], "pinned": {k: str(v) for k, v in found.pinned.items()},
                         "not_searched": [list(x) for x in found.not_searched], "scenarios": found.candidates,
                         "max_scenarios": MAX_SCENARIOS, "predicted": found.predicted, "pruned": found.pruned,
                         "memory_dropped": found.memory_dropped, "summary": found.summary()}
        emit_json(TUNE_JSON, doc)
        return 0
    _tune_header(args, cfg, profile, overlap, recompute, attention, limit_text, found.summary())
    print(f"top {len(shown)} of {found.predicted} predicted scenarios by predicted step time (model predict's model, "
          f"vocabulary 0; ms per step and rank; comm = exposed communication per axis; b = micro-batch size x count):")
    print(format_search(found, args.top))
    for n in notes:
        print(f"note: {n}")
    return 0


def _search_label(sc) -> str:
    from fourd_mpi.perf.search import label

    return label(sc)


# -- model calibrate | validate ---------------------------------------------------------------

def _register_model(sub) -> None:
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
    a.add_argument("--batch", type=int_list_of(batch_size, "global batches"), default="1024,2048", metavar="LIST", help="global batches in sequences, comma list "
                   "(default 1024,2048)")
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
                    help="memory per GPU, run's grammar (80GiB, 80G or 80 GiB; default 80: the A100-80GB nodes; 40 for the "
                         "others; none)")
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
    from fourd_mpi.perf.axonn_commmodel import (compare, default_explained, explain_grid, format_comparison,
                                                format_explanation)
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
    from fourd_mpi.perf.paper import DEFAULT_BATCH, PUBLISHED, WEAK_SERIES, model_case, plot, report
    from fourd_mpi.jobs.sites import resolve_profile

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
    from fourd_mpi.perf.paper import SETTINGS, OVERLAP, series_data, ptdp_case

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
    from fourd_mpi.analysis.tables import collect_or_fail
    from fourd_mpi.jobs.sites import resolve_profile
    from fourd_mpi.analysis.model_check import report, validate

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

    from fourd_mpi.analysis.tables import collect_or_fail, format_table
    from fourd_mpi.perf.machine import TERMS, load_profile
    from fourd_mpi.analysis.model_check import calibrate

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


# -- bench collectives -----------------------------------------------------------------------

#: the largest message of bench collectives (bytes): it holds a few buffers of this size per rank
MAX_BENCH_BYTES = 1 << 30
#: the most iterations of one measurement of bench collectives
MAX_BENCH_ITERS = 1 << 20
#: the largest n of bench collectives' n x n GEMM (three float64 matrices of 2 GiB each)
MAX_GEMM_SIZE = 1 << 14


#: ``bench collectives --format json`` (written by :func:`fourd_mpi.run.collbench.format_result`)
BENCH_JSON = JsonDoc("bench collectives", {
    "world_size": "ranks", "num_nodes": "nodes", "grids": "the grids benchmarked", "formulas": "of the columns",
    "units": "of the values", "communicators": "comm, axes, level, p, per_node",
    "rows": "per communicator, op, size and placement: the csv columns", "overlap": "the overlap measurements",
    "sync": "the synchronization cost per communicator", "compute": "GEMM and element-wise rates",
    "wrong": "wrong result elements in all", "avg_busbw_gbps": "mean busbw of the rows",
    "iterations": "the iteration rule", "step_model": "model and dtype of the step's messages",
    "step_messages": "the step's messages and whether the sizes cover them", "bound": "the --time-limit rule",
    "sweep": "time_limit_s, elapsed_s, planned, measured, skipped (what the bound left out)",
    "profile": "path of the profile written (null: none, with reason), missing_ops"}, optional=("profile",))


def _size(text: str) -> int:
    units = {"k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}
    t = text.strip().lower().rstrip("b").rstrip("i")
    scale = units.get(t[-1:], 1)
    t = t[:-1] if t[-1:] in units else t
    try:
        value = int(float(t) * scale)
    except (ValueError, OverflowError):  # OverflowError: inf
        raise argparse.ArgumentTypeError(f"expected a size like 8, 64K or 4M, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    if value > MAX_BENCH_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is larger than the largest message, 1G ({MAX_BENCH_BYTES:,} "
                                         "bytes): the benchmark holds a few buffers of that size on every rank")
    return value


def _register_bench(sub) -> None:
    """``fourd-mpi bench collectives ...``"""
    from fourd_mpi.perf.calibration import MAX_FIT_RMS, OPS
    from fourd_mpi.run.collbench import DEFAULT_TIME_LIMIT_S, PROGRESS_EVERY_S

    bench = sub.add_parser("bench", help="micro-benchmarks under mpiexec: collectives (OSU / nccl-tests "
                           "style) and the machine profile for the performance model")
    bsub = bench.add_subparsers(dest="bench_command", required=True, parser_class=sub._parser_class)
    p = bsub.add_parser("collectives", help="latency, algbw/busbw and overlap %% of the grid's collectives, "
                        "each size's row printed as it is measured; writes a machine profile; bounded by --time-limit")
    g = p.add_argument_group("communicators (each axis of size > 1, and the world)")
    for option in options_in("grid"):
        add_option(g, option)
    g.add_argument("--grid", action="append", default=[], metavar="DxZxYxX",
                   help="grid to benchmark (repeatable); default: the grid flags, or when none is given one "
                        "grid per divisor p of the world with G_x = p (every group size once)")
    g.add_argument("--no-world", action="store_true", help="skip the world communicator")
    add_option(g, OPTIONS["step-timeout"], help="watchdog: a rank that waits longer than this in one measurement "
               "(one collective, size and placement) prints where it waits and aborts the job (MPI_Abort); 0 "
               "disables (default 600)")
    s = p.add_argument_group("sweep")
    s.add_argument("--ops", default=",".join(OPS), metavar="LIST", help=f"comma list of {', '.join(OPS)}")
    s.add_argument("--min-size", type=_size, default=8, metavar="BYTES", help="smallest message (default 8)")
    s.add_argument("--max-size", type=_size, default=64 * 1024 ** 2, metavar="BYTES",
                   help="largest message, measured even when the --factor steps miss it (default 64M: "
                        "8, 64, ..., 16M, 64M; measured here: 310 MB peak resident memory per rank at 64M, 82 MB at 4M)")
    s.add_argument("--factor", type=int_in(2, 1 << 20, "the size multiplier"), default=8, help="size step (default 8: 8, 64, 512, ...)")
    s.add_argument("--iters", type=int_in(1, MAX_BENCH_ITERS, "timed iterations"), default=20,
                   help="at least this many timed iterations per size and placement (default 20, as nccl-tests' -n)")
    s.add_argument("--min-time", type=float_in(0.0, 86400.0, "seconds"), default=0.2, metavar="SECONDS",
                   help="and at least this many seconds of timed iterations (default 0.2; 0: --iters alone); "
                        "the ranks agree on the count, so collectives stay matched")
    s.add_argument("--max-time", type=float_in(1e-3, 86400.0, "seconds"), default=10.0, metavar="SECONDS",
                   help="bound: stop the timed iterations of one size and placement after this much wall time, "
                        "even below --iters or --min-time (default 10; at least one iteration)")
    s.add_argument("--time-limit", type=float_in(0.0, 7 * 86400.0, "seconds"), default=DEFAULT_TIME_LIMIT_S,
                   metavar="SECONDS", help=f"bound on the whole sweep, the compute calibration before it included (default "
                   f"{DEFAULT_TIME_LIMIT_S:g}; 0: none): each communicator and collective gets its share of the time "
                   "left, and a measurement runs only when its least predicted time (warm-up, --min-time or one "
                   "timed iteration, the check; extrapolated from the sizes measured before it) fits into what is "
                   "left of that share, its timed iterations stopping there: the largest sizes are left out first, "
                   "named in one line (JSON: sweep.skipped)")
    s.add_argument("--progress-every", type=float_in(0.0, 86400.0, "seconds"), default=PROGRESS_EVERY_S,
                   metavar="SECONDS", help=f"a progress line on standard error (which collective, size i of n, time "
                   f"elapsed and about how much is left) at each new communicator and collective, before a "
                   f"measurement predicted to take this long, and otherwise at most every SECONDS (default "
                   f"{PROGRESS_EVERY_S:g}; 0: none)")
    s.add_argument("--warmup", type=int_in(0, MAX_BENCH_ITERS, "untimed iterations"), default=3, help="untimed iterations first (default 3)")
    s.add_argument("--overlap-sizes", type=int_in(0, 64, "sizes"), default=2, metavar="K",
                   help="measure overlap at the K largest sizes up to 4M (default 2; 0 skips it)")
    add_options(p, ("model",), names=("dtype",))  # the step whose messages the report sets beside the table
    c = p.add_argument_group("compute calibration")
    c.add_argument("--dtypes", default="float32,float64", help="GEMM dtypes to measure (default float32,float64)")
    c.add_argument("--gemm-size", type=int_in(1, MAX_GEMM_SIZE, "n of an n x n GEMM"), default=256, help="n of the n x n x n GEMM (default 256)")
    c.add_argument("--backend", default="numpy", choices=("numpy", "cupy"), help="array library of the GEMM "
                   "(collective buffers are host memory)")
    o = p.add_argument_group("output")
    o.add_argument("-o", "--output", metavar="FILE", default=None,
                   help="machine profile to write (default results/profiles/<host>.yaml); the report stays on "
                        "standard output")
    o.add_argument("--name", default=None, help="profile name (default local-<host>)")
    o.add_argument("--fallback", default=None, metavar="PROFILE",
                   help="built-in profile named in the file for levels not measured (e.g. perlmutter)")
    o.add_argument("--force", action="store_true", help="replace an existing profile file (or --report file)")
    o.add_argument("--max-fit-error", type=float_in(0.0, 1000.0, "a percentage"), default=100 * MAX_FIT_RMS,
                   metavar="PERCENT", help=f"the profile is written only when every alpha-beta fit (per level, "
                   f"collective and group size) misses its measurements by less than this relative rms error "
                   f"(default {100 * MAX_FIT_RMS:.0f}); else one line names the worst fit and every rank exits 1")
    o.add_argument("--accept-poor-fit", action="store_true",
                   help="write the profile even when a fit reaches --max-fit-error; the model then uses the stored "
                        "measured points first. A flag of its own, not --force: replacing a file and accepting a "
                        "poor fit are different decisions")
    o.add_argument("--report", dest="table", metavar="FILE",
                   help="also write the printed report (in --format) there")
    add_deprecated(o, "--table", "--report", dest="table", metavar="FILE")
    add_json_format(o, BENCH_JSON, ("table", "csv", "json"),
                    help="report on stdout: table (nccl-tests / OSU-like text, default) or csv (a row per "
                         "communicator, op, size and placement), each row printed when it is measured; or json (one "
                         "document at the end: everything)")
    s.add_argument("--no-in-place", dest="in_place", action="store_false",
                   help="measure out-of-place only (default: out-of-place and MPI_IN_PLACE)")
    bench.set_defaults(handler=cmd_bench, serial=False)


def cmd_bench(args, world) -> int:
    """``fourd-mpi bench collectives``: run, write the profile (rank 0), print the report (rank 0).

    Errors are printed once, by rank 0, and every rank exits with the same status (rank 0's,
    broadcast): 2 for bad options or a profile/report that cannot be written, 1 when the result
    check found wrong elements (``#wrong`` > 0), else 0.
    """
    from fourd_mpi.cli.args import error_line
    from fourd_mpi.core.mpiutil import on_root
    from fourd_mpi.errors import ConfigError
    from fourd_mpi.core.watchdog import Watchdog, check_timeout
    from fourd_mpi.run.collbench import StreamReport, run_bench

    hostname = socket.gethostname()
    out = args.output or os.path.join("results", "profiles", f"{hostname}.yaml")
    rank = world.Get_rank()
    try:
        # rank 0 writes them; every rank hears, before anything is measured
        on_root(world, lambda: refuse_output(out, args.force, inputs=[args.fallback or ""], makes_dirs=True))
        if args.table:
            on_root(world, lambda: refuse_output(args.table, args.force, option="--report",
                                                   inputs=[out, args.fallback or ""]))
        if args.name is not None:
            on_root(world, lambda: _check_profile_name(args.name))
        if args.fallback:
            from fourd_mpi.perf.machine import load_profile

            load_profile(args.fallback)  # fail early on an unknown name, on every rank
        check_timeout(args.step_timeout)
        watchdog = Watchdog(args.step_timeout, rank)
        report = StreamReport(args.format, every=args.progress_every) if rank == 0 else None
        result = run_bench(args, world, watchdog, report)
        watchdog.close()
    except ConfigError as exc:  # the same on every rank (checked before any collective): said once
        if rank == 0:
            error_line(exc)
        return 2
    status = 0
    if rank == 0:
        try:
            status = _report_bench(result, args, hostname, out, report)
        except (ConfigError, OSError) as exc:
            error_line(exc)
            status = 2
    return world.bcast(status, root=0)


def _check_profile_name(name: str) -> None:
    """``--name`` as the machine profile schema wants it, checked before anything is measured."""
    import re

    from fourd_mpi.errors import ConfigError
    from fourd_mpi.perf.machine import PROFILE_SCHEMA

    rule = PROFILE_SCHEMA["properties"]["name"]
    if not re.match(rule["pattern"], name):
        raise ConfigError(f"--name {name!r}: {rule['description']} (at most 64 characters, starting with a letter or digit)")


def _report_bench(result, args, hostname, out, report) -> int:
    """Rank 0: write the machine profile (from what was measured), print the rest of the report in ``--format``
    (``report``: the :class:`~fourd_mpi.run.collbench.StreamReport` that printed the rows as they were
    measured) and the profile summary; the exit status."""
    import yaml

    from fourd_mpi.perf.calibration import build_profile, missing_kinds, profile_problem
    from fourd_mpi.run.collbench import format_result, total_wrong

    problem = profile_problem(result)
    missing = missing_kinds(result)
    refused = None
    if problem:
        summary = [f"# {problem}"]
        result["profile"] = {"path": None, "reason": problem}
    else:
        summary, refused = _write_profile(result, args, hostname, out, build_profile, yaml)
        result["profile"] = {"path": None if refused else out, "missing_ops": missing}
        if refused:
            result["profile"]["reason"] = refused
        if missing:
            summary.append(f"  no fit of {', '.join(m[1:] for m in missing)}: --ops lacks {', '.join(missing)}; the "
                           f"model takes them from the profile's fallback (--fallback) or refuses")
    text = format_result(result, args.format)
    if args.format == "json":
        import json

        BENCH_JSON.check(json.loads(text))
    report.end(result)
    if result.get("skipped_line"):
        print(f"fourd-mpi: note: {result['skipped_line']}", file=sys.stderr, flush=True)
    if args.format == "table":
        print("\n".join(summary), flush=True)
    else:  # stdout stays machine-readable
        print("\n".join(line.lstrip("# ") if line.startswith("#") else line for line in summary if line),
              file=sys.stderr, flush=True)
    if args.table:
        write_text(args.table, text + "\n" + ("\n".join(summary) + "\n" if args.format == "table" else ""), "--report")
    wrong = total_wrong(result)
    if wrong:
        print(f"fourd-mpi: error: the result check found {wrong} wrong element(s) (#wrong)", file=sys.stderr,
              flush=True)
        return 1
    if refused:
        print(f"fourd-mpi: error: {refused}", file=sys.stderr, flush=True)
        return 1
    return 0


def _per_size_errors(entry, kind) -> str:
    """``; per group size (what the model uses): p=2 12%, p=4 8%`` from a level's ``by_size`` fits, or ``""``."""
    per_p = (entry.get("by_size") or {}).get(kind) or {}
    if not per_p:
        return ""
    return "; per group size (what the model uses): " + ", ".join(
        f"p={p} {100 * f['rms_rel_error']:.0f}%" for p, f in per_p.items())


def _write_profile(result, args, hostname, out, build_profile, yaml):
    """Validate and write the machine profile (rank 0); ``(the lines that describe its fits, why it was
    not written or None)``: a fit whose relative rms error reaches
    ``--max-fit-error`` (default :data:`~fourd_mpi.perf.calibration.MAX_FIT_RMS`) keeps it from being written
    unless ``--accept-poor-fit``."""
    from fourd_mpi.perf.calibration import fit_window, poor_fit_line, poor_fits
    from fourd_mpi.run.collbench import mpi_library

    name = args.name or f"local-{hostname}"
    profile = build_profile(result, name, hostname, args.fallback, args.backend, mpi_library=mpi_library())
    from fourd_mpi.perf.machine import PROFILE_SCHEMA

    import jsonschema

    jsonschema.validate(profile, PROFILE_SCHEMA)
    limit = args.max_fit_error / 100
    bad = poor_fits(profile, limit)
    refused = (poor_fit_line(bad, limit, fit_window(result["rows"], limit), searched=True)
               if bad and not args.accept_poor_fit else None)
    if bad and args.accept_poor_fit:
        profile["calibration"]["poor_fits"] = (f"{len(bad)} fit(s) at or over {100 * limit:g}% rms, written "
                                               f"by --accept-poor-fit: " + ", ".join(
                                                   f"{lv} {kind} p={p} {100 * rms:.0f}%" for lv, kind, p, rms in bad))
        jsonschema.validate(profile, PROFILE_SCHEMA)
    if not refused:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        write_text(out, f"# machine profile written by fourd-mpi bench collectives ({len(result['rows'])} "
                        f"measurements)\n" + yaml.safe_dump(profile, sort_keys=False))
    fits = []
    for level, entry in profile["levels"].items():
        for kind in ("allgather", "reduce_scatter", "allreduce"):
            f = entry.get(kind)
            if f is None:
                fits.append(f"  {level:<5} {kind:<15} not measured")
                continue
            fits.append(f"  {level:<5} {kind:<15} alpha {f['alpha_s'] * 1e6:8.2f} us  beta {f['beta_s_per_byte'] * 1e9:8.4f} "
                        f"ns/B ({1 / f['beta_s_per_byte'] / 1e9 if f['beta_s_per_byte'] > 0 else float('inf'):.3f} GB/s)"
                        f"  rms rel. error {100 * f['rms_rel_error']:.0f}% over {f['points']} points"
                        + _per_size_errors(entry, kind))
    summary = ["", f"machine profile {out}{' NOT written (see the error line)' if refused else ''}:"] + fits + [
        f"  oversubscription x{profile['compute']['oversubscription']:.2f}, overlap efficiency with polling "
        f"{profile['progress']['overlap_efficiency']:.2f}"]
    if "inter" not in profile["levels"]:
        summary.append("  no inter-node level (one node): grids that cross nodes need --fallback or a multi-node run")
    if bad and args.accept_poor_fit:
        summary.append(f"  written with {len(bad)} fit(s) at or over {100 * limit:g}% rms (--accept-poor-fit): "
                       f"the model uses the stored measured points where it has them")
    return summary, refused
