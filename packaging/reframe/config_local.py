"""ReFrame configuration for ``local``: this machine, no batch scheduler, ``mpiexec`` from PATH.

CI puts the wheel's virtual environment first on PATH, so ``mpiexec`` is the ``mpich`` extra's
and ``fourd-mpi`` the installed wheel's::

    PATH=$VENV/bin:$PATH reframe -C packaging/reframe/config_local.py \\
        -c packaging/reframe/fourd_mpi_check.py -r

On a Slurm cluster use the centre's configuration, or add a system like (``squeue`` scheduler,
``srun`` launcher; ``access`` carries the account and constraint)::

    {"name": "cluster", "hostnames": ["^login"], "partitions": [
        {"name": "gpu", "scheduler": "squeue", "launcher": "srun", "access": ["-A ACCOUNT", "-C gpu"],
         "environs": ["builtin"], "max_jobs": 4}]}
"""

site_configuration = {
    "systems": [
        {
            "name": "local",
            "descr": "this machine: local scheduler, mpiexec launcher",
            "hostnames": [".*"],
            "partitions": [
                {
                    "name": "default",
                    "descr": "processes on this machine, launched with mpiexec -n N",
                    "scheduler": "local",
                    "launcher": "mpiexec",
                    "environs": ["builtin"],
                    "max_jobs": 1,
                }
            ],
        }
    ],
    # the environment "builtin" is ReFrame's own (no modules: PATH as the caller set it)
}
