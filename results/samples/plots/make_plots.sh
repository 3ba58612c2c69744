#!/usr/bin/env bash
# Regenerates the figures of this directory from the committed sample traces (no MPI, one process).
# Usage: results/samples/plots/make_plots.sh [FOURD_MPI]   (from the repository root)
set -euo pipefail
FOURD=${1:-.venv/bin/fourd-mpi}
S=results/samples
P=$S/plots
"$FOURD" plot scaling $S/weak-*.h5 --scaling weak --force -o $P/scaling.png
"$FOURD" plot breakdown $S/grid-*.h5 --force -o $P/breakdown.png
"$FOURD" plot timeline $S/grid-1x2x2x2-overlap.h5 --force -o $P/timeline.png
# overlap_pct of every grid run (an upper bound), and hidden_pct of the overlapped run against weak-8,
# the same model, grid (1x2x2x2) and batch without overlap
"$FOURD" plot overlap $S/grid-*.h5 --force -o $P/overlap.png
"$FOURD" plot overlap $S/grid-1x2x2x2-overlap.h5 --baseline $S/weak-8.h5 --force -o $P/hidden.png
