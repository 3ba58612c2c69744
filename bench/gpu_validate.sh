#!/usr/bin/env bash
# GPU validation of the CuPy path on one GPU machine, stage by stage; every stage logs to
# $OUT/<stage>.log (OUT defaults to ./gpu-out).
#
#   bash bench/gpu_validate.sh setup info gputests verify     # correctness
#   bash bench/gpu_validate.sh setup alltests                 # the whole suite
#   bash bench/gpu_validate.sh setup bench breakdown overlap  # performance
#
# setup: a venv in /tmp/fourd-gpu that sees the machine's own Python packages (CuPy, NumPy,
#   h5py, pytest, ...) and installs the wheels in .whl/ (the mpich wheel, mpi4py, jsonschema
#   and what it needs) without an index: GPU machines often reach no package registry.
# info: nvidia-smi, CuPy/CUDA versions, the MPI library, what device-buffer detection decides.
# gputests: tests/core/test_gpu.py. alltests: the whole suite (Slurm tests skip without Slurm).
# verify: the CuPy step against the NumPy single-rank reference, 1, 2 and 4 ranks sharing the
#   GPU, every grid, overlap none and all, float32 / TF32 / float16 / bfloat16.
# bench: bench/gpu_bench.py at gpt-small size and at hidden 4096 and 8192, seq 2048.
# breakdown: a 1-rank and a 2-rank run, analyze --what breakdown and --what comm.
# overlap: 2 ranks sharing the GPU with staging and host polling, overlap % per collective.
# fused: the fused attention kernels (PyTorch SDPA) against the unfused ones, and verify with them.
# mfu: step time, MFU and op breakdown of gpt h4096 s2048 bf16, unfused vs fused attention, 1 and 2 ranks.
# copy: host<->device copies inside a staged 2-rank step vs the same copies alone (bench/gpu_copy.py).
# peer: bench/peer_axonn.py at 8 and 16 ranks on the machine's cores (CPU).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
VENV=/tmp/fourd-gpu
PY=$VENV/bin/python
SYS_PY=$(command -v python3)  # the machine's Python, before our venv goes first on PATH
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export PATH=$VENV/bin:$PATH
RES=${RES:-$OUT/runs}  # traces: RES=/tmp/... keeps them out of $OUT
mkdir -p "$RES"

stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log, never stop the script
    local name=$1 limit=$2
    shift 2
    echo "### $name: $*" | tee -a "$OUT/$name.log"
    timeout -k 10 "$limit" "$@" >>"$OUT/$name.log" 2>&1
    local rc=$?
    echo "### $name rc=$rc" | tee -a "$OUT/$name.log"
    tail -n 25 "$OUT/$name.log"
}

