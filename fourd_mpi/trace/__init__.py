"""The trace pipeline, one role per module (no MPI imports except inside the merge that a live run calls).

pip's h5py has no parallel HDF5 (docs/design.md section 4), so:

1. During the run each rank appends its events and one step record per step to its own files in the
   *spool directory* ``<results>/<run-id>.ranks/`` (:mod:`~fourd_mpi.trace.spool`; the event schema and
   per-rank recorder: :mod:`~fourd_mpi.trace.events`, clocks: :mod:`~fourd_mpi.trace.clocks`).
2. At the end, the ranks send their events over MPI to the lowest rank of their group of
   ``--trace-group-size`` consecutive ranks (nobody reads another rank's files); with one group rank 0
   writes ``<results>/<run-id>.h5`` itself, with several each group writes a part file
   (:mod:`~fourd_mpi.trace.parts`) and rank 0 a top-level file that binds them
   (:mod:`~fourd_mpi.trace.merge`, :mod:`~fourd_mpi.trace.writer`). The trace is written under a
   temporary name, then published with ``link`` (never overwrites; ``--force``: rename over it). Only
   then is the spool removed.
3. After a crash, :func:`fourd_mpi.trace.recover.recover` builds a ``partial`` (or ``failed``) trace
   from the spool: the steps every rank completed, group by group (:mod:`~fourd_mpi.trace.rebuild`).

Beneath them: :mod:`~fourd_mpi.trace.files` (names, paths, record types, small I/O) and
:mod:`~fourd_mpi.trace.guarded` (the file object under the HDF5 writer). Above them: the reader
(:mod:`~fourd_mpi.trace.read`; its one pass over the events, :mod:`~fourd_mpi.trace.scan`; damage,
:mod:`~fourd_mpi.trace.damage`), the invariants (:mod:`~fourd_mpi.trace.invariants`), the per-run summary
(:mod:`~fourd_mpi.trace.summary`) and a trace's line in the results index (:mod:`~fourd_mpi.trace.indexing`;
the index file itself, :mod:`fourd_mpi.results.index`, reads no trace and sits below this package).
The file layout is documented in ``docs/trace-format.md``.
"""
