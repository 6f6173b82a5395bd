#!/usr/bin/env bash
# Runs every test of a pytest file on its own, each bounded, and prints one line per test
# (PASS / FAIL / HANG). A hang gets native stacks of the test process and its children (gdb, when
# the machine has it) and Python stacks (faulthandler on SIGABRT) before it is killed.
#   bash bench/gpu/each_test.sh tests/python/test_ipc_gpu.py [seconds per test] [-k expr]
set -u
FILE=$1; SECS=${2:-30}; shift 2 || shift $#
L=${LOGDIR:-/tmp/tether-logs}/each; mkdir -p "$L"
mapfile -t IDS < <(python3 -m pytest -q --collect-only -p no:cacheprovider "$FILE" "$@" 2>/dev/null | grep '::')
for id in "${IDS[@]}"; do
  log="$L/$(echo "$id" | tr '/:[]' '____').log"
  PYTHONFAULTHANDLER=1 python3 -m pytest -q -p no:cacheprovider "$id" > "$log" 2>&1 &
  pid=$!; t0=$SECONDS
  while kill -0 $pid 2> /dev/null && [ $((SECONDS - t0)) -lt "$SECS" ]; do sleep 0.5; done
  if kill -0 $pid 2> /dev/null; then
    kids=$(pgrep -P $pid | tr '\n' ' ')
    if command -v gdb > /dev/null; then
      for p in $pid $kids; do echo "--- native stacks of $p" >> "$log"
        timeout 20 gdb -p "$p" -batch -ex "thread apply all bt 12" >> "$log" 2>&1; done
    fi
    for p in $pid $kids; do kill -ABRT "$p" 2> /dev/null; done; sleep 2
    for p in $pid $kids; do kill -9 "$p" 2> /dev/null; done; wait $pid 2> /dev/null
    echo "HANG $id (> ${SECS}s)"; grep -aE "^#[0-9]+ .* in (tether|cu|std::)|^Thread|File \"" "$log" | head -60 | sed 's/^/    /'
  else
    wait $pid; rc=$?
    if [ $rc -eq 0 ]; then echo "PASS $id $((SECONDS - t0))s"
    else echo "FAIL $id rc=$rc"; grep -aE "^E " "$log" | head -8 | sed 's/^/    /'; fi
  fi
done
