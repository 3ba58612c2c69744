"""The algorithm registry: names, titles and grid constraints of each ``--algorithm``, and its family.

What an algorithm shares with its family (the module that runs it, the pure checks, the model's hooks)
is one record of :mod:`fourd_mpi.algorithms.families`; an :class:`Algorithm` keeps only what differs
between the algorithms of one family, and its methods read the family's hooks.

Pure (no MPI, no array library): :func:`fourd_mpi.run.options.resolve` applies
:meth:`Algorithm.constrain` and :meth:`Algorithm.check` on every rank before any collective, so a
grid that an algorithm cannot run fails with the same one-line error everywhere.

The 4D family (``axonn4d`` and its named special cases) shares one implementation,
:mod:`fourd_mpi.algorithms.tensor4d`; the baselines only fix axes to 1:

================  =====================================  ==========================
name              what it is                              fixed axes
================  =====================================  ==========================
``axonn4d``       AxoNN 4D: data x 3D tensor (SC'24)      none
``megatron1d``    Megatron-LM 1D tensor + data            ``G_x = G_z = 1``
``fsdp``          fully sharded data parallel (ZeRO-3)    ``G_x = G_y = 1``
``dp``            plain data parallelism                  ``G_x = G_y = G_z = 1``
``optimus3d``     Optimus-CUBE 3D tensor + data           ``G_x = G_y = G_z = q``
``pipeline``      AxoNN inter-layer pipeline x 4D         none (``--ginter`` stages)
================  =====================================  ==========================

Only ``pipeline`` splits the world before the 4D grid (its family's ``splitter``):
:meth:`Algorithm.tensor_world` gives the ranks of one 4D grid (``world / G_inter``); every other
algorithm refuses ``--ginter`` or ``--microbatches`` above 1.

With ``G_x = G_z = 1`` a normal layer stores ``W[n/G_y, k]`` (column-parallel) and a
transposed layer ``W[n, k/G_y]`` with its forward all-reduce over Y (row-parallel): exactly
Megatron-LM's pair. With ``G_x = G_y = 1`` every weight is a flat shard over Z, all-gathered
before use and its gradient reduce-scattered: ZeRO-3 / FSDP, with Z splitting the batch too.

Inference: with none of its free axes given, a baseline puts every rank on its characteristic axis
(``megatron1d`` on 8 ranks is ``1x1x8x1``, ``fsdp`` ``1x8x1x1``, ``dp`` ``8x1x1x1``); ``axonn4d``, as
before, gives the rest to the data axis. Giving one free axis (``--gdata 2``) lets the other take the rest.

``optimus3d`` (:mod:`fourd_mpi.algorithms.optimus3d`) is not a preset of the 4D layers: its grid is a
cube (its family's ``shaper``: :func:`fourd_mpi.algorithms.cube.cube_shape` infers ``q`` and ``G_data`` from
the world size) and its model has other divisibility rules (``model_checker``:
:func:`fourd_mpi.algorithms.cube.model_problems`, replacing the 4D rules of
:func:`fourd_mpi.step.presets.model_problems`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple

from fourd_mpi.algorithms import families
from fourd_mpi.algorithms.families import Family
from fourd_mpi.core.grid import AXES, GridShape, infer_grid_shape
from fourd_mpi.errors import ConfigError


@dataclass(frozen=True)
class Algorithm:
    """One entry of ``--algorithm``.

    name: the value of ``--algorithm``; title: printed in run headers, tables and plots;
    family: the name of its :class:`~fourd_mpi.algorithms.families.Family` (which module runs it, its pure
    checks and model hooks: :attr:`spec`); reference: where it comes from;
    fixed: axes this algorithm pins to a size (``{"x": 1, "z": 1}``).
    """

    name: str
    title: str
    family: str
    reference: str
    fixed: Mapping[str, int] = field(default_factory=dict)
    #: the usual name, for plot legends and short table cells ("Megatron-LM 1D"); default: ``name``
    label: str = ""
    #: the axis that takes every rank when none of the free axes is given (``megatron1d``: all ranks
    #: tensor-parallel over Y, ``fsdp``: all sharded over Z); ``data`` as in
    #: :func:`~fourd_mpi.core.grid.infer_grid_shape`
    infer: str = "data"

    @property
    def spec(self) -> Family:
        """The family record (:data:`fourd_mpi.algorithms.families.FAMILIES`); a :class:`ConfigError` when
        the family is not registered."""
        return families.get(self.family)

    @property
    def display(self) -> str:
        """The usual name (``label``), else ``name``."""
        return self.label or self.name

    def shape(self, world_size: int, grid_sizes: Mapping[str, Optional[int]]) -> GridShape:
        """The grid of ``world_size`` ranks from the given ``--g*`` sizes (None: omitted). Pure."""
        shaper = self.spec.shaper
        if shaper is not None:
            return shaper(world_size, grid_sizes)
        return infer_grid_shape(world_size, **self.constrain(grid_sizes))

    def model_problems(self, cfg, grid: GridShape) -> list:
        """Everything wrong with running model ``cfg`` on ``grid`` with this algorithm (sentences). Pure."""
        checker = self.spec.model_checker
        if checker is not None:
            return checker(cfg, grid)
        from fourd_mpi.step.presets import model_problems

        return model_problems(cfg, grid)

    def validate_model(self, cfg, grid: GridShape) -> None:
        """Raise :class:`ConfigError` naming every problem of :meth:`model_problems`."""
        checker = self.spec.model_checker
        if checker is None:
            from fourd_mpi.step.presets import validate_model

            return validate_model(cfg, grid)
        problems = checker(cfg, grid)
        if problems:
            raise ConfigError(f"--algorithm {self.name}: model {cfg.name} on grid {grid} (G_data x G_z x G_y x G_x): "
                              + "; ".join(problems))

    def constrain(self, grid_sizes: Mapping[str, Optional[int]]) -> Dict[str, Optional[int]]:
        """The ``--g*`` sizes with this algorithm's fixed axes filled in; a :class:`ConfigError` when the
        user gave a fixed axis another size. Pure."""
        sizes = dict(grid_sizes)
        for axis, size in self.fixed.items():
            given = sizes.get(axis)
            if given is not None and given != size:
                pinned = ", ".join(f"G_{a} = {s}" for a, s in self.fixed.items())
                raise ConfigError(f"--algorithm {self.name} ({self.title}) fixes {pinned}: --g{axis} {given} "
                                  f"contradicts it (use --algorithm axonn4d for a general grid)")
            sizes[axis] = size
        free = [a for a in AXES if a not in self.fixed]
        if self.infer != "data" and all(sizes.get(a) is None for a in free):
            sizes.update({a: 1 for a in free if a != self.infer})  # the rest goes to the ``infer`` axis
        return sizes

    def grid_problem(self, options, grid) -> Optional[str]:
        """Why ``grid`` (a :class:`~fourd_mpi.core.grid.GridShape`) cannot run this algorithm with the resolved
        ``options`` (None when it can): a fixed axis of another size, or the algorithm's own check.
        Pure; ``verify``, ``tune`` and sweeps use it to keep only the grids an algorithm runs."""
        from dataclasses import replace

        try:
            self.constrain({a: getattr(grid, a) for a in AXES})
            self.check(replace(options, grid=grid, algorithm=self.name))
        except ConfigError as exc:
            return str(exc)
        return None

    def check(self, options) -> None:
        """Cross-checks of resolved options (:class:`~fourd_mpi.algorithms.runoptions.RunOptions`) that only this
        algorithm knows (e.g. a cube grid): its family's ``checker``. Pure; raises :class:`ConfigError`."""
        checker = self.spec.checker
        if checker is not None:
            checker(self, options)

    def tensor_world(self, world_size: int, values: Mapping) -> int:
        """Ranks of one 4D grid of this algorithm on ``world_size`` ranks (``values``: option values keyed
        by dest, e.g. ``ginter``). Pure; raises :class:`ConfigError` (same line on every rank)."""
        splitter = self.spec.splitter
        if splitter is not None:
            return splitter(self, world_size, values)
        for dest, flag in (("ginter", "--ginter"), ("microbatches", "--microbatches")):
            given = values.get(dest) or 1
            if given > 1:
                raise ConfigError(f"{flag} {given}: --algorithm {self.name} ({self.title}) has no pipeline "
                                  f"stages; use --algorithm pipeline (or {flag} 1)")
        return world_size

    def grid_dims(self, options) -> Dict[str, int]:
        """The axes of the run's grid over the whole world, axis -> size outermost first
        (:class:`~fourd_mpi.core.grid.ProcessGrid`): its family's ``grid_dims`` (the pipeline adds ``inter``),
        else the 4D grid's ``data, z, y, x``. Pure."""
        dims = self.spec.grid_dims
        return dims(options) if dims is not None else dict(zip(AXES, options.grid.dims))

    def module(self):
        """The implementing module, its family's (imported on first use)."""
        return self.spec.module()

    def describe(self, shape) -> str:
        """One header line: ``algorithm megatron1d: Megatron-LM 1D tensor parallelism + data (G_x = G_z = 1)``."""
        pinned = ", ".join(f"G_{a} = {s}" for a, s in self.fixed.items())
        describer = self.spec.describer
        if describer is not None:
            pinned = describer(shape)
        return f"algorithm {self.name}: {self.title}" + (f" ({pinned})" if pinned else "") + f" on grid {shape}"


