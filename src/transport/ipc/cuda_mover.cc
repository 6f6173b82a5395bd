#include "transport/ipc/cuda_mover.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>

#include "gpu/copy_kernel.h"

namespace tether::transport::ipc {

using gpu::CudaApi;
using gpu::CUdeviceptr;
using gpu::cuda_error;
using gpu::kCudaNotReady;
using gpu::kCudaSuccess;

namespace {

// A process may open the allocations of one GPU of another process in one context only (CUDA IPC
// rule), so every allocation of (other process, its GPU) is opened on the GPU the first one was.
int home_device(pid_t pid, int their_device, int prefer) {
  static std::mutex mu;
  static std::map<std::pair<pid_t, int>, int> homes;
  std::lock_guard lock(mu);
  return homes.try_emplace({pid, their_device}, prefer).first->second;
}

// Pinned host memory of `bytes`, portable to every GPU (allocating it needs a context: GPU 0's).
Result<void*> pinned(uint64_t bytes, unsigned flags) {
  std::string why;
  const CudaApi* a = gpu::cuda(&why);
  if (!a) return Status(Code::kUnavailable, why);
  if (Status s = gpu::use_device(0); !s.is_ok()) return s;
  void* p = nullptr;
  TETHER_CUDA_TRY("cuMemHostAlloc", a->cuMemHostAlloc(&p, bytes, flags));
  return p;
}

}  // namespace

Status export_region(core::RegionState& region) {
  if (region.kind != MemoryKind::kCuda || region.size == 0) return Status::ok();
  const CudaApi* a = gpu::cuda();
  if (!a) return Status::ok();
  auto info = gpu::pointer_info(region.base);  // makes the region's GPU current
  if (!info.is_ok() || !info.value().is_device) return Status::ok();  // not exportable: ipc refuses its chunks
  core::CudaExport& e = region.cuda_export;
  gpu::CUipcMemHandle h;
  if (a->cuIpcGetMemHandle(&h, info.value().alloc_base) == kCudaSuccess) {
    std::memcpy(e.handle, h.reserved, sizeof h.reserved);
    e.alloc_base = info.value().alloc_base;
    e.alloc_size = info.value().alloc_size;
    e.ok = true;
    return Status::ok();
  }
  // Memory from the VMM API (torch's expandable segments, cuMemCreate pools): its pieces as fds. Where
  // that fails too (not created shareable), the region's chunks are refused with Unavailable.
  auto v = export_vmm(reinterpret_cast<uint64_t>(region.base), region.size);
  if (!v.is_ok()) return Status::ok();
  std::shared_ptr<VmmExport> x = v.take();
  VmmName name{};
  name.table = reinterpret_cast<uint64_t>(x->pieces.data());
  name.count = uint32_t(x->pieces.size());
  name.identity = x->identity;
  std::memcpy(e.handle, &name, sizeof name);
  e.alloc_base = x->base;
  e.alloc_size = x->size;
  e.vmm = true;
  e.owner = std::move(x);
  e.ok = true;
  return Status::ok();
}

bool region_ref(const core::RegionState& region, CudaRef* out) {
  const core::CudaExport& e = region.cuda_export;
  if (region.kind != MemoryKind::kCuda || !e.ok) return false;
  std::memcpy(out->handle, e.handle, sizeof out->handle);
  out->base = e.alloc_base;
  out->size = e.alloc_size;
  out->device = region.device;
  out->kind = e.vmm ? kVmm : kIpcHandle;
  return true;
}

Mapping::~Mapping() {
  const CudaApi* a = gpu::cuda();
  if (!a || !ptr || !opened || vmm) return;  // a VMM import unmaps itself
  // Every copy that used it has completed: users hold the mapping until their event fired.
  if (gpu::use_device(device).is_ok()) a->cuIpcCloseMemHandle(ptr);
}

Result<std::shared_ptr<Mapping>> CudaImports::get(const CudaRef& ref, int prefer) {
  // Held across the open: lanes answering chunks of one allocation at once would otherwise all
  // open it, and CUDA refuses a second open of a handle in one context (CUDA_ERROR_ALREADY_MAPPED).
  // Opens happen once per allocation and peer; every later chunk finds the cache.
  std::lock_guard lock(mu_);
  {
    auto it = by_base_.find(key(ref));
    if (it != by_base_.end() && names(*it->second, ref)) return it->second;
    auto f = forgotten_.find(key(ref));
    if (f != forgotten_.end()) {
      std::shared_ptr<Mapping> alive = f->second.lock();
      forgotten_.erase(f);
      if (alive && names(*alive, ref)) return by_base_[key(ref)] = alive;
    }
  }
  std::string why;
  const CudaApi* a = gpu::cuda(&why);
  if (!a) return Status(Code::kUnavailable, why);
  const int n = gpu::device_count();
  if (prefer < 0 || prefer >= n) prefer = ref.device >= 0 && ref.device < n ? ref.device : 0;
  auto m = std::make_shared<Mapping>();
  std::memcpy(m->handle, ref.handle, sizeof ref.handle);
  m->remote_base = ref.base;
  m->device = home_device(pid_, ref.device, prefer);
  if (Status s = gpu::use_device(m->device); !s.is_ok()) return s;
  if (ref.kind != kIpcHandle && ref.kind != kVmm) return Status(Code::kProtocolError, "ipc: an unknown kind of GPU memory");
  if (pid_ == ::getpid()) {  // two endpoints of one process: CUDA refuses to open our own handle; no need
    auto info = gpu::pointer_info(reinterpret_cast<void*>(ref.base));
    const bool ours = info.is_ok() && info.value().is_device &&
                      (ref.kind == kVmm || (info.value().alloc_base == ref.base && info.value().alloc_size == ref.size));
    if (!ours) return Status(Code::kNotFound, "ipc: a GPU allocation of this process is gone");
    m->ptr = ref.base;
    m->size = ref.size;
    m->device = info.value().device;
  } else if (ref.kind == kVmm) {
    VmmName name;
    std::memcpy(&name, ref.handle, sizeof name);
    auto v = import_vmm(pid_, name.table, name.count, ref.size, m->device);
    if (!v.is_ok()) return v.status();
    m->vmm = v.take();
    m->ptr = m->vmm->ptr;
    m->size = ref.size;
    m->opened = true;
    opens_->fetch_add(1, std::memory_order_relaxed);
  } else {
    gpu::CUipcMemHandle h;
    std::memcpy(h.reserved, ref.handle, sizeof h.reserved);
    if (Status s = gpu::cuda_check("cuIpcOpenMemHandle", a->cuIpcOpenMemHandle(&m->ptr, h, gpu::kIpcLazyEnablePeerAccess)); !s.is_ok()) {
      m->ptr = 0;
      return s;
    }
    m->opened = true;
    opens_->fetch_add(1, std::memory_order_relaxed);
    // The size the driver mapped, not the one we were told: bounds checks use this.
    CUdeviceptr base = 0;
    size_t size = 0;
    TETHER_CUDA_TRY("cuMemGetAddressRange", a->cuMemGetAddressRange(&base, &size, m->ptr));
    m->size = std::min<uint64_t>(size - (m->ptr - base), ref.size);
    if (m->size != ref.size) return Status(Code::kProtocolError, "a peer's GPU allocation is smaller than it says");
  }
  by_base_[key(ref)] = m;  // new, or replaces a freed allocation (closed when its last copy lets go)
  return m;
}

bool CudaImports::names(const Mapping& m, const CudaRef& ref) {
  return m.size == ref.size && (m.vmm != nullptr) == (ref.kind == kVmm) && std::memcmp(m.handle, ref.handle, sizeof ref.handle) == 0;
}

void CudaImports::forget(const CudaRef& ref) {
  std::shared_ptr<Mapping> last;  // closed outside the lock, when no copy uses it any more
  std::lock_guard lock(mu_);
  auto it = by_base_.find(key(ref));
  if (it == by_base_.end() || !names(*it->second, ref)) return;
  last = std::move(it->second);
  by_base_.erase(it);
  for (auto f = forgotten_.begin(); f != forgotten_.end();) f = f->second.expired() ? forgotten_.erase(f) : std::next(f);
  forgotten_[key(ref)] = last;
}

CudaLane::~CudaLane() {
  const CudaApi* a = gpu::cuda();
  if (!a) return;
  for (size_t d = 0; d < devs_.size(); ++d) {
    Dev& v = devs_[d];
    if (!v.stream) continue;
    if (!gpu::use_device(int(d)).is_ok()) continue;
    a->cuStreamSynchronize(v.stream);
    if (v.event) a->cuEventDestroy(v.event);
    a->cuStreamDestroy(v.stream);
  }
  if (bounce_) a->cuMemFreeHost(bounce_);
  if (table_) a->cuMemFreeHost(table_);
}

Result<CudaLane::Dev*> CudaLane::ready(int device) {
  std::string why;
  const CudaApi* a = gpu::cuda(&why);
  if (!a) return Status(Code::kUnavailable, why);
  if (Status s = gpu::use_device(device); !s.is_ok()) return s;
  if (devs_.empty()) devs_.resize(size_t(gpu::device_count()));
  Dev& d = devs_[size_t(device)];
  if (!d.stream) {  // first use of this GPU on this lane
    TETHER_CUDA_TRY("cuStreamCreate", a->cuStreamCreate(&d.stream, gpu::kStreamNonBlocking));
    TETHER_CUDA_TRY("cuEventCreate", a->cuEventCreate(&d.event, gpu::kEventDisableTiming));
  }
  return &d;
}

Status CudaLane::finish(Dev& d, const char* what) {
  const CudaApi* a = gpu::cuda();
  TETHER_CUDA_TRY("cuEventRecord", a->cuEventRecord(d.event, d.stream));
  const gpu::CUresult r = a->cuEventSynchronize(d.event);
  return r == kCudaSuccess ? Status::ok() : Status(Code::kInternal, std::string(what) + ": " + cuda_error("cuEventSynchronize", r));
}

Status CudaLane::copy(int device, CUdeviceptr dst, CUdeviceptr src, uint64_t len) {
  if (Status s = start(device, dst, src, len); !s.is_ok()) return s;
  return wait(device);
}

Status CudaLane::start(int device, CUdeviceptr dst, CUdeviceptr src, uint64_t len) {
  auto d = ready(device);
  if (!d.is_ok()) return d.status();
  const CudaApi* a = gpu::cuda();
  if (len > 0) TETHER_CUDA_TRY("cuMemcpyAsync", a->cuMemcpyAsync(dst, src, len, d.value()->stream));
  TETHER_CUDA_TRY("cuEventRecord", a->cuEventRecord(d.value()->event, d.value()->stream));
  return Status::ok();
}

Result<bool> CudaLane::done(int device) {
  const gpu::CUresult r = gpu::cuda()->cuEventQuery(devs_[size_t(device)].event);
  if (r == kCudaNotReady) return false;
  if (r != kCudaSuccess) return Status(Code::kInternal, cuda_error("cuEventQuery", r));
  return true;
}

Status CudaLane::wait(int device) {
  const gpu::CUresult r = gpu::cuda()->cuEventSynchronize(devs_[size_t(device)].event);
  return r == kCudaSuccess ? Status::ok() : Status(Code::kInternal, "ipc copy: " + cuda_error("cuEventSynchronize", r));
}

Status CudaLane::copy_many(int device, const uint64_t* triples, uint32_t n, bool kernel) {
  if (n > kMaxBatch) return Status(Code::kInternal, "ipc: too many fragments for one copy");
  auto got = ready(device);
  if (!got.is_ok()) return got.status();
  Dev& d = *got.value();
  const CudaApi* a = gpu::cuda();
  if (kernel) {
    if (Status s = gpu::launch_copy(device, d.stream, triples, n); !s.is_ok()) return s;
  } else {
    for (uint32_t i = 0; i < n; ++i)
      if (triples[3 * i + 2] > 0)
        if (Status s = gpu::cuda_check("cuMemcpyAsync", a->cuMemcpyAsync(triples[3 * i + 1], triples[3 * i], triples[3 * i + 2], d.stream));
            !s.is_ok())
          return s;
  }
  return finish(d, "ipc batch copy");
}

Result<uint64_t*> CudaLane::table() {
  if (table_) return table_;
  auto p = pinned(3 * sizeof(uint64_t) * kMaxBatch, gpu::kHostAllocPortable | gpu::kHostAllocDeviceMap);
  if (!p.is_ok()) return p.status();
  table_ = static_cast<uint64_t*>(p.value());
  return table_;
}

Status CudaLane::start_table(int device, uint32_t n, uint64_t longest) {
  if (n > kMaxBatch) return Status(Code::kInternal, "ipc: too many fragments for one copy");
  if (!table_) return Status(Code::kInternal, "ipc: a batch launched before its table was made");
  auto d = ready(device);
  if (!d.is_ok()) return d.status();
  // A unified address: the device reads the mapped table where the host wrote it.
  const auto at = reinterpret_cast<CUdeviceptr>(table_);
  if (Status s = gpu::launch_copy_table(device, d.value()->stream, at, n, longest); !s.is_ok()) return s;
  TETHER_CUDA_TRY("cuEventRecord", gpu::cuda()->cuEventRecord(d.value()->event, d.value()->stream));
  return Status::ok();
}

Result<uint8_t*> CudaLane::bounce(uint64_t bytes) {
  if (bounce_size_ >= bytes) return bounce_;
  auto p = pinned(bytes, gpu::kHostAllocPortable);  // GPU 0's context current from here
  if (!p.is_ok()) return p.status();
  if (bounce_) gpu::cuda()->cuMemFreeHost(bounce_);  // every copy through it has completed (each call waits)
  bounce_ = static_cast<uint8_t*>(p.value());
  bounce_size_ = bytes;
  return bounce_;
}

}  // namespace tether::transport::ipc
