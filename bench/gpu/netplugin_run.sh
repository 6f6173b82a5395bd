#!/usr/bin/env bash
# The netplugin transport on the GPU machine: build, netplugin GPU tests, the unpack microbenchmark, and the full
# transfer through the testnet plugin (GPU bounce pages) beside tcp. Logs under $OUT.
# Usage: bash bench/gpu/netplugin_run.sh [tests|bench|all]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}
python3 -m pip install --no-build-isolation -q . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
python3 -c "import tether; print('gpu_status', tether._tether.gpu_status())"
# The testnet plugin (the tests build it themselves too, into build/testnet-gpu).
CMAKE=$(python3 -c "import cmake; print(cmake.CMAKE_BIN_DIR)" 2>/dev/null)/cmake; [ -x "$CMAKE" ] || CMAKE=cmake
"$CMAKE" -S . -B build/testnet-gpu -DTETHER_BUILD_PYTHON=OFF -DTETHER_BUILD_TEST_PLUGIN=ON -DTETHER_CUDA=OFF \
  -DCMAKE_BUILD_TYPE=Release > "$OUT/plugin.log" 2>&1 && "$CMAKE" --build build/testnet-gpu --target tether_testnet >> "$OUT/plugin.log" 2>&1 \
  || { tail -20 "$OUT/plugin.log"; exit 1; }
PLUGIN=$PWD/build/testnet-gpu/libtether_testnet.so
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
PAIRS="0:1 0:0"; [ "$NGPU" -ge 2 ] || PAIRS="0:0"  # one GPU: GPU0 -> GPU0 between two processes
if [ "$what" != bench ]; then
  TETHER_TEST_NET_PLUGIN=$PLUGIN timeout 580 python3 -m pytest tests/python/test_netplugin_gpu.py -q -x -p no:cacheprovider > "$OUT/test_netplugin_gpu.log" 2>&1
  echo "test_netplugin_gpu rc=$?"; tail -5 "$OUT/test_netplugin_gpu.log"
fi
if [ "$what" != tests ]; then
  python3 bench/gpu/unpack_bench.py --iters 2000 --json "$OUT/unpack_bench.json" | tee "$OUT/unpack_bench.txt"
  for t in tcp netplugin; do
    for g in $PAIRS; do set -- ${g/:/ }
      TETHER_NET_PLUGIN=$PLUGIN TETHER_TESTNET_BOUNCE=cuda timeout 150 tether bench --transport $t --device gpu \
        --local-gpu-idx $1 --remote-gpu-idx $2 --mode write,read --sizes 4M,64M,256M --check --quiet \
        --json "$OUT/bench_${t}_gpu$1-gpu$2.json" > "$OUT/bench_${t}_gpu$1-gpu$2.txt" 2>&1
      echo "$t gpu$1->gpu$2 rc=$?"; grep -E "write|read" "$OUT/bench_${t}_gpu$1-gpu$2.txt" | head -6
    done
  done
fi
