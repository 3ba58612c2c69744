#!/bin/bash
# One GPU per rank (ALCF's recipe for Polaris): node-local rank from PMI_LOCAL_RANK (Cray MPICH),
# GPUs in reverse order to match the CPU binding of --depth/--cpu-bind depth.
num_gpus=4
gpu=$((num_gpus - 1 - PMI_LOCAL_RANK % num_gpus))
export CUDA_VISIBLE_DEVICES=$gpu
exec "$@"
