"""The parallel training algorithms the suite runs in one harness (``--algorithm``).

Each algorithm is a module of its own (its layouts, its layers and their collectives); the
registry (:mod:`fourd_mpi.algorithms.registry`) names them, with the grid constraints of the
named baselines, without importing MPI or the algorithm modules (sweeps and ``tune`` resolve
options on login nodes).
"""
