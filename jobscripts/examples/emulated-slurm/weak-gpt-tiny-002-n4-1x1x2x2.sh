#!/bin/bash
#SBATCH --job-name=weak-gpt-tiny-002-n4-1x1x2x2
#SBATCH --nodes=1
#SBATCH --ntasks=4
#SBATCH --ntasks-per-node=4
#SBATCH --time=00:10:00
#SBATCH --output=jobscripts/examples/emulated-slurm/logs/weak-gpt-tiny-002-n4-1x1x2x2.out
# fourd-mpi sweep weak-gpt-tiny: run 3 of 4 on site emulated-slurm
#   4 ranks = 1 node(s) x 4 ranks per node
#   grid 1x1x2x2 (G_data x G_z x G_y x G_x), model gpt-tiny, global batch 32
#   estimated memory per rank: 3.89 MiB
# Rendered by fourd-mpi 0.1.0 from jobscripts/weak-gpt-tiny.yaml; re-render rather than edit.
set -eo pipefail
export OMP_NUM_THREADS=1
export OPENBLAS_NUM_THREADS=1
export UCX_TLS=tcp,self
# the launcher and interpreter this job runs: one line if either is missing (exit 127)
tool=mpiexec; command -v "$tool" >/dev/null 2>&1 || { echo "fourd-mpi job: $tool not found on $(hostname) (PATH=$PATH): render the sweep from the environment that has fourd-mpi, or give sweep render --python PATH" >&2; exit 127; }
tool=python3; command -v "$tool" >/dev/null 2>&1 || { echo "fourd-mpi job: $tool not found on $(hostname) (PATH=$PATH): render the sweep from the environment that has fourd-mpi, or give sweep render --python PATH" >&2; exit 127; }
echo "fourd-mpi sweep weak-gpt-tiny run weak-gpt-tiny-002-n4-1x1x2x2 on $(hostname) at $(date -u +%FT%TZ)"
mpiexec -iface eth0 -n 4 python3 -m fourd_mpi run --gdata 1 --gz 1 --gy 2 --gx 2 --model gpt-tiny --batch 32 --steps=6 --warmup=1 --trace-level=op --overlap=none --results-dir results/weak-gpt-tiny/emulated-slurm --run-id weak-gpt-tiny-002-n4-1x1x2x2 --display lines
