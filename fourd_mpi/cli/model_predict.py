"""``fourd-mpi model predict`` and ``fourd-mpi model published``: a forced configuration through the
model, and the model against the shipped published results (one process, no MPI).

Every option of ``predict`` may also come from ``--config FILE.yaml`` (keys = option names without the
leading dashes, ``-`` or ``_``); the command line wins over the file, the file over the defaults.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from fourd_mpi.cli.jsonout import JsonDoc, add_json_format, emit_json
from fourd_mpi.errors import ConfigError
from fourd_mpi.util.values import (axis_size, batch_size, gib_or_none, head_count, int_in, layer_count, repeat_count,
                                   seq_length, vocab_size, width)
from fourd_mpi.util.values import text as nonempty_text

_chunks = int_in(1, 1 << 16, "model chunks per stage")

#: option -> (type, default, help); every one a ``--name`` of ``model predict`` and a key of ``--config``
PREDICT_OPTIONS = {
    "model": (str, "gpt-80b", "model preset (fourd-mpi run --model); sizes below override it"),
    "layers": (layer_count, None, "blocks l"), "hidden": (width, None, "hidden size h (ffn = 4h unless --ffn-hidden)"),
    "heads": (head_count, None, "attention heads"), "ffn-hidden": (width, None, "MLP width"),
    "kv-heads": (head_count, None, "key/value heads of grouped-query attention (Ainslie et al. 2023; default: "
                                   "--heads, multi-head attention); the model only"),
    "mlp": (str, "gelu", "gelu (two h x f GEMMs) or swiglu (three: Shazeer 2020, Llama 2); the model only"),
    "seq": (seq_length, None, "sequence length s"), "batch": (batch_size, None, "global batch B in sequences (required)"),
    "vocab": (vocab_size, 51200, "vocabulary V (embedding and LM head; 0 leaves them out; default 51200)"),
    "algorithm": (str, "axonn4d", "axonn4d, megatron1d, fsdp, dp or pipeline (4D family)"),
    "grid": (str, None, "G_data x G_z x G_y x G_x of one pipeline stage, e.g. 16x1x8x1 (required)"),
    "stages": (axis_size, 1, "pipeline stages p (default 1)"),
    "first-stage-layers": (layer_count, None, "blocks of the first stage (Megatron-LM's --decoder-first-pipeline-"
                                              "num-layers; the other stages split the rest evenly)"),
    "last-stage-layers": (layer_count, None, "blocks of the last stage (Megatron-LM's --decoder-last-pipeline-num-"
                                             "layers); without either, p not dividing L: the first L mod p stages "
                                             "hold one block more"),
    "schedule": (str, "1f1b", "1f1b, interleaved (with --chunks-per-stage v) or axonn"),
    "chunks-per-stage": (_chunks, 1, "model chunks v per stage of the interleaved schedule"),
    "context-parallel": (axis_size, 1, "ranks sharing each sequence (Megatron-LM's context parallelism: s/cp tokens "
                                       "per rank, K/V around a ring; needs --attention fused; default 1)"),
    "microbatch-size": (batch_size, None, "sequences b per micro-batch and data x Z shard"),
    "microbatches": (repeat_count, None, "micro-batches m per step (B = b m G_data G_z; gradient accumulation)"),
    "sequence-parallel": (bool, False, "sequence parallelism over Y (Megatron-like grids)"),
    "recompute": (str, "full", "none, selective or full activation recompute"),
    "dtype": (str, None, "float16, bfloat16, float32, or float8 (alias fp8: Transformer Engine's FP8 GEMMs, BF16 "
                         "storage; Hopper profiles) (default: the profile's training dtype)"),
    "attention": (str, "fused", "fused (flash) or unfused"),
    "precision": (str, None, "mixed or pure (default mixed for 16-bit dtypes)"),
    "shard-optimizer": (str, "none", "none or data (distributed optimizer / ZeRO-1: optimizer state split over "
                                     "G_data; the gradient all-reduce becomes a reduce-scatter and, after the "
                                     "update, a blocking parameter all-gather)"),
    "optimizer": (str, "adam", "adam or sgd"),
    "overlap": (str, "all", "none, all or a list of oag,ors,oar,dp,od"),
    "dw-window": (str, "2", "dW blocks whose reduce-scatter may be in flight at once with ORS, or 'none' "
                            "(unbounded; default 2)"),
    "profile": (str, "perlmutter", "machine profile: a built-in (dgx-a100, dgx-a100-40gb, dgx-h100, h100-roce, "
                                   "alps-gh200, perlmutter, frontier, laptop) or a file"),
    "ranks-per-node": (axis_size, None, "ranks per node (default: the profile's)"),
    "memory-limit": (gib_or_none, None, "GiB per GPU for the fits line (default: the profile's device memory; 'none')"),
    "implementation": (str, "fourd", "fourd (this suite's step), deepspeed-2021 (fsdp on 1xNx1x1 only: DeepSpeed "
                                     "ZeRO-3 v0.3.13-v0.5.4's third gathers and per-rank copy loops) or megatron-lm "
                                     "(megatron1d or dp: Megatron-LM 2020-2021's DDP=local, one coalesced gradient "
                                     "all-reduce per step) or pytorch-fsdp (fsdp: PyTorch FSDP's gradient "
                                     "accumulation, a reduce-scatter per micro-batch into sharded sums)"),
}


def register(msub) -> None:
    """Add ``predict`` and ``published`` to ``fourd-mpi model``'s subcommands."""
    p = msub.add_parser("predict", help="one configuration with every choice forced: step time split into compute, "
                                        "exposed communication per axis and bubble, memory per GPU by part, %% of "
                                        "peak under each FLOP convention (offline)")
    # dest differs from "config": the main parser expands a command's ``config`` as run options
    p.add_argument("--config", dest="predict_config", type=nonempty_text, default=None, metavar="FILE",
                   help="YAML mapping of these options (the command line wins)")
    for name, (kind, _, text) in PREDICT_OPTIONS.items():
        if kind is bool:
            p.add_argument(f"--{name}", action="store_const", const=True, default=None, help=text)
        else:
            p.add_argument(f"--{name}", type=kind, default=None, help=text)
    add_json_format(p, PREDICT_JSON)
    pub = msub.add_parser("published", help="the model against the shipped published results (Megatron-LM SC21 "
                                            "Tables 1 and 2, its README of 2020, AxoNN SC'24), the memory and the "
                                            "ranking claims (offline)")
    pub.add_argument("--dataset", default="all", metavar="NAME",
                     help="narayanan_sc21, axonn_sc24, narayanan_sc21_table2, megatron_readme_2020, llama3_405b, "
                          "megascale_megatron or all (default)")
    pub.add_argument("--no-claims", action="store_true", help="leave out the ranking claims")
    add_json_format(pub, PUBLISHED_JSON)


