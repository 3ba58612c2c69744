"""fourd_mpi: an MPI-native benchmark suite for 4D hybrid parallel training
(data parallelism x 3D tensor parallelism, as in AxoNN).

One subpackage per role, one job per module: docs/layout.md lists every subpackage and module, in the package
order that no import climbs (the import rules: docs/design.md section 7). Importing this package, or any
offline subpackage, never initializes MPI.
"""

__version__ = "0.1.0"
