#!/usr/bin/env bash
# A short GPU check of every transport, for a tight device budget: each step bounded, one summary file
# ($OUT/summary.txt) and one combined log ($OUT/all.log); the rest stays in /tmp. Any number of GPUs:
# with one, the GPU0 -> GPU1 steps run GPU0 -> GPU0 between two processes and the steps that need two
# GPUs (full mesh, NVLink) say "skipped".
#   bash bench/gpu/final.sh                 every step
#   bash bench/gpu/final.sh ipc_gpu mesh_sp  only the named steps (names below)
#   bash bench/gpu/final.sh one_gpu par_tests   the one-GPU table (docs/PERFORMANCE.md, "Same host: ipc, GPU memory") and every GPU test
set -u
STEPS=" $* "
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=/tmp/tether-logs; mkdir -p "$L"
S="$OUT/summary.txt"; : > "$S"
# libfabric's headers are build-time only and the device image lacks them: carry Debian's .deb
# (`mkdir -p .debs && cd .debs && apt-get download libfabric-dev`, then run with carry=[".debs"]).
if [ ! -e /usr/include/rdma/fabric.h ] && ls .debs/libfabric-dev_*.deb > /dev/null 2>&1; then
  dpkg -x .debs/libfabric-dev_*.deb /tmp/libfabric-dev
  export CMAKE_ARGS="${CMAKE_ARGS:-} -DTETHER_LIBFABRIC_INCLUDE=/tmp/libfabric-dev/usr/include"
fi
python3 -m pip install --no-build-isolation -q . > "$L/build.log" 2>&1 || { tail -30 "$L/build.log" | tee -a "$S"; exit 1; }
CMAKE=$(python3 -c "import cmake; print(cmake.CMAKE_BIN_DIR)" 2>/dev/null)/cmake; [ -x "$CMAKE" ] || CMAKE=cmake
PLUGIN=$PWD/build/testnet-gpu/libtether_testnet.so
PT="python3 -m pytest -q -x -p no:cacheprovider"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
R=$(( NGPU > 1 ? 1 : 0 ))  # the target's GPU: GPU 1, or GPU 0 again (two processes sharing it)
G="--device gpu --local-gpu-idx 0 --remote-gpu-idx $R --mode write --check --quiet"
t() {  # name seconds command...: runs it, appends its verdict (and errors) to the summary
  local name=$1 secs=$2; shift 2; local t0=$SECONDS
  [ "$STEPS" = "  " ] || [[ "$STEPS" == *" $name "* ]] || return 0
  timeout -k 10 "$secs" "$@" > "$L/$name.log" 2>&1; local rc=$?  # -k: a process that outlives TERM is killed
  { echo "== $name rc=$rc $((SECONDS - t0))s $(grep -aE '[0-9]+ (passed|failed)' "$L/$name.log" | tail -1)"
    grep -aE "^E |Error:|FAILED|ERROR SUMMARY|^=========.*(Invalid|error)" "$L/$name.log" | head -6
    grep -aE "GB/s|MET|ratio|│ +(write|read)" "$L/$name.log" | head -12
    grep -aE "^(pull|push|one process|two processes|write |fabric:|peer transport:|env:|pull|push|bytes|kernel|d2d|contiguous|256 MiB|4096x16K)|NCCL" "$L/$name.log" | head -40
    grep -aE "^(FAIL|HANG|ok  ) |^    " "$L/$name.log" | head -80
    grep -aE "^\| |^GPU0 ->" "$L/$name.log" | head -20
    grep -aE "^(milestone|[IT] (first|last|lane|op)|earliest|latest|waited|the transfer|[0-9]+ transfers)" "$L/$name.log" | head -40
    } >> "$S"
  cat "$L/$name.log" >> "$OUT/all.log"
}
two() {  # as t, where two GPUs are needed: else one line saying so
  if [ "$NGPU" -ge 2 ]; then t "$@"
  elif [ "$STEPS" = "  " ] || [[ "$STEPS" == *" $1 "* ]]; then echo "== $1 skipped: needs 2 GPUs ($NGPU here)" >> "$S"; fi
}
t one_gpu 330 python3 bench/gpu/one_gpu.py --step-timeout 100 --json "$OUT/one_gpu.json"
t ipc_gpu 300 $PT tests/python/test_ipc_gpu.py
t ipc_gpu_each 240 bash bench/gpu/each_test.sh tests/python/test_ipc_gpu.py 30
t tcp_vectored 50 $PT tests/python/test_gpu.py -k vectored
t memcheck 45 compute-sanitizer --tool memcheck --target-processes all --report-api-errors no --error-exitcode 9 \
  $PT tests/python/test_gpu.py -k "vectored and kernel and gpu0-gpu$R"
