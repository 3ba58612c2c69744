"""``fourd-mpi model predict`` and ``fourd-mpi model published``: a forced configuration through the
model, and the model against the shipped published results (one process, no MPI).

Every option of ``predict`` may also come from ``--config FILE.yaml`` (keys = option names without the
leading dashes, ``-`` or ``_``); the command line wins over the file, the file over the defaults.
"""

from __future__ import annotations

import argparse
import logging

from fourd_mpi.cli.args import add_deprecated
from fourd_mpi.cli.jsonout import JsonDoc, add_json_format, emit_json
from fourd_mpi.errors import ConfigError
from fourd_mpi.util.values import axis_size, batch_size, head_count, int_in, layer_count, text, vocab_size

log = logging.getLogger(__name__)

_chunks = int_in(1, 1 << 16, "model chunks per stage")


def _run(name: str):
    """The parser of run's option ``name`` (fourd_mpi/run/options.py): the same words, bounds and units."""
    from fourd_mpi.run.options import OPTIONS

    kind = OPTIONS[name].type
    return text if kind is str else kind


#: option -> (type, default, help); every one a ``--name`` of ``model predict`` and a key of ``--config``.
#: Where run has the option (fourd_mpi/run/options.py RUN_OPTIONS) the name, parser and meaning are run's;
#: the defaults are a Megatron-like run's (recompute full, fused attention, every overlap); the rest are
#: :data:`fourd_mpi.perf.scenario.SCENARIO_ONLY`
PREDICT_OPTIONS = {
    "model": (_run("model"), "gpt-80b", "model preset (fourd-mpi run --model); sizes below override it"),
    "layers": (_run("layers"), None, "blocks l"),
    "hidden": (_run("hidden"), None, "hidden size h (ffn = 4h unless --ffn-hidden)"),
    "heads": (_run("heads"), None, "attention heads"), "ffn-hidden": (_run("ffn-hidden"), None, "MLP width"),
    "kv-heads": (head_count, None, "key/value heads of grouped-query attention (Ainslie et al. 2023; default: "
                                   "--heads, multi-head attention); the model only"),
    "mlp": (str, "gelu", "gelu (two h x f GEMMs) or swiglu (three: Shazeer 2020, Llama 2); the model only"),
    "seq": (_run("seq"), None, "sequence length s"),
    "batch": (_run("batch"), None, "global batch B in sequences (required)"),
    "vocab": (vocab_size, 51200, "vocabulary V (embedding and LM head; 0 leaves them out; default 51200)"),
    "algorithm": (str, "axonn4d", "axonn4d, megatron1d, fsdp, dp or pipeline (4D family)"),
    "grid": (str, None, "G_data x G_z x G_y x G_x of one pipeline stage, e.g. 16x1x8x1 (required)"),
    "ginter": (_run("ginter"), 1, "pipeline stages p, as run's --ginter (default 1)"),
    "first-stage-layers": (layer_count, None, "blocks of the first stage (Megatron-LM's --decoder-first-pipeline-"
                                              "num-layers; the other stages split the rest evenly)"),
    "last-stage-layers": (layer_count, None, "blocks of the last stage (Megatron-LM's --decoder-last-pipeline-num-"
                                             "layers); without either, p not dividing L: the first L mod p stages "
                                             "hold one block more"),
    "pipeline-schedule": (str, "1f1b", "1f1b, interleaved (with --chunks-per-stage v) or axonn, as run's "
                                       "--pipeline-schedule (default 1f1b)"),
    "chunks-per-stage": (_chunks, 1, "model chunks v per stage of the interleaved schedule"),
    "context-parallel": (axis_size, 1, "ranks sharing each sequence (Megatron-LM's context parallelism: s/cp tokens "
                                       "per rank, K/V around a ring; needs --attention fused; default 1)"),
    "context-parallel-comm": (str, "ring", "how context-parallel ranks share K and V: ring (Megatron-LM, hidden "
                                           "behind attention) or allgather (Llama 3: all-gathered before attention, "
                                           "exposed); default ring"),
    "microbatch-size": (batch_size, None, "sequences b per micro-batch and data x Z shard"),
    "microbatches": (_run("microbatches"), None, "micro-batches m per step (B = b m G_data G_z; gradient "
                                                 "accumulation)"),
    "sequence-parallel": (bool, False, "sequence parallelism over Y (Megatron-like grids)"),
    "recompute": (_run("recompute"), "full", "none, selective or full activation recompute"),
    "dtype": (_run("dtype"), None, "float16, bfloat16, float32, or float8 (alias fp8: Transformer Engine's FP8 "
                                   "GEMMs, BF16 storage; Hopper profiles) (default: the profile's training dtype)"),
    "attention": (str, "fused", "fused (flash) or unfused"),
    "precision": (str, None, "mixed or pure (default mixed for 16-bit dtypes)"),
    "shard-optimizer": (str, "none", "none or data (distributed optimizer / ZeRO-1: optimizer state split over "
                                     "G_data; the gradient all-reduce becomes a reduce-scatter and, after the "
                                     "update, a blocking parameter all-gather)"),
    "optimizer": (_run("optimizer"), "adam", "adam or sgd"),
    "overlap": (_run("overlap"), "all", "none, all or a list of oag,ors,oar,dp,od (run's oup is "
                                                      "taken and not modelled)"),
    "progress": (_run("progress"), "poll", "who progresses nonblocking collectives during compute: poll (default), "
                                           "none, thread or auto, as run's --progress (priced alike but none)"),
    "dw-window": (str, "2", "dW blocks whose reduce-scatter may be in flight at once with ORS, or 'none' "
                            "(unbounded; default 2)"),
    "profile": (str, "perlmutter", "machine profile: a built-in (dgx-a100, dgx-a100-40gb, dgx-h100, h100-roce, "
                                   "alps-gh200, perlmutter, frontier, laptop) or a file"),
    "ranks-per-node": (axis_size, None, "ranks per node (default: the profile's)"),
    "memory-limit": (_run("memory-limit"), None, "memory per GPU for the fits line, run's grammar (80GiB, 80G or "
                                                 "40 GiB; default: the profile's device memory; none)"),
    "implementation": (str, "fourd", "fourd (this suite's step), deepspeed-2021 (fsdp on 1xNx1x1 only: DeepSpeed "
                                     "ZeRO-3 v0.3.13-v0.5.4's third gathers, per-rank copy loops and "
                                     "per-parameter gradient reduce-scatters) or megatron-lm "
                                     "(megatron1d or dp: Megatron-LM 2020-2021's DDP=local, one coalesced gradient "
                                     "all-reduce per step) or pytorch-fsdp (fsdp: PyTorch FSDP's gradient "
                                     "accumulation, a reduce-scatter per micro-batch into sharded sums)"),
}
#: today's spellings of run's words: hidden aliases (:func:`~fourd_mpi.cli.args.add_deprecated`) that print a
#: one-line note naming run's spelling
ALIASES = {"stages": "ginter", "schedule": "pipeline-schedule"}


