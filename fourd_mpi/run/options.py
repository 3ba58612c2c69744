"""The options of ``fourd-mpi run``, declared once, and their resolution into :class:`RunOptions`.

:data:`RUN_OPTIONS` is the one table: name, value parser, default, choices, help.
Everything else is generated from it:

- the argparse groups of ``run``, ``verify``, ``info``, ``tune`` and ``bench``
  (:func:`fourd_mpi.cli.args.add_options`);
- ``--config FILE`` (:func:`fourd_mpi.run.configfile.config_tokens`) and the
  ``options``/``matrix``/``zip`` values of a sweep spec (:mod:`fourd_mpi.jobs.spec`),
  which check names and values with :meth:`Option.parse`;
- the resolved configuration a run prints and stores (:func:`resolved_config`).

:func:`resolve` is pure: every rank runs it before any collective, so bad input fails
everywhere with the same one-line message. This module never imports ``mpi4py.MPI``
(sweeps and ``tune`` use it on login nodes).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from fourd_mpi.algorithms.pipeline_plan import SCHEDULES as PIPELINE_SCHEDULES
from fourd_mpi.algorithms.registry import ALGORITHMS, DEFAULT_ALGORITHM
from fourd_mpi.algorithms.registry import get as get_algorithm
from fourd_mpi.algorithms.runoptions import RunOptions
from fourd_mpi.core.backend import BACKENDS, DEVICE_BUFFER_MODES, DTYPES, check_dtype_options
from fourd_mpi.core.grid import GridShape
from fourd_mpi.core.progress import PROGRESS_STRATEGIES
from fourd_mpi.errors import ConfigError
from fourd_mpi.run.display import DISPLAYS
from fourd_mpi.step.fusedattention import ATTENTION_MODES
from fourd_mpi.step.optim import OPTIMIZERS
from fourd_mpi.step.overlap import ALL as OVERLAP_ALL
from fourd_mpi.step.overlap import DEFAULT_CHUNKS, DEFAULT_PREFETCH_DEPTH, OVERLAP_NAMES, OverlapConfig
from fourd_mpi.step.presets import PRESETS, RECOMPUTE_MODES, ModelConfig, resolve_model
from fourd_mpi.trace.events import LEVELS
from fourd_mpi.util.values import (
    axis_size,
    batch_size,
    data_batch_count,
    group_size,
    head_count,
    layer_count,
    memory_limit,
    number,
    poll_flops_value,
    positive_float,
    repeat_count,
    run_seed,
    seq_length,
    step_count,
    text,
    warmup_count,
    width,
)


@dataclass(frozen=True)
class Option:
    """One option of ``fourd-mpi run``: ``--name VALUE`` (or ``--name`` when ``flag``)."""

    name: str  #: long name without the dashes, e.g. ``ffn-hidden``
    group: str  #: key of :data:`GROUPS`
    type: Callable[[str], Any] = str  #: text -> value; raises ArgumentTypeError
    default: Any = None
    choices: Optional[Tuple[str, ...]] = None
    help: str = ""
    metavar: Optional[str] = None
    flag: bool = False  #: a switch (store_true): true or false in files
    #: an old second spelling of a choice another option makes (the current spelling, e.g. ``--overlap ...,cache``):
    #: still accepted, hidden from ``--help``, one line on stderr when given on the command line
    old: Optional[str] = None

    @property
    def dest(self) -> str:
        """The attribute name (``ffn_hidden``)."""
        return self.name.replace("-", "_")

    def parse(self, value: Any) -> Any:
        """A value from a config file or sweep spec (text, number or boolean) -> the typed value.

        Raises :class:`ConfigError` naming the option, with the same words as the command line.
        """
        if self.flag:
            if not isinstance(value, bool):
                raise ConfigError(f"{self.name} must be true or false, got {value!r}")
            return value
        if isinstance(value, (list, dict)) or value is None:
            raise ConfigError(f"{self.name} must be a single value, got {value!r}")
        text = str(value).lower() if isinstance(value, bool) else str(value)
        try:
            typed = self.type(text)
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"--{self.name}: {exc}") from None
        self.check_choice(typed)
        return typed

    def check_choice(self, value: Any) -> None:
        """Raise :class:`ConfigError` if the option has choices and ``value`` is none of them (argparse's words)."""
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"--{self.name}: invalid choice: {value!r} (choose from "
                              f"{', '.join(map(repr, self.choices))})")

    def tokens(self, value: Any) -> list:
        """Command-line tokens that give this option ``value`` (already parsed)."""
        if self.flag:
            return [f"--{self.name}"] if value else []
        # "--key=value": a value that starts with "-" must not be taken for an option
        # parsed to bytes: give the unit back (bare numbers are GiB)
        if self.type is memory_limit and value is not None:
            return [f"--{self.name}={int(value)}B"]
        return [f"--{self.name}=" + (str(value).lower() if isinstance(value, bool) else str(value))]


