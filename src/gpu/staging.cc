#include "gpu/staging.h"

#include <algorithm>
#include <memory>
#include <mutex>

#include "gpu/copy_kernel.h"

namespace tether::gpu {
namespace {

// CUDA_ERROR_OUT_OF_MEMORY: a scratch buffer the GPU has no room for (its copies go direct instead).
constexpr CUresult kCudaOutOfMemory = 2;
}  // namespace

Result<Unpack> parse_unpack(const std::string& name) {
  if (name.empty()) return kernels_available() ? Unpack::kKernel : Unpack::kD2D;
  if (name == "kernel") {
    std::string why;
    if (!kernels_available(&why)) return Status(Code::kUnavailable, "unpack=kernel: " + why);
    return Unpack::kKernel;
  }
  if (name == "d2d") return Unpack::kD2D;
  if (name == "host") return Unpack::kHost;
  return Status(Code::kInvalidArgument, "unpack must be kernel, d2d or host, not '" + name + "'");
}

const char* unpack_name(Unpack u) {
  switch (u) {
    case Unpack::kKernel: return "kernel";
    case Unpack::kD2D: return "d2d";
    case Unpack::kHost: return "host";
  }
  return "?";
}

bool kernels_available(std::string* why) {
#ifdef TETHER_HAVE_KERNELS
  if (!cuda(why)) return false;
  Status k = copy_kernel(0);
  if (!k.is_ok() && why) *why = k.message();
  return k.is_ok();
#else
  if (why) *why = "this build has no GPU kernels (nvcc was not found at build time)";
  return false;
#endif
}

StagingRing::StagingRing(uint32_t slots, uint64_t capacity, uint32_t max_fragments)
    : max_fragments_(max_fragments), capacity_(capacity), slots_(slots), runs_(slots) {}

StagingRing::~StagingRing() {
  const CudaApi* a = cuda();
  if (!a) return;
  wait_all();  // nothing may still be copying into memory freed below
  for (StagingSlot& s : slots_)
    for (auto& d : s.per_device)
      if (d.event) a->cuEventDestroy(d.event);
  for (CUstream st : streams_)
    if (st) a->cuStreamDestroy(st);
  for (const Scratch& sc : scratch_)
    if (sc.ptr) a->cuMemFree(sc.ptr);
  if (block_) a->cuMemFreeHost(block_);
}

Status StagingRing::prepare(int device) {
  if (!block_) {
    std::string why;
    const CudaApi* a = cuda(&why);
    if (!a) return Status(Code::kUnavailable, why);
    if (Status st = use_device(device); !st.is_ok()) return st;  // pinned allocations need a context
    const uint64_t stride = this->stride();
    void* p = nullptr;
    if (Status st = cuda_check("cuMemHostAlloc", a->cuMemHostAlloc(&p, stride * slots_.size(), kHostAllocPortable | kHostAllocDeviceMap));
        !st.is_ok())
      return st;
    block_ = static_cast<uint8_t*>(p);
    for (size_t i = 0; i < slots_.size(); ++i) {
      StagingSlot& s = slots_[i];
      s.table = std::make_unique<uint64_t[]>(size_t(max_fragments_) * 3);
      s.host = block_ + i * stride;
      s.capacity = capacity_;
      s.per_device.resize(size_t(device_count()));
    }
  }
  for (StagingSlot& s : slots_)
    if (Status st = ready(s, device); !st.is_ok()) return st;
  return Status::ok();
}

Result<StagingSlot*> StagingRing::acquire(int device, uint32_t span) {
  const int first = runs_.find(span);
  if (first < 0) return static_cast<StagingSlot*>(nullptr);
  if (!block_)
    if (Status st = prepare(device); !st.is_ok()) return st;
  runs_.take(uint32_t(first), span);
  return &slots_[size_t(first)];
}

Status StagingRing::ready(StagingSlot& s, int device) {
  if (device < 0 || size_t(device) >= s.per_device.size())
    return Status(Code::kInvalidArgument, "GPU " + std::to_string(device) + " does not exist");
  if (Status st = use_device(device); !st.is_ok()) return st;
  const CudaApi* a = cuda();
  auto& d = s.per_device[size_t(device)];
  if (streams_.size() <= size_t(device)) streams_.resize(size_t(device) + 1, nullptr);
  if (!streams_[size_t(device)])
    TETHER_CUDA_TRY("cuStreamCreate", a->cuStreamCreate(&streams_[size_t(device)], kStreamNonBlocking));
  if (!d.event) TETHER_CUDA_TRY("cuEventCreate", a->cuEventCreate(&d.event, kEventDisableTiming));
  return Status::ok();
}

// The ring's scratch buffer on `device`, at least `bytes` long, or 0 where the GPU had no memory for
// it (the ring's kernel-mode copies on that device then go direct; it does not ask again). One per ring
// and device is enough: every copy of the ring on that device runs on one stream, so a chunk's copy and
// kernel are done with it before the next chunk's start. It grows (rarely: a two-slot batch after
// one-slot ones) once the stream has finished with the smaller one.
Result<CUdeviceptr> StagingRing::scratch_for(int device, uint64_t bytes) {
  const CudaApi* a = cuda();
  if (scratch_.size() <= size_t(device)) scratch_.resize(size_t(device) + 1);
  Scratch& sc = scratch_[size_t(device)];
  if (sc.refused) return CUdeviceptr(0);
  if (sc.bytes >= bytes) return sc.ptr;
  if (sc.ptr) {
    TETHER_CUDA_TRY("cuStreamSynchronize", a->cuStreamSynchronize(streams_[size_t(device)]));
    TETHER_CUDA_TRY("cuMemFree", a->cuMemFree(sc.ptr));
    sc = Scratch{};
  }
  const uint64_t size = (bytes + stride() - 1) / stride() * stride();
  const CUresult r = a->cuMemAlloc(&sc.ptr, size);
  if (r == kCudaOutOfMemory) {
    sc = Scratch{};
    sc.refused = true;
    return CUdeviceptr(0);
  }
  TETHER_CUDA_TRY("cuMemAlloc", r);
  sc.bytes = size;
  return sc.ptr;
}

Status StagingRing::copy(StagingSlot& s, int device, const Fragment* frags, uint32_t n, Unpack mode, bool to_slot) {
  if (n > max_fragments_) return Status(Code::kInternal, "staging: too many fragments for one chunk");
  if (Status st = ready(s, device); !st.is_ok()) return st;
  const CudaApi* a = cuda();
  auto& d = s.per_device[size_t(device)];
  const CUstream stream = streams_[size_t(device)];
  s.device = device;
  auto host_at = [&](const Fragment& f) { return reinterpret_cast<CUdeviceptr>(s.host + f.offset); };
  auto ptr = [](const Fragment& f) { return reinterpret_cast<CUdeviceptr>(f.ptr); };
  if (mode == Unpack::kKernel && n > 1) {
    if (Status st = copy_kernel(device); !st.is_ok()) return st;
    uint64_t begin = UINT64_MAX, extent = 0;  // only [begin, extent) of the slot moves
    for (uint32_t i = 0; i < n; ++i) {
      begin = std::min(begin, frags[i].offset);
      extent = std::max(extent, frags[i].offset + frags[i].length);
    }
    // Stage through device scratch memory: the copy engine moves the slot's bytes across PCIe and the
    // kernel only touches GPU memory. Two processes' kernels on one GPU take turns, so a kernel reading or
    // writing pinned memory over PCIe held the GPU far longer (docs/PERFORMANCE.md, "Defaults and why").
    // base 0 (no scratch memory free): the kernel touches the pinned slot itself.
    auto scratch = scratch_for(device, extent);
    if (!scratch.is_ok()) return scratch.status();
    const CUdeviceptr base = scratch.value();
    auto slot_at = [&](const Fragment& f) { return base ? base + f.offset : host_at(f); };
    uint64_t* table = s.table.get();
    for (uint32_t i = 0; i < n; ++i) {
      table[3 * i + 0] = to_slot ? ptr(frags[i]) : slot_at(frags[i]);
      table[3 * i + 1] = to_slot ? slot_at(frags[i]) : ptr(frags[i]);
      table[3 * i + 2] = frags[i].length;
    }
    const CUdeviceptr host = reinterpret_cast<CUdeviceptr>(s.host + begin);
    if (base && !to_slot)
      TETHER_CUDA_TRY("cuMemcpyAsync(chunk to GPU)", a->cuMemcpyAsync(base + begin, host, extent - begin, stream));
    if (Status st = launch_copy(device, stream, table, n); !st.is_ok()) return st;
    if (base && to_slot)
      TETHER_CUDA_TRY("cuMemcpyAsync(chunk to host)", a->cuMemcpyAsync(host, base + begin, extent - begin, stream));
  } else {
    for (uint32_t i = 0; i < n; ++i) {
      const CUdeviceptr dst = to_slot ? host_at(frags[i]) : ptr(frags[i]);
      const CUdeviceptr src = to_slot ? ptr(frags[i]) : host_at(frags[i]);
      const CUresult r = mode == Unpack::kHost ? a->cuMemcpy(dst, src, frags[i].length)
                                               : a->cuMemcpyAsync(dst, src, frags[i].length, stream);
      TETHER_CUDA_TRY(mode == Unpack::kHost ? "cuMemcpy" : "cuMemcpyAsync", r);
    }
  }
  return cuda_check("cuEventRecord", a->cuEventRecord(d.event, stream));
}

Status StagingRing::pack(StagingSlot* slot, int device, const Fragment* frags, uint32_t n, Unpack mode) {
  return copy(*slot, device, frags, n, mode, true);
}

Status StagingRing::unpack(StagingSlot* slot, int device, const Fragment* frags, uint32_t n, Unpack mode) {
  return copy(*slot, device, frags, n, mode, false);
}

void StagingRing::wait_all() {
  const CudaApi* a = cuda();
  if (!a) return;
  for (StagingSlot& s : slots_)
    for (auto& d : s.per_device)
      if (d.event) a->cuEventSynchronize(d.event);
}

Result<bool> StagingRing::done(StagingSlot* slot) {
  if (slot->device < 0) return true;
  const CudaApi* a = cuda();
  const CUresult r = a->cuEventQuery(slot->per_device[size_t(slot->device)].event);
  if (r == kCudaNotReady) return false;
  if (r != kCudaSuccess) return Status(Code::kInternal, cuda_error("cuEventQuery", r));
  return true;
}

}  // namespace tether::gpu
