"""The history of runs: one JSON line per run in ``<results-dir>/index.jsonl`` (``index``) and the
selection of runs from it by field or configuration value (``query``). Offline: never imports
``mpi4py.MPI``; ``fourd-mpi run`` calls :func:`fourd_mpi.results.index.append_entry` on rank 0.
"""
