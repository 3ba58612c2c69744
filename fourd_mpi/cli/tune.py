"""``fourd-mpi tune``: rank every grid shape of a rank count by the performance model's predicted
step time (one process, no MPI). ``tune`` takes the model and run options from the run-option table,
so it offers exactly the choices of ``fourd-mpi run``; pinning a search axis searches scenarios."""

from __future__ import annotations

import sys

from fourd_mpi.cli.args import add_options, add_site, wrote
from fourd_mpi.cli.jsonout import JsonDoc, add_json_format, emit_json
from fourd_mpi.util.files import refuse_output, write_text
from fourd_mpi.util.units import GIB
from fourd_mpi.util.values import axis_size, layer_count, memory_limit, rank_count, repeat_count


def register(sub) -> None:
    p = sub.add_parser("tune", help="rank every grid shape of a rank count by predicted step time "
                       "(performance model; one process, no mpiexec)")
    p.add_argument("--ranks", type=rank_count, required=True, metavar="N",
                   help="the rank count to place (at most 4,096 candidate grids: every power of two up to 2^24 "
                        "qualifies; 720720 has 89,600 and is refused)")
    p.add_argument("--algorithm", default="axonn4d", metavar="NAME|LIST|all",
                   help="algorithm(s) to rank: a name of fourd-mpi run --algorithm, a comma list, or all (one table "
                        "across algorithms with an algorithm column; default axonn4d). pipeline tries every stage "
                        "count dividing the ranks and the layers, every 4D grid of a stage, and every micro-batch "
                        "size that divides the per-replica batch (at most 1024 micro-batches; at most 20,000 "
                        "configurations, else refused, or skipped with a line under a list); configurations whose "
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
    from fourd_mpi.perf.tune import check_search_size, format_ranking, rank_grids, sweep_spec, why_best
    from fourd_mpi.step.overlap import OverlapConfig
    from fourd_mpi.step.presets import resolve_labelled

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
        _print_ranking(f"top {min(args.top, len(ranking.predictions))} of {len(ranking.predictions)} valid grids by "
                       "predicted step time (ms per step; comm = exposed communication per axis):",
                       format_ranking(ranking, args.top), why_best(ranking), notes)
    if args.emit_sweep:
        grids = [p.grid for p in ranking.predictions[: args.top]]
        spec = sweep_spec(cfg, args.ranks, grids, args.overlap)
        _write_sweep(args.emit_sweep, "grids", spec)
        wrote(args.emit_sweep, f"sweep spec: {len(grids)} grid(s) at {args.ranks} ranks")
    if args.format == "json":
        emit_json(TUNE_JSON, doc)
    return 0


def _print_ranking(title: str, table: str, best: str, notes) -> None:
    """The text form of a ranking: its title line, the table, the line on the best, then the notes."""
    print(title)
    print(table)
    print(best)
    for n in notes:
        print(f"note: {n}")


def _write_sweep(path: str, what: str, spec: dict) -> None:
    """``--emit-sweep PATH``: the sweep spec measuring the predicted top ``what`` (grids, configurations)."""
    import yaml

    write_text(path, f"# written by fourd-mpi tune: measure the predicted top {what}\n"
               + yaml.safe_dump(spec, sort_keys=False), "--emit-sweep")


def _tune_across(args, names, cfg, overlap, profile, limit, limit_text, recompute, attention, dtype_source) -> int:
    """``tune --algorithm LIST|all``: one ranking across algorithms (:mod:`fourd_mpi.perf.algorithms`)."""
    from fourd_mpi.perf.algorithms import format_across, format_best, rank_algorithms, sweep_options

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
        _print_ranking(f"top {min(args.top, len(ranking.entries))} of {len(ranking.entries)} predicted valid "
                       "configurations by predicted step time (ms per step and rank; comm = exposed communication "
                       "per axis):", format_across(ranking, args.top), format_best(ranking), notes)
    if args.emit_sweep:
        from fourd_mpi.perf.tune import sweep_spec

        grids, algorithms = sweep_options(ranking, args.top)
        spec = sweep_spec(cfg, args.ranks, [], args.overlap)
        spec["grids"] = {args.ranks: grids}
        spec["description"] = f"the top {args.top} configurations of fourd-mpi tune --algorithm {args.algorithm}"
        spec["matrix"]["algorithm"] = algorithms  # each algorithm runs the listed grids it allows
        _write_sweep(args.emit_sweep, "configurations", spec)
        print(f"sweep spec {args.emit_sweep}: {len(grids)} grid(s) x {len(algorithms)} algorithm(s) "
              f"at {args.ranks} ranks", file=sys.stderr if args.format == "json" else sys.stdout)
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