#: argparse group titles, in the order --help shows them
GROUPS = {
    "grid": "grid (G_data x G_z x G_y x G_x; omitted sizes are inferred)",
    "model": "model",
    "numerics": "numerics",
    "overlap": "overlap and MPI progress",
    "steps": "steps",
    "trace": "trace and output",
}

_N = "N"
RUN_OPTIONS: Tuple[Option, ...] = (
    Option("algorithm", "grid", str, DEFAULT_ALGORITHM, tuple(ALGORITHMS),
           help="parallel algorithm: " + "; ".join(f"{a.name} = {a.title}" for a in ALGORITHMS.values())
           + f" (default {DEFAULT_ALGORITHM}; the named baselines fix axes to 1)"),
    Option("gx", "grid", axis_size, None, metavar=_N, help="G_x: ranks sharing a layer's input dimension "
           "(innermost, consecutive world ranks)"),
    Option("gy", "grid", axis_size, None, metavar=_N, help="G_y: ranks sharing a layer's output dimension"),
    Option("gz", "grid", axis_size, None, metavar=_N, help="G_z: ranks sharding weights (all-gathered over Z) "
           "and splitting the batch"),
    Option("gdata", "grid", axis_size, None, metavar=_N, help="G_data: data-parallel replicas (outermost)"),
    Option("ginter", "grid", axis_size, 1, metavar=_N,
           help="--algorithm pipeline: G_inter pipeline stages, each a G_data x G_z x G_y x G_x grid of world / "
                "G_inter ranks (rank order data, inter, z, y, x; default 1)"),
    Option("microbatches", "grid", repeat_count, 1, metavar=_N,
           help="--algorithm pipeline: micro-batches per batch shard (must divide its B / (G_data G_z) "
                "sequences; default 1)"),
    Option("pipeline-schedule", "grid", str, "axonn", PIPELINE_SCHEDULES,
           help="--algorithm pipeline: axonn (message-driven: stage 0 keeps G_inter micro-batches in flight, "
                "the others react to whichever message arrives first; default) or 1f1b (warm-up forwards, "
                "one forward one backward, cool-down backwards); other algorithms ignore it"),
    Option("model", "model", text, "gpt-tiny", metavar="PRESET",
           help=f"preset: {', '.join(PRESETS)} (default gpt-tiny)"),
    Option("layers", "model", layer_count, None, metavar=_N, help="transformer blocks (default: the preset's)"),
    Option("hidden", "model", width, None, metavar=_N, help="hidden size h (default: the preset's)"),
    Option("heads", "model", head_count, None, metavar=_N, help="attention heads (default: the preset's)"),
    Option("ffn-hidden", "model", width, None, metavar=_N, help="FFN width (default: the preset's, 4h)"),
    Option("seq", "model", seq_length, None, metavar=_N, help="sequence length (default: the preset's)"),
    Option("batch", "model", batch_size, None, metavar=_N, help="global batch in sequences (default: the "
           "preset's)"),
    Option("dtype", "numerics", str, "float32", tuple(DTYPES),
           help="bfloat16: cupy backend only (CuPy >= 14 with ml_dtypes; NumPy has no bfloat16)"),
    Option("tf32", "numerics", flag=True, default=False,
           help="cupy, float32: GEMMs in TF32 on tensor cores (Ampere and newer)"),
    Option("backend", "numerics", str, "auto", BACKENDS, help="auto: cupy when every rank has a usable GPU, "
           "else numpy"),
    Option("device-buffers", "numerics", str, "auto", DEVICE_BUFFER_MODES,
           help="what MPI gets: direct = device buffers (needs CUDA-aware MPI); staged = copies through "
                "pinned host buffers (both: every operation); auto (default) = per operation class (p2p, "
                "blocking, nonblocking all-gather, nonblocking reductions), direct where the library's "
                "documented rules allow it and a smoke-test all-reduce on a device buffer succeeds. numpy backend: "
                "direct = host arrays; staged = "
                "emulated staging (host copies, same code path and trace events; for testing)"),
    Option("attention", "numerics", str, "auto", ATTENTION_MODES,
           help="attention kernels: unfused = scores [b, heads, s, s], softmax, two batched GEMMs (any backend); "
                "fused = PyTorch's scaled_dot_product_attention on the GPU (cuDNN, then FlashAttention-2, then "
                "memory-efficient), no score matrix; cudnn / flash = that kernel alone; auto (default) = fused "
                "on the cupy backend where PyTorch with CUDA can run it, else unfused"),
    Option("seed", "numerics", run_seed, 0, metavar=_N, help="seed of the synthetic weights and data (default 0)"),
    Option("optimizer", "numerics", str, "adam", OPTIMIZERS, help="default adam"),
    Option("memory-limit", "numerics", memory_limit, None, metavar="SIZE",
           help="memory each rank may use, e.g. 3.5GiB, 80G or 40 (GiB) (default: measured: MemAvailable / ranks "
                "on the node, "
                "the memory cgroup's room, ulimit -v, free GPU memory / ranks on the GPU); a run whose "
                "estimate (weights, gradients, optimizer state, activations, buffers, data) exceeds it is "
                "refused before allocating; 0 or none turns the check off"),
    Option("lr", "numerics", number, None, metavar="LR", help="learning rate (default 1e-3 adam, 1e-2 sgd)"),
    Option("overlap", "overlap", text, "none", metavar="LIST",
           help=f"none, all (= {','.join(OVERLAP_ALL)}) or a comma list of {', '.join(OVERLAP_NAMES)} (default none; "
                "oup: each parameter updated as its gradient completes, the next step's first all-gather issued "
                "right after its update)"),
    Option("progress", "overlap", str, "auto", PROGRESS_STRATEGIES,
           help="who progresses nonblocking collectives during compute: auto (default: thread where collectives "
                "overlap compute, every communicating axis stays on its node, the host computes and each rank has "
                "a spare CPU; else poll; the trace stores which ran), poll, none, thread"),
    Option("cache-weights", "overlap", flag=True, default=False, old="--overlap ...,cache",
           help="old spelling of 'cache' in --overlap (keep weights gathered in forward for backward: memory for "
                "communication); accepted with a note, not in --help; a resolved config still stores it"),
    Option("recompute", "overlap", str, "none", RECOMPUTE_MODES,
           help="activation recompute (memory for compute): none (default); selective = drop the attention "
                "core (scores, probabilities, context) and recompute it in backward; full = keep only each "
                "block's input and run the block's forward again at the start of its backward"),
    Option("prefetch-depth", "overlap", repeat_count, DEFAULT_PREFETCH_DEPTH, metavar=_N,
           help=f"oag: how many layers ahead weight all-gathers are issued (default {DEFAULT_PREFETCH_DEPTH})"),
    Option("chunks", "overlap", repeat_count, DEFAULT_CHUNKS, metavar="K",
           help=f"od: token chunks of the forward all-reduce (default {DEFAULT_CHUNKS})"),
    Option("poll-flops", "overlap", poll_flops_value, "auto", metavar="F",
           help="poll: FLOPs of GEMM between two MPI progress polls, or auto (the default): chunks of at least "
                "50 ms of compute at the measured GEMM rate, longer where a poll costs over 2%% of them (chunk "
                "FLOPs = GEMM FLOP/s x max(0.05 s, poll seconds / 0.02), within 1e6..1e10)"),
    Option("check-buffers", "overlap", flag=True, default=False,
           help="debug: verify that no send buffer is modified while its collective is in flight"),
    Option("steps", "steps", step_count, 10, metavar=_N, help="training steps (default 10)"),
    Option("warmup", "steps", warmup_count, 1, metavar=_N,
           help="leading steps excluded from the summary statistics, kept in the trace (default 1)"),
    Option("data-batches", "steps", data_batch_count, 4, metavar=_N,
           help="distinct synthetic batches generated before the first step and cycled (step i uses batch "
                "i mod N; at most --steps are made; default 4)"),
    Option("trace-level", "trace", str, "op", LEVELS,
           help="step: one event per step; layer: + per-layer spans; op: + every GEMM, collective "
                "and wait (default)"),
    Option("results-dir", "trace", text, "results", metavar="DIR", help="where the trace goes (default results)"),
    Option("label", "trace", text, None, metavar="TEXT", help="part of the run id: <time>-<label>-<random>"),
    Option("run-id", "trace", text, None, metavar="ID", help="the run id itself (the trace is DIR/ID.h5)"),
    Option("force", "trace", flag=True, default=False, help="replace an existing trace of the same run id"),
    Option("trace-group-size", "trace", group_size, 0, metavar=_N,
           help="ranks per trace writer at the end of the run: each group of N consecutive ranks writes one part "
                "file and the trace binds them (0, default: the ranks of the largest node, raised to keep at most "
                "256 parts; a world of one group writes a single file)"),
    Option("display", "trace", str, "auto", DISPLAYS,
           help="rank 0's per-step output: a progress bar, lines, or nothing (auto: bar on a terminal)"),
    Option("peak-tflops", "trace", positive_float, None, metavar="T",
           help="data-sheet peak TFLOP/s per rank for MFU and HFU (default: the GPU's entry in the peak table "
                "fourd_mpi/perf/peaks.py; on a CPU none, so no MFU); %% of measured GEMM is always reported"),
    Option("nvtx", "trace", flag=True, default=False,
           help="NVTX ranges of every step, phase, layer and op for Nsight Systems (nsys profile --trace=nvtx); "
                "needs NVIDIA's nvtx package (pip install nvtx; without it one line says so and the run goes on)"),
    Option("step-timeout", "trace", number, 600.0, metavar="SECONDS",
           help="watchdog: a rank that waits longer than this in one collective prints where it waits, marks "
                "the run hung and aborts the job (MPI_Abort) so the allocation is freed; 0 disables (default "
                "600: far above any step of the presets on a working machine)"),
    Option("inject-fault", "trace", text, None, metavar="RANK:STEP[:MODE]",
           help="testing: at the start of STEP (= --steps: before the final merge), once every rank has "
                "finished the steps before, RANK dies (MODE kill = SIGKILL, default; raise = exception), "
                "deletes the spool directory (remove-spool), fills the results file system, if smaller "
                "than 1 GiB (fill-disk), creates RESULTS/inject-fault.touch (touch: the signal of a "
                "fault-injecting test file system), sends itself SIGTERM (sigterm) or SIGSTOP (stop: live until "
                "SIGCONT); sigterm-merge and kill-merge (STEP = --steps) send SIGTERM or SIGKILL during the final "
                "merge, once the trace's temporary files exist; sigterm-published and kill-published (RANK 0, STEP = "
                "--steps) right after the trace is published and indexed, before the per-rank files are removed"),
)

