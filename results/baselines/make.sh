#!/usr/bin/env bash
# Regenerates the two traces of results/baselines (README.md there says how they were made and what
# the machine was doing). Same configuration twice on CPUs 0-1: once as it is, once while two CPU hogs
# (`yes`, one pinned to each of the two CPUs) compete with the two ranks. Needs the repository's .venv
# (pip install -e ".[mpich]"). Usage: bash results/baselines/make.sh [OUTPUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
out=${1:-results/baselines}
mkdir -p "$out"
run=(taskset -c 0,1 .venv/bin/mpiexec -n 2 .venv/bin/fourd-mpi run --gx 2 --model gpt-tiny --steps 22 --warmup 2
     --trace-level step --results-dir "$out" --display quiet)
echo "baseline: load average before $(cut -d' ' -f1-3 /proc/loadavg)"
"${run[@]}" --run-id baseline-gpt-tiny-np2 | grep '^step time'
echo "baseline: load average after $(cut -d' ' -f1-3 /proc/loadavg)"
taskset -c 0 yes >/dev/null &
hog0=$!
taskset -c 1 yes >/dev/null &
hog1=$!
trap 'kill "$hog0" "$hog1"' EXIT
sleep 1
echo "slower: load average before $(cut -d' ' -f1-3 /proc/loadavg) (two hogs running)"
"${run[@]}" --run-id slower-gpt-tiny-np2 | grep '^step time'
echo "slower: load average after $(cut -d' ' -f1-3 /proc/loadavg)"
