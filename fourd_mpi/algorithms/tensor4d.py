"""The 4D family (``axonn4d``, ``megatron1d``, ``fsdp``, ``dp``): the 3D parallel matrix
multiplication of :mod:`fourd_mpi.step` on ``G_data x G_z x G_y x G_x``.

Pure cross-checks of an algorithm's options live with its family's record
(:attr:`fourd_mpi.algorithms.families.Family.checker`). The hooks every algorithm module provides
(called by :meth:`fourd_mpi.run.build.Run.build`):

- ``build_state(options, grid, backend, counter)`` -> ``(model, data)``;
- ``make_trainer(model, data, comm, optimizer, options)`` -> the trainer whose ``step(i)`` runs a step.

The model exposes ``parameters()`` (each with ``name``, ``global_shape`` and ``global_index()``, the
same names and global tensors on every algorithm so ``verify`` compares them with the serial
reference), ``layer_names()``, ``fc_layers()`` and ``activation_layout``; the data exposes
``batch(step)``, ``global_index()``, ``global_shape``, ``prep_seconds``, ``nbytes``.
"""

from __future__ import annotations

from fourd_mpi.step.engine import Trainer
from fourd_mpi.step.model import Model, SyntheticData


def build_state(options, grid, backend, counter):
    """``(model, data)`` of this rank on ``grid``: weights and synthetic batches in the 4D layouts."""
    model = Model(options.model, grid, backend, seed=options.seed, counter=counter)
    data = SyntheticData(options.model, grid, backend, seed=options.seed,
                         batches=min(options.data_batches, options.steps))
    return model, data


def make_trainer(model, data, comm, optimizer, options):
    return Trainer(model, data, comm, optimizer, overlap=options.overlap, recompute=options.recompute)
