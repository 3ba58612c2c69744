"""Sweep specs: a weak- or strong-scaling study in YAML, expanded into concrete runs.

.. code-block:: yaml

    name: weak-gpt-tiny          # names directories, jobs and run ids: letters, digits, . _ -
    study: weak                  # weak | strong
    ranks: [1, 2, 4, 8]
    grids: all                   # all | auto | auto:K | ["1x2x2x2", ...] | {8: [...], 4: all}
    model: {preset: gpt-tiny, batch: 8}   # weak: the sizes at the smallest rank count
    weak: {grow: batch}          # batch | hidden | layers (weak studies only)
    options: {steps: 10, warmup: 1}       # fixed `fourd-mpi run` options
    matrix: {overlap: [none, all]}        # cross product (ReFrame parameters, Ramble matrix)
    zip: {prefetch_depth: [1, 2], chunks: [2, 4]}   # zipped lists of equal length (Ramble zip)
    repeats: 1
    job: {time: "00:10:00", ranks_per_node: 4, account: m1234}   # also pack: N, pack_mode: sequential

Expansion order is ranks, then grid, then the matrix (first key outermost) crossed
with the zipped lists, then repeats. ``algorithm`` may be an option, a matrix or a zip key
(``matrix: {algorithm: [axonn4d, megatron1d, fsdp]}``): each algorithm runs the grids of the
spec that it allows (``all``: every factorization with its fixed axes; ``auto``: its predicted
best; a list: the listed grids it allows), and run ids end in the algorithm's name. Everything is
checked before anything is written: option names and values against ``fourd-mpi run``'s option table
(:data:`fourd_mpi.run.options.RUN_OPTIONS`) and its resolution, grids against the rank
count and the model's divisibility rules.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from fourd_mpi.algorithms.registry import DEFAULT_ALGORITHM, model_problems_of
from fourd_mpi.algorithms.registry import get as get_algorithm
from fourd_mpi.algorithms.runoptions import GridCheckOptions
from fourd_mpi.core.grid import GridShape, grid_factorizations
from fourd_mpi.errors import ConfigError
from fourd_mpi.jobs.pack import PACK_MODES
from fourd_mpi.run.options import lookup, plan_tokens, resolve_values
from fourd_mpi.step.presets import PRESETS, ModelConfig, resolve_model
from fourd_mpi.util.yamlspec import YamlDocument, load_yaml, schema_violations

#: Names that reach file names, job names and scripts: nothing a shell would interpret.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
#: Scheduler values (account, partition, queue, ...) go into directives unquoted.
SAFE_VALUE_PATTERN = r"^[A-Za-z0-9_.:+@/=,-]{1,128}$"
GRID_PATTERN = r"^[1-9][0-9]*x[1-9][0-9]*x[1-9][0-9]*x[1-9][0-9]*$"
# Slurm's --time forms (fourd_mpi.jobs.schedulers.parse_time): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
TIME_PATTERN = r"^([0-9]+(:[0-9]+){0,2}|[0-9]+-[0-9]+(:[0-9]+){0,2})$"
MODEL_FIELDS = ("layers", "hidden", "heads", "ffn_hidden", "seq", "batch")
GROW_RULES = ("batch", "hidden", "layers")

#: ``fourd-mpi run`` options that the sweep itself sets for every run.
SWEEP_OWNED = {
    "gx": "grids", "gy": "grids", "gz": "grids", "gdata": "grids",
    "model": "model.preset", "layers": "model", "hidden": "model", "heads": "model",
    "ffn-hidden": "model", "seq": "model", "batch": "model",
    "results-dir": "results_dir", "run-id": "(the sweep names runs)", "label": "(the sweep names runs)",
    "force": "(never: results are not overwritten)", "config": "options", "display": "(lines in job logs)",
    "inject-fault": "(testing only)",
}

_scalar = {"type": ["string", "number", "boolean"]}
_grid_choice = {
    "description": "grids are all, auto, auto:K or a list of G_data x G_z x G_y x G_x strings like 1x2x2x2",
    "oneOf": [
        {"type": "string", "pattern": r"^(all|auto(:[1-9][0-9]*)?)$"},
        {"type": "array", "minItems": 1, "items": {"type": "string", "pattern": GRID_PATTERN,
                                                    "description": "a grid is DxZxYxX, e.g. 1x2x2x2"}},
    ],
}
_safe = {"type": "string", "pattern": SAFE_VALUE_PATTERN,
         "description": "use letters, digits and _.:+@/=,- only (the value goes into scheduler directives)"}
_positive = {"type": "integer", "minimum": 1}
_model = {"type": "object", "additionalProperties": False, "required": ["preset"],
          "properties": {"preset": {"enum": sorted(PRESETS)}, **{f: _positive for f in MODEL_FIELDS}}}

SCHEMA: Dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "study", "ranks", "grids", "model"],
    "properties": {
        "name": {"type": "string", "pattern": NAME_PATTERN,
                 "description": "a sweep name uses letters, digits and . _ - (at most 64, not starting with . _ -)"},
        "description": {"type": "string"},
        "study": {"enum": ["weak", "strong"]},
        "ranks": {"type": "array", "minItems": 1, "uniqueItems": True, "items": _positive},
        "grids": {"oneOf": [_grid_choice, {"type": "object", "minProperties": 1,
                                           "propertyNames": {"pattern": "^[1-9][0-9]*$"},
                                           "additionalProperties": _grid_choice}],
                  "description": "grids are all, auto, auto:K, a list of DxZxYxX strings, "
                                 "or a mapping of rank count to one of those"},
        "model": {"oneOf": [_model, {"type": "array", "minItems": 1, "items": _model}],
                  "description": "model is a mapping {preset: NAME, ...sizes} or a list of them"},
        "weak": {"type": "object", "additionalProperties": False,
                 "properties": {"grow": {"enum": list(GROW_RULES)}, "multiple_of": _positive}},
        "options": {"type": "object", "additionalProperties": _scalar},
        "matrix": {"type": "object", "additionalProperties": {"type": "array", "minItems": 1, "items": _scalar}},
        "zip": {"type": "object", "additionalProperties": {"type": "array", "minItems": 1, "items": _scalar}},
        "repeats": _positive,
        "results_dir": {"type": "string", "pattern": r"^[A-Za-z0-9_./-]{1,200}$",
                        "description": "a results directory uses letters, digits and _ . / - only"},
        "job": {
            "type": "object", "additionalProperties": False,
            "properties": {
                "time": {"type": ["string", "integer"], "pattern": TIME_PATTERN, "minimum": 1,
                         "description": "a time limit is minutes, M:S, H:M:S, D-H, D-H:M or D-H:M:S (Slurm's forms)"},
                "ranks_per_node": _positive,
                "account": _safe, "partition": _safe, "qos": _safe, "queue": _safe,
                "constraint": _safe, "reservation": _safe,
                "python": {"type": "string", "minLength": 1},
                "pack": {**_positive, "description": "pack is the number of runs per job (1: one job per run)"},
                "pack_mode": {"enum": list(PACK_MODES)},
                "setup": {"type": "array", "items": {"type": "string"}},
            },
        },
    },
}


@dataclass(frozen=True)
class RunPlan:
    """One run of a sweep: a rank count, a grid, a model and the remaining ``run`` options."""

    index: int
    run_id: str
    ranks: int
    grid: GridShape
    model: ModelConfig
    options: Tuple[Tuple[str, Any], ...]  # (long option name, value), matrix and zip values included
    repeat: int = 0

    def option(self, name: str, default=None):
        return dict(self.options).get(name, default)

    def values(self) -> Dict[str, Any]:
        """The run's option values keyed by dest (grid, model sizes and options), as
        :func:`fourd_mpi.run.options.resolve_values` takes them."""
        values: Dict[str, Any] = {"gdata": self.grid.data, "gz": self.grid.z, "gy": self.grid.y,
                                  "gx": self.grid.x, "model": self.model.name}
        values.update({name: getattr(self.model, name) for name in MODEL_FIELDS})
        for name, value in self.options:
            option = lookup(name, "sweep")
            values[option.dest] = option.parse(value)
        return values

    def run_argv(self, results_dir: str) -> List[str]:
        """``fourd-mpi`` arguments of this run (``run`` first); every value is a separate token."""
        argv = ["run", "--gdata", str(self.grid.data), "--gz", str(self.grid.z), "--gy", str(self.grid.y),
                "--gx", str(self.grid.x), "--model", self.model.name]
        base = PRESETS[self.model.name]
        for name in MODEL_FIELDS:
            value = getattr(self.model, name)
            if value != getattr(base, name):
                argv += [f"--{name.replace('_', '-')}", str(value)]
        argv += plan_tokens((name, lookup(name, "sweep").parse(value)) for name, value in self.options)
        return argv + ["--results-dir", results_dir, "--run-id", self.run_id, "--display", "lines"]

    def describe(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in self.options)
        return f"{self.ranks} ranks, grid {self.grid}, {self.model.name} batch {self.model.batch} {extra}".strip()


@dataclass
class SweepSpec:
    """A validated spec; :meth:`expand` gives its runs."""

    name: str
    study: str
    ranks: List[int]
    grids: Any
    models: List[Dict[str, Any]]  # ``model:`` of the file, one mapping or a list of them
    weak: Dict[str, Any] = field(default_factory=dict)
    options: Dict[str, Any] = field(default_factory=dict)
    matrix: Dict[str, List[Any]] = field(default_factory=dict)
    zipped: Dict[str, List[Any]] = field(default_factory=dict)
    repeats: int = 1
    results_dir: Optional[str] = None
    job: Dict[str, Any] = field(default_factory=dict)
    description: str = ""
    many_models: bool = False
    source: str = "<spec>"
    doc: Optional[YamlDocument] = None

    def revalidate_job(self) -> None:
        """Check ``job:`` again after command-line overrides (same rules as in the file)."""
        violations = schema_violations(self.job, SCHEMA["properties"]["job"])
        if violations:
            parts, message = violations[0]
            raise ConfigError(f"--{parts[0] if parts else 'job'}: {message}")

    def error(self, parts: Sequence, message: str) -> ConfigError:
        if self.doc is not None:
            return self.doc.error(parts, message)
        return ConfigError(f"{self.source}: {'.'.join(map(str, parts))}: {message}")

    # -- model sizes per rank count ---------------------------------------------------
    def model_for(self, ranks: int, which: int = 0) -> ModelConfig:
        """Model ``which`` at ``ranks``: fixed (strong), or grown from the smallest rank count (weak)."""
        sizes = {k: v for k, v in self.models[which].items() if k != "preset"}
        preset = self.models[which]["preset"]
        where = ["model", which] if self.many_models else ["model"]
        base = resolve_model(preset, **sizes)
        if self.study == "strong" or ranks == min(self.ranks):
            return base
        n0 = min(self.ranks)
        rule = self.weak.get("grow", "batch")
        if rule in ("batch", "layers"):
            if ranks % n0:
                raise self.error(["ranks"], f"weak scaling grows the {rule} in proportion to the ranks: "
                                            f"{ranks} is not a multiple of the smallest rank count {n0}")
            if rule == "batch" and base.batch is None:
                raise self.error(where, f"preset {preset} has no default batch: give model.batch")
            grown = (base.batch if rule == "batch" else base.layers) * ranks // n0
            return resolve_model(preset, **{**sizes, rule: grown})
        # hidden: parameters grow as hidden^2, so hidden grows as sqrt(ranks) (rounded)
        multiple = self.weak.get("multiple_of", base.heads)
        hidden = max(multiple, int(round(base.hidden * math.sqrt(ranks / n0) / multiple)) * multiple)
        return resolve_model(preset, **{**sizes, "hidden": hidden})

    # -- grids ------------------------------------------------------------------------
    def _grid_choice(self, ranks: int):
        if isinstance(self.grids, dict):
            if str(ranks) not in self.grids:
                raise self.error(["grids"], f"no grids for {ranks} ranks (the mapping has "
                                            f"{', '.join(sorted(self.grids, key=int))})")
            return self.grids[str(ranks)], ["grids", str(ranks)]
        return self.grids, ["grids"]

    def grids_for(self, ranks: int, model: ModelConfig, options: Dict[str, Any]) -> List[GridShape]:
        """The grids of ``ranks`` ranks this run's algorithm allows; for a pipeline the 4D grid of one stage
        (``ranks / ginter`` ranks: the job still launches ``ranks`` processes)."""
        choice, where = self._grid_choice(ranks)
        algorithm = get_algorithm(str(options.get("algorithm", DEFAULT_ALGORITHM)))
        try:
            ranks = algorithm.tensor_world(ranks, {k.replace("-", "_"): v for k, v in options.items()})
        except ConfigError as exc:
            raise self.error(where, str(exc)) from None
        base = GridCheckOptions(model=model, grid=GridShape(ranks, 1, 1, 1), algorithm=algorithm.name)

        def allowed(g: GridShape) -> bool:  # a grid of this algorithm (fixed axes, its own checks)
            return algorithm.grid_problem(base, g) is None

        def model_problems(cfg, g):
            return model_problems_of(algorithm, cfg, g)

        named = "" if algorithm.name == DEFAULT_ALGORITHM else f" with algorithm {algorithm.name}"
        if choice == "all":
            candidates = [g for g in grid_factorizations(ranks) if allowed(g)]
            valid = [g for g in candidates if not model_problems(model, g)]
            if not valid:
                first = candidates[0] if candidates else GridShape(ranks, 1, 1, 1)
                example = model_problems(model, first) or [algorithm.grid_problem(base, first) or "invalid"]
                raise self.error(where, f"no grid of {ranks} ranks fits model {model.name}{named} "
                                        f"(e.g. {first}: {'; '.join(example)})")
            return valid
        if isinstance(choice, str) and choice.startswith("auto"):
            k = int(choice.split(":")[1]) if ":" in choice else 1
            return self._auto_grids(ranks, model, options, k, where)
        grids = [GridShape.parse(text) for text in choice]
        matching = [g for g in grids if g.size == ranks]
        if not matching:
            raise self.error(where, f"none of the grids {', '.join(map(str, grids))} has {ranks} ranks "
                                    f"(G_data*G_z*G_y*G_x must equal the rank count)")
        mine = [g for g in matching if allowed(g)]
        if not mine:
            raise self.error(where, f"none of the grids {', '.join(map(str, matching))} of {ranks} ranks is a grid "
                                    f"of algorithm {algorithm.name}: {algorithm.grid_problem(base, matching[0])}")
        matching = mine
        for grid in matching:
            problems = model_problems(model, grid)
            if problems:
                raise self.error(where, f"grid {grid} does not fit model {model.name} at {ranks} ranks: "
                                        + "; ".join(problems))
        return matching

    def _auto_grids(self, ranks, model, options, k, where) -> List[GridShape]:
        try:
            from fourd_mpi.perf.tune import top_grids
        except ImportError:
            raise self.error(where, "grids: auto needs the performance model (fourd_mpi.perf.tune), "
                                    "which this installation lacks") from None
        try:
            return top_grids(model, ranks, k, overlap=str(options.get("overlap", "none")),
                             dtype=str(options.get("dtype", "float32")),
                             algorithm=str(options.get("algorithm", DEFAULT_ALGORITHM)))
        except ConfigError as exc:
            raise self.error(where, str(exc)) from None

    # -- parameters ---------------------------------------------------------------------
    def parameter_sets(self) -> List[Dict[str, Any]]:
        """The matrix's cross product, each combined with every position of the zipped lists."""
        keys = list(self.matrix)
        matrix = [dict(zip(keys, values)) for values in itertools.product(*(self.matrix[k] for k in keys))]
        length = len(next(iter(self.zipped.values()))) if self.zipped else 1
        zipped = [{k: v[i] for k, v in self.zipped.items()} for i in range(length)]
        return [{**self.options, **m, **z} for m in matrix for z in zipped]

    def expand(self) -> List[RunPlan]:
        """Every run of the sweep, in order; raises on the first problem, before anything is written."""
        runs: List[RunPlan] = []
        for ranks in self.ranks:
            for which in range(len(self.models)):
                model = self.model_for(ranks, which)
                for grid, params in self._grid_parameter_pairs(ranks, model):
                    for repeat in range(self.repeats):
                        index = len(runs)
                        run_id = f"{self.name}-{index:03d}-n{ranks}-{grid}" + (
                            f"-{params.get('algorithm', DEFAULT_ALGORITHM)}" if self.names_algorithm else "") + (
                            f"-r{repeat}" if self.repeats > 1 else "")
                        runs.append(RunPlan(index, run_id, ranks, grid, model, tuple(params.items()), repeat))
        return runs

    def _grid_parameter_pairs(self, ranks: int, model: ModelConfig):
        """(grid, parameters), grid-major; ``auto`` grids may differ between parameter sets."""
        by_grid: Dict[GridShape, List[Dict[str, Any]]] = {}
        for params in self.parameter_sets():
            for grid in self.grids_for(ranks, model, params):
                by_grid.setdefault(grid, []).append(params)
        return [(grid, params) for grid, params_list in by_grid.items() for params in params_list]

    @property
    def names_algorithm(self) -> bool:
        """Whether the spec sets ``algorithm`` (an option, a matrix or a zip key): run ids then name it."""
        return any("algorithm" in section for section in (self.options, self.matrix, self.zipped))

    def as_dict(self) -> Dict[str, Any]:
        """The spec as YAML-ready data (round-trips through :func:`load_spec`)."""
        out: Dict[str, Any] = {"name": self.name, "study": self.study, "ranks": list(self.ranks),
                               "grids": self.grids,
                               "model": [dict(m) for m in self.models] if self.many_models else dict(self.models[0])}
        for key, value in (("description", self.description), ("weak", self.weak), ("options", self.options),
                           ("matrix", self.matrix), ("zip", self.zipped), ("job", self.job),
                           ("results_dir", self.results_dir)):
            if value:
                out[key] = value
        if self.repeats != 1:
            out["repeats"] = self.repeats
        return out


