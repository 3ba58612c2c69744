#!/usr/bin/env bash
# Regenerates the sample traces of this directory: an 8-rank sweep of gpt-tiny on one node.
#   weak-*:  weak scaling, 1 -> 8 ranks, 2 sequences per rank (tensor-parallel grids)
#   grid-*:  8 ranks, four grid shapes, and overlap all on 1x2x2x2
# Usage: results/samples/make_samples.sh [MPIEXEC] [PYTHON]   (from the repository root)
set -euo pipefail
MPIEXEC=${1:-.venv/bin/mpiexec}
PYTHON=${2:-.venv/bin/python}
OUT=results/samples
export OMP_NUM_THREADS=1
run() {  # ranks run-id options...
  local n=$1 id=$2; shift 2
  "$MPIEXEC" -n "$n" "$PYTHON" -m fourd_mpi run --model gpt-tiny --steps 4 --warmup 1 --display quiet \
    --results-dir "$OUT" --run-id "$id" --force "$@"
}
run 1 weak-1 --batch 2
run 2 weak-2 --batch 4 --gx 2
run 4 weak-4 --batch 8 --gx 2 --gy 2
run 8 weak-8 --batch 16 --gx 2 --gy 2 --gz 2
run 8 grid-1x2x2x2-overlap --batch 16 --gx 2 --gy 2 --gz 2 --overlap all --label grids
run 8 grid-1x1x2x4 --batch 16 --gx 4 --gy 2 --label grids
run 8 grid-2x2x1x2 --batch 16 --gdata 2 --gz 2 --gx 2 --label grids
run 8 grid-8x1x1x1 --batch 16 --gdata 8 --label grids
