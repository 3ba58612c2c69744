"""Scaling sweeps on schedulers: sweep specs, site profiles, Slurm/PBS/LSF/SGE adapters,
job-script rendering, submit/status/collect. Never imports ``mpi4py.MPI``.
"""