#: by long name
OPTIONS: Dict[str, Option] = {o.name: o for o in RUN_OPTIONS}
MODEL_SIZES = ("layers", "hidden", "heads", "ffn_hidden", "seq", "batch")


def options_in(*groups: str) -> Tuple[Option, ...]:
    """The options of these groups, in table order."""
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise KeyError(f"unknown option group(s) {sorted(unknown)}")
    return tuple(o for o in RUN_OPTIONS if o.group in groups)


def lookup(name: str, where: str) -> Option:
    """The option called ``name`` (``-`` or ``_``); a :class:`ConfigError` listing the known ones otherwise."""
    key = str(name).replace("_", "-")
    if key not in OPTIONS:
        raise ConfigError(f"{where}: unknown option {name!r} (known: {', '.join(sorted(OPTIONS))})")
    return OPTIONS[key]


def defaults() -> Dict[str, Any]:
    """``{dest: default}`` of every option: the only place defaults come from."""
    return {o.dest: o.default for o in RUN_OPTIONS}


#: RunOptions fields that come straight from an option of the same name (``overlap`` is made of four options)
_RUN_FIELDS = tuple(f.name for f in fields(RunOptions) if f.name not in ("model", "grid", "overlap"))
#: the options :class:`~fourd_mpi.step.overlap.OverlapConfig` is parsed from (``RunOptions.overlap``)
_OVERLAP_PARTS = ("overlap", "cache_weights", "prefetch_depth", "chunks")


