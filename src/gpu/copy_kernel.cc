#include "gpu/copy_kernel.h"

#include <algorithm>
#include <array>
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

// Parameter blocks, laid out as kernels.cu's Frags<K> (wide: 24 bytes a fragment) and Pieces<K>
// (compact: 32-bit offsets from two bases, 12 bytes). The driver copies the whole block into every
// launch, so a launch uses the smallest block its fragments fit.
template <uint32_t K>
struct Wide {
  uint64_t n;
  uint64_t f[3 * K];
};
template <uint32_t K>
struct Compact {
  uint64_t src_base, dst_base, n;
  uint32_t p[3 * K];
};
constexpr std::array<uint32_t, 2> kWide = {96, kCopyFragsPerLaunch};
constexpr std::array<uint32_t, 3> kCompact = {128, 1024, kCopyFragsPerLaunch};
static_assert(sizeof(Wide<kWide[1]>) <= 32764 && sizeof(Compact<kCompact[2]>) <= 32764, "CUDA's parameter limit");


struct KernelModule {
  std::once_flag once;
  CUfunction wide[kWide.size()] = {};
  CUfunction compact[kCompact.size()] = {};
  CUfunction table = nullptr;
  std::string why;
};

KernelModule& module(int device) {
  static std::vector<KernelModule>& modules = *new std::vector<KernelModule>(64);  // never destroyed, as cuda()
  return modules[size_t(device)];
}

// gridDim.x: one 256-thread block per 16 KiB of the longest fragment (up to 1024), gridDim.y: one row
// per fragment. A 4 KiB fragment gets one block, one 16-byte load per thread; a 4 MiB chunk of them
// is resident in one wave on a Hopper GPU.
unsigned grid_x(uint64_t longest) {
  return unsigned(std::clamp<uint64_t>((longest + kThreads * 64 - 1) / (kThreads * 64), 1, 1024));
}

Status go(CUfunction fn, CUstream stream, void* params, uint32_t n, uint64_t longest) {
  const unsigned gx = grid_x(longest);
  void* args[] = {params};
  if (CUresult r = cuda()->cuLaunchKernel(fn, gx, n, 1, kThreads, 1, 1, 0, stream, args, nullptr); r != kCudaSuccess)
    return Status(Code::kInternal, cuda_error("cuLaunchKernel(tether copy kernel)", r));
  return Status::ok();
}

template <uint32_t K>
Status launch_wide(CUfunction fn, CUstream stream, const uint64_t* t, uint32_t n, uint64_t longest) {
  Wide<K> p;  // on this thread's stack: the driver copies it into the launch
  p.n = n;
  std::memcpy(p.f, t, size_t(n) * 3 * sizeof(uint64_t));
  return go(fn, stream, &p, n, longest);
}

// A compact launch of n <= kCopyFragsPerLaunch fragments in the smallest block they fit; `fill`
// writes their (src_off, dst_off, len) words straight into it.
template <uint32_t K, typename Fill>
Status launch_compact(CUfunction fn, CUstream stream, uint64_t src_base, uint64_t dst_base, uint32_t n,
                      uint64_t longest, const Fill& fill) {
  Compact<K> p;  // on this thread's stack: the driver copies it into the launch
  p.src_base = src_base;
  p.dst_base = dst_base;
  p.n = n;
  fill(p.p);
  return go(fn, stream, &p, n, longest);
}

template <typename Fill>
Status launch_compact(const KernelModule& m, CUstream stream, uint64_t src_base, uint64_t dst_base, uint32_t n,
                      uint64_t longest, const Fill& fill) {
  if (n <= kCompact[0]) return launch_compact<kCompact[0]>(m.compact[0], stream, src_base, dst_base, n, longest, fill);
  if (n <= kCompact[1]) return launch_compact<kCompact[1]>(m.compact[1], stream, src_base, dst_base, n, longest, fill);
  return launch_compact<kCompact[2]>(m.compact[2], stream, src_base, dst_base, n, longest, fill);
}

