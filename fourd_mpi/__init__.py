"""fourd_mpi: an MPI-native benchmark suite for 4D hybrid parallel training.

Modules, one role each: :mod:`grid` (4D Cartesian communicator), :mod:`backend`
(NumPy/CuPy), :mod:`collectives` (MPI operations per axis), :mod:`layout` (layouts
and block arithmetic), :mod:`kernels` (local math), :mod:`layers` (4D FC layer,
sharded LayerNorm), :mod:`model` (GPT/MLP stacks, loss, data), :mod:`optim`,
:mod:`engine` (training step), :mod:`runtime` (building a run), :mod:`verify`
(serial reference check), :mod:`cli`.
"""

__version__ = "0.1.0"