def register(msub) -> None:
    """Add ``predict`` and ``published`` to ``fourd-mpi model``'s subcommands."""
    p = msub.add_parser("predict", help="one configuration with every choice forced: step time split into compute, "
                                        "exposed communication per axis and bubble, memory per GPU by part, %% of "
                                        "peak under each FLOP convention (offline)")
    # dest differs from "config": the main parser expands a command's ``config`` as run options
    p.add_argument("--config", dest="predict_config", type=text, default=None, metavar="FILE",
                   help="YAML mapping of these options (the command line wins)")
    for name, (kind, _, what) in PREDICT_OPTIONS.items():
        if kind is bool:
            p.add_argument(f"--{name}", action="store_const", const=True, default=None, help=what)
        else:
            p.add_argument(f"--{name}", type=kind, default=None, help=what)
    for old, new in ALIASES.items():
        add_deprecated(p, f"--{old}", f"--{new}", dest=new.replace("-", "_"), type=PREDICT_OPTIONS[new][0])
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
              "assumed, source, scheme, prediction, command (the model predict command line of the point)",
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
            if name in ALIASES:  # today's spelling of run's word, as the command line's --stages
                log.info("note: %s: is deprecated, use %s:", key, ALIASES[name].replace("-", "_"))
                name = ALIASES[name]
            if name not in PREDICT_OPTIONS:
                raise ConfigError(f"--config {source}: unknown option {key!r} (known: {', '.join(PREDICT_OPTIONS)})")
            if values[name] is None:
                kind = PREDICT_OPTIONS[name][0]
                if kind is bool or value is None:
                    values[name] = value
                    continue
                if isinstance(value, (list, dict)) or (isinstance(value, bool) and kind not in (str, text)):
                    raise ConfigError(f"--config {source}: {key} must be a single value, got {value!r}")
                try:  # the command line's parser: the same bounds and words ('' refused as there)
                    values[name] = (text if kind is str else kind)(str(value))
                except argparse.ArgumentTypeError as exc:
                    raise ConfigError(f"--config {source}: {key}: {exc}") from None
    for name, (_, default, _) in PREDICT_OPTIONS.items():
        if values[name] is None:
            values[name] = default
    return values


def scenario_from(values: dict):
    """``(Scenario, MachineProfile)`` of the resolved options (:meth:`~fourd_mpi.perf.scenario.Scenario.from_options`);
    one-line :class:`ConfigError` otherwise."""
    from fourd_mpi.jobs.sites import resolve_profile
    from fourd_mpi.perf.scenario import Scenario

    if values["grid"] is None:
        raise ConfigError("model predict needs --grid G_DATAxG_ZxG_YxG_X (one pipeline stage's 4D grid)")
    profile = resolve_profile(None, values["profile"])
    return Scenario.from_options(values, profile), profile


def cmd_predict(args) -> int:
    from fourd_mpi.perf.prediction import format_result, predict_scenario

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
