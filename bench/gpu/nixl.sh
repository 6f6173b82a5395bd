#!/usr/bin/env bash
# The NIXL plugin on the device machine (one GPU is enough): builds tether with the plugin, installs it
# into a trimmed NIXL, runs the NIXL tests (VRAM and DRAM) and the peers bench rows side by side.
# The device has no internet and takes 64 MiB per call, so carry a folder `.device` (ignored by git) with
#   .device/nixl-bundle.tar.xz   python3 bench/nixl/bundle.py .device/nixl-bundle.tar.xz   (cp312, ~10 MiB)
#   .device/nixl/                a copy of ../shared/third_party/nixl (NIXL's backend headers)
#   bash bench/gpu/nixl.sh [steps...]      (run with carry=[".device"]; summary in $OUT/nixl.txt)
set -u
STEPS=" $* "
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=/tmp/tether-logs; mkdir -p "$L"
S="$OUT/nixl.txt"; : > "$S"
mkdir -p /tmp/nixl && tar -xJf .device/nixl-bundle.tar.xz -C /tmp/nixl || { echo "no NIXL bundle" | tee -a "$S"; exit 1; }
export PYTHONPATH=/tmp/nixl/nixl-site${PYTHONPATH:+:$PYTHONPATH}
export TETHER_NIXL_SRC=$PWD/.device/nixl
python3 -m pip install --no-build-isolation -q . > "$L/build.log" 2>&1 || { tail -30 "$L/build.log" | tee -a "$S"; exit 1; }
(cd /tmp && tether nixl install && tether nixl status) >> "$S" 2>&1
PT="python3 -m pytest -q -rs -p no:cacheprovider"
t() {  # name seconds command...: runs it, appends its verdict and its table to the summary
  local name=$1 secs=$2; shift 2; local t0=$SECONDS
  [ "$STEPS" = "  " ] || [[ "$STEPS" == *" $name "* ]] || return 0
  timeout -k 10 "$secs" "$@" > "$L/$name.log" 2>&1; local rc=$?
  { echo "== $name rc=$rc $((SECONDS - t0))s $(grep -aE '[0-9]+ (passed|failed)' "$L/$name.log" | tail -1)"
    grep -aE "^E  |FAILED|^SKIPPED" "$L/$name.log" | head -12
    grep -aE "│|┃|━" "$L/$name.log"; } >> "$S"
  cat "$L/$name.log" >> "$OUT/nixl_all.log"
}
t nixl_gpu 300 $PT tests/python/test_nixl_gpu.py
t nixl_dram 300 $PT tests/python/test_nixl.py -x
t peers_gpu 420 python3 bench/peers/run.py --device gpu --only tether nixl-tether-tcp nixl-tcp tether-ipc nixl-tether nixl-default --json "$OUT/peers_gpu.json"
t peers_cpu 420 python3 bench/peers/run.py --only tether nixl-tether-tcp nixl-tcp tether-ipc nixl-tether nixl-default --json "$OUT/peers_cpu.json"
# The serving rows beside UCX, two rounds (docs/PERFORMANCE.md, "Two GPUs on one host").
t peers_serving 300 python3 bench/peers/run.py --device gpu --rounds 2 --only nixl-tether nixl-default nixl-tether-tcp nixl-tcp \
  --workloads "4096 x 16 KiB readv (KV pull);64 KiB write;8 B write" --json "$OUT/peers_serving.json"
# Why NIXL/UCX with UCX_TLS=tcp does not start here: the driver alone, UCX's own log at info level.
t ucx_tcp_diag 90 env UCX_LOG_LEVEL=info python3 bench/peers/nixl_driver.py tcp
# The disaggregated-prefill example, its test (Llama on cuda:0 for all three paths) and a record.
t disagg_test 300 $PT tests/python/test_disagg_prefill.py
t disagg_run 240 python3 examples/disagg_prefill/run.py --verify-bytes --json "$OUT/disagg.json"
t disagg_run_tcp 240 python3 examples/disagg_prefill/run.py --transport tcp --paths tether,nixl-TETHER --json "$OUT/disagg_tcp.json"
cat "$S"
