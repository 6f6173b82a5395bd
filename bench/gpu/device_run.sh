#!/usr/bin/env bash
# One batched run on the GPU machine: build, GPU tests, GPU-over-TCP benchmarks. Logs under $OUT.
# Usage (device tool): bash bench/gpu/device_run.sh [tests|bench|all]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}
{ which nvcc; nvcc --version | tail -1; nvidia-smi -L; } > "$OUT/env.txt" 2>&1
python3 -m pip install --no-build-isolation -q . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
grep -i "kernels\|nvcc" "$OUT/build.log" | head -3
python3 -c "import tether; print('gpu_status', tether._tether.gpu_status())"
if [ "$what" != bench ]; then
  timeout 300 python3 -m pytest tests/python/test_gpu.py -q -x -p no:cacheprovider > "$OUT/test_gpu.log" 2>&1
  echo "test_gpu rc=$?"; tail -5 "$OUT/test_gpu.log"
fi
if [ "$what" != tests ]; then
  for u in kernel d2d host; do
    timeout 120 tether bench --transport tcp --device gpu --local-gpu-idx 0 --remote-gpu-idx 1 --mode write --sizes 256M \
      --unpack $u --check --quiet --json "$OUT/bench_256M_$u.json" > "$OUT/bench_256M_$u.txt" 2>&1
    echo "256M $u rc=$?"; grep -E "write" "$OUT/bench_256M_$u.txt" | head -2
  done
fi
