#!/bin/bash
#$ -N weak-gpt-tiny-001-n2-1x1x1x2
#$ -S /bin/bash
#$ -cwd
#$ -pe mpi 2
#$ -l h_rt=00:10:00
#$ -j y
#$ -o jobscripts/examples/sge/logs/weak-gpt-tiny-001-n2-1x1x1x2.out
# fourd-mpi sweep weak-gpt-tiny: run 2 of 4 on site sge
#   2 ranks = 1 node(s) x 2 ranks per node
#   grid 1x1x1x2 (G_data x G_z x G_y x G_x), model gpt-tiny, global batch 16
#   estimated memory per rank: 3.76 MiB
# Rendered by fourd-mpi 0.1.0 from jobscripts/weak-gpt-tiny.yaml; re-render rather than edit.
set -eo pipefail
export OMP_NUM_THREADS=1
export OPENBLAS_NUM_THREADS=1
# the launcher and interpreter this job runs: one line if either is missing (exit 127)
tool=mpiexec; command -v "$tool" >/dev/null 2>&1 || { echo "fourd-mpi job: $tool not found on $(hostname) (PATH=$PATH): render the sweep from the environment that has fourd-mpi, or give sweep render --python PATH" >&2; exit 127; }
tool=python3; command -v "$tool" >/dev/null 2>&1 || { echo "fourd-mpi job: $tool not found on $(hostname) (PATH=$PATH): render the sweep from the environment that has fourd-mpi, or give sweep render --python PATH" >&2; exit 127; }
echo "fourd-mpi sweep weak-gpt-tiny run weak-gpt-tiny-001-n2-1x1x1x2 on $(hostname) at $(date -u +%FT%TZ)"
mpiexec -n 2 python3 -m fourd_mpi run --gdata 1 --gz 1 --gy 1 --gx 2 --model gpt-tiny --batch 16 --steps=6 --warmup=1 --trace-level=op --overlap=none --results-dir results/weak-gpt-tiny/sge --run-id weak-gpt-tiny-001-n2-1x1x1x2 --display lines
