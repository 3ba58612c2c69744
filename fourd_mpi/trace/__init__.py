"""The trace pipeline: event schema and per-rank recorder (``events``), spool files, merge and
recovery (``store``), the reader and its invariants (``read``), the per-run summary. No MPI
imports except inside the merge that a live run calls.
"""