def overlap_of(values: Mapping[str, Any]) -> OverlapConfig:
    """``--overlap``, ``--cache-weights``, ``--prefetch-depth`` and ``--chunks`` (keyed by dest, the table's
    defaults for those missing) as one :class:`OverlapConfig` (raises :class:`ConfigError`). The one parse of
    the overlap text; an :class:`OverlapConfig` is taken as it is."""
    v = {**defaults(), **values}
    if isinstance(v["overlap"], OverlapConfig):
        return v["overlap"]
    text = str(v["overlap"]) + (",cache" if v["cache_weights"] else "")
    return OverlapConfig.parse(text, prefetch_depth=v["prefetch_depth"], chunks=v["chunks"])


def run_options(model: ModelConfig, grid: GridShape, **values) -> RunOptions:
    """:class:`RunOptions` of ``values`` (keyed by dest; the table's defaults for those missing; the overlap as
    text or :class:`OverlapConfig`) without any check: for benchmarks and tests that build a run directly.
    A command line goes through :func:`resolve`."""
    v = {**defaults(), **values}
    return RunOptions(model=model, grid=grid, overlap=overlap_of(v), **{k: v[k] for k in _RUN_FIELDS})


def resolve(world_size: int, preset: str, grid_sizes: Dict[str, Optional[int]],
            model_overrides: Dict[str, Optional[int]], _cross_checks: bool = True, **options) -> RunOptions:
    """Pure validation of user options into :class:`RunOptions` (raises :class:`ConfigError`). ``options``:
    values keyed by dest, the table's defaults for those missing; the overlap text and its three companions
    (:func:`overlap_of`) are parsed here, once, into ``RunOptions.overlap``.

    ``_cross_checks=False`` leaves out the checks between options (warm-up against steps), for
    validating one option at a time against the defaults (sweep specs)."""
    unknown = set(options) - set(_RUN_FIELDS) - set(_OVERLAP_PARTS)
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(sorted(unknown))}")
    options = {**{k: v for k, v in defaults().items() if k in _RUN_FIELDS or k in _OVERLAP_PARTS}, **options}
    for option in RUN_OPTIONS:  # values from Python (tests, benchmarks) have not met argparse
        if option.dest in options:
            option.check_choice(options[option.dest])
    algorithm = get_algorithm(options["algorithm"])
    # one option at a time (sweep specs): --ginter 2 is checked with the algorithm of each run, not the default's
    tensor_world = algorithm.tensor_world(world_size, options) if _cross_checks else world_size
    try:
        shape = algorithm.shape(tensor_world, grid_sizes)
    except ConfigError as exc:
        if tensor_world == world_size:
            raise
        stages = world_size // tensor_world
        text = str(exc).split("; or run under mpiexec")[0]  # a launch hint for one grid, not for the stages
        raise ConfigError(f"{text} (the 4D grid of each of the {stages} pipeline stages: world size {world_size} / "
                          f"--ginter {stages} = {tensor_world} ranks)") from None
    model = resolve_model(preset, **model_overrides)
    algorithm.validate_model(model, shape)
    check_dtype_options(options["dtype"], options["backend"], options["tf32"])
    attention = options["attention"]
    if attention not in ("auto", "unfused") and options["backend"] == "numpy":
        raise ConfigError(f"--attention {attention} runs on a GPU only: use --backend cupy (or auto), or "
                          "--attention unfused")
    if options["steps"] < 1:
        raise ConfigError(f"--steps must be positive, got {options['steps']}")
    if options["warmup"] < 0:
        raise ConfigError(f"--warmup must be zero or positive, got {options['warmup']}")
    if _cross_checks and options["warmup"] >= options["steps"]:
        raise ConfigError(f"--warmup {options['warmup']} leaves no measured step of --steps "
                          f"{options['steps']}: give --warmup smaller than --steps (--warmup 0 measures all)")
    lr = options["lr"]
    if lr is not None and not (math.isfinite(lr) and lr > 0):
        raise ConfigError(f"--lr must be a positive finite number, got {lr}")
    overlap = overlap_of({k: options[k] for k in _OVERLAP_PARTS})  # the overlap list, depth and chunks
    depth, layers = overlap.prefetch_depth, model.layers * (4 if model.kind == "gpt" else 2)
    if _cross_checks and depth > layers - 1:
        raise ConfigError(f"--prefetch-depth {depth} reaches beyond the model: {model.name} has {layers} weight "
                          f"layers ({model.layers} blocks x {layers // model.layers}), so at most {layers - 1} "
                          f"can be fetched ahead of the current one: give --prefetch-depth {layers - 1} or less")
    poll = options["poll_flops"]
    if poll != "auto" and not (isinstance(poll, (int, float)) and poll > 0):
        raise ConfigError(f"--poll-flops must be 'auto' or positive, got {poll}")
    run_options = RunOptions(model=model, grid=shape, overlap=overlap, **{k: options[k] for k in _RUN_FIELDS})
    algorithm.check(run_options)
    return run_options