#: ``model predict --format json``
PREDICT_JSON = JsonDoc("model predict", {
    "scenario": "every option, the model's sizes, grid and GPUs", "step_s": "predicted step time",
    "compute_s": "its compute", "exposed_s": "exposed communication per axis", "bubble_s": "pipeline bubble",
    "terms_s": "the step's terms", "memory_bytes": "memory per GPU by part", "memory_stage": "the stage it is for",
    "fits": "whether it fits --memory-limit", "flops_per_step": "per FLOP convention",
    "peak_tflops": "the data-sheet peak", "tflops_per_gpu": "per convention", "pct_peak": "per convention",
    "formulas": "of the conventions", "notes": "the model's notes"})
#: ``model published --format json``
PUBLISHED_JSON = JsonDoc("model published", {
    "summary": "errors over every point", "summary_by_dataset": "per dataset",
    "summary_target_set": "over the points the model must match (or null)",
    "points": "per published point: dataset, name, gpus, metric, published, predicted, ratio, error, to_match, "
              "assumed, source, scheme, prediction",
    "memory_claims": "the memory claims", "claims": "the ranking claims (not with --no-claims)"},
    optional=("claims", "memory_claims"))


def _options(args) -> dict:
    """The options of ``predict``: command line over ``--config`` over defaults."""
    values = {name: getattr(args, name.replace("-", "_")) for name in PREDICT_OPTIONS}
    if args.predict_config is not None:
        from fourd_mpi.util.yamlspec import YamlDocument

        # the suite's safe reader: a regular file only (a FIFO is refused, not waited on), at most 1 MiB,
        # bounded depth and nodes, aliases refused past 100,000 expanded nodes
        source = args.predict_config
        doc = YamlDocument.read(source, "predict config").data or {}
        if not isinstance(doc, dict):
            raise ConfigError(f"--config {source}: expected a mapping of option: value")
        for key, value in doc.items():
            name = str(key).replace("_", "-")
            if name not in PREDICT_OPTIONS:
                raise ConfigError(f"--config {source}: unknown option {key!r} (known: {', '.join(PREDICT_OPTIONS)})")
            if values[name] is None:
                kind = PREDICT_OPTIONS[name][0]
                if kind is bool or value is None:
                    values[name] = value
                    continue
                if isinstance(value, (list, dict)) or (isinstance(value, bool) and kind is not str):
                    raise ConfigError(f"--config {source}: {key} must be a single value, got {value!r}")
                try:  # the command line's parser: the same bounds and words ('' refused as there)
                    values[name] = (nonempty_text if kind is str else kind)(str(value))
                except argparse.ArgumentTypeError as exc:
                    raise ConfigError(f"--config {source}: {key}: {exc}") from None
    for name, (_, default, _) in PREDICT_OPTIONS.items():
        if values[name] is None:
            values[name] = default
    return values


