"""The MPI pieces: the 4D grid, layouts, array backends, GPU-aware MPI detection, progress
strategies and the collectives (``mpicoll`` is the only module that calls MPI collectives).

Importing this package imports nothing; only ``mpicoll`` (and ``collectives`` and ``p2p``, which use it) and
``mpiutil`` need ``mpi4py.MPI``.
"""
