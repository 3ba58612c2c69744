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
#
# CUDA-aware MPI (packaging/cuda-mpi/build.sh; docs/design.md section 5c), one device call of at most 10 minutes:
#
#   bash bench/gpu_validate.sh cudampi-all       # run: carry .whl and .cudampi; results/benchmarks/gpu/README.md
#   bash bench/gpu_validate.sh prepare openmpi   # HERE, before: .whl (cp312 wheels) and .cudampi/KEY.tar.zst
#   GPU_REHEARSAL=1 bash bench/gpu_validate.sh cudampi-all   # HERE, no GPU: the same stages on NumPy, tiny
#   bash bench/gpu_validate.sh list              # the stages, their time limits and the total
#
# cudampi-all = cset cipc chost cverify2 ccoll cstep cmfu cverify4 summary pack (CUDAMPI_STAGES below; each
# command under `timeout`, the limits sum to at most 540 s; name stages instead of cudampi-all to run fewer, and
# GPU_DEADLINE_S=S to skip any run that could end past S seconds). cset: unpack .cudampi/*.tar.zst
# (CUDAMPI_IMPL=openmpi|mpich picks one; CUDAMPI_ARCHIVE=FILE names it) into /tmp/fourd-cudampi, source its env.sh,
# install the wheels of $WHEELS (.whl) into /tmp/fourd-cudampi/site without an index, print driver, CUDA, CuPy,
# BUILDINFO, mpi4py and `fourd-mpi info` on 2 ranks. cipc: bench/gpu_ipc_probe.py (CUDA IPC between the 2 ranks,
# cudaHostRegister, pinned copy GB/s, host MPI_Allreduce GB/s). chost: bench/gpu_coll.py on host arrays (NumPy,
# float32) at the step's sizes: the MPI path under every staged collective, without the device.
# cverify2/cverify4: verify --device-buffers MODE for each of CUDAMPI_MODES (default "auto staged"), 2 / 4 ranks
# on the one GPU, every grid, overlap none and all, bfloat16 (fused attention where torch imports) and float32.
# ccoll: bench/gpu_coll.py, the step's collectives on device buffers, direct and staged alternating. cstep: the
# 2-rank bf16 gpt h4096 s2048 batch 16 step, the CUDAMPI_MODES alternating twice, medians. cmfu: the 1-rank MFU run
# (batch 16, fused attention). summary: $OUT/summary.md (one table). pack: the logs into $OUT/logs.tar.gz.
# What comes back: summary.md, logs.tar.gz, coll.json (the device tool returns at most 8 files).
# GPU_REHEARSAL=1: backend numpy (staged = NumPy's emulated staging), float16 for bfloat16, tiny models, the
# wheels of $WHEELS (a cp311 set here) into GPU_PYTHON's target: the set-up path is the real one.
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

# -- CUDA-aware MPI stages (cudampi-all) -------------------------------------------------------------------
REPO=$PWD
REHEARSAL=${GPU_REHEARSAL:-0}
CROOT=${CUDAMPI_ROOT:-/tmp/fourd-cudampi}          # unpacked prefix, wheel target, traces
CSITE=$CROOT/site
CRES=$CROOT/runs
WHEELS=${WHEELS:-$REPO/.whl}
CPY=${GPU_PYTHON:-$SYS_PY}                         # the machine's Python (rehearsal: a venv without mpi4py)
#: stage:runs:seconds per run (each run under its own `timeout`); the product summed: at most 540 s
CUDAMPI_STAGES=(cset:3:15 cipc:1:25 chost:1:25 cverify2:4:25 ccoll:1:50 cstep:4:40 cmfu:1:35 cverify4:4:20 summary:1:5
                pack:1:5)