def resolve_values(values: Mapping[str, Any], world_size: int, cross_checks: bool = True) -> RunOptions:
    """:func:`resolve` from option values keyed by ``dest`` (an argparse namespace's ``vars``, or a
    sweep run's options); missing ones take the table's defaults. The command line and the sweep
    spec both resolve through here, so a spec is checked exactly as ``fourd-mpi run`` will run it."""
    v = {**defaults(), **{k: val for k, val in values.items() if k in defaults()}}
    return resolve(world_size, v["model"], {"data": v["gdata"], "z": v["gz"], "y": v["gy"], "x": v["gx"]},
                   {k: v[k] for k in MODEL_SIZES}, cross_checks, **{k: v[k] for k in _RUN_FIELDS + _OVERLAP_PARTS})


def resolved_config(preset: str, options: RunOptions, extra: Mapping[str, Any] = ()) -> Dict[str, Any]:
    """The run's configuration after inference, keyed by option names: a valid ``--config`` file
    that gives the same run. ``extra``: values of options that :class:`RunOptions` does not hold
    (trace and display options), keyed by dest."""
    cfg, grid = options.model, options.grid
    config: Dict[str, Any] = {"model": preset, **{k.replace("_", "-"): getattr(cfg, k) for k in MODEL_SIZES},
                              "gdata": grid.data, "gz": grid.z, "gy": grid.y, "gx": grid.x}
    stored = options.as_dict()  # the overlap as its four options
    for o in RUN_OPTIONS:
        if o.dest in _RUN_FIELDS or o.dest in _OVERLAP_PARTS:
            config[o.name] = stored[o.dest]
    for key, value in dict(extra).items():
        config[lookup(key, "resolved config").name] = value
    return config


def plan_tokens(values: Sequence[Tuple[str, Any]]) -> list:
    """Command-line tokens for ``(name, value)`` pairs of parsed option values, in order."""
    out: list = []
    for name, value in values:
        out += lookup(name, "run options").tokens(value)
    return out
