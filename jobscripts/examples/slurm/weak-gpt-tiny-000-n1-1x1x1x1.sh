#!/bin/bash
#SBATCH --job-name=weak-gpt-tiny-000-n1-1x1x1x1
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=00:10:00
#SBATCH --output=jobscripts/examples/slurm/logs/weak-gpt-tiny-000-n1-1x1x1x1.out
# fourd-mpi sweep weak-gpt-tiny: run 1 of 4 on site slurm
#   1 ranks = 1 node(s) x 1 ranks per node
#   grid 1x1x1x1 (G_data x G_z x G_y x G_x), model gpt-tiny, global batch 8
#   estimated memory per rank: 3.01 MiB
# Rendered by fourd-mpi 0.1.0 from jobscripts/weak-gpt-tiny.yaml; re-render rather than edit.
set -eo pipefail
export OMP_NUM_THREADS=1
export OPENBLAS_NUM_THREADS=1
# the launcher and interpreter this job runs: one line if either is missing (exit 127)
tool=srun; command -v "$tool" >/dev/null 2>&1 || { echo "fourd-mpi job: $tool not found on $(hostname) (PATH=$PATH): render the sweep from the environment that has fourd-mpi, or give sweep render --python PATH" >&2; exit 127; }
tool=python3; command -v "$tool" >/dev/null 2>&1 || { echo "fourd-mpi job: $tool not found on $(hostname) (PATH=$PATH): render the sweep from the environment that has fourd-mpi, or give sweep render --python PATH" >&2; exit 127; }
echo "fourd-mpi sweep weak-gpt-tiny run weak-gpt-tiny-000-n1-1x1x1x1 on $(hostname) at $(date -u +%FT%TZ)"
srun --mpi=pmi2 -N 1 -n 1 --ntasks-per-node=1 python3 -m fourd_mpi run --gdata 1 --gz 1 --gy 1 --gx 1 --model gpt-tiny --steps=6 --warmup=1 --trace-level=op --overlap=none --results-dir results/weak-gpt-tiny/slurm --run-id weak-gpt-tiny-000-n1-1x1x1x1 --display lines