_ALGORITHMS: Tuple[Algorithm, ...] = (
    Algorithm("axonn4d", "AxoNN 4D (data x 3D tensor parallelism)", "tensor4d",
              "Singh et al., SC'24, arXiv 2305.13525", label="AxoNN 4D"),
    Algorithm("megatron1d", "Megatron-LM 1D tensor parallelism + data", "tensor4d",
              "Shoeybi et al., arXiv 1909.08053", {"x": 1, "z": 1}, label="Megatron-LM 1D", infer="y"),
    Algorithm("fsdp", "fully sharded data parallelism (ZeRO-3 / FSDP)", "tensor4d",
              "Rajbhandari et al., SC'20; Zhao et al., VLDB'23", {"x": 1, "y": 1}, label="FSDP (ZeRO-3)",
              infer="z"),
    Algorithm("dp", "plain data parallelism", "tensor4d", "-", {"x": 1, "y": 1, "z": 1}, label="DP"),
    Algorithm("optimus3d", "Optimus-CUBE 3D tensor parallelism + data (Colossal-AI parallel_3d)", "optimus3d",
              "Bian, Xu, Wang, You, arXiv 2104.05343", label="Optimus-CUBE 3D"),
    Algorithm("pipeline", "AxoNN inter-layer pipeline x 4D tensor", "pipeline",
              "Singh & Bhatele, IPDPS'22, 'AxoNN: an asynchronous, message-driven parallel framework for "
              "extreme-scale deep learning'", label="AxoNN pipeline"),
)

