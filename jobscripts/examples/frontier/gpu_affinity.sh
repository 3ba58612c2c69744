#!/bin/bash
# GPU affinity of site frontier: every rank starts as "gpu_affinity.sh COMMAND..." and sees one GPU,
# the one closest to its cores: node-local rank r ($SLURM_LOCALID) gets GPU gpus[r % 8] below.
# The launcher gives no rank a GPU cgroup of its own (no --gpus-per-task or --gpu-bind): each rank can still open
# the other GPUs' memory, which GPU-aware MPI needs for its intra-node IPC path (docs/sites.md, "GPU binding and
# CUDA IPC"). The order and its sources: the comments of the site file of frontier.
# Rendered by fourd-mpi; re-render rather than edit.
set -eo pipefail
gpus=(4 5 2 3 6 7 0 1)
local_rank=${SLURM_LOCALID:?"fourd-mpi gpu_affinity.sh: SLURM_LOCALID is not set (start this wrapper under the site's launcher)"}
case $local_rank in
  ''|*[!0-9]*) echo "fourd-mpi gpu_affinity.sh: SLURM_LOCALID=$local_rank is not a rank number" >&2; exit 2 ;;
esac
export ROCR_VISIBLE_DEVICES="${gpus[local_rank % 8]}"
exec "$@"
