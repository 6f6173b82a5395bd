#include "unpack_bench.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>

#include "gpu/cuda_api.h"
#include "gpu/copy_kernel.h"

namespace tether::gpu {
namespace {

// Everything the run allocates, freed on every way out.
struct Resources {
  const CudaApi* a = nullptr;
  CUstream stream = nullptr;
  CUevent ev[2] = {nullptr, nullptr};
  CUdeviceptr bounce = 0, dest = 0;
  uint64_t* host_table = nullptr;  // (src, dst, len) triples, mapped: the kernel-table row reads them itself
  ~Resources() {
    if (stream) a->cuStreamSynchronize(stream);
    for (CUevent e : ev)
      if (e) a->cuEventDestroy(e);
    if (stream) a->cuStreamDestroy(stream);
    for (CUdeviceptr p : {bounce, dest})
      if (p) a->cuMemFree(p);
    if (host_table) a->cuMemFreeHost(host_table);
  }
};

}  // namespace

Result<std::vector<UnpackBenchRow>> bench_unpack(int device, uint64_t chunk_bytes, uint64_t frag_bytes, uint32_t iters,
                                                 uint64_t seed) {
  std::string why;
  const CudaApi* a = cuda(&why);
  if (!a) return Status(Code::kUnavailable, why);
  if (!a->cuEventElapsedTime) return Status(Code::kUnavailable, "libcuda lacks cuEventElapsedTime");
  if (frag_bytes == 0 || chunk_bytes % frag_bytes != 0 || chunk_bytes / frag_bytes > 65535 || chunk_bytes > UINT32_MAX || iters == 0)
    return Status(Code::kInvalidArgument, "chunk must be a multiple of the fragment size, under 4 GiB, at most 65535 fragments");
  if (Status s = use_device(device); !s.is_ok()) return s;
  const uint64_t n = chunk_bytes / frag_bytes;

  Resources r;
  r.a = a;
  TETHER_CUDA_TRY("cuStreamCreate", a->cuStreamCreate(&r.stream, kStreamNonBlocking));
  TETHER_CUDA_TRY("cuEventCreate", a->cuEventCreate(&r.ev[0], 0));
  TETHER_CUDA_TRY("cuEventCreate", a->cuEventCreate(&r.ev[1], 0));
  TETHER_CUDA_TRY("cuMemAlloc", a->cuMemAlloc(&r.bounce, chunk_bytes));
  TETHER_CUDA_TRY("cuMemAlloc", a->cuMemAlloc(&r.dest, chunk_bytes));
  void* ht = nullptr;
  TETHER_CUDA_TRY("cuMemHostAlloc", a->cuMemHostAlloc(&ht, n * 3 * sizeof(uint64_t), kHostAllocPortable | kHostAllocDeviceMap));
  r.host_table = static_cast<uint64_t*>(ht);

  // Random bounce contents; fragment i of the chunk lies in bounce page perm[i] (a shuffled pool).
  std::vector<uint8_t> pattern(chunk_bytes), expect(chunk_bytes), got(chunk_bytes), poison(chunk_bytes, 0xA5);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  auto next = [&x] {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return x;
  };
  for (auto& b : pattern) b = uint8_t(next());
  std::vector<uint64_t> perm(n);
  std::vector<CopyPiece> pieces(n);  // the unpacker's form: offsets from the bounce buffer and the destination
  std::iota(perm.begin(), perm.end(), 0);
  for (uint64_t i = n - 1; i > 0; --i) std::swap(perm[i], perm[next() % (i + 1)]);
  for (uint64_t i = 0; i < n; ++i) {
    std::memcpy(&expect[i * frag_bytes], &pattern[perm[i] * frag_bytes], frag_bytes);
    r.host_table[3 * i + 0] = r.bounce + perm[i] * frag_bytes;
    r.host_table[3 * i + 1] = r.dest + i * frag_bytes;
    r.host_table[3 * i + 2] = frag_bytes;
    pieces[i] = CopyPiece{uint32_t(perm[i] * frag_bytes), uint32_t(i * frag_bytes), uint32_t(frag_bytes)};
  }
  TETHER_CUDA_TRY("cuMemcpy(bounce)", a->cuMemcpy(r.bounce, reinterpret_cast<CUdeviceptr>(pattern.data()), chunk_bytes));

  auto op = [&](const std::string& method) -> Status {
    if (method == "kernel")  // what the netplugin unpacker does per receive
      return launch_copy_pieces(device, r.stream, r.bounce, r.dest, pieces.data(), uint32_t(n));
    if (method == "kernel-table")  // the kernel reads the mapped triples itself (unified address): the ipc batches' form
      return launch_copy_table(device, r.stream, reinterpret_cast<CUdeviceptr>(r.host_table), uint32_t(n), frag_bytes);
    if (method == "kernel-wide")  // full 64-bit triples (other callers' form when offsets do not fit)
      return launch_copy(device, r.stream, r.host_table, uint32_t(n), CopyForm::kWide);
    if (method == "d2d") {
      for (uint64_t i = 0; i < n; ++i)
        TETHER_CUDA_TRY("cuMemcpyAsync", a->cuMemcpyAsync(r.host_table[3 * i + 1], r.host_table[3 * i], frag_bytes, r.stream));
      return Status::ok();
    }
    TETHER_CUDA_TRY("cuMemcpyAsync", a->cuMemcpyAsync(r.dest, r.bounce, chunk_bytes, r.stream));
    return Status::ok();
  };
  auto elapsed_ms = [&](float* ms) -> Status {
    TETHER_CUDA_TRY("cuEventSynchronize", a->cuEventSynchronize(r.ev[1]));
    TETHER_CUDA_TRY("cuEventElapsedTime", a->cuEventElapsedTime(ms, r.ev[0], r.ev[1]));
    return Status::ok();
  };

  std::vector<UnpackBenchRow> rows;
  for (const char* method : {"kernel", "kernel-wide", "kernel-table", "d2d", "contiguous"}) {
    UnpackBenchRow row;
    row.method = method;
    TETHER_CUDA_TRY("cuMemcpy(poison)", a->cuMemcpy(r.dest, reinterpret_cast<CUdeviceptr>(poison.data()), chunk_bytes));
    for (int w = 0; w < 10; ++w)
      if (Status s = op(method); !s.is_ok()) return s;
    // Back to back.
    TETHER_CUDA_TRY("cuEventRecord", a->cuEventRecord(r.ev[0], r.stream));
    const auto t0 = std::chrono::steady_clock::now();
    for (uint32_t i = 0; i < iters; ++i)
      if (Status s = op(method); !s.is_ok()) return s;
    row.host_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
    TETHER_CUDA_TRY("cuEventRecord", a->cuEventRecord(r.ev[1], r.stream));
    float ms = 0;
    if (Status s = elapsed_ms(&ms); !s.is_ok()) return s;
    row.stream_gbps = double(chunk_bytes) * iters / (double(ms) * 1e6);
    // One at a time.
    double total_ms = 0;
    for (uint32_t i = 0; i < iters; ++i) {
      TETHER_CUDA_TRY("cuEventRecord", a->cuEventRecord(r.ev[0], r.stream));
      if (Status s = op(method); !s.is_ok()) return s;
      TETHER_CUDA_TRY("cuEventRecord", a->cuEventRecord(r.ev[1], r.stream));
      if (Status s = elapsed_ms(&ms); !s.is_ok()) return s;
      total_ms += ms;
    }
    row.alone_gbps = double(chunk_bytes) * iters / (total_ms * 1e6);
    // Every byte, once: the unpacks must have put each page in its place, the plain copy the pool as is.
    TETHER_CUDA_TRY("cuStreamSynchronize", a->cuStreamSynchronize(r.stream));
    TETHER_CUDA_TRY("cuMemcpy(check)", a->cuMemcpy(reinterpret_cast<CUdeviceptr>(got.data()), r.dest, chunk_bytes));
    const std::vector<uint8_t>& want = row.method == "contiguous" ? pattern : expect;
    for (uint64_t i = 0; i < chunk_bytes; ++i) row.mismatches += got[i] != want[i];
    rows.push_back(row);
  }
  return rows;
}

}  // namespace tether::gpu