#: by name, in the order ``--help`` lists them
ALGORITHMS: Dict[str, Algorithm] = {a.name: a for a in _ALGORITHMS}
DEFAULT_ALGORITHM = "axonn4d"


def names() -> Tuple[str, ...]:
    return tuple(ALGORITHMS)


def of_metadata(metadata: Mapping) -> str:
    """The algorithm name of a trace's metadata (its ``algorithm``, else ``run_options.algorithm``);
    traces written before the algorithm axis ran the 4D algorithm: :data:`DEFAULT_ALGORITHM`."""
    name = metadata.get("algorithm") if isinstance(metadata, Mapping) else None
    if not name and isinstance(metadata, Mapping) and isinstance(metadata.get("run_options"), Mapping):
        name = metadata["run_options"].get("algorithm")
    return str(name) if name else DEFAULT_ALGORITHM


def model_problems_of(algorithm: Algorithm, cfg, grid) -> list:
    """What keeps model ``cfg`` from running on ``grid`` with ``algorithm`` (sentences): the algorithm's own
    rules where it has them (an ``Algorithm.model_problems`` method), else the 4D rules of
    :func:`fourd_mpi.step.presets.model_problems`. Pure."""
    own = getattr(algorithm, "model_problems", None)
    if callable(own):
        return list(own(cfg, grid))
    from fourd_mpi.step.presets import model_problems

    return list(model_problems(cfg, grid))


def display_name(name: str) -> str:
    """The usual name of algorithm ``name`` for legends and titles; an unknown name (a trace of an
    algorithm this installation lacks) as it is."""
    algorithm = ALGORITHMS.get(str(name))
    return algorithm.display if algorithm is not None else str(name)


def get(name: str) -> Algorithm:
    """The algorithm called ``name``; a :class:`ConfigError` listing the known ones otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(f"unknown algorithm {name!r}: choose one of {', '.join(ALGORITHMS)}") from None