def scenario_from(values: dict):
    """``(Scenario, MachineProfile)`` of the resolved options; one-line :class:`ConfigError` otherwise."""
    from fourd_mpi.core.grid import GridShape
    from fourd_mpi.perf.memory import ATTENTION, OPTIMIZER_SHARDING, PRECISIONS, RECOMPUTE
    from fourd_mpi.perf.scenario import Scenario
    from fourd_mpi.jobs.sites import resolve_profile
    from fourd_mpi.step.overlap import OverlapConfig
    from fourd_mpi.step.presets import MLP_KINDS, resolve_model

    if values["grid"] is None:
        raise ConfigError("model predict needs --grid G_DATAxG_ZxG_YxG_X (one pipeline stage's 4D grid)")
    for name, choices in (("recompute", RECOMPUTE), ("attention", ATTENTION), ("shard-optimizer", OPTIMIZER_SHARDING),
                          ("mlp", MLP_KINDS)):
        if values[name] not in choices:
            raise ConfigError(f"--{name} {values[name]!r}: choose {', '.join(choices)}")
    if values["precision"] is not None and values["precision"] not in PRECISIONS:
        raise ConfigError(f"--precision {values['precision']!r}: choose {', '.join(PRECISIONS)}")
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn-hidden", "seq", "batch", "stages", "chunks-per-stage",
                 "microbatch-size", "microbatches", "ranks-per-node"):
        if values[name] is not None and values[name] < 1:
            raise ConfigError(f"--{name} must be positive, got {values[name]}")
    OverlapConfig.parse(values["overlap"])  # one line for an unknown overlap
    sizes = {"layers": values["layers"], "hidden": values["hidden"], "heads": values["heads"],
             "ffn_hidden": values["ffn-hidden"], "seq": values["seq"], "kv_heads": values["kv-heads"],
             "mlp": values["mlp"]}
    cfg = resolve_model(values["model"], batch=values["batch"], **sizes)
    base = resolve_model(values["model"])
    changed = [f"--{k.replace('_', '-')} {v}" for k, v in sizes.items() if v is not None and v != getattr(base, k)]
    if changed:  # the header must not call a 96-layer model by the 42-layer preset's name alone
        cfg = replace(cfg, name=f"{values['model']} with {' '.join(changed)}")
    profile = resolve_profile(None, values["profile"])
    window = values["dw-window"]
    if str(window).lower() == "none":
        window = None
    else:
        try:
            window = layer_count(str(window))
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"--dw-window: {exc} (or none)") from None
    limit = values["memory-limit"]
    if limit is None:
        limit = profile.device_memory_gib
    elif limit == "none":
        limit = None
    from fourd_mpi.core.backend import DTYPES
    from fourd_mpi.perf.terms import DTYPE_ALIASES, FP8, model_dtype

    dtype = model_dtype(values["dtype"] or profile.training_dtype)
    if dtype not in (*DTYPES, FP8):
        raise ConfigError(f"--dtype {dtype!r}: choose {', '.join((*DTYPES, FP8))} (or {', '.join(DTYPE_ALIASES)})")
    sc = Scenario(cfg, GridShape.parse(values["grid"]), profile.name, algorithm=values["algorithm"],
                  stages=values["stages"], schedule=values["schedule"], chunks=values["chunks-per-stage"],
                  microbatch_size=values["microbatch-size"], microbatches=values["microbatches"], vocab=values["vocab"],
                  sequence_parallel=bool(values["sequence-parallel"]), recompute=values["recompute"], dtype=dtype,
                  attention=values["attention"], precision=values["precision"],
                  shard_optimizer=values["shard-optimizer"], optimizer=values["optimizer"], overlap=values["overlap"],
                  dw_window=window, ranks_per_node=values["ranks-per-node"], memory_limit_gib=limit,
                  implementation=values["implementation"], first_stage_layers=values["first-stage-layers"],
                  last_stage_layers=values["last-stage-layers"], context_parallel=values["context-parallel"])
    return sc, profile


def cmd_predict(args) -> int:
    from fourd_mpi.perf.scenario import format_result, predict_scenario

    sc, profile = scenario_from(_options(args))
    result = predict_scenario(sc, profile)
    if args.format == "json":
        emit_json(PREDICT_JSON, result.as_dict())
    else:
        print(format_result(result, profile))
    return 0


def cmd_published(args) -> int:
    from fourd_mpi.perf import published

    names = published.DATASETS if args.dataset == "all" else (args.dataset,)
    for name in names:
        if name not in published.DATASETS:
            raise ConfigError(f"--dataset {name!r}: choose {', '.join(published.DATASETS)} or all")
    rows = published.evaluate(names)
    claims = None if args.no_claims else published.evaluate_claims()
    memory = published.evaluate_memory_claims(names)
    if args.format == "json":
        emit_json(PUBLISHED_JSON, published.as_dict(rows, claims, memory))
    else:
        print(published.report(rows, claims, memory))
    return 0