def _check_option(spec: SweepSpec, parts: Sequence, key: str, value) -> Tuple[str, Any]:
    """The long option name of ``key``, after checking ``key: value`` against the run-option table
    and ``fourd-mpi run``'s own validation (overlap lists, dtype and backend, ...) on one rank."""
    name = str(key).replace("_", "-")
    if name in SWEEP_OWNED:
        raise spec.error(parts, f"{key} is set by the sweep, not as a run option: use {SWEEP_OWNED[name]}")
    try:
        option = lookup(name, spec.source)
        typed = option.parse(value)
        resolve_values({option.dest: typed}, 1, cross_checks=False)  # combinations: checked per run below
    except ConfigError as exc:
        message = str(exc).replace(f"{spec.source}: ", "")
        raise spec.error(parts, message) from None
    return name, typed


def _refuse_repeats(spec: SweepSpec, where: Sequence, typed: Sequence, shown: Sequence) -> None:
    """A list of a spec whose values (as parsed: ``2`` and ``"2"`` are one value) repeat would run one
    configuration twice under two run ids, silently: refused, naming both positions."""
    seen = {}
    for i, value in enumerate(typed):
        key = repr(value)
        if key in seen:
            raise spec.error(list(where) + [i], f"{shown[i]!r} repeats item {seen[key]} of the list: give each value "
                                                f"once (repeats: N runs every configuration N times)")
        seen[key] = i


