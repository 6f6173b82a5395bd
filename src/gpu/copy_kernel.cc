#include "gpu/copy_kernel.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#ifdef TETHER_HAVE_KERNELS
extern const unsigned char tether_kernels_fatbin[];
extern const size_t tether_kernels_fatbin_size;
#endif

namespace tether::gpu {
namespace {

constexpr unsigned kThreads = 256;  // the kernels' __launch_bounds__
constexpr uint32_t kSmall = 96;     // kernels.cu: tether_copy_frags_96
constexpr uint32_t kLarge = kCopyFragsPerLaunch;  // tether_copy_frags_1344
static_assert(8 + 24 * kLarge <= 32764, "CUDA's kernel parameter limit");

// The kernels' parameter block, laid out as kernels.cu's Frags<K>.
template <uint32_t K>
struct Params {
  uint64_t n;
  uint64_t f[3 * K];
};

struct KernelModule {
  std::once_flag once;
  CUfunction small = nullptr, large = nullptr;
  std::string why;
};

KernelModule& module(int device) {
  static std::vector<KernelModule> modules(64);
  return modules[size_t(device)];
}

template <uint32_t K>
Status launch(CUfunction fn, CUstream stream, const uint64_t* triples, uint32_t n) {
  Params<K> p;  // on this thread's stack: the driver copies it into the launch
  p.n = n;
  uint64_t longest = 0;
  std::memcpy(p.f, triples, size_t(n) * 3 * sizeof(uint64_t));
  for (uint32_t i = 0; i < n; ++i) longest = std::max(longest, triples[3 * i + 2]);
  // gridDim.x: one 256-thread block per 16 KiB of the longest fragment (up to 1024), gridDim.y: one
  // row per fragment. A 4 KiB fragment gets one block, one 16-byte load per thread; the whole chunk
  // is resident in one wave on a Hopper GPU.
  const unsigned gx = unsigned(std::clamp<uint64_t>((longest + kThreads * 64 - 1) / (kThreads * 64), 1, 1024));
  void* args[] = {&p};
  if (CUresult r = cuda()->cuLaunchKernel(fn, gx, n, 1, kThreads, 1, 1, 0, stream, args, nullptr); r != kCudaSuccess)
    return Status(Code::kInternal, cuda_error("cuLaunchKernel(tether_copy_frags)", r));
  return Status::ok();
}

}  // namespace

Status copy_kernel(int device) {
  if (device < 0 || device >= 64) return Status(Code::kInvalidArgument, "GPU index out of range");
  KernelModule& m = module(device);
  std::call_once(m.once, [&] {
#ifdef TETHER_HAVE_KERNELS
    const CudaApi* a = cuda(&m.why);
    if (!a) return;
    if (Status s = use_device(device); !s.is_ok()) { m.why = s.message(); return; }
    CUmodule mod = nullptr;
    if (CUresult r = a->cuModuleLoadData(&mod, tether_kernels_fatbin); r != kCudaSuccess) {
      m.why = cuda_error("cuModuleLoadData(tether kernels)", r) + ": this GPU's architecture may be missing from the build";
      return;
    }
    CUfunction small = nullptr, large = nullptr;
    if (CUresult r = a->cuModuleGetFunction(&small, mod, "tether_copy_frags_96"); r != kCudaSuccess) {
      m.why = cuda_error("cuModuleGetFunction(tether_copy_frags_96)", r);
      return;
    }
    if (CUresult r = a->cuModuleGetFunction(&large, mod, "tether_copy_frags_1344"); r != kCudaSuccess) {
      m.why = cuda_error("cuModuleGetFunction(tether_copy_frags_1344)", r) + " (kernel parameters over 4 KiB need CUDA 12.1+)";
      return;
    }
    m.small = small;
    m.large = large;
#else
    m.why = "this build has no GPU kernels (nvcc was not found at build time; see TETHER_CUDA in CMakeLists.txt)";
#endif
  });
  if (!m.large) return Status(Code::kUnavailable, m.why);
  return Status::ok();
}

Status launch_copy(int device, CUstream stream, const uint64_t* triples, uint32_t n) {
  if (n == 0) return Status::ok();
  if (Status s = copy_kernel(device); !s.is_ok()) return s;
  const KernelModule& m = module(device);
  while (n > 0) {
    const uint32_t k = std::min(n, kLarge);
    Status s = k <= kSmall ? launch<kSmall>(m.small, stream, triples, k) : launch<kLarge>(m.large, stream, triples, k);
    if (!s.is_ok()) return s;
    triples += 3 * size_t(k);
    n -= k;
  }
  return Status::ok();
}

}  // namespace tether::gpu
