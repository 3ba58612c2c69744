#!/bin/bash
# One GPU per rank, ALCF's set_affinity_gpu_polaris.sh (https://docs.alcf.anl.gov/polaris/running-jobs/using-gpus/):
# node-local rank from PMI_LOCAL_RANK (Cray MPICH's mpiexec); GPUs in reverse order because on Polaris
# GPU 3 is nearest cores 0-7 and GPU 0 nearest cores 24-31, and --depth/--cpu-bind depth puts local rank 0
# on cores 0-7. Each rank then sees one GPU, which CuPy numbers 0.
num_gpus=4
gpu=$((num_gpus - 1 - PMI_LOCAL_RANK % num_gpus))
export CUDA_VISIBLE_DEVICES=$gpu
exec "$@"
