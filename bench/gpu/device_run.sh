#!/usr/bin/env bash
# One batched run on the GPU machine (any number of GPUs: GPU0 -> GPU1, or GPU0 -> GPU0 between two
# processes on one): build, GPU tests, GPU-over-TCP benchmarks beside NCCL's socket transport. Logs
# under $OUT; a short table last.
# Usage (device tool): bash bench/gpu/device_run.sh [tests|bench|all]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}
{ which nvcc; nvcc --version | tail -1; nvidia-smi -L; nproc; } > "$OUT/env.txt" 2>&1
python3 -m pip install --no-build-isolation -q . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
python3 -c "import tether; print('gpu_status', tether._tether.gpu_status())"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
R=$(( NGPU > 1 ? 1 : 0 ))  # the target's GPU: GPU 1, or GPU 0 again (two processes sharing it)
G="--transport tcp --device gpu --local-gpu-idx 0 --remote-gpu-idx $R --mode write --check --quiet"
if [ "$what" != bench ]; then
  timeout 300 python3 -m pytest tests/python/test_gpu.py -q -x -p no:cacheprovider > "$OUT/test_gpu.log" 2>&1
  echo "test_gpu rc=$? $(tail -1 $OUT/test_gpu.log)"
  timeout 240 compute-sanitizer --tool memcheck --target-processes all --report-api-errors no --error-exitcode 9 \
    python3 -m pytest tests/python/test_gpu.py -q -x -p no:cacheprovider -k "vectored and kernel" > "$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY|passed|failed' $OUT/memcheck.log | tail -3 | tr '\n' ' ')"
  grep -E "^=========" "$OUT/memcheck.log" | grep -v "ERROR SUMMARY: 0" | head -12
fi
if [ "$what" != tests ]; then
  timeout 200 tether bench $G --sizes 256M --channels 8,16 --window 32,64 --unpack d2d \
    --json "$OUT/sweep_256M.json" > "$OUT/sweep_256M.txt" 2>&1; echo "sweep rc=$?"
  for u in kernel d2d host; do
    timeout 120 tether bench $G --sizes 16K --num-iovs 4096 --unpack $u \
      --json "$OUT/kv_$u.json" > "$OUT/kv_$u.txt" 2>&1; echo "kv $u rc=$?"
    timeout 120 tether bench $G --sizes 64M,256M --unpack $u \
      --json "$OUT/contig_$u.json" > "$OUT/contig_$u.txt" 2>&1; echo "contig $u rc=$?"
  done
  TETHER_KERNEL_STAGING=scratch timeout 120 tether bench $G --sizes 16K --num-iovs 4096 --unpack kernel \
    --json "$OUT/kv_kernel_scratch.json" > "$OUT/kv_kernel_scratch.txt" 2>&1; echo "kv kernel scratch rc=$?"
  timeout 200 python3 bench/peers/run.py --only nccl-socket --json "$OUT/nccl_socket.json" > "$OUT/nccl_socket.txt" 2>&1
  echo "nccl-socket rc=$?"
  python3 - "$OUT" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
print(f"{'file':<22}{'size':>8}{'iovs':>6}{'config':>34}{'GB/s':>8}{'check':>7}")
for f in sorted(glob.glob(f"{out}/*.json")):
    if "nccl" in f: continue
    try: d = json.load(open(f))
    except Exception as e: print(f, "unreadable", e); continue
    for r in d.get("results", []):
        cfg = {k: v for k, v in (r.get("config") or {}).items() if k != "connect_ms"}
        print(f"{os.path.basename(f):<22}{r['size']:>8}{r['num_iovs']:>6}{str(cfg):>34}{r['gbps']:>8.2f}{str(r['check']):>7}")
PY
  grep -E "NCCL|nccl" "$OUT/nccl_socket.txt" | head -8
fi
