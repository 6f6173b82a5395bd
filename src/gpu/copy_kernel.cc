#include "gpu/copy_kernel.h"

#include <algorithm>
#include <mutex>
#include <vector>

#ifdef TETHER_HAVE_KERNELS
extern const unsigned char tether_kernels_fatbin[];
extern const size_t tether_kernels_fatbin_size;
#endif

namespace tether::gpu {
namespace {

constexpr unsigned kThreads = 256;  // the kernel's __launch_bounds__

struct KernelModule {
  std::once_flag once;
  CUfunction fn = nullptr;
  std::string why;
};

}  // namespace

Result<CUfunction> copy_kernel(int device) {
  static std::vector<KernelModule> modules(64);
  if (device < 0 || size_t(device) >= modules.size()) return Status(Code::kInvalidArgument, "GPU index out of range");
  KernelModule& m = modules[size_t(device)];
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
    if (CUresult r = a->cuModuleGetFunction(&m.fn, mod, "tether_copy_frags"); r != kCudaSuccess)
      m.why = cuda_error("cuModuleGetFunction", r);
#else
    m.why = "this build has no GPU kernels (nvcc was not found at build time; see TETHER_CUDA in CMakeLists.txt)";
#endif
  });
  if (!m.fn) return Status(Code::kUnavailable, m.why);
  return m.fn;
}

Status launch_copy(int device, CUstream stream, CUdeviceptr table, uint32_t n, uint64_t longest) {
  if (n == 0) return Status::ok();
  auto fn = copy_kernel(device);
  if (!fn.is_ok()) return fn.status();
  // gridDim.x splits a fragment (up to 64 blocks of 256 threads x 64 bytes), gridDim.y walks fragments.
  const unsigned gx = unsigned(std::clamp<uint64_t>((longest + kThreads * 64 - 1) / (kThreads * 64), 1, 64));
  const unsigned gy = std::min<unsigned>(n, 65535);
  CUdeviceptr table_arg = table;
  unsigned n_arg = n;
  void* args[] = {&table_arg, &n_arg};
  if (CUresult r = cuda()->cuLaunchKernel(fn.value(), gx, gy, 1, kThreads, 1, 1, 0, stream, args, nullptr); r != kCudaSuccess)
    return Status(Code::kInternal, cuda_error("cuLaunchKernel(tether_copy_frags)", r));
  return Status::ok();
}

}  // namespace tether::gpu
