#!/bin/bash
#SBATCH --job-name=weak-gpt-tiny-000-n1-1x1x1x1
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=7
#SBATCH --time=00:10:00
#SBATCH --output=jobscripts/examples/frontier/logs/weak-gpt-tiny-000-n1-1x1x1x1.out
#SBATCH --account=PROJECT123
#SBATCH --partition=batch
#SBATCH --gpus-per-node=8
# fourd-mpi sweep weak-gpt-tiny: run 1 of 4 on site frontier
#   1 ranks = 1 node(s) x 1 ranks per node, one GPU per rank
#   grid 1x1x1x1 (G_data x G_z x G_y x G_x), model gpt-tiny, global batch 8
#   estimated memory per rank: 3.01 MiB
# Rendered by fourd-mpi 0.1.0 from jobscripts/weak-gpt-tiny.yaml; re-render rather than edit.
set -eo pipefail
module load PrgEnv-gnu/8.7.0
module load cpe/26.03
module load miniforge3/23.11.0-0
module load rocm/7.0.2
module load craype-accel-amd-gfx90a
export MPICH_GPU_SUPPORT_ENABLED=1
export OMP_NUM_THREADS=7
export ROCM_HOME="${ROCM_PATH}"
export LD_LIBRARY_PATH="${CRAY_LD_LIBRARY_PATH}:${LD_LIBRARY_PATH}"
# the launcher and interpreter this job runs: one line if either is missing (exit 127)
tool=srun; command -v "$tool" >/dev/null 2>&1 || { echo "fourd-mpi job: $tool not found on $(hostname) (PATH=$PATH): render the sweep from the environment that has fourd-mpi, or give sweep render --python PATH" >&2; exit 127; }
tool=python3; command -v "$tool" >/dev/null 2>&1 || { echo "fourd-mpi job: $tool not found on $(hostname) (PATH=$PATH): render the sweep from the environment that has fourd-mpi, or give sweep render --python PATH" >&2; exit 127; }
echo "fourd-mpi sweep weak-gpt-tiny run weak-gpt-tiny-000-n1-1x1x1x1 on $(hostname) at $(date -u +%FT%TZ)"
srun -N 1 -n 1 --ntasks-per-node=1 -c 7 jobscripts/examples/frontier/gpu_affinity.sh python3 -m fourd_mpi run --backend cupy --gdata 1 --gz 1 --gy 1 --gx 1 --model gpt-tiny --steps=6 --warmup=1 --trace-level=op --overlap=none --results-dir results/weak-gpt-tiny/frontier --run-id weak-gpt-tiny-000-n1-1x1x1x1 --display lines
