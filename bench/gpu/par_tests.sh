#!/usr/bin/env bash
# Every GPU test module at once (they share the GPUs, one or more; none of them times anything), each bounded;
# prints one line per module, "FAIL"/"HANG" where it did not pass, then the failures. For the device
# budget: about as long as the longest module (test_ipc_gpu.py, ~5 min) instead of their sum.
#   bash bench/gpu/par_tests.sh SECONDS   (needs the project installed; TETHER_TEST_NET_PLUGIN for netplugin)
set -u
SECS=${1:-400}
L=${TMPDIR:-/tmp}/tether-par; mkdir -p "$L"
PT="python3 -m pytest -q -p no:cacheprovider"
mods="test_ipc_gpu test_gpu test_gpu_mesh test_netplugin_gpu test_fabric_gpu"
for m in $mods; do
  timeout "$SECS" $PT -m "not gpu_alone" "tests/python/$m.py" > "$L/$m.log" 2>&1 &
done
rc=0
for m in $mods; do wait -n || true; done
# Tests that take a whole GPU's memory run after the rest: beside them, another module's allocation fails
# or frees memory under the filler.
timeout 120 $PT -m gpu_alone tests/python/test_gpu.py > "$L/gpu_alone.log" 2>&1
mods="$mods gpu_alone"
for m in $mods; do
  line=$(grep -aE "[0-9]+ (passed|failed|skipped)|no tests ran" "$L/$m.log" | tail -1)
  if grep -qaE "[0-9]+ failed|error" <<< "$line" || [ -z "$line" ]; then
    echo "FAIL $m: ${line:-no summary (timed out?)}"; rc=1
    grep -aE "^(FAILED|ERROR) |^E " "$L/$m.log" | head -8 | sed 's/^/    /'
  else
    echo "ok   $m: $line"
  fi
done
exit $rc
