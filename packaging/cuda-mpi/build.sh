#!/usr/bin/env bash
# A CUDA-aware MPI built here from Debian's source packages and PyPI's CUDA wheels: no GPU, no
# binary from outside the package registries. docs/guide/gpu-mpi.md says how to use it.
#
#   bash packaging/cuda-mpi/build.sh openmpi   # Open MPI 4.1 --with-cuda (smcuda: CUDA IPC on one node)
#   bash packaging/cuda-mpi/build.sh mpich     # MPICH 4.0 --with-cuda (yaksa GPU kernels, sm_90)
#
# Prints, as its last line, the prefix of the build (bin/mpiexec, lib/libmpi.so, env.sh). Also made:
#   PREFIX/env.sh            `source` it: PATH, LD_LIBRARY_PATH, OPAL_PREFIX / MPICH's variables, MPI4PY_LIBMPI;
#                            works from wherever the prefix was unpacked (relocatable)
#   PREFIX/wheels/           mpi4py built from source against this MPI, for this machine's Python
#   PREFIX/BUILDINFO         versions, configure line, build seconds
#   CACHE/KEY.tar.zst        the prefix packed (zstd -19), to carry to a GPU machine (at most 40 MiB)
#
# Cached by KEY (implementation, Debian source version, CUDA wheel version, RECIPE): a second call
# with the same key prints the prefix at once. CACHE is $FOURD_CUDA_MPI_CACHE, else
# /var/cache/fourd-mpi/cuda-mpi (root) or ~/.cache/fourd-mpi/cuda-mpi. A failed build leaves its
# log in CACHE/KEY.build/build.log and no prefix. A build killed or failed after configure resumes at make on
# the next call (BUILD/RESUME; the object files of its last minutes are compiled again); one stopped
# before configure starts again.
#
# As root, the system packages the build needs are installed with apt-get (compilers, libtool-bin,
# and for MPICH libfabric-dev and its verbs/psm libraries). The Debian sources are fetched with a
# private apt configuration under CACHE (a deb-src list made from the system's own deb entries): the
# system's apt configuration is not changed.
set -euo pipefail

IMPL=${1:-}
case "$IMPL" in
  openmpi|mpich) ;;
  *) echo "usage: $0 openmpi|mpich" >&2; exit 2 ;;
esac

#: bump when the recipe below changes what is built (the cache key includes it); per implementation, so that a
#: change to one does not rebuild the other (mpich 3: the link-time libcuda stub below)
case "$IMPL" in
  openmpi) RECIPE=2 ;;
  mpich) RECIPE=3 ;;
esac
#: CUDA from PyPI. Open MPI needs only cuda.h (libcuda is opened at run time); MPICH's yaksa needs
#: nvcc (with nvvm's cicc: the nvcc wheel names nvidia-nvvm, crt and runtime as its requirements) and libcudart. 13.0 matches driver 580 (CUDA 13.0) of the GPU machines seen here: no reliance
#: on minor-version compatibility.
CUDA12_RUNTIME=12.9.79
CUDA13=13.0.88
CUDA13_CCCL=13.0.85
MPI4PY_VERSION=${FOURD_MPI4PY_VERSION:-4.1.2}
#: GPU architecture of MPICH's yaksa kernels: sm_90 (H100/H200). FOURD_CUDA_SM=80 for A100.
CUDA_SM=${FOURD_CUDA_SM:-90}
JOBS=${FOURD_BUILD_JOBS:-$(nproc)}

if [ -n "${FOURD_CUDA_MPI_CACHE:-}" ]; then CACHE=$FOURD_CUDA_MPI_CACHE
elif [ "$(id -u)" = 0 ]; then CACHE=/var/cache/fourd-mpi/cuda-mpi
else CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/fourd-mpi/cuda-mpi; fi
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}

log() { echo "[cuda-mpi $IMPL] $*" >&2; }