t kv_kernel 30 tether bench --transport tcp $G --sizes 16K --num-iovs 4096 --unpack kernel
t kv_d2d 30 tether bench --transport tcp $G --sizes 16K --num-iovs 4096 --unpack d2d
t kv_host 60 tether bench --transport tcp $G --sizes 16K --num-iovs 4096 --unpack host --iters 5
for u in kernel d2d host; do t contig_$u 40 tether bench --transport tcp $G --sizes 64M --unpack $u; done
"$CMAKE" -S . -B build/testnet-gpu -DTETHER_BUILD_PYTHON=OFF -DTETHER_BUILD_TEST_PLUGIN=ON -DTETHER_CUDA=OFF \
  -DCMAKE_BUILD_TYPE=Release > "$L/plugin.log" 2>&1 && "$CMAKE" --build build/testnet-gpu --target tether_testnet >> "$L/plugin.log" 2>&1
TETHER_TEST_NET_PLUGIN=$PLUGIN t netplugin_gpu 60 $PT tests/python/test_netplugin_gpu.py -k "cuda and kernel"
TETHER_TEST_NET_PLUGIN=$PLUGIN t netplugin_gpu_all 120 $PT tests/python/test_netplugin_gpu.py
t ipc_gpu_vmm 180 $PT tests/python/test_ipc_gpu.py tests/python/test_gpu.py -k "vmm or deregistering"
TETHER_TEST_NET_PLUGIN=$PLUGIN t par_tests 420 bash bench/gpu/par_tests.sh 400
t unpack_bench 30 python3 bench/gpu/unpack_bench.py --iters 300
t unpack_bench16 30 python3 bench/gpu/unpack_bench.py --iters 300 --frag-kib 16
for tr in netplugin tcp; do
  TETHER_NET_PLUGIN=$PLUGIN TETHER_TESTNET_BOUNCE=cuda t np_beside_$tr 60 tether bench --transport $tr $G --sizes 4M,64M
done
two mesh_ipc 45 tether bench --full-mesh --device gpu --gpus 2 --transport ipc --sizes 256M --iters 5 --warmup 1 --mode write --check --quiet --nccl default
two mesh_tcp 40 tether bench --full-mesh --device gpu --gpus 2 --transport tcp --sizes 256M --iters 5 --warmup 1 --mode write --check --quiet
two mesh_sp_tcp 90 tether bench --full-mesh --device gpu --gpus 2 --single-process --transport tcp --sizes 64M --iters 5 --warmup 1 --mode write --check --quiet
t fabric_host 240 $PT tests/python/test_fabric.py
t fabric_gpu_probe 60 python3 bench/gpu/fabric_gpu_probe.py
t fabric_gpu 120 $PT tests/python/test_fabric_gpu.py
t ipc_gpu_tuned 50 python3 bench/gpu/compare_ipc_gpu.py --channels 16
t ipc_gpu_check 80 python3 bench/gpu/compare_ipc_gpu.py --channels 16 --check
t scatter_probe 150 python3 bench/gpu/scatter_probe.py
t post_blocks_gpu 90 python3 bench/tools/post_blocks.py --transports ipc --gpus --channels 16 --window 64 --iters 50
t ipc_rw 60 tether bench --transport ipc --mode write,read --sizes 1M,16M,256M --async-api --depth 2 --check --quiet \
  --device gpu --local-gpu-idx 0 --remote-gpu-idx $R
