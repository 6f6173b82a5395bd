#!/usr/bin/env bash
# Every GPU test module in one device call, on one build: the project installed (with the NIXL plugin),
# the testnet NCCL net plugin built, then bench/gpu/par_tests.sh and, beside it, test_nixl_gpu.py with
# the NIXL bundle on PYTHONPATH. About 4.5 min of wall time on one H200.
#   bash bench/gpu/all_tests.sh [SECONDS]    (carry=[".device"]: .device/nixl-bundle.tar.xz, .device/nixl/;
#                                             see bench/gpu/nixl.sh; a summary last, logs in $OUT)
set -u
SECS=${1:-300}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/nixl && tar -xJf .device/nixl-bundle.tar.xz -C /tmp/nixl || { echo "no NIXL bundle in .device"; exit 1; }
export TETHER_NIXL_SRC=$PWD/.device/nixl
timeout 300 python3 -m pip install --no-build-isolation -q . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
CMAKE=$(python3 -c "import cmake; print(cmake.CMAKE_BIN_DIR)" 2>/dev/null)/cmake; [ -x "$CMAKE" ] || CMAKE=cmake
timeout 120 bash -c "$CMAKE -S . -B build/testnet-gpu -DTETHER_BUILD_PYTHON=OFF -DTETHER_BUILD_TEST_PLUGIN=ON \
  -DTETHER_CUDA=OFF -DCMAKE_BUILD_TYPE=Release && $CMAKE --build build/testnet-gpu --target tether_testnet" > "$OUT/plugin.log" 2>&1 ||
  { tail -20 "$OUT/plugin.log"; exit 1; }
export TETHER_TEST_NET_PLUGIN=$PWD/build/testnet-gpu/libtether_testnet.so
(cd /tmp && PYTHONPATH=/tmp/nixl/nixl-site tether nixl install) > "$OUT/nixl_install.log" 2>&1
PYTHONPATH=/tmp/nixl/nixl-site timeout "$SECS" python3 -m pytest -q -p no:cacheprovider tests/python/test_nixl_gpu.py \
  > "$OUT/nixl_gpu.log" 2>&1 &
NIXL_PID=$!
timeout $((SECS + 60)) bash bench/gpu/par_tests.sh "$SECS" > "$OUT/par.txt" 2>&1; rc=$?
wait "$NIXL_PID"; nrc=$?
cp "${TMPDIR:-/tmp}"/tether-par/*.log "$OUT/" 2>/dev/null
cat "$OUT/par.txt"
echo "$([ $nrc = 0 ] && echo "ok  " || echo FAIL) test_nixl_gpu: $(tail -1 "$OUT/nixl_gpu.log")"
[ $rc = 0 ] && [ $nrc = 0 ]