def spec_from_data(data: Dict[str, Any], source: str = "<spec>", doc: Optional[YamlDocument] = None) -> SweepSpec:
    """A :class:`SweepSpec` from already schema-checked data; checks what a schema cannot."""
    grids = data["grids"]
    if isinstance(grids, dict):
        grids = {str(k): v for k, v in grids.items()}
    spec = SweepSpec(name=data["name"], study=data["study"], ranks=list(data["ranks"]), grids=grids,
                     models=[dict(m) for m in (data["model"] if isinstance(data["model"], list) else [data["model"]])],
                     many_models=isinstance(data["model"], list), weak=dict(data.get("weak") or {}),
                     repeats=data.get("repeats", 1),
                     results_dir=data.get("results_dir"), job=dict(data.get("job") or {}),
                     description=data.get("description", ""), source=source, doc=doc)
    if spec.weak and spec.study != "weak":
        raise spec.error(["weak"], "weak: applies to weak-scaling studies only (study: weak)")
    if isinstance(grids, dict):
        for key in grids:
            if int(key) not in spec.ranks:
                raise spec.error(["grids", key], f"{key} ranks is not in ranks {spec.ranks}")
    for section, target in (("options", spec.options), ("matrix", spec.matrix), ("zip", spec.zipped)):
        for key, value in (data.get(section) or {}).items():
            values = value if section != "options" else [value]
            name, typed = None, []
            for i, item in enumerate(values):
                parts = [section, key] if section == "options" else [section, key, i]
                name, value_typed = _check_option(spec, parts, key, item)
                typed.append(value_typed)
            if section == "matrix":
                _refuse_repeats(spec, [section, key], typed, values)
            if name in spec.options or name in spec.matrix or name in spec.zipped:
                raise spec.error([section, key], f"{key} is given in more than one of options, matrix and zip")
            target[name] = value
    lengths = {k: len(v) for k, v in spec.zipped.items()}
    if len(set(lengths.values())) > 1:
        raise spec.error(["zip"], "zipped lists must have the same length, got "
                         + ", ".join(f"{k}: {n}" for k, n in lengths.items()))
    if spec.zipped:
        rows = list(zip(*spec.zipped.values()))
        _refuse_repeats(spec, ["zip", next(iter(data.get("zip")))], [tuple(map(str, r)) for r in rows],
                        [", ".join(map(str, r)) for r in rows])
    choices = grids.items() if isinstance(grids, dict) else [(None, grids)]
    for key, choice in choices:
        if isinstance(choice, list):
            where = ["grids"] + ([key] if key is not None else [])
            _refuse_repeats(spec, where, [str(g).strip().lower() for g in choice], choice)
    for run in spec.expand():  # every run resolvable exactly as `fourd-mpi run` will resolve it
        try:
            resolve_values(run.values(), run.ranks)
        except ConfigError as exc:
            raise spec.error([], f"run {run.run_id} ({run.describe()}): {exc}") from None
    return spec


def load_spec(path: str) -> SweepSpec:
    """Read, validate and check a sweep spec; every error names the key and its line."""
    doc = load_yaml(path, "sweep spec", SCHEMA)
    return spec_from_data(doc.data, path, doc)


def dump_spec(spec_data: Dict[str, Any]) -> str:
    """YAML text of a spec (``spec_data`` as from :meth:`SweepSpec.as_dict`), keys in schema order."""
    import yaml

    order = list(SCHEMA["properties"])
    ordered = {k: spec_data[k] for k in order if k in spec_data}
    return yaml.safe_dump(ordered, sort_keys=False, default_flow_style=None)
