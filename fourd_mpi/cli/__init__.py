"""The command line (``fourd-mpi``): one module per command group, plus ``args`` (shared
parser pieces) and ``main`` (the parser and entry point). Nothing outside this package
imports it.
"""
