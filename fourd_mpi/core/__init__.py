"""The MPI pieces: the 4D grid, layouts, array backends, GPU-aware MPI detection, progress
strategies and the collectives (the only module that calls MPI collectives).

Importing this package imports nothing; only ``collectives`` and ``mpiutil`` need ``mpi4py.MPI``.
"""
