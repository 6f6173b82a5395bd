#include "copy_bench.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <vector>

#include "gpu/copy_kernel.h"
#include "gpu/cuda_api.h"

namespace tether::gpu {
namespace {

struct Streams {
  const CudaApi* a = nullptr;
  std::vector<CUstream> s;
  std::vector<CUevent> e;
  ~Streams() {
    for (CUstream x : s)
      if (x) a->cuStreamSynchronize(x);
    for (CUevent x : e)
      if (x) a->cuEventDestroy(x);
    for (CUstream x : s)
      if (x) a->cuStreamDestroy(x);
  }
};

}  // namespace

Result<CopyBenchResult> bench_copy(int device, uint64_t src, uint64_t dst, uint64_t bytes, uint64_t frag_bytes,
                                   uint32_t streams, uint32_t batch, uint32_t iters, bool kernel, uint64_t seed) {
  std::string why;
  const CudaApi* a = cuda(&why);
  if (!a) return Status(Code::kUnavailable, why);
  if (bytes == 0 || streams == 0 || streams > 64 || iters == 0 || frag_bytes == 0 || bytes % frag_bytes != 0 ||
      batch == 0 || batch > kCopyFragsPerLaunch)
    return Status(Code::kInvalidArgument, "bench_copy: bytes a multiple of frag_bytes, 1-64 streams, batch 1-1344");
  if (Status s = use_device(device); !s.is_ok()) return s;
  if (kernel)
    if (Status s = copy_kernel(device); !s.is_ok()) return s;
  Streams st;
  st.a = a;
  st.s.resize(streams);
  st.e.resize(streams);
  for (uint32_t i = 0; i < streams; ++i) {
    TETHER_CUDA_TRY("cuStreamCreate", a->cuStreamCreate(&st.s[i], kStreamNonBlocking));
    TETHER_CUDA_TRY("cuEventCreate", a->cuEventCreate(&st.e[i], kEventDisableTiming));
  }
  // Fragment i of the source lands at slot perm[i] of the destination (the scattered pattern).
  const uint64_t n = bytes / frag_bytes;
  std::vector<uint64_t> perm(n), triples(3 * n);
  std::iota(perm.begin(), perm.end(), 0);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (uint64_t i = n - 1; i > 0; --i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::swap(perm[i], perm[x % (i + 1)]);
  }
  for (uint64_t i = 0; i < n; ++i) {
    triples[3 * i] = src + i * frag_bytes;
    triples[3 * i + 1] = dst + perm[i] * frag_bytes;
    triples[3 * i + 2] = frag_bytes;
  }
  auto op = [&]() -> Status {
    if (kernel) {
      uint32_t k = 0;
      for (uint64_t f = 0; f < n; f += batch, k = (k + 1) % streams)
        if (Status s = launch_copy(device, st.s[k], &triples[3 * f], uint32_t(std::min<uint64_t>(batch, n - f))); !s.is_ok())
          return s;
    } else {
      const uint64_t part = (bytes / streams + 4095) & ~uint64_t(4095);
      for (uint32_t k = 0; k * part < bytes; ++k)
        TETHER_CUDA_TRY("cuMemcpyAsync", a->cuMemcpyAsync(dst + k * part, src + k * part, std::min(part, bytes - k * part), st.s[k]));
    }
    for (uint32_t k = 0; k < streams; ++k) TETHER_CUDA_TRY("cuEventRecord", a->cuEventRecord(st.e[k], st.s[k]));
    return Status::ok();
  };
  auto wait = [&]() -> Status {
    for (uint32_t k = 0; k < streams; ++k) TETHER_CUDA_TRY("cuEventSynchronize", a->cuEventSynchronize(st.e[k]));
    return Status::ok();
  };
  for (int w = 0; w < 2; ++w) {
    if (Status s = op(); !s.is_ok()) return s;
    if (Status s = wait(); !s.is_ok()) return s;
  }
  CopyBenchResult r;
  double submit = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (uint32_t i = 0; i < iters; ++i) {
    const auto s0 = std::chrono::steady_clock::now();
    if (Status s = op(); !s.is_ok()) return s;
    submit += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - s0).count();
    if (Status s = wait(); !s.is_ok()) return s;
  }
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  r.us_per_op = us / iters;
  r.submit_us = submit / iters;
  r.gbps = double(bytes) / (r.us_per_op * 1e3);
  // Every byte: the source as it is, and where each fragment went.
  std::vector<uint8_t> s(bytes), d(bytes);
  TETHER_CUDA_TRY("cuMemcpy(check src)", a->cuMemcpy(reinterpret_cast<CUdeviceptr>(s.data()), src, bytes));
  TETHER_CUDA_TRY("cuMemcpy(check dst)", a->cuMemcpy(reinterpret_cast<CUdeviceptr>(d.data()), dst, bytes));
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t at = kernel ? perm[i] * frag_bytes : i * frag_bytes;
    for (uint64_t b = 0; b < frag_bytes; ++b) r.mismatches += s[i * frag_bytes + b] != d[at + b];
  }
  return r;
}

}  // namespace tether::gpu
