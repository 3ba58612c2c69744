"""The multi-node test bed: a cluster of emulated nodes on one Linux machine (docs/multinode.md).

- :mod:`~fourd_mpi.testbed.bed` — the nodes: a network namespace each (own address, own host name),
  veth pairs on a bridge, link rate and burst shaped with ``tc ... tbf``; ``up``, ``down``,
  ``status``, idempotent, with a state file that lists everything created so ``down`` (and a CI-start
  ``down --all``) removes it even after a killed run; the launcher shim that lets the ``mpich``
  wheel's ``mpiexec`` (Hydra's ssh launcher) or Open MPI's (``plm_rsh_agent``) start ranks on the nodes
  (:func:`~fourd_mpi.testbed.bed.mpiexec_argv`).
- :mod:`~fourd_mpi.testbed.slurm` — a real multi-node Slurm on the nodes: ``slurmctld`` in the root
  namespace, one ``slurmd`` per node in the node's namespace.

Offline code: nothing here imports ``mpi4py``; it needs root, ``ip``, ``tc``, ``nsenter`` and
``unshare`` (util-linux), and refuses with one line where they are missing.
"""
