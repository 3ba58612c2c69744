# CPU hogs for FOURD_CI_HOGS (sourced by .ci/run; docs/contributing.md): busy loops beside the test suite,
# pinned to no core, so that the suite is run on a loaded machine. Each hog ends by itself when the shell
# that started it is gone (even after a SIGKILL that runs no trap); stop_hogs ends them at once.
# shellcheck shell=bash

HOG_PIDS=()

# start_hogs N: N busy loops in the background; their pids in HOG_PIDS
start_hogs() {
  local n="$1" i
  [ "$n" -gt 0 ] || return 0
  for ((i = 0; i < n; i++)); do
    # the shell's pid is passed, not read by the hog: a shell killed before the hog started must still count
    python3 -c 'import os, sys
while os.getppid() == int(sys.argv[1]):
    sum(range(100000))' "$$" &
    HOG_PIDS+=("$!")
  done
  echo "started $n CPU hog(s) (busy loops, pinned to no core; pids ${HOG_PIDS[*]}); load average $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"
}

# stop_hogs: end the hogs started by start_hogs (none: nothing to say)
stop_hogs() {
  if [ "${#HOG_PIDS[@]}" -gt 0 ]; then
    kill "${HOG_PIDS[@]}" 2>/dev/null || true
    wait "${HOG_PIDS[@]}" 2>/dev/null || true
    echo "stopped ${#HOG_PIDS[@]} CPU hog(s) (pids ${HOG_PIDS[*]}); load average $(cut -d' ' -f1-3 /proc/loadavg)"
    HOG_PIDS=()
  fi
}
