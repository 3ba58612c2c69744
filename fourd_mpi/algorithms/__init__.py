"""The parallel training algorithms the suite runs in one harness (``--algorithm``).

Each algorithm is a module of its own (its layouts, its layers and their collectives); the
registry (:mod:`fourd_mpi.algorithms.registry`) names them, with the grid constraints of the
named baselines, and one record per family (:mod:`fourd_mpi.algorithms.families`) holds what the
algorithms of a family share (the module that runs them, their pure checks, the performance
model's and the admission check's hooks), without importing MPI, the algorithm modules or the
model (sweeps and ``tune`` resolve options on login nodes).
"""