t ipc_rw_host 60 tether bench --transport ipc --mode write,read --sizes 1M,16M,256M --check --quiet --device cpu
t ipc_gpu_notify 90 $PT tests/python/test_ipc_gpu.py -k write_and_notify
# One op at a time, by size: where a lone op's time goes (ipc host memory, GPU0>GPU1, GPU0>GPU0, one
# lane; tcp beside). docs/ARCHITECTURE.md, "Waking up".
L1="--mode write --iters 400 --quiet --sizes 4K,64K,1M,16M"
t lat_ipc_host 40 tether bench --transport ipc --device cpu $L1
t lat_ipc_gpu 40 tether bench --transport ipc --device gpu --local-gpu-idx 0 --remote-gpu-idx $R $L1
t lat_ipc_gpu00 40 tether bench --transport ipc --device gpu --local-gpu-idx 0 --remote-gpu-idx 0 $L1
TETHER_CHANNELS=1 t lat_ipc_gpu_1lane 40 tether bench --transport ipc --device gpu --local-gpu-idx 0 --remote-gpu-idx $R $L1
t lat_tcp_gpu 40 tether bench --transport tcp --device gpu --local-gpu-idx 0 --remote-gpu-idx $R $L1
# Thread wake-up cost: busy polling off (beside ipc_gpu_tuned).
TETHER_BUSY_POLL_US=0 t ipc_busy0 50 python3 bench/gpu/compare_ipc_gpu.py --channels 16
for c in 32 64 128 256 1024; do t ipc_chunk_${c}M 40 python3 bench/gpu/compare_ipc_gpu.py --channels 16 --gpu-chunk $((c << 20)); done
# The serving paths' rows (docs/PERFORMANCE.md, "Two GPUs on one host"): scattered KV over ipc one at a
# time and two in flight, 256 MiB, and tcp beside its ceiling at the same stream count; then traces of
# one scattered ipc write and one 16 MiB tcp read (bench/tools/trace_report.py: where an op's time goes).
KV="--device gpu --local-gpu-idx 0 --remote-gpu-idx $R --check --quiet --mode write,read"
t kv_ipc 60 tether bench --transport ipc $KV --sizes 16K --num-iovs 4096
t kv_ipc_depth2 60 tether bench --transport ipc $KV --sizes 16K --num-iovs 4096 --async-api --depth 2
t ipc256 60 tether bench --transport ipc $KV --sizes 256M
t tcp_rows 150 bash -c "tether bench --transport tcp $KV --sizes 16M,256M --ceiling &&
  tether bench --transport tcp $KV --sizes 16K --num-iovs 4096 --ceiling"
TR="--device gpu --local-gpu-idx 0 --remote-gpu-idx $R --quiet --iters 30 --warmup 5"
for m in write read; do  # steps trace_kv_ipc (the write) and trace_kv_ipc_read
  n=trace_kv_ipc; [ $m = read ] && n=trace_kv_ipc_read
  t $n 120 bash -c "rm -f /tmp/tr_kv.*; TETHER_TRACE=/tmp/tr_kv tether bench --transport ipc $TR \
    --sizes 16K --num-iovs 4096 --mode $m && python3 bench/tools/trace_report.py /tmp/tr_kv --phases &&
    python3 bench/tools/trace_report.py /tmp/tr_kv --timeline 0.5 | head -80"
done
t trace_tcp16_read 120 bash -c "rm -f /tmp/tr_t16.*; TETHER_TRACE=/tmp/tr_t16 tether bench --transport tcp $TR --sizes 16M \
  --mode read && python3 bench/tools/trace_report.py /tmp/tr_t16 --phases &&
  python3 bench/tools/trace_report.py /tmp/tr_t16 --reader-time && python3 bench/tools/trace_report.py /tmp/tr_t16 --sender-time"
t trace_tcp16_write 120 bash -c "rm -f /tmp/tr_w16.*; TETHER_TRACE=/tmp/tr_w16 tether bench --transport tcp $TR --sizes 16M \
  --mode write && python3 bench/tools/trace_report.py /tmp/tr_w16 --phases &&
  python3 bench/tools/trace_report.py /tmp/tr_w16 --sender-time && python3 bench/tools/trace_report.py /tmp/tr_w16 --reader-time"
# Scattered KV over tcp beside a contiguous transfer of the same 64 MiB: what the gathers cost over the
# pipeline's fill and drain, which any staged transfer of a few chunks per lane pays.
t kv_tcp_contig 150 bash -c "tether bench --transport tcp $KV --sizes 16K --num-iovs 4096 --ceiling &&
  tether bench --transport tcp $KV --sizes 64M --ceiling"
for m in write read; do
  t trace_kv_tcp_$m 120 bash -c "rm -f /tmp/tr_kt.*; TETHER_TRACE=/tmp/tr_kt tether bench --transport tcp $TR --sizes 16K \
    --num-iovs 4096 --mode $m && python3 bench/tools/trace_report.py /tmp/tr_kt --phases &&
    python3 bench/tools/trace_report.py /tmp/tr_kt --sender-time && python3 bench/tools/trace_report.py /tmp/tr_kt --reader-time"
done
t test_gpu_rest 240 $PT tests/python/test_gpu.py -k "not vectored"
t ipc_gpu_quick 90 $PT tests/python/test_ipc_gpu.py -k "vectored or cache or deregistered or two_endpoints or child or send_recv"
t tcp256 60 tether bench --transport tcp $G --sizes 256M --iters 10
t nccl_socket 150 python3 bench/peers/run.py --only nccl-socket
two nvlink_probe 40 python3 bench/gpu/nvlink_probe.py
t ipc_probe 150 python3 bench/gpu/ipc_probe.py
t env 20 bash -c '{ ldconfig -p | grep -E "libfabric|libcuda.so"; command -v fi_info && fi_info -l; nproc; nvidia-smi --query-gpu=name,driver_version --format=csv; } | sed "s/^/env: /"'
cat "$S"
