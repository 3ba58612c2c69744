#!/bin/bash
#SBATCH --job-name=weak-gpt-tiny-001-n2-1x1x1x2
#SBATCH --nodes=1
#SBATCH --ntasks=2
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=32
#SBATCH --time=00:10:00
#SBATCH --output=jobscripts/examples/perlmutter/logs/weak-gpt-tiny-001-n2-1x1x1x2.out
#SBATCH --account=PROJECT123
#SBATCH --qos=regular
#SBATCH --constraint=gpu
#SBATCH --gpus-per-node=4
# fourd-mpi sweep weak-gpt-tiny: run 2 of 4 on site perlmutter
#   2 ranks = 1 node(s) x 2 ranks per node, one GPU per rank
#   grid 1x1x1x2 (G_data x G_z x G_y x G_x), model gpt-tiny, global batch 16
#   estimated memory per rank: 3.76 MiB
# Rendered by fourd-mpi 0.1.0 from jobscripts/weak-gpt-tiny.yaml; re-render rather than edit.
set -eo pipefail
module load PrgEnv-gnu
module load cudatoolkit
module load craype-accel-nvidia80
module load cray-mpich
module load python
export MPICH_GPU_SUPPORT_ENABLED=1
export MPICH_OFI_NIC_POLICY=GPU
export OMP_NUM_THREADS=16
export SLURM_CPU_BIND=cores
# the launcher and interpreter this job runs: one line if either is missing (exit 127)
tool=srun; command -v "$tool" >/dev/null 2>&1 || { echo "fourd-mpi job: $tool not found on $(hostname) (PATH=$PATH): render the sweep from the environment that has fourd-mpi, or give sweep render --python PATH" >&2; exit 127; }
tool=python3; command -v "$tool" >/dev/null 2>&1 || { echo "fourd-mpi job: $tool not found on $(hostname) (PATH=$PATH): render the sweep from the environment that has fourd-mpi, or give sweep render --python PATH" >&2; exit 127; }
echo "fourd-mpi sweep weak-gpt-tiny run weak-gpt-tiny-001-n2-1x1x1x2 on $(hostname) at $(date -u +%FT%TZ)"
srun --cpu-bind=cores -N 1 -n 2 --ntasks-per-node=2 -c 32 jobscripts/examples/perlmutter/gpu_affinity.sh python3 -m fourd_mpi run --backend cupy --gdata 1 --gz 1 --gy 1 --gx 2 --model gpt-tiny --batch 16 --steps=6 --warmup=1 --trace-level=op --overlap=none --results-dir results/weak-gpt-tiny/perlmutter --run-id weak-gpt-tiny-001-n2-1x1x1x2 --display lines
