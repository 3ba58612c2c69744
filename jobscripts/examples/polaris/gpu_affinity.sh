#!/bin/bash
# GPU affinity of site polaris: every rank starts as "gpu_affinity.sh COMMAND..." and sees one GPU,
# the one closest to its cores: node-local rank r ($PMI_LOCAL_RANK) gets GPU gpus[r % 4] below.
# The launcher gives no rank a GPU cgroup of its own (no --gpus-per-task or --gpu-bind): each rank can still open
# the other GPUs' memory, which GPU-aware MPI needs for its intra-node IPC path (docs/sites.md, "GPU binding and
# CUDA IPC"). The order and its sources: the comments of the site file of polaris.
# Rendered by fourd-mpi; re-render rather than edit.
set -eo pipefail
gpus=(3 2 1 0)
local_rank=${PMI_LOCAL_RANK:?"fourd-mpi gpu_affinity.sh: PMI_LOCAL_RANK is not set (start this wrapper under the site's launcher)"}
case $local_rank in
  ''|*[!0-9]*) echo "fourd-mpi gpu_affinity.sh: PMI_LOCAL_RANK=$local_rank is not a rank number" >&2; exit 2 ;;
esac
export CUDA_VISIBLE_DEVICES="${gpus[local_rank % 4]}"
exec "$@"