#: the buffer modes of cverify and cstep: auto (what a run does: direct where the library documents it, else staged)
#: and staged; "direct" forces every class (refused where the library documents a class as staged, 2026-11-28)
read -r -a MODES <<<"${CUDAMPI_MODES:-auto staged}"
CUDAMPI_BUDGET=540
#: no stage starts that could end after this many seconds of the script (x LIMIT_SCALE): the device call's 600 s
#: must leave room for summary and pack. GPU_DEADLINE_S=...
DEADLINE_S=${GPU_DEADLINE_S:-570}
SUMMARY_TSV=$OUT/summary.tsv
#: rehearsal: every limit times GPU_LIMIT_SCALE (default 3: 2 busy cores, NumPy; 1 on the GPU)
LIMIT_SCALE=${GPU_LIMIT_SCALE:-1}
if [ "$REHEARSAL" = 1 ]; then
    # NumPy has no bfloat16 and its float16 GEMMs crawl (and overflow in the step): float32 stands in
    CB=numpy; BF=float32; LIMIT_SCALE=${GPU_LIMIT_SCALE:-3}; VDTYPES=(float32)
    STEPM=(--hidden 128 --heads 4 --seq 64 --batch 4)
else
    CB=cupy; BF=bfloat16; VDTYPES=(bfloat16 float32)
    STEPM=(--hidden 4096 --heads 32 --seq 2048 --batch 16)
fi
DEADLINE=$((DEADLINE_S * LIMIT_SCALE))

limit_of() {  # limit_of STAGE: seconds per run of STAGE from CUDAMPI_STAGES
    local e
    for e in "${CUDAMPI_STAGES[@]}"; do
        IFS=: read -r n _ t <<<"$e"
        [ "$n" = "$1" ] && { echo $((t * LIMIT_SCALE)); return 0; }
    done
    echo "no stage $1 in CUDAMPI_STAGES" >&2
    return 1
}

cstage() {  # cstage STAGE LABEL PATTERN COMMAND...: stage() plus a summary row (label, limit, s, rc, last PATTERN line)
    local name=$1 label=$2 pattern=$3 limit t0 rc tmp key
    shift 3
    limit=$(limit_of "$name") || return 1
    if [ $((SECONDS + limit)) -gt "$DEADLINE" ]; then  # summary and pack must still fit in the device call
        printf '%s\t%s\t%s\t0\t-\tSKIPPED: would end past %ss of the script\n' "$name" "$label" "$limit" "$DEADLINE" >>"$SUMMARY_TSV"
        echo "### $name [$label] SKIPPED: $SECONDS s + ${limit}s > deadline ${DEADLINE}s"
        return 0
    fi
    tmp=$OUT/.$name.cur
    echo "### $name [$label] (limit ${limit}s): $*" | tee -a "$OUT/$name.log"
    t0=$SECONDS
    if [ "$(type -t "$1")" = function ]; then set -- bash -c '"$@"' bash "$@"; fi  # exported below
    timeout -k 5 "$limit" "$@" >"$tmp" 2>&1
    rc=$?
    cat "$tmp" >>"$OUT/$name.log"
    key=$(grep -aE "$pattern" "$tmp" | tail -n 1 | tr '\t|' '  ' | sed 's/  */ /g' | cut -c1-150)
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && key="TIMEOUT after ${limit}s; $key"
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$label" "$limit" "$((SECONDS - t0))" "$rc" "$key" >>"$SUMMARY_TSV"
    echo "### $name [$label] rc=$rc in $((SECONDS - t0))s: $key" | tee -a "$OUT/$name.log"
    tail -n 8 "$tmp"
    rm -f "$tmp"
}

pick_archive() {  # the carried CUDA-aware MPI: CUDAMPI_ARCHIVE, else .cudampi/${CUDAMPI_IMPL}*.tar.zst (newest)
    if [ -n "${CUDAMPI_ARCHIVE:-}" ]; then echo "$CUDAMPI_ARCHIVE"; return; fi
    local a
    # shellcheck disable=SC2012  # names made by build.sh: letters, digits, . _ -
    a=$(ls -t "$REPO/.cudampi/${CUDAMPI_IMPL:-}"*.tar.zst 2>/dev/null | head -n 1)
    [ -n "$a" ] || { echo "no archive in $REPO/.cudampi (bash bench/gpu_validate.sh prepare openmpi|mpich)" >&2; return 1; }
    echo "$a"
}