# -- the Debian source package, through a private apt configuration ------------------------------
APTDIR=$CACHE/apt
apt_private() {  # apt_private apt-get|apt-cache ARGS...: the system's lists, caches and sources untouched
  local tool=$1
  shift
  "$tool" -o Dir::Etc::SourceList="$APTDIR/sources.list" -o Dir::Etc::SourceParts=/nonexistent \
    -o Dir::State::Lists="$APTDIR/lists" -o Dir::Cache="$APTDIR/cache" -o Debug::NoLocking=1 "$@"
}
debian_sources() {  # deb-src lines for every deb entry the system's apt knows (one-line and deb822 formats)
  mkdir -p "$APTDIR/lists/partial" "$APTDIR/cache/archives/partial"
  "$PY" "$HERE/debsrc.py" /etc/apt/sources.list /etc/apt/sources.list.d >"$APTDIR/sources.list.new"
  mv "$APTDIR/sources.list.new" "$APTDIR/sources.list"
  if [ ! -s "$APTDIR/sources.list" ]; then log "no Debian 'deb' entry found in /etc/apt: cannot fetch sources"; exit 1; fi
  apt_private apt-get -qq update >/dev/null
}
source_version() {  # the version apt-get source would fetch, e.g. 4.1.4-3
  { apt_private apt-cache showsrc "$1" 2>/dev/null || true; } | awk '/^Version:/ {print $2; exit}'
}

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  debian_sources
  SRCVER=$(source_version "$IMPL")
else
  SRCVER=${FOURD_MPI_SOURCE_VERSION:-}
fi
if [ -z "$SRCVER" ]; then
  # without root: reuse whatever cached build exists for this implementation and recipe
  found=$(find "$CACHE" -mindepth 2 -maxdepth 2 -path "$CACHE/$IMPL-*-r$RECIPE/prefix" -type d 2>/dev/null | sort | tail -n 1)
  if [ -n "$found" ]; then echo "$found"; exit 0; fi
  log "cannot find the Debian source version of $IMPL (needs root and apt-get, or FOURD_MPI_SOURCE_VERSION)"; exit 1
fi
UPSTREAM=${SRCVER%%-*}
case "$IMPL" in
  openmpi) KEY=openmpi-$SRCVER-cuda$CUDA12_RUNTIME-r$RECIPE ;;
  mpich) KEY=mpich-$SRCVER-cuda$CUDA13-sm$CUDA_SM-r$RECIPE ;;
esac
KEY=${KEY//[^A-Za-z0-9._-]/_}
OUTDIR=$CACHE/$KEY
PREFIX=$OUTDIR/prefix
ARCHIVE=$CACHE/$KEY.tar.zst

if [ -f "$PREFIX/BUILDINFO" ] && [ -f "$ARCHIVE" ]; then
  log "cached: $KEY"
  echo "$PREFIX"
  exit 0
fi

# -- a build: from scratch, or resumed where a killed one stopped --------------------------------
# A build that got through configure leaves BUILD/RESUME (its source folder, CUDA folder and configure line).
# The next call with the same KEY goes straight back to make (incremental), after removing the object files
# written in the last RESUME_WINDOW seconds before the log's last line: the compiles the kill cut short may
# have left them half written. Anything else in BUILD (an unconfigured try) is started afresh.
BUILD=$CACHE/$KEY.build
LOG=$BUILD/build.log
RESUME_WINDOW=300
START=$SECONDS
RESUMED=
if [ -f "$BUILD/RESUME" ] && [ -f "$LOG" ]; then
  # shellcheck disable=SC1091
  source "$BUILD/RESUME"  # SRC, CUDA_DIR, CONFIGURE (written below by this script)
  if [ -n "${SRC:-}" ] && [ -f "$SRC/config.status" ] && [ -f "$SRC/Makefile" ] && [ -d "$CUDA_DIR" ]; then
    RESUMED=1
    stopped=$(stat -c %Y "$LOG")
    stale=$(find "$SRC" -type f \( -name '*.o' -o -name '*.lo' \) -newermt "@$((stopped - RESUME_WINDOW))" | wc -l)
    find "$SRC" -type f \( -name '*.o' -o -name '*.lo' \) -newermt "@$((stopped - RESUME_WINDOW))" -delete
    rm -rf "$OUTDIR"  # a half-done install of this KEY only
    log "resuming $KEY at make ($stale object file(s) of the last ${RESUME_WINDOW} s before it stopped removed; log: $LOG)"
  fi
fi
if [ -z "$RESUMED" ]; then
rm -rf "$BUILD" "$OUTDIR"  # both under CACHE/KEY*, made by this script only
mkdir -p "$BUILD"
log "building $KEY (log: $LOG)"
fi
on_exit() {
  local rc=$?
  if [ "$rc" != 0 ]; then log "FAILED (exit $rc); the last lines of $LOG:"; tail -n 30 "$LOG" >&2; fi
}
trap on_exit EXIT

if [ -z "$RESUMED" ]; then
if [ "$(id -u)" = 0 ]; then
  pkgs=(build-essential libtool-bin zstd dpkg-dev file)
  [ "$IMPL" = mpich ] && pkgs+=(libfabric-dev libibverbs-dev librdmacm-dev libpsm2-dev libpsm-infinipath1-dev patchelf)
  # shellcheck disable=SC2016
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkgs[@]}" >>"$LOG" 2>&1
fi

