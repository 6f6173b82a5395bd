#!/usr/bin/env bash
# Everything GPU in one device call (any number of GPUs: GPU0 -> GPU1, or GPU0 -> GPU0 between two
# processes on one), each step bounded; logs under $OUT, summary last.
# Usage: bash bench/gpu/run_all.sh [steps...]  (default: every step). Steps: tcp ipc netplugin bench
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
steps=${*:-tcp ipc netplugin bench}
python3 -m pip install --no-build-isolation -q . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
python3 -c "import tether; print('gpu_status', tether._tether.gpu_status())"
CMAKE=$(python3 -c "import cmake; print(cmake.CMAKE_BIN_DIR)" 2>/dev/null)/cmake; [ -x "$CMAKE" ] || CMAKE=cmake
PLUGIN=$PWD/build/testnet-gpu/libtether_testnet.so
"$CMAKE" -S . -B build/testnet-gpu -DTETHER_BUILD_PYTHON=OFF -DTETHER_BUILD_TEST_PLUGIN=ON -DTETHER_CUDA=OFF \
  -DCMAKE_BUILD_TYPE=Release > "$OUT/plugin.log" 2>&1 && "$CMAKE" --build build/testnet-gpu --target tether_testnet >> "$OUT/plugin.log" 2>&1 || tail -5 "$OUT/plugin.log"
t() { local name=$1 secs=$2; shift 2; timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$? $(grep -E '[0-9]+ (passed|failed)' "$OUT/$name.log" | tail -1)"; }
PT="python3 -m pytest -q -x -p no:cacheprovider"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
R=$(( NGPU > 1 ? 1 : 0 ))  # the target's GPU: GPU 1, or GPU 0 again (two processes sharing it)
for s in $steps; do case $s in
  tcp) t test_gpu 200 $PT tests/python/test_gpu.py
       t memcheck 150 compute-sanitizer --tool memcheck --target-processes all --report-api-errors no --error-exitcode 9 \
         $PT tests/python/test_gpu.py -k "vectored and kernel"
       grep -E "^=========" "$OUT/memcheck.log" | grep -v "ERROR SUMMARY: 0" | head -8 ;;
  ipc) t test_ipc_gpu 200 $PT tests/python/test_ipc_gpu.py
       grep -E "Error|error:|assert" "$OUT/test_ipc_gpu.log" | head -6 ;;
  netplugin) TETHER_TEST_NET_PLUGIN=$PLUGIN t test_netplugin_gpu 200 $PT tests/python/test_netplugin_gpu.py -k "cuda"
       grep -E "Error|error:|assert" "$OUT/test_netplugin_gpu.log" | head -6 ;;
  bench)
    G="--device gpu --local-gpu-idx 0 --remote-gpu-idx $R --mode write --check --quiet"
    t b_sweep 120 tether bench --transport tcp $G --sizes 256M --channels 8,16 --window 32,64 --json "$OUT/b_sweep.json"
    for u in kernel d2d host; do
      t b_kv_$u 90 tether bench --transport tcp $G --sizes 16K --num-iovs 4096 --unpack $u --json "$OUT/b_kv_$u.json"
      t b_contig_$u 90 tether bench --transport tcp $G --sizes 64M,256M --unpack $u --json "$OUT/b_contig_$u.json"
    done
    TETHER_KERNEL_STAGING=scratch t b_kv_kernel_scratch 90 tether bench --transport tcp $G --sizes 16K --num-iovs 4096 --unpack kernel --json "$OUT/b_kv_kernel_scratch.json"
    t b_ipc_gpu 200 python3 bench/gpu/compare_ipc_gpu.py --check --json "$OUT/b_ipc_gpu.json"
    t b_unpack 120 python3 bench/gpu/unpack_bench.py --iters 2000 --json "$OUT/b_unpack.json"
    TETHER_NET_PLUGIN=$PLUGIN TETHER_TESTNET_BOUNCE=cuda t b_netplugin 120 tether bench --transport netplugin $G \
      --local-gpu-idx 0 --remote-gpu-idx 0 --sizes 4M,64M --json "$OUT/b_netplugin.json"
    t b_nccl_socket 150 python3 bench/peers/run.py --only nccl-socket --json "$OUT/b_nccl_socket.json" ;;
esac; done
python3 - "$OUT" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
for f in sorted(glob.glob(f"{out}/b_*.json")):
    try: d = json.load(open(f))
    except Exception as e: print(os.path.basename(f), "unreadable"); continue
    rows = d.get("results") or d.get("rows") or []
    for r in rows if isinstance(rows, list) else []:
        if isinstance(r, dict) and "gbps" in r:
            cfg = {k: v for k, v in (r.get("config") or {}).items() if k not in ("connect_ms",)}
            print(f"{os.path.basename(f)[2:-5]:<18}{r.get('mode','')[:5]:>6}{r.get('size',0):>11}{r.get('num_iovs',1):>6}{r['gbps']:>9.2f} {r.get('check')} {r.get('transport','')} {cfg}")
PY
for f in "$OUT"/b_ipc_gpu.log "$OUT"/b_unpack.log "$OUT"/b_nccl_socket.log; do echo "--- $(basename $f)"; tail -14 "$f" | cut -c1-160; done