cudampi_setup() {  # unpack, env.sh, wheels without an index; exports what later stages need
    local arch
    arch=$(pick_archive) || return 1
    rm -rf "$CROOT" && mkdir -p "$CSITE" "$CRES" || return 1
    echo "wheels: $(cd "$WHEELS" && echo *.whl)"
    "$CPY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --target "$CSITE" "$WHEELS"/*.whl || return 1
    echo "archive: $arch ($(du -h "$arch" | cut -f1))"
    if command -v "${ZSTD:-zstd}" >/dev/null; then  # ZSTD=none: the Python fallback (rehearsal)
        "${ZSTD:-zstd}" -dc "$arch" | tar -C "$CROOT" -xf - || return 1
    else  # no zstd program: the carried zstandard wheel
        PYTHONPATH=$CSITE "$CPY" -c 'import sys, tarfile, zstandard
with open(sys.argv[1], "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as r, tarfile.open(fileobj=r, mode="r|") as t:
    t.extractall(sys.argv[2], filter="fully_trusted")' "$arch" "$CROOT" || return 1
    fi
    [ -f "$CROOT/prefix/env.sh" ] || { echo "no prefix/env.sh in $arch" >&2; return 1; }
}

cudampi_env() {  # the environment of every stage after cset (also when a later stage is run alone)
    [ -f "$CROOT/prefix/env.sh" ] || { echo "cudampi: run the cset stage first ($CROOT/prefix/env.sh missing)" >&2; return 1; }
    # shellcheck disable=SC1091
    source "$CROOT/prefix/env.sh"
    export PYTHONPATH=$CSITE:$REPO PY=$CPY
    # Open MPI as root, more ranks than cores allowed (4.1: OMPI_MCA_*; 5.x: PRRTE's); MPICH ignores them
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
    export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
    export HYDRA_LAUNCHER=fork
}

versions() {  # driver, CUDA, CuPy, MPI build, mpi4py (the rehearsal has no driver, CUDA or CuPy)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n 2
    "$CPY" -c 'import cupy; r = cupy.cuda.runtime; print("CuPy", cupy.__version__, "CUDA runtime", r.runtimeGetVersion(), "driver API", r.driverGetVersion())' 2>&1 | tail -n 1
    "$CPY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)' 2>&1 | tail -n 1
    echo "--- BUILDINFO"; cat "$CROOT/prefix/BUILDINFO"
    echo "--- env: MPI4PY_LIBMPI=$MPI4PY_LIBMPI PATH starts $(command -v mpiexec)"
    "$CPY" -c 'import mpi4py; from mpi4py import MPI; print("mpi4py", mpi4py.__version__, "from", mpi4py.__file__); print("MPI:", MPI.Get_library_version().splitlines()[0].strip())'
    if command -v ompi_info >/dev/null; then ompi_info --parsable --all 2>/dev/null | grep -E 'built_with_cuda_support:value|mpi_built_with_cuda_support:value|btl:smcuda:version' | head -n 4; fi
}

att_fused() {  # --attention fused where PyTorch imports (the GPU machine), else nothing
    if [ "$REHEARSAL" != 1 ] && "$CPY" -c 'import torch' 2>/dev/null; then echo "--attention fused"; fi
}

cverify() {  # cverify STAGE RANKS: verify direct and staged, bf16 and fp32
    local st=$1 n=$2 dt mode att a
    att=$(att_fused)
    for dt in "${VDTYPES[@]}"; do
        a=""; [ "$dt" = bfloat16 ] && a=$att
        for mode in "${MODES[@]}"; do
            # shellcheck disable=SC2086  # $a: an option or nothing
            cstage "$st" "$n ranks $dt $mode${a:+ fused}" 'passed, [0-9]+ failed|rror' \
                mpiexec -n "$n" "$PY" -m fourd_mpi verify --backend "$CB" --reference-backend numpy --dtype "$dt" \
                --device-buffers "$mode" $a --all-grids --overlap none --overlap all --steps 3
        done
    done
}

summary_md() {  # $OUT/summary.md from summary.tsv: one table; cstep's medians per mode below it
    {
        echo "# CUDA-aware MPI stages ($( [ "$REHEARSAL" = 1 ] && echo 'REHEARSAL on CPU, numpy' || echo GPU)), $(date -u +%FT%TZ)"
        echo
        echo "| stage | case | limit (s) | took (s) | rc | result |"
        echo "|---|---|---|---|---|---|"
        awk -F'\t' '{printf "| %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6}' "$SUMMARY_TSV"
        echo
        for mode in "${MODES[@]}"; do
            awk -F'\t' -v m="$mode" '$1 == "cstep" && $2 ~ m && $6 ~ /median/ {
                    sub(/.*median /, "", $6); sub(/ s.*/, "", $6); v[n++] = $6 + 0 }
                END { if (!n) { printf "cstep %s: no step time\n", m; exit }
                      for (i = 0; i < n; i++) for (j = i + 1; j < n; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
                      med = (n % 2) ? v[int(n / 2)] : (v[n / 2 - 1] + v[n / 2]) / 2
                      printf "cstep %s: median of %d run medians %.4f s\n", m, n, med }' "$SUMMARY_TSV"
        done
        echo "stage limits: $(IFS=' '; echo "${CUDAMPI_STAGES[*]}") (stage:runs:seconds), total $(stage_total) s"
    } >"$OUT/summary.md"
    cat "$OUT/summary.md"
}

# the functions a stage runs under `timeout` (a new bash) and what they read
export -f pick_archive cudampi_setup versions
export REPO CROOT CSITE CRES WHEELS CPY

stage_total() {
    local e n r t sum=0
    for e in "${CUDAMPI_STAGES[@]}"; do IFS=: read -r n r t <<<"$e"; sum=$((sum + r * t)); done
    echo "$sum"
}

prepare() {  # HERE (registry, cache): .whl for Python 3.12 and .cudampi/ARCHIVE of build.sh's cache; the payload size
    local impl=${1:-openmpi} cache=${FOURD_CUDA_MPI_CACHE:-/var/cache/fourd-mpi/cuda-mpi} a
    local plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
                --platform manylinux1_x86_64)
    mkdir -p "$WHEELS" "$REPO/.cudampi"
    "$SYS_PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${WHEEL_PY:-3.12}" --implementation cp \
        "${plat[@]}" -d "$WHEELS" mpi4py==4.1.2 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
        referencing==0.37.0 rpds-py==2026.9.1 zstandard==0.25.0 || return 1
    # shellcheck disable=SC2012
    a=$(ls -t "$cache/$impl"-*.tar.zst 2>/dev/null | head -n 1)
    [ -n "$a" ] || { echo "no $impl archive in $cache: bash packaging/cuda-mpi/build.sh $impl" >&2; return 1; }
    rm -f "$REPO/.cudampi/$impl"-*.tar.zst
    cp "$a" "$REPO/.cudampi/"
    payload
}