cd "$BUILD"
# the upstream tarball as Debian ships it (IMPL_UPSTREAM.orig.tar.*), unpacked as is: Debian's patches touch
# configure.ac and m4 files, after which make wants to rerun automake 1.15 (Open MPI 4.1.4 stops there)
apt_private apt-get source -qq --download-only "$IMPL=$SRCVER" >>"$LOG" 2>&1
ORIG=$(find "$BUILD" -maxdepth 1 -name "${IMPL}_${UPSTREAM}.orig.tar.*" | head -n 1)
[ -n "$ORIG" ] || { log "apt-get source gave no ${IMPL}_${UPSTREAM}.orig.tar.* file"; exit 1; }
tar -xf "$ORIG" -C "$BUILD"
SRC=$(find "$BUILD" -maxdepth 1 -mindepth 1 -type d -name "$IMPL-*" | head -n 1)
[ -n "$SRC" ] || { log "the tarball $ORIG holds no $IMPL-* folder"; exit 1; }

# CUDA from PyPI, into a folder of this build (not into any environment)
CUDA_PY=$BUILD/cuda-wheels
case "$IMPL" in
  openmpi) "$PY" -m pip install -q --no-deps --target "$CUDA_PY" "nvidia-cuda-runtime-cu12==$CUDA12_RUNTIME" >>"$LOG" 2>&1
           CUDA_DIR=$CUDA_PY/nvidia/cuda_runtime ;;
  mpich) "$PY" -m pip install -q --no-deps --target "$CUDA_PY" "nvidia-cuda-nvcc==$CUDA13" "nvidia-cuda-crt==$CUDA13" \
           "nvidia-cuda-runtime==$CUDA13" "nvidia-cuda-cccl==$CUDA13_CCCL" "nvidia-nvvm==$CUDA13" >>"$LOG" 2>&1
         CUDA_DIR=$CUDA_PY/nvidia/cu13 ;;
esac
[ -f "$CUDA_DIR/include/cuda.h" ] || { log "no include/cuda.h under $CUDA_DIR"; exit 1; }

