"""The algorithm registry: names, titles, grid constraints and the module that builds each one.

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

Only ``pipeline`` splits the world before the 4D grid: :meth:`Algorithm.tensor_world` gives the
ranks of one 4D grid (``world / G_inter``); every other algorithm refuses ``--ginter`` or
``--microbatches`` above 1.

With ``G_x = G_z = 1`` a normal layer stores ``W[n/G_y, k]`` (column-parallel) and a
transposed layer ``W[n, k/G_y]`` with its forward all-reduce over Y (row-parallel): exactly
Megatron-LM's pair. With ``G_x = G_y = 1`` every weight is a flat shard over Z, all-gathered
before use and its gradient reduce-scattered: ZeRO-3 / FSDP, with Z splitting the batch too.

Inference: with none of its free axes given, a baseline puts every rank on its characteristic axis
(``megatron1d`` on 8 ranks is ``1x1x8x1``, ``fsdp`` ``1x8x1x1``, ``dp`` ``8x1x1x1``); ``axonn4d``, as
before, gives the rest to the data axis. Giving one free axis (``--gdata 2``) lets the other take the rest.

``optimus3d`` (:mod:`fourd_mpi.algorithms.optimus3d`) is not a preset of the 4D layers: its grid is a
cube (``shaper``: :func:`fourd_mpi.algorithms.cube.cube_shape` infers ``q`` and ``G_data`` from the world
size) and its model has other divisibility rules (``model_checker``:
:func:`fourd_mpi.algorithms.cube.model_problems`, replacing the 4D rules of
:func:`fourd_mpi.step.presets.model_problems`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional, Tuple

from fourd_mpi.algorithms import pipeline_plan
from fourd_mpi.algorithms import cube
from fourd_mpi.core.grid import GridShape, infer_grid_shape
from fourd_mpi.errors import ConfigError

#: grid axes in Cartesian order (outermost first), as :data:`fourd_mpi.core.grid.AXES`
_AXES = ("data", "z", "y", "x")


@dataclass(frozen=True)
class Algorithm:
    """One entry of ``--algorithm``.

    name: the value of ``--algorithm``; title: printed in run headers, tables and plots;
    family: which implementation runs it (``impl``, a module path imported only when a run is built);
    fixed: axes this algorithm pins to a size (``{"x": 1, "z": 1}``); reference: where it comes from;
    checker: pure cross-checks of the resolved options (``checker(algorithm, options)``, raises
    :class:`ConfigError`), defined in a module that imports neither MPI nor the step.
    shaper: pure ``shaper(world_size, grid_sizes) -> GridShape`` for a grid that is not a free
    factorization (a cube); None: :meth:`constrain` then :func:`~fourd_mpi.core.grid.infer_grid_shape`.
    model_checker: pure ``model_checker(model, grid) -> [sentence]`` replacing the 4D model rules
    (:func:`fourd_mpi.step.presets.model_problems`) for an algorithm with other layouts.
    describer: pure ``describer(grid) -> text`` for the header line's parentheses (how the algorithm uses the grid).
    """

    name: str
    title: str
    family: str
    impl: str
    reference: str
    fixed: Mapping[str, int] = field(default_factory=dict)
    checker: Optional[Callable] = None
    #: the usual name, for plot legends and short table cells ("Megatron-LM 1D"); default: ``name``
    label: str = ""
    #: the axis that takes every rank when none of the free axes is given (``megatron1d``: all ranks
    #: tensor-parallel over Y, ``fsdp``: all sharded over Z); ``data`` as in :func:`~fourd_mpi.core.grid.infer_grid_shape`
    infer: str = "data"
    #: pure ``splitter(algorithm, world_size, values) -> ranks of one 4D grid`` for algorithms that split
    #: the world before the 4D grid (``values``: option values keyed by dest); None: the whole world
    splitter: Optional[Callable] = None
    shaper: Optional[Callable] = None
    model_checker: Optional[Callable] = None
    describer: Optional[Callable] = None

    @property
    def display(self) -> str:
        """The usual name (``label``), else ``name``."""
        return self.label or self.name

    def shape(self, world_size: int, grid_sizes: Mapping[str, Optional[int]]) -> GridShape:
        """The grid of ``world_size`` ranks from the given ``--g*`` sizes (None: omitted). Pure."""
        if self.shaper is not None:
            return self.shaper(world_size, grid_sizes)
        return infer_grid_shape(world_size, **self.constrain(grid_sizes))

    def model_problems(self, cfg, grid: GridShape) -> list:
        """Everything wrong with running model ``cfg`` on ``grid`` with this algorithm (sentences). Pure."""
        if self.model_checker is not None:
            return self.model_checker(cfg, grid)
        from fourd_mpi.step.presets import model_problems

        return model_problems(cfg, grid)

    def validate_model(self, cfg, grid: GridShape) -> None:
        """Raise :class:`ConfigError` naming every problem of :meth:`model_problems`."""
        if self.model_checker is None:
            from fourd_mpi.step.presets import validate_model

            return validate_model(cfg, grid)
        problems = self.model_checker(cfg, grid)
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
        free = [a for a in _AXES if a not in self.fixed]
        if self.infer != "data" and all(sizes.get(a) is None for a in free):
            sizes.update({a: 1 for a in free if a != self.infer})  # the rest goes to the ``infer`` axis
        return sizes

    def grid_problem(self, options, grid) -> Optional[str]:
        """Why ``grid`` (a :class:`~fourd_mpi.core.grid.GridShape`) cannot run this algorithm with the resolved
        ``options`` (None when it can): a fixed axis of another size, or the algorithm's own check.
        Pure; ``verify``, ``tune`` and sweeps use it to keep only the grids an algorithm runs."""
        from dataclasses import replace

        try:
            self.constrain({a: getattr(grid, a) for a in _AXES})
            self.check(replace(options, grid=grid, algorithm=self.name))
        except ConfigError as exc:
            return str(exc)
        return None

    def check(self, options) -> None:
        """Cross-checks of resolved options (:class:`~fourd_mpi.algorithms.runoptions.RunOptions`) that only this
        algorithm knows (e.g. a cube grid). Pure; raises :class:`ConfigError`."""
        if self.checker is not None:
            self.checker(self, options)

    def tensor_world(self, world_size: int, values: Mapping) -> int:
        """Ranks of one 4D grid of this algorithm on ``world_size`` ranks (``values``: option values keyed
        by dest, e.g. ``ginter``). Pure; raises :class:`ConfigError` (same line on every rank)."""
        if self.splitter is not None:
            return self.splitter(self, world_size, values)
        for dest, flag in (("ginter", "--ginter"), ("microbatches", "--microbatches")):
            given = values.get(dest) or 1
            if given > 1:
                raise ConfigError(f"{flag} {given}: --algorithm {self.name} ({self.title}) has no pipeline "
                                  f"stages; use --algorithm pipeline (or {flag} 1)")
        return world_size

    def module(self):
        """The implementing module (imported on first use)."""
        return importlib.import_module(self.impl)

    def describe(self, shape) -> str:
        """One header line: ``algorithm megatron1d: Megatron-LM 1D tensor parallelism + data (G_x = G_z = 1)``."""
        pinned = ", ".join(f"G_{a} = {s}" for a, s in self.fixed.items())
        if self.describer is not None:
            pinned = self.describer(shape)
        return f"algorithm {self.name}: {self.title}" + (f" ({pinned})" if pinned else "") + f" on grid {shape}"


_TENSOR4D = "fourd_mpi.algorithms.tensor4d"
_ALGORITHMS: Tuple[Algorithm, ...] = (
    Algorithm("axonn4d", "AxoNN 4D (data x 3D tensor parallelism)", "tensor4d", _TENSOR4D,
              "Singh et al., SC'24, arXiv 2305.13525", label="AxoNN 4D"),
    Algorithm("megatron1d", "Megatron-LM 1D tensor parallelism + data", "tensor4d", _TENSOR4D,
              "Shoeybi et al., arXiv 1909.08053", {"x": 1, "z": 1}, label="Megatron-LM 1D", infer="y"),
    Algorithm("fsdp", "fully sharded data parallelism (ZeRO-3 / FSDP)", "tensor4d", _TENSOR4D,
              "Rajbhandari et al., SC'20; Zhao et al., VLDB'23", {"x": 1, "y": 1}, label="FSDP (ZeRO-3)",
              infer="z"),
    Algorithm("dp", "plain data parallelism", "tensor4d", _TENSOR4D, "-", {"x": 1, "y": 1, "z": 1}, label="DP"),
    Algorithm("optimus3d", "Optimus-CUBE 3D tensor parallelism + data (Colossal-AI parallel_3d)", "optimus3d",
              "fourd_mpi.algorithms.optimus3d", "Bian, Xu, Wang, You, arXiv 2104.05343",
              checker=cube.checker, shaper=cube.cube_shape, model_checker=cube.model_problems,
              describer=cube.describe, label="Optimus-CUBE 3D"),
    Algorithm("pipeline", "AxoNN inter-layer pipeline x 4D tensor", "pipeline", "fourd_mpi.algorithms.pipeline",
              "Singh & Bhatele, IPDPS'22, 'AxoNN: an asynchronous, message-driven parallel framework for "
              "extreme-scale deep learning'", checker=pipeline_plan.check, splitter=pipeline_plan.stage_world,
              label="AxoNN pipeline"),
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