payload() {  # what a device call carries: the tree git sends plus the carried .whl and .cudampi (limit 64 MiB)
    local tree w c
    tree=$(cd "$REPO" && git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f1)
    tree=$((tree / 1024))
    w=$(du -sk "$WHEELS" 2>/dev/null | cut -f1); c=$(du -sk "$REPO/.cudampi" 2>/dev/null | cut -f1)
    echo "payload: tree ${tree} KiB + .whl ${w:-0} KiB + .cudampi ${c:-0} KiB = $(( (tree + ${w:-0} + ${c:-0}) / 1024 )) MiB (limit 64 MiB)"
    du -h "$REPO"/.cudampi/*.tar.zst 2>/dev/null || true
}

stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log, never stop the script
    local name=$1 limit=$2
    shift 2
    echo "### $name: $*" | tee -a "$OUT/$name.log"
    timeout -k 10 "$limit" "$@" >>"$OUT/$name.log" 2>&1
    local rc=$?
    echo "### $name rc=$rc" | tee -a "$OUT/$name.log"
    tail -n 25 "$OUT/$name.log"
}

args=()
for what in "$@"; do
    if [ "$what" = cudampi-all ]; then
        for e in "${CUDAMPI_STAGES[@]}"; do args+=("${e%%:*}"); done
    else
        args+=("$what")
    fi
done
set -- "${args[@]}"
while [ $# -gt 0 ]; do
    what=$1
    shift
    case $what in
    list)
        for e in "${CUDAMPI_STAGES[@]}"; do IFS=: read -r n r t <<<"$e"; printf '%-9s %2s x %3s s = %3s s\n' "$n" "$r" "$t" $((r * t)); done
        echo "total $(stage_total) s (budget $CUDAMPI_BUDGET s)"
        [ "$(stage_total)" -le "$CUDAMPI_BUDGET" ] || { echo "over budget" >&2; exit 1; }
        ;;
    prepare)  # prepare [openmpi|mpich]
        impl=openmpi
        if [ $# -gt 0 ] && { [ "$1" = openmpi ] || [ "$1" = mpich ]; }; then impl=$1; shift; fi
        prepare "$impl" || exit 1
        ;;
    payload) payload ;;
    cset|cunpack)  # cunpack: the set-up alone (tests/test_gpu_validate.py), no versions, no info
        : >"$SUMMARY_TSV"
        cstage cset "unpack, wheels" 'archive:|rror' cudampi_setup
        cudampi_env || exit 1
        if [ "$what" = cunpack ]; then
            echo "cunpack: MPI4PY_LIBMPI=$MPI4PY_LIBMPI mpiexec=$(command -v mpiexec) site=$CSITE"
            continue
        fi
        cstage cset versions 'MPI:|rror' versions
        cstage cset "info 2 ranks" 'MPI buffers|rror' mpiexec -n 2 "$PY" -m fourd_mpi info --backend "$CB" --gx 2
        ;;
    cverify2) cudampi_env || exit 1; cverify cverify2 2 ;;
    cverify4) cudampi_env || exit 1; cverify cverify4 4 ;;
    ccoll)
        cudampi_env || exit 1
        cstage ccoll "2 ranks gx2 $BF step sizes" '^allreduce |rror' mpiexec -n 2 "$PY" bench/gpu_coll.py \
            --backend "$CB" --dtype "$BF" --layers 2 "${STEPM[@]}" --gx 2 --rounds 2 --iters 1 --blocking \
            --json "$OUT/coll.json"
        ;;
    cstep)  # the modes alternating (auto, staged, auto, staged): run medians, their median per mode in summary.md
        cudampi_env || exit 1
        att=$(att_fused)
        for i in 1 2; do
            for mode in "${MODES[@]}"; do
                # shellcheck disable=SC2086  # $att: an option or nothing
                cstage cstep "2 ranks gx2 $BF $mode #$i" 'step time: median|rror' mpiexec -n 2 "$PY" -m fourd_mpi run \
                    --backend "$CB" --model gpt-small --dtype "$BF" --layers 2 "${STEPM[@]}" --gx 2 $att \
                    --device-buffers "$mode" --overlap all --steps 2 --warmup 1 --trace-level step \
                    --results-dir "$CRES" --run-id "step-$mode-$i" --force --display lines
            done
        done
        ;;
    cipc)  # CUDA IPC, host registration, pinned copies and host MPI on 2 ranks (bench/gpu_ipc_probe.py)
        cudampi_env || exit 1
        if [ "$REHEARSAL" = 1 ]; then echo "cipc: needs CuPy and a GPU (skipped in the rehearsal)"; continue; fi
        cstage cipc "2 ranks, 256 MiB" 'ipc-probe rank' mpiexec -n 2 "$PY" bench/gpu_ipc_probe.py --bytes 268435456
        ;;
    chost)  # the staged path's own MPI: host arrays (NumPy), float32, the step's sizes, no device in it
        cudampi_env || exit 1
        cstage chost "2 ranks gx2 float32 host arrays" '^allreduce |rror' mpiexec -n 2 "$PY" bench/gpu_coll.py \
            --backend numpy --dtype float32 --layers 2 "${STEPM[@]}" --gx 2 --rounds 1 --iters 1 --modes direct \
            --blocking
        ;;
    cmfu)
        cudampi_env || exit 1
        att=$(att_fused)
        # shellcheck disable=SC2086
        cstage cmfu "1 rank $BF${att:+ fused}" '^MFU|rror' mpiexec -n 1 "$PY" -m fourd_mpi run --backend "$CB" \
            --model gpt-small --dtype "$BF" --layers 2 "${STEPM[@]}" $att --overlap all --steps 6 --warmup 2 \
            --trace-level step --results-dir "$CRES" --run-id mfu-1 --force --display lines
        ;;
    summary) summary_md ;;
    pack)  # at most 8 files come back: summary.md, coll.json, logs.tar.gz
        (cd "$OUT" && timeout 5 tar -czf logs.tar.gz --exclude=logs.tar.gz --exclude=runs ./*.log summary.tsv 2>/dev/null \
            && rm -f ./*.log summary.tsv && rmdir runs 2>/dev/null; ls -la "$OUT")
        ;;
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
