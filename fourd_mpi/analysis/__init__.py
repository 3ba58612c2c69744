"""Offline analysis of traces: tables (``tables``), figures (``plots``) and exports for Perfetto
and Thicket (``export``). Never imports ``mpi4py.MPI``.
"""
