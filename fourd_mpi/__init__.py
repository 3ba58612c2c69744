"""fourd_mpi: an MPI-native benchmark suite for 4D hybrid parallel training
(data parallelism x 3D tensor parallelism, as in AxoNN).

Subpackages, one role each (docs/layout.md lists every module):

- :mod:`fourd_mpi.core` — the grid, layouts, array backends, GPU-aware MPI detection,
  progress strategies, and the collectives (the only code that calls MPI collectives);
- :mod:`fourd_mpi.step` — kernels, layers, model, synthetic data, optimizers, the overlap
  schedule and the step engine, model presets;
- :mod:`fourd_mpi.run` — run options (declared once), building a run, the traced session,
  verification against the serial reference, metadata, console display, the collective micro-benchmark;
- :mod:`fourd_mpi.trace` — event schema and recorder, per-rank spool and merge, reader, summary;
- :mod:`fourd_mpi.analysis` — tables, figures, Perfetto and Caliper/Thicket exports, the model against traces;
- :mod:`fourd_mpi.perf` — the performance model only (pure): predictions, tuner, calibration fits;
- :mod:`fourd_mpi.jobs` — sweep specs, site profiles, schedulers, job scripts;
- :mod:`fourd_mpi.util` — small pure helpers;
- :mod:`fourd_mpi.cli` — the command line; nothing else imports it.

Importing this package, or any offline subpackage, never initializes MPI, and no import climbs the package
order errors < util < core < step < algorithms < perf < results < trace < run < analysis < jobs < testbed < cli
(docs/design.md section 7).
"""

__version__ = "0.1.0"
