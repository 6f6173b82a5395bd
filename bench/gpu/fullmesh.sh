#!/usr/bin/env bash
# Full mesh on every visible GPU (docs/PERFORMANCE.md, "Full mesh beside NCCL"): tether's GPU full mesh (all ordered pairs i>j at once,
# GPU memory to GPU memory, every byte checked) over tcp and ipc, one process per GPU and one
# process for all, beside NCCL all-pairs send/recv (default and socket transport forced) from the
# same run. JSON and logs under $OUT; one short table last.
#
#   python3 -m pip install --no-build-isolation . && bash bench/gpu/fullmesh.sh [tcp|ipc|all]
#
# Env: OUT (default /tmp/out), SIZES (default 16M,256M), GPUS (default: every visible GPU),
# ITERS (default: by size on 2 GPUs; 3 above 2 GPUs, where 56 flows x 256 MiB per op make the
# checked passes the long part), STEP_TIMEOUT seconds per command (default 280).
# About 2-3 minutes on 2 GPUs; on 8 GPUs run `tcp` and `ipc` as two calls if one must stay under 10 min.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}
SIZES=${SIZES:-16M,256M}
STEP_TIMEOUT=${STEP_TIMEOUT:-280}
python3 -c "import tether" 2>/dev/null || { echo "tether is not installed: python3 -m pip install --no-build-isolation ."; exit 2; }
GPUS=${GPUS:-$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)}
# A mesh of one GPU has no pair: the one thing here that truly needs two devices. Not a failure on a
# one-GPU machine (the one-GPU figures: bench/gpu/one_gpu.py).
if [ "${GPUS:-0}" -lt 2 ]; then echo "skipped: a full mesh needs 2 or more GPUs visible to torch (found ${GPUS:-0})"; exit 0; fi
if [ -z "${ITERS:-}" ] && [ "$GPUS" -gt 2 ]; then ITERS=3; fi
ITER_ARGS=${ITERS:+--iters $ITERS --warmup 1}
{ nvidia-smi -L; nvidia-smi topo -m; nproc; python3 -c "import torch, tether; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'tether', tether.__version__, tether._tether.gpu_status())"; } > "$OUT/env.txt" 2>&1
echo "full mesh on $GPUS GPUs, sizes $SIZES, ${ITERS:-auto} iters; logs in $OUT"
COMMON="--full-mesh --device gpu --gpus $GPUS --sizes $SIZES --mode write --check --quiet $ITER_ARGS"
step() {  # name, then tether bench arguments
  local name=$1; shift
  local t0=$SECONDS
  timeout -k 10 "$STEP_TIMEOUT" tether bench $COMMON "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1  # -k: kill what outlives TERM
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0)) s"
  echo "$rc" > "$OUT/$name.rc"
}
if [ "$what" != ipc ]; then
  # NCCL rides on the first step: its rows come from the same run, on the same GPUs and sizes.
  step tcp_per_gpu --transport tcp --nccl default,socket
  step tcp_single --transport tcp --single-process
fi
if [ "$what" != tcp ]; then
  step ipc_per_gpu --transport ipc
  step ipc_single --transport ipc --single-process
fi
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
print(f"{'run':<14}{'transport':<12}{'size':>9}{'flows':>6}{'agg GB/s':>10}{'min flow':>10}{'max flow':>10}"
      f"{'min GPU out':>12}{'check':>7}")
for f in sorted(glob.glob(f"{out}/*.log")):
    name = os.path.basename(f)[:-4]
    rc = open(f"{out}/{name}.rc").read().strip() if os.path.exists(f"{out}/{name}.rc") else "?"
    try:
        rows = json.load(open(f"{out}/{name}.json"))["results"]
    except Exception:
        err = [l for l in open(f).read().splitlines() if l.strip()]
        print(f"{name:<14}rc={rc}: {(err or ['no output'])[-1][:100]}")
        continue
    groups = {}
    for r in rows:
        groups.setdefault((r["transport"], r["size"]), []).append(r)
    for (transport, size), rs in groups.items():
        pair = lambda r: str(r["config"].get("pair"))
        flows = [r for r in rs if ">" in pair(r) and not pair(r).endswith("*")]
        egress = [r for r in rs if pair(r).endswith(">*")]
        agg = [r for r in rs if pair(r) == "all"]
        fmt = lambda v: f"{v:.2f}" if v is not None else "-"
        print(f"{name if not transport.startswith('nccl') else 'nccl':<14}{transport:<12}{size >> 20:>6} MiB"
              f"{len(flows) or '-':>6}{fmt(agg[0]['gbps'] if agg else None):>10}"
              f"{fmt(min(r['gbps'] for r in flows) if flows else None):>10}"
              f"{fmt(max(r['gbps'] for r in flows) if flows else None):>10}"
              f"{fmt(min(r['gbps'] for r in egress) if egress else None):>12}"
              f"{str(all(r['check'] for r in rs)):>7}")
PY