cd "$SRC"
case "$IMPL" in
  openmpi)
    CONFIGURE=(./configure --prefix="$PREFIX" --with-cuda="$CUDA_DIR" --disable-mpi-fortran --without-ucx
               --disable-static --enable-mpirun-prefix-by-default)
    ;;
  mpich)
    # MPICH wants an unversioned lib64/libcudart.so; the wheel ships libcudart.so.13
    mkdir -p "$CUDA_DIR/lib64"
    ln -sf ../lib/libcudart.so.13 "$CUDA_DIR/lib64/libcudart.so"
    ln -sf ../lib/libcudart.so.13 "$CUDA_DIR/lib64/libcudart.so.13"
    export PATH=$CUDA_DIR/bin:$PATH
    # MPL (MPICH's GPU layer: MPIX_Query_cuda_support, the GPU IPC path) is built with CUDA only where
    # -lcuda links (src/mpl/configure.ac: "also require -lcuda", cuMemGetAddressRange); PyPI has no driver
    # library, and without it MPICH 4.0.2 built yaksa's kernels but reported no CUDA support on an H200
    # (2026-11-28). A link-time stub, as the toolkit's lib64/stubs/libcuda.so: every function cuda.h declares
    # (after its _v2 renames), soname libcuda.so.1, never shipped: the driver's own libcuda.so.1 loads at run time
    # (beside lib64/libcudart.so: the folder --with-cuda makes configure search)
    "$PY" "$HERE/cuda_stub.py" "$CUDA_DIR/include/cuda.h" "$CUDA_DIR/lib64" >>"$LOG" 2>&1 \
      || { log "the libcuda stub failed (see $LOG)"; exit 1; }
    # CUDA 13 removed cudaDeviceProp::computeMode (yaksa's init hook reads it)
    hook=modules/yaksa/src/backend/cuda/hooks/yaksuri_cuda_init_hooks.c
    if grep -q 'prop.computeMode' "$hook"; then
      "$PY" "$HERE/patch_yaksa.py" "$hook" >>"$LOG" 2>&1
    fi
    CONFIGURE=(./configure --prefix="$PREFIX" --with-device=ch4:ofi --with-libfabric=/usr --with-cuda="$CUDA_DIR"
               --with-cuda-sm="$CUDA_SM" --with-yaksa-depth=1 --disable-fortran --disable-static
               --enable-wrapper-rpath=no)
    ;;
esac
log "configure: ${CONFIGURE[*]}"
nice -n 19 "${CONFIGURE[@]}" >>"$LOG" 2>&1
{ printf 'SRC=%q\nCUDA_DIR=%q\nCONFIGURE=(' "$SRC" "$CUDA_DIR"; printf '%q ' "${CONFIGURE[@]}"; echo ')'; } >"$BUILD/RESUME"
else
  cd "$SRC"
  [ "$IMPL" = mpich ] && export PATH=$CUDA_DIR/bin:$PATH
fi
log "make -j$JOBS (Open MPI: about 17 min on 2 busy cores; MPICH: about 30)"
nice -n 19 make -j"$JOBS" >>"$LOG" 2>&1
nice -n 19 make install >>"$LOG" 2>&1

# slim, relocatable prefix: no static libraries, no debug symbols, no manuals
rm -rf "$PREFIX/share/man" "$PREFIX/share/doc"
find "$PREFIX/lib" -name '*.a' -delete
find "$PREFIX/lib" -name '*.la' -delete
find "$PREFIX" -type f \( -name '*.so*' -o -perm -u+x \) -exec sh -c \
  'for f; do file -b "$f" | grep -q ELF && strip --strip-unneeded "$f" 2>/dev/null; done; true' sh {} +