// One launch of n <= kCopyFragsPerLaunch triples.
Status launch_one(const KernelModule& m, CUstream stream, const uint64_t* t, uint32_t n, CopyForm form) {
  uint64_t src_lo = UINT64_MAX, dst_lo = UINT64_MAX, src_hi = 0, dst_hi = 0, longest = 0;
  for (uint32_t i = 0; i < n; ++i) {
    src_lo = std::min(src_lo, t[3 * i]);
    dst_lo = std::min(dst_lo, t[3 * i + 1]);
    src_hi = std::max(src_hi, t[3 * i] + t[3 * i + 2]);
    dst_hi = std::max(dst_hi, t[3 * i + 1] + t[3 * i + 2]);
    longest = std::max(longest, t[3 * i + 2]);
  }
  const bool compact = form != CopyForm::kWide && src_hi - src_lo <= UINT32_MAX && dst_hi - dst_lo <= UINT32_MAX;
  if (compact)
    return launch_compact(m, stream, src_lo, dst_lo, n, longest, [&](uint32_t* p) {
      for (uint32_t i = 0; i < n; ++i) {
        p[3 * i + 0] = uint32_t(t[3 * i + 0] - src_lo);
        p[3 * i + 1] = uint32_t(t[3 * i + 1] - dst_lo);
        p[3 * i + 2] = uint32_t(t[3 * i + 2]);
      }
    });
  if (n <= kWide[0]) return launch_wide<kWide[0]>(m.wide[0], stream, t, n, longest);
  return launch_wide<kWide[1]>(m.wide[1], stream, t, n, longest);
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
    auto get = [&](const std::string& name, CUfunction* out) {
      if (CUresult r = a->cuModuleGetFunction(out, mod, name.c_str()); r != kCudaSuccess) {
        m.why = cuda_error(("cuModuleGetFunction(" + name + ")").c_str(), r);
        *out = nullptr;
        return false;
      }
      return true;
    };
    for (size_t i = 0; i < kWide.size(); ++i)
      if (!get("tether_copy_frags_" + std::to_string(kWide[i]), &m.wide[i])) return;
    for (size_t i = 0; i < kCompact.size(); ++i)
      if (!get("tether_copy_pieces_" + std::to_string(kCompact[i]), &m.compact[i])) return;
    if (!get("tether_copy_table", &m.table)) return;
#else
    m.why = "this build has no GPU kernels (nvcc was not found at build time; see TETHER_CUDA in CMakeLists.txt)";
#endif
  });
  if (!m.table) return Status(Code::kUnavailable, m.why);
  return Status::ok();
}

Status launch_copy(int device, CUstream stream, const uint64_t* triples, uint32_t n, CopyForm form) {
  if (n == 0) return Status::ok();
  if (Status s = copy_kernel(device); !s.is_ok()) return s;
  const KernelModule& m = module(device);
  while (n > 0) {
    const uint32_t k = std::min(n, kCopyFragsPerLaunch);
    if (Status s = launch_one(m, stream, triples, k, form); !s.is_ok()) return s;
    triples += 3 * size_t(k);
    n -= k;
  }
  return Status::ok();
}

Status launch_copy_pieces(int device, CUstream stream, uint64_t src_base, uint64_t dst_base, const CopyPiece* pieces,
                          uint32_t n) {
  static_assert(sizeof(CopyPiece) == 3 * sizeof(uint32_t));
  if (n == 0) return Status::ok();
  if (Status s = copy_kernel(device); !s.is_ok()) return s;
  const KernelModule& m = module(device);
  while (n > 0) {
    const uint32_t k = std::min(n, kCopyFragsPerLaunch);
    uint32_t longest = 0;
    for (uint32_t i = 0; i < k; ++i) longest = std::max(longest, pieces[i].len);
    Status s = launch_compact(m, stream, src_base, dst_base, k, longest,
                              [&](uint32_t* p) { std::memcpy(p, pieces, size_t(k) * sizeof(CopyPiece)); });
    if (!s.is_ok()) return s;
    pieces += k;
    n -= k;
  }
  return Status::ok();
}

Status launch_copy_table(int device, CUstream stream, CUdeviceptr table, uint32_t n, uint64_t longest) {
  if (n == 0) return Status::ok();
  if (Status s = copy_kernel(device); !s.is_ok()) return s;
  CUdeviceptr table_arg = table;
  uint64_t n_arg = n;
  void* args[] = {&table_arg, &n_arg};
  const unsigned gy = std::min<uint32_t>(n, 65535);  // the kernel walks the rest
  if (CUresult r = cuda()->cuLaunchKernel(module(device).table, grid_x(longest), gy, 1, kThreads, 1, 1, 0, stream, args, nullptr);
      r != kCudaSuccess)
    return Status(Code::kInternal, cuda_error("cuLaunchKernel(tether_copy_table)", r));
  return Status::ok();
}

}  // namespace tether::gpu
