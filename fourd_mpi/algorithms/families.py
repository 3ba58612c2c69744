"""One record per algorithm family: its run implementation, its pure checks, its model hooks and its
admission memory hook, in one place (:data:`FAMILIES`).

Pure (no MPI, no array library) and below :mod:`fourd_mpi.perf` and :mod:`fourd_mpi.run` in the package
order: the hooks that live above ``algorithms`` are named by strings and imported on first use
(:meth:`Family.module`, :meth:`Family.hook`), so listing a family imports nothing heavy. An algorithm
(:class:`fourd_mpi.algorithms.registry.Algorithm`) names its family and keeps only what differs between
the algorithms of one family (name, title, reference, fixed axes, legend label, inference axis).

- ``tensor4d``: runs :mod:`fourd_mpi.algorithms.tensor4d`, model :mod:`fourd_mpi.perf.predict` (``axonn4d``,
  ``megatron1d``, ``fsdp``, ``dp``);
- ``optimus3d``: runs :mod:`fourd_mpi.algorithms.optimus3d`, model :mod:`fourd_mpi.perf.optimus3d`;
- ``pipeline``: runs :mod:`fourd_mpi.algorithms.pipeline`, model :mod:`fourd_mpi.perf.pipeline`.

The hooks of a record:

- pure checks (callables of ``algorithms``, None: the 4D default): ``checker(algorithm, options)`` raises
  :class:`~fourd_mpi.errors.ConfigError`; ``shaper(world_size, grid_sizes) -> GridShape`` for a grid that is
  not a free factorization (a cube); ``model_checker(model, grid) -> [sentence]`` replacing the 4D model
  rules of :func:`fourd_mpi.step.presets.model_problems`; ``describer(grid) -> text`` for the header line's
  parentheses; ``splitter(algorithm, world_size, values) -> ranks of one 4D grid`` for a family that splits
  the world before the 4D grid (``values``: option values keyed by dest); ``grid_dims(options) -> {axis:
  size}``, outermost first, for a family whose run grid has more axes than ``data, z, y, x`` (the pipeline:
  ``data, inter, z, y, x``; :class:`fourd_mpi.core.grid.ProcessGrid` over the world).
- model hooks (names, see :meth:`Family.hook`; None: the family has none): ``predict`` (called with
  keywords as :func:`fourd_mpi.perf.predict.predict`) -> :class:`~fourd_mpi.perf.predict.Prediction`;
  ``candidates(cfg, ranks, algorithm) -> [(grid, extra)]`` (None: every 4D factorization the algorithm
  allows, no extra); ``run_options(run_options) -> extra`` (the family's ``predict`` keywords of a traced
  run); ``memory(cfg, grid, dtype=, optimizer=, overlap=, recompute=, attention=, precision=,
  shard_optimizer=, **extra) -> MemoryEstimate`` equal to the prediction's; ``lower_bound(cfg, grid,
  profile, ..., **extra)`` -> seconds never above the predicted step (used as in
  :mod:`fourd_mpi.perf.algorithms`).
- ``admission(options, attention) -> (MemoryEstimate, tokens per rank)``: the memory of a run's resolved
  options (:class:`~fourd_mpi.algorithms.runoptions.RunOptions`) with the attention kernels that will run, and the
  tokens ``m`` one rank holds (its input and target are ``[m, h/G_x]``), for
  :func:`fourd_mpi.run.admission.memory_need`.

Adding a family is one :class:`Family` entry here (and its algorithms in the registry).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Dict, Optional

from fourd_mpi.algorithms import cube, pipeline_plan
from fourd_mpi.errors import ConfigError

#: the model hooks of :meth:`Family.hook`
MODEL_HOOKS = ("predict", "candidates", "run_options", "memory", "lower_bound", "admission")


@dataclass(frozen=True)
class Family:
    """One algorithm family (see the module docstring for each hook's signature).

    name: the family (:attr:`fourd_mpi.algorithms.registry.Algorithm.family`); impl: the module that runs it
    (``build_state``, ``make_trainer``; imported only when a run is built); model: the module of its
    performance model. A model hook is a function name in ``model``, or ``"package.module:function"`` for
    one defined elsewhere; None where the family has no such hook.
    """

    name: str
    impl: str
    model: str = ""
    checker: Optional[Callable] = None
    shaper: Optional[Callable] = None
    model_checker: Optional[Callable] = None
    describer: Optional[Callable] = None
    splitter: Optional[Callable] = None
    grid_dims: Optional[Callable] = None
    predict: Optional[str] = "predict"
    candidates: Optional[str] = None
    run_options: Optional[str] = None
    memory: Optional[str] = None
    lower_bound: Optional[str] = None
    admission: Optional[str] = None

    def module(self):
        """The implementing module (imported on first use)."""
        return importlib.import_module(self.impl)

    def hook(self, which: str) -> Optional[Callable]:
        """The model hook ``which`` (one of :data:`MODEL_HOOKS`), imported on first use; None when the family
        has none, or its module is not in this installation (a branch not merged yet)."""
        if which not in MODEL_HOOKS:
            raise ValueError(f"unknown model hook {which!r}: one of {', '.join(MODEL_HOOKS)}")
        value = getattr(self, which)
        if not value:
            return None
        path, _, attr = value.rpartition(":")
        try:
            module = importlib.import_module(path or self.model)
        except ImportError:
            return None
        return getattr(module, attr, None)

    def required(self, which: str) -> Callable:
        """:meth:`hook` ``which``; a :class:`ConfigError` (one line) when this installation lacks it."""
        found = self.hook(which)
        if found is None:
            raise ConfigError(f"algorithm family {self.name!r} has no {which} hook in this installation "
                              f"({getattr(self, which) or 'none named'}, model {self.model or 'none'})")
        return found

    def covered(self) -> bool:
        """Whether the performance model predicts this family (its ``predict`` hook resolves)."""
        return self.model != "" and self.hook("predict") is not None


_ACROSS = "fourd_mpi.perf.algorithms"

#: by family name
FAMILIES: Dict[str, Family] = {f.name: f for f in (
    Family("tensor4d", "fourd_mpi.algorithms.tensor4d", "fourd_mpi.perf.predict", memory="predicted_memory",
           lower_bound="lower_bound", admission="fourd_mpi.perf.memory:admission_memory"),
    Family("optimus3d", "fourd_mpi.algorithms.optimus3d", "fourd_mpi.perf.optimus3d", checker=cube.checker,
           shaper=cube.cube_shape, model_checker=cube.model_problems, describer=cube.describe,
           admission="admission_memory"),
    Family("pipeline", "fourd_mpi.algorithms.pipeline", "fourd_mpi.perf.pipeline", checker=pipeline_plan.check,
           splitter=pipeline_plan.stage_world, grid_dims=pipeline_plan.grid_dims, predict="predict_pipeline",
           candidates=f"{_ACROSS}:pipeline_candidates", run_options=f"{_ACROSS}:pipeline_run_options",
           memory=f"{_ACROSS}:pipeline_stage_memory", lower_bound="pipeline_lower_bound", admission="admission_memory"),
)}


def get(name: str) -> Family:
    """The family called ``name``; a :class:`ConfigError` naming the known ones otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ConfigError(f"unknown algorithm family {name!r}: one of {', '.join(FAMILIES)}") from None
