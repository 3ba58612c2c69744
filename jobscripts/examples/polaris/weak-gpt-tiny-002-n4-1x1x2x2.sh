#!/bin/bash
#PBS -N weak-gpt-tiny-002-n4-1x1x2x2
#PBS -l select=1:system=polaris
#PBS -l place=scatter
#PBS -l filesystems=home:eagle
#PBS -l walltime=00:10:00
#PBS -q debug
#PBS -A PROJECT123
#PBS -j oe
#PBS -o jobscripts/examples/polaris/logs/weak-gpt-tiny-002-n4-1x1x2x2.out
# fourd-mpi sweep weak-gpt-tiny: run 3 of 4 on site polaris
#   4 ranks = 1 node(s) x 4 ranks per node, one GPU per rank
#   grid 1x1x2x2 (G_data x G_z x G_y x G_x), model gpt-tiny, global batch 32
#   estimated memory per rank: 3.89 MiB
# Rendered by fourd-mpi 0.1.0 from jobscripts/weak-gpt-tiny.yaml; re-render rather than edit.
set -eo pipefail
cd "${PBS_O_WORKDIR}"
module use /soft/modulefiles
module load craype-accel-nvidia80
module load conda
export MPICH_GPU_SUPPORT_ENABLED=1
export OMP_NUM_THREADS=8
conda activate base
# the launcher and interpreter this job runs: one line if either is missing (exit 127)
tool=mpiexec; command -v "$tool" >/dev/null 2>&1 || { echo "fourd-mpi job: $tool not found on $(hostname) (PATH=$PATH): render the sweep from the environment that has fourd-mpi, or give sweep render --python PATH" >&2; exit 127; }
tool=python3; command -v "$tool" >/dev/null 2>&1 || { echo "fourd-mpi job: $tool not found on $(hostname) (PATH=$PATH): render the sweep from the environment that has fourd-mpi, or give sweep render --python PATH" >&2; exit 127; }
echo "fourd-mpi sweep weak-gpt-tiny run weak-gpt-tiny-002-n4-1x1x2x2 on $(hostname) at $(date -u +%FT%TZ)"
mpiexec -n 4 --ppn 4 --depth 8 --cpu-bind depth jobscripts/examples/polaris/gpu_affinity.sh python3 -m fourd_mpi run --backend cupy --gdata 1 --gz 1 --gy 2 --gx 2 --model gpt-tiny --batch 32 --steps=6 --warmup=1 --trace-level=op --overlap=none --results-dir results/weak-gpt-tiny/polaris --run-id weak-gpt-tiny-002-n4-1x1x2x2 --display lines