for what in "$@"; do
    case $what in
    setup)
        if [ -x "$PY" ] && $PY -c 'import cupy, mpi4py' 2>/dev/null; then echo "setup: $VENV exists"; continue; fi
        site=$("$SYS_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        "$SYS_PY" -m venv --without-pip "$VENV"
        mine=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        echo "$site" >"$mine/machine-packages.pth"  # after our own site-packages: our wheels win
        "$SYS_PY" -m pip --python "$PY" install -q --no-index --no-deps --no-compile .whl/*.whl
        $PY -c 'import mpi4py, cupy, numpy, h5py; from mpi4py import MPI; print("mpi4py", mpi4py.__version__, "cupy", cupy.__version__, "numpy", numpy.__version__, MPI.Get_library_version().splitlines()[0])'
        ;;
    info)
        stage info 120 bash -c "nvidia-smi; $PY -c 'import cupy; cupy.show_config()'; \
            $PY -m fourd_mpi info --backend cupy; mpiexec -n 2 $PY -m fourd_mpi info --backend cupy --gx 2"
        ;;
    gputests)
        stage gputests 420 $PY -m pytest -q -rs tests/core/test_gpu.py -p no:cacheprovider
        ;;
    alltests)
        stage alltests 540 $PY -m pytest -q -rs --timeout 300 tests -p no:cacheprovider
        ;;
    verify)  # VERIFY_NUMERICS="--dtype float16;--dtype bfloat16" checks only those; VERIFY_RANKS="1 2"
        IFS=';' read -ra NUMERICS <<<"${VERIFY_NUMERICS:---dtype float32;--dtype float32 --tf32;--dtype float16;--dtype bfloat16}"
        for n in ${VERIFY_RANKS:-1 2 4}; do
            # shellcheck disable=SC2086  # $num holds several options
            for num in "${NUMERICS[@]}"; do
                stage "verify" 300 mpiexec -n $n $PY -m fourd_mpi verify --backend cupy --reference-backend numpy \
                    $num --all-grids --overlap none --overlap all --steps 3
            done
        done
        ;;
    benchsmall)
        stage bench 300 $PY bench/gpu_bench.py --dtypes float32,tf32,float16,bfloat16 --json "$OUT/bench-small.json"
        ;;
    bench)
        stage bench 300 $PY bench/gpu_bench.py --dtypes float32,tf32,float16,bfloat16 --json "$OUT/bench-small.json"
        for h in 4096 8192; do
            stage bench 300 $PY bench/gpu_bench.py --hidden $h --heads 32 --seq 2048 --batch 4 --layers 2 \
                --dtypes tf32,bfloat16 --json "$OUT/bench-h$h.json"
        done
        stage bench 300 mpiexec -n 2 $PY bench/gpu_bench.py --dtypes float32 --warmup 2 --steps 5
        ;;
    breakdown)  # BREAKDOWN_RANKS="1" runs only the single-rank case
        for n in ${BREAKDOWN_RANKS:-1 2}; do
            stage breakdown 150 mpiexec -n "$n" $PY -m fourd_mpi run --backend cupy --model gpt-small --dtype bfloat16 \
                --layers 2 --hidden 4096 --heads 32 --seq 2048 --batch 4 --steps 6 --warmup 2 --overlap all \
                --results-dir "$RES" --run-id "bd-$n" --display quiet
            stage breakdown 120 $PY -m fourd_mpi analyze "$RES/bd-$n.h5" --what breakdown
        done
        ;;
    overlap)
        for mode in none all; do
            stage overlap 100 mpiexec -n 2 $PY -m fourd_mpi run --backend cupy --model gpt-small --dtype float32 --tf32 \
                --gx 2 --layers 2 --hidden 2048 --seq 1024 --batch 8 --steps 6 --warmup 2 --overlap $mode \
                --progress poll --device-buffers staged --results-dir "$RES" --run-id "ov-$mode" --display quiet
            stage overlap 120 $PY -m fourd_mpi analyze "$RES/ov-$mode.h5" --what comm
        done
        ;;
    fused)  # the fused attention kernels against the unfused ones, then verify with them (bf16, fp16, fp32)
        stage fused 60 $PY -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'cuDNN', torch.backends.cudnn.version())"
        stage fused 240 $PY -m pytest -q -rs tests/core/test_gpu.py -k fused_attention -p no:cacheprovider
        for n in ${FUSED_RANKS:-1 2}; do
            for dt in bfloat16 float16 float32; do
                stage fused 150 mpiexec -n "$n" $PY -m fourd_mpi verify --backend cupy --reference-backend numpy \
                    --dtype $dt --attention fused --all-grids --overlap none --overlap all --steps 3
            done
        done
        ;;
    mfu)  # MFU: gpt h4096 s2048 bf16, unfused vs fused attention; trace level step (no synchronisations inside
          # the step) for the step time and MFU, level op (synchronised, event-timed ops) for the breakdown
        for cfg in ${MFU_CASES:-1:unfused:4 1:fused:4 1:unfused:16 1:fused:16 2:fused:16}; do
            IFS=: read -r n att b <<<"$cfg"
            grid=""; [ "$n" = 2 ] && grid="--gx 2"
            # shellcheck disable=SC2086  # $grid holds an option or nothing
            for level in step op; do
                stage mfu 120 mpiexec -n "$n" $PY -m fourd_mpi run --backend cupy --model gpt-small --dtype bfloat16 \
                    --layers 2 --hidden 4096 --heads 32 --seq 2048 --batch "$b" --attention "$att" $grid --overlap all \
                    --steps 8 --warmup 2 --trace-level $level --results-dir "$RES" --run-id "mfu-$n-$att-$b-$level" \
                    --display lines
            done
            stage mfu 60 $PY -m fourd_mpi analyze "$RES/mfu-$n-$att-$b-op.h5" --what breakdown
        done
        ;;
    copy)  # staged copies inside a 2-rank step (analyze --what comm: d2h/h2d rows) vs the same copies alone
        stage copy 120 $PY bench/gpu_copy.py --sizes 4MiB,16MiB,64MiB,256MiB --json "$OUT/copy.json"
        stage copy 150 mpiexec -n 2 $PY -m fourd_mpi run --backend cupy --model gpt-small --dtype bfloat16 --gx 2 \
            --layers 2 --hidden 4096 --heads 32 --seq 2048 --batch 8 --steps 5 --warmup 1 --overlap all \
            --device-buffers staged --trace-level op --results-dir "$RES" --run-id copy-3 --display quiet
        stage copy 60 $PY -m fourd_mpi analyze "$RES/copy-3.h5" --what comm
        ;;
    peer)  # the AxoNN peer benchmark at 8 and 16 ranks on the 16 cores (CPU, no oversubscription), alternating;
           # no GPU visible: AxoNN takes NCCL whenever torch sees one (8 ranks on one GPU: NCCL fails)
        export CUDA_VISIBLE_DEVICES=
        stage peer 200 $PY bench/peer_axonn.py --ranks 8 --grids ${PEER_GRIDS8:-2x2x2} --hidden 2048 --rounds 3 \
            --json "$OUT/peer8.json"
        stage peer 240 $PY bench/peer_axonn.py --ranks 16 --grids ${PEER_GRIDS16:-2x2x4} --hidden 2048 --rounds 3 \
            --json "$OUT/peer16.json"
        ;;
    *) echo "unknown stage $what" >&2; exit 2 ;;
    esac
done