if [ "$IMPL" = mpich ]; then
  # the CUDA runtime yaksa links, and libfabric with its providers' libraries: the GPU machine has neither
  cp -L "$CUDA_DIR/lib/libcudart.so.13" "$PREFIX/lib/"
  for lib in $(ldd "$PREFIX/lib/libmpi.so" | awk '/libfabric|libpsm|libibverbs|librdmacm|libnl|libefa|libnuma|libhwloc|libpciaccess|libudev|libatomic|libinfinipath|libuuid/ {print $3}'); do
    cp -L "$lib" "$PREFIX/lib/"
  done
  for f in "$PREFIX"/lib/*.so*; do patchelf --set-rpath "\$ORIGIN" "$f" 2>/dev/null || true; done
  # the link-time libcuda stub, for machines without a driver only (env.sh puts it last on the search path)
  mkdir -p "$PREFIX/lib/stubs"
  cp "$CUDA_DIR/lib64/libcuda.so" "$PREFIX/lib/stubs/libcuda.so.1"
fi

# env.sh: source it from wherever the prefix lies
cat >"$PREFIX/env.sh" <<'ENVSH'
# source this file: the CUDA-aware MPI of this folder first on PATH, its libraries found by mpi4py
_fourd_mpi_prefix=$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")" && pwd)
export PATH="$_fourd_mpi_prefix/bin:$PATH"
export LD_LIBRARY_PATH="$_fourd_mpi_prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ENVSH
case "$IMPL" in
  openmpi) cat >>"$PREFIX/env.sh" <<'ENVSH'
export OPAL_PREFIX="$_fourd_mpi_prefix"            # Open MPI's relocation variable
export MPI4PY_LIBMPI="$_fourd_mpi_prefix/lib/libmpi.so.40"
# no libcuda on a machine without a GPU: no warning box at start-up
[ -e /dev/nvidiactl ] || export OMPI_MCA_opal_warn_on_missing_libcuda=0
ENVSH
  ;;
  mpich) cat >>"$PREFIX/env.sh" <<'ENVSH'
export MPI4PY_LIBMPI="$_fourd_mpi_prefix/lib/libmpi.so.12"
# without a GPU driver this MPICH crashes in MPI_Init (yaksa); GPU support off on such machines, and libmpi's
# libcuda.so.1 found in the link-time stub (never called with GPU support off)
if [ ! -e /dev/nvidiactl ]; then
  export MPIR_CVAR_ENABLE_GPU=0
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$_fourd_mpi_prefix/lib/stubs"
fi
ENVSH
  ;;
esac
echo 'unset _fourd_mpi_prefix' >>"$PREFIX/env.sh"

# mpi4py from source against this MPI, for this Python
log "mpi4py $MPI4PY_VERSION from source"
mkdir -p "$PREFIX/wheels"
(
  # shellcheck disable=SC1091
  source "$PREFIX/env.sh"
  MPICC="$PREFIX/bin/mpicc" nice -n 19 "$PY" -m pip wheel -q --no-deps --no-binary=mpi4py -w "$PREFIX/wheels" \
    "mpi4py==$MPI4PY_VERSION"
) >>"$LOG" 2>&1

{
  echo "implementation: $IMPL $UPSTREAM (the upstream tarball of Debian's source package $IMPL $SRCVER)"
  echo "cuda: $(basename "$CUDA_DIR") from PyPI $( [ "$IMPL" = openmpi ] && echo "nvidia-cuda-runtime-cu12 $CUDA12_RUNTIME" || echo "nvidia-cuda-nvcc/crt/runtime $CUDA13, cccl $CUDA13_CCCL, sm_$CUDA_SM")"
  echo "configure: ${CONFIGURE[*]}" | sed "s|$BUILD|BUILD|g; s|$PREFIX|PREFIX|g"
  echo "mpi4py: $MPI4PY_VERSION for $("$PY" -c 'import sys; print("python%d.%d" % sys.version_info[:2])')"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(nproc) cores in $((SECONDS - START)) s"
  echo "recipe: $RECIPE"
} >"$PREFIX/BUILDINFO"
cp "$LOG" "$OUTDIR/build.log"

log "packing $ARCHIVE"
tar -C "$OUTDIR" -cf - prefix | zstd -q -19 -T0 -f -o "$ARCHIVE.tmp"
mv "$ARCHIVE.tmp" "$ARCHIVE"
rm -rf "$BUILD"
trap - EXIT
log "done in $((SECONDS - START)) s: $(du -sh "$PREFIX" | cut -f1) installed, $(du -h "$ARCHIVE" | cut -f1) packed"
echo "$PREFIX"
